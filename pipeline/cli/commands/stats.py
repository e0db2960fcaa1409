"""``distillq stats``: backlog, consumer groups, pending work, dead letters, throughput, live workers and learner
ranks."""

from __future__ import annotations

import argparse
import asyncio
import json

import redis.asyncio as aioredis
from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.table import Table

from pipeline.cli.attention import attention, counts, secs, size
from pipeline.cli.commands.common import (
    add_command,
    make_console,
    run_output,
    stream_name,
    with_redis,
)
from pipeline.cli.pipelinestate import collect_all
from pipeline.cli.streamstats import Snapshot, WorkerStats, with_rates
from pipeline.config import add_redis_args
from pipeline.stages.exits import EXIT_REDIS, CliError, redis_url
from pipeline.transport.connection import mask_url
from pipeline.transport.keys import STREAMS, Keys


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = add_command(sub, "stats", "stream lengths, consumer groups, lag, dead letters, throughput, workers",
                    "Show, per stream, its length, memory and added/s, and for its consumer group the lag, pending "
                    "entries, oldest pending age and read/s; then consumers, live workers, learner ranks and the "
                    "dead-letter count. "
                    "On a terminal --watch redraws in place; in a file or pipe each refresh is printed in turn.")
    p.add_argument("streams", nargs="*", type=stream_name, metavar="STREAM",
                   help=f"streams to show (default: all of {', '.join(STREAMS)})")
    p.add_argument("--watch", nargs="?", type=float, const=2.0, default=None, metavar="SECONDS",
                   help="refresh every SECONDS until Ctrl-C, with live rates (default: off; 2 when given "
                        "without a value)")
    p.add_argument("--refreshes", type=int, default=None, metavar="N",
                   help="with --watch: stop after N refreshes (default: unlimited)")
    p.add_argument("--json", action="store_true", help="JSON (one object per refresh with --watch)")
    p.add_argument("--window", type=float, default=60.0, metavar="SECONDS",
                   help="throughput window for one-shot figures")
    p.add_argument("--hold-warn", type=float, default=300.0, metavar="SECONDS",
                   help="name a live learner rank that has held an unacknowledged batch longer than SECONDS (batches "
                        "under a name no live learner has are named at once)")
    p.add_argument("--weights-url", default=None, metavar="URL",
                   help="also show what the weights store at URL holds (redis:// or s3://, docs/weights.md): versions "
                        "kept, the newest and its snapshot, bytes, the store's memory (default: none)")
    add_redis_args(p)
    p.set_defaults(func=main)


def _rate(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}"


def stream_table(snap: Snapshot) -> Table:
    t = Table(title=f"streams (namespace {snap.namespace})", title_justify="left")
    for col in ("stream", "length", "memory", "added/s", "group", "lag", "pending", "oldest pending",
                "read/s", "consumers"):
        t.add_column(col, justify="left" if col in ("stream", "group") else "right")
    for s in snap.streams.values():
        added = _rate(s.added_per_s) if s.added_per_s is not None else f"≥{s.window_rate:.2f}"
        if s.name == "dlq":
            added = f"{s.window_rate:.2f}"  # never consumed: the window count is exact
        length = f"[red]{s.length} FULL[/red]" if s.full else str(s.length)
        head = [s.name if s.exists else f"{s.name} (absent)", length, size(s.memory_bytes), added]
        if not s.groups:
            t.add_row(*head, "-", "-", "-", "-", "-", "-")
        for i, g in enumerate(s.groups):
            lag = f"~{g.lag}" if g.lag_estimated else str(g.lag)
            row = [g.name if g.exists else f"{g.name} (absent)", lag, str(g.pending),
                   secs(g.oldest_pending_age_s), _rate(g.read_per_s), str(g.consumers)]
            t.add_row(*(head if i == 0 else [""] * len(head)), *row)
    return t


def consumer_table(snap: Snapshot) -> Table | None:
    rows = [(s.name, g.name, c) for s in snap.streams.values() for g in s.groups for c in g.consumer_list]
    if not rows:
        return None
    t = Table(title="consumers", title_justify="left")
    for col in ("stream", "group", "consumer", "pending", "idle", "heartbeat", "reclaim in"):
        t.add_column(col, justify="right" if col in ("pending", "idle", "reclaim in") else "left")
    for stream, group, c in rows:
        beat = "-" if c.heartbeat is None else "live" if c.heartbeat else "[red]none[/red]"
        reclaim = "-" if c.reclaim_in_s is None else "now" if c.reclaim_in_s <= 0 else secs(c.reclaim_in_s)
        t.add_row(stream, group, c.name, str(c.pending), secs(c.idle_s), beat, reclaim)
    return t


def _pct(share: float | None) -> str:
    return "-" if share is None else f"{share:.1%}"


def cross_text(w: WorkerStats) -> str:
    """A teacher of another tokenizer: its share of trained tokens in aligned chunks with teacher signal, and of
    the teacher's top-k probability mass that mapped to student ids (``-`` before it scored any); else ``-``."""
    if not w.cross_tokenizer:
        return "-"
    return f"aligned {_pct(w.cross_aligned_share)}, top-k mass mapped {_pct(w.cross_topk_mapped_share)}"


def version_text(w: WorkerStats) -> str:
    """A rollout worker's policy version (of the last group it sampled; ``none yet`` before one); else ``-``."""
    if w.stage != "rollout":
        return "-"
    return "none yet" if w.weights_version is None else f"v{w.weights_version}"


def worker_table(snap: Snapshot) -> Table:
    """One row per live worker; a ``weights version`` column when a rollout worker is live (the policy version of
    the last group each sampled), a ``cross-tokenizer`` column when a teacher scores a student of another
    tokenizer."""
    t = Table(title=f"live workers: {len(snap.workers)}", title_justify="left")
    cross = any(w.cross_tokenizer for w in snap.workers)
    rollout = any(w.stage == "rollout" for w in snap.workers)
    cols = ("stage", "consumer", "host", "pid", "handled", "heartbeat age", "outcomes", "teacher drops",
            *(("weights version",) if rollout else ()), *(("cross-tokenizer",) if cross else ()))
    for col in cols:
        t.add_column(col, justify="right" if col in ("pid", "handled", "heartbeat age") else "left")
    for w in sorted(snap.workers, key=lambda w: (w.stage, w.consumer)):
        stage = f"{w.stage} ({w.pool})" if w.pool and w.pool != "default" else w.stage  # a teacher's pool
        t.add_row(stage, w.consumer, w.host, str(w.pid), str(w.handled), secs(w.age_s), counts(w.outcomes),
                  counts(w.drops) if w.stage == "teacher" else "-",
                  *((version_text(w),) if rollout else ()), *((cross_text(w),) if cross else ()))
    return t


def pool_table(snap: Snapshot) -> Table | None:
    """One row per teacher pool (none while the pool ``default`` is the only one)."""
    if all(p.name == "default" for p in snap.pools):
        return None
    t = Table(title=f"teacher pools: {len(snap.pools)}", title_justify="left")
    for col in ("pool", "stream", "backlog", "lag", "pending", "oldest pending", "live workers"):
        t.add_column(col, justify="left" if col in ("pool", "stream") else "right")
    for p in snap.pools:
        live = str(p.workers) if p.workers or not p.backlog else f"[red]{p.workers}[/red]"
        t.add_row(p.name, p.stream, str(p.backlog), str(p.lag), str(p.pending), secs(p.oldest_pending_age_s), live)
    return t


def _opt(v: int | None) -> str:
    return "-" if v is None else str(v)


def learner_table(snap: Snapshot) -> Table:
    """One row per learner rank heartbeat (``pipeline.learner.health``); ages on the Redis clock."""
    t = Table(title=f"learner ranks: {len(snap.learners)}", title_justify="left")
    for col in ("consumer", "rank", "host", "pid", "step", "held", "held for", "last ack", "published",
                "delivered version", "heartbeat age"):
        t.add_column(col, justify="left" if col in ("consumer", "rank", "host") else "right")
    for b in snap.learners:
        t.add_row(b.consumer, f"{b.rank} of {b.world_size}", b.host, str(b.pid), str(b.step), str(b.held),
                  secs(b.held_s), "never" if b.last_ack_s is None else f"{secs(b.last_ack_s)} ago",
                  _opt(b.published_version), _opt(b.delivered_version), secs(b.age_s))
    return t


def render(snap: Snapshot) -> Group:
    parts: list[Table | str] = [stream_table(snap)]
    consumers = consumer_table(snap)
    if consumers is not None:
        parts.append(consumers)
    pools = pool_table(snap)
    if pools is not None:
        parts.append(pools)
    parts.append(worker_table(snap))
    parts.append(learner_table(snap))
    color = "red" if snap.dead_letters else "green"
    version = "never set" if snap.policy_version is None else str(snap.policy_version)
    jobs = "?" if snap.rollout_jobs is None else str(snap.rollout_jobs)
    parts.append(f"dead letters: [{color}]{snap.dead_letters}[/{color}]   policy version: {version}   "
                 f"prompts queued: {jobs}   backlog cap: {snap.max_backlog} entries per stream key   "
                 f"{memory_line(snap)}   added/s: ≥ ids of the last window still queued; exact rates show with "
                 "--watch")
    notes = attention(snap)
    if notes:
        parts.append("[red]attention:[/red]\n" + "\n".join(f"  - {escape(n)}" for n in notes))
    return Group(*parts)


def memory_line(snap: Snapshot) -> str:
    m = snap.memory
    if m is None:
        return "Redis memory: ?"
    used = f"Redis memory: {size(m.used_bytes)}"
    if m.max_bytes:
        used += f" of maxmemory {size(m.max_bytes)} ({m.used_bytes / m.max_bytes:.0%}, {m.policy})"
    else:
        used += " (no maxmemory)"
    return used + (f", {m.oom_errors} write(s) refused for memory since Redis started" if m.oom_errors else "")


def to_json(snap: Snapshot) -> dict[str, object]:
    """The snapshot and its ``attention`` lines (``--json``)."""
    return {**snap.to_json(), "attention": attention(snap)}


def _streams(args: argparse.Namespace) -> list[str]:
    return list(dict.fromkeys(args.streams)) if args.streams else list(STREAMS)


#: Seconds a snapshot may take before ``stats`` says Redis is not answering (exit status 3).
ANSWER_S = 10.0


async def snapshot(redis: aioredis.Redis, keys: Keys, args: argparse.Namespace) -> Snapshot:
    """``collect_all`` within ``ANSWER_S``, else one line: Redis is not answering, and why it may be."""
    try:
        return await asyncio.wait_for(collect_all(redis, keys, _streams(args), window_s=args.window,
                                                  hold_warn_s=args.hold_warn), ANSWER_S)
    except TimeoutError:
        raise CliError(f"Redis at {mask_url(redis_url(args) or '')} did not answer within {ANSWER_S:.0f} s: paused "
                       "(CLIENT PAUSE), busy with a long command (SLOWLOG GET shows it) or overloaded",
                       EXIT_REDIS) from None


async def watch(redis: aioredis.Redis, keys: Keys, args: argparse.Namespace, console: Console) -> int:
    prev: Snapshot | None = None
    n = 0
    redraw = not args.json and console.is_terminal  # in a file or a pipe, each refresh is printed in turn
    live: Live | None = Live(console=console, auto_refresh=False) if redraw else None
    try:
        if live is not None:
            live.start()
        while args.refreshes is None or n < args.refreshes:
            snap = with_rates(prev, await snapshot(redis, keys, args))
            if live is not None:
                live.update(render(snap), refresh=True)
            elif args.json:
                print(json.dumps(to_json(snap)), flush=True)
            else:
                console.print(render(snap))
                console.print()
            prev, n = snap, n + 1
            if args.refreshes is None or n < args.refreshes:
                await asyncio.sleep(max(0.05, args.watch))
    finally:
        if live is not None:
            live.stop()
    return 0


async def once(redis: aioredis.Redis, keys: Keys, args: argparse.Namespace, console: Console) -> int:
    snap = await snapshot(redis, keys, args)
    weights = None
    if args.weights_url:
        from pipeline.weightstore.stores import summary

        weights = await asyncio.to_thread(summary, args.weights_url)
    if args.json:
        print(json.dumps({**to_json(snap), **({"weights": weights} if weights is not None else {})}, indent=2))
    else:
        console.print(render(snap))
        if weights is not None:
            from pipeline.weightstore.stores import summary_line

            console.print(escape(summary_line(weights)))
    return 0


async def _show(redis: aioredis.Redis, keys: Keys, args: argparse.Namespace, console: Console) -> int:
    return await (once if args.watch is None else watch)(redis, keys, args, console)


def main(args: argparse.Namespace) -> int:
    console = make_console()
    return run_output(with_redis(args, lambda r, k: _show(r, k, args, console)))
