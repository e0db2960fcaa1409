"""``distillq where GROUP_ID``: where a group is (rollouts, scored, batches, DLQ) or what became of it."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import redis.asyncio as aioredis

from pipeline.cli.commands.common import add_command, run, with_redis
from pipeline.cli.locate import fate, locate, prompt_group_ids
from pipeline.config import add_redis_args
from pipeline.stages.exits import EXIT_USAGE, CliError
from pipeline.transport.keys import Keys


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = add_command(sub, "where", "where a group is: rollouts, scored, batches, DLQ, or what became of it",
                    "Look for one group id in rollouts, scored, the batches' manifests and the DLQ, with who holds "
                    "each entry, its dedupe markers (a push of the same id is skipped while they live) and the "
                    "feeder's drop record; then one line saying where it is or what became of it. Reads only. "
                    "Exit status 0 when anything was found, 1 when nothing was. With --epoch or --file: every "
                    "group of an enqueued epoch or of a push/enqueue file, counted by fate (trained, in flight, "
                    "dead-lettered, dropped, lost, not found), each one not trained named with its line; exit "
                    "status 1 when any is lost or not found.")
    p.add_argument("group_id", metavar="GROUP_ID", nargs="?", default=None,
                   help="the group id (as tail, dlq list or stats show it) (default: none: --epoch or --file)")
    p.add_argument("--epoch", type=int, default=None, metavar="N",
                   help="every prompt enqueued for epoch N (its records live 30 days) (default: none)")
    p.add_argument("--file", type=Path, default=None, metavar="FILE",
                   help="every group of a JSONL file: a push file's group_id, or an enqueue file's id (with "
                        "--epoch, else 0) (default: none)")
    p.add_argument("--json", action="store_true", help="one JSON object")
    add_redis_args(p)
    p.set_defaults(func=main)


def file_group_ids(path: Path, epoch: int) -> list[str]:
    """Group ids of a JSONL file: each line's ``group_id`` (a push file), else ``EPOCH:id`` (an enqueue file)."""
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise CliError(f"{path}: line {n}: not JSON ({e})", EXIT_USAGE) from e
        gid = obj.get("group_id") if isinstance(obj, dict) else None
        pid = obj.get("id") if isinstance(obj, dict) else None
        if gid is None and pid is None:
            raise CliError(f"{path}: line {n}: neither group_id nor id", EXIT_USAGE)
        out.append(str(gid) if gid is not None else f"{epoch}:{pid}")
    return out


async def where_many(redis: aioredis.Redis, keys: Keys, args: argparse.Namespace) -> int:
    """Every group of ``--epoch`` or ``--file``, counted by fate; exit status 1 when any is lost or not found."""
    epoch = 0 if args.epoch is None else args.epoch
    ids = file_group_ids(args.file, epoch) if args.file is not None else await prompt_group_ids(redis, keys, epoch)
    what = str(args.file) if args.file is not None else f"epoch {epoch}"
    rows = []
    for gid in ids:
        w = await locate(redis, keys, gid)
        rows.append((gid, fate(w.summary), w.summary))
    counts = Counter(f for _, f, _ in rows)
    bad = counts["lost"] + counts["not found"]
    if args.json:
        print(json.dumps({"of": what, "groups": len(rows), "fates": dict(counts),
                          "not_trained": [{"group_id": g, "fate": f, "summary": t} for g, f, t in rows
                                          if f != "trained"]}))
        return 1 if bad else 0
    print(f"{what}: {len(rows)} group(s): " + (", ".join(f"{n} {f}" for f, n in counts.most_common()) or "none"))
    for gid, f, text in rows:
        if f != "trained":
            print(f"  {gid}: {text}")
    return 1 if bad else 0


async def where(redis: aioredis.Redis, keys: Keys, args: argparse.Namespace) -> int:
    w = await locate(redis, keys, args.group_id)
    found = bool(w.entries or w.markers or w.dropped or w.prompt)
    if args.json:
        print(json.dumps(w.to_json()))
        return 0 if found else 1
    print(f"group {w.group_id} (namespace {w.namespace})")
    for s in w.entries:
        held = (f"  held by {s.consumer} ({s.deliveries} deliveries, idle {s.idle_s:.1f} s)"
                if s.consumer is not None else "")
        print(f"  {s.stream:<9} entry {s.entry_id}{'  ' + s.detail if s.detail else ''}{held}")
        if s.advice:
            print(f"            {s.advice}")
    for m in w.markers:
        ttl = "no expiry" if m.expires_in_s is None else f"expires in {m.expires_in_s / 3600:.1f} h"
        print(f"  {m.stream:<9} dedupe marker ({m.value}), {ttl}")
    if w.dropped is not None:
        print(f"  feeder    dropped: {json.dumps(w.dropped)}")
    if w.prompt is not None:
        print(f"  prompt    {', '.join(f'{k} {v}' for k, v in w.prompt.items())}")
    print(w.summary)
    return 0 if found else 1


def main(args: argparse.Namespace) -> int:
    many = args.epoch is not None or args.file is not None
    if many == (args.group_id is not None):
        raise CliError("give one GROUP_ID, or --epoch N or --file FILE for many", EXIT_USAGE)
    return run(with_redis(args, lambda r, k: (where_many if many else where)(r, k, args)))
