"""``distillq dlq list|show|replay|resample|purge``: inspect dead letters, send them back, or delete them.

Dead-letter fields (written by ``StreamConsumer.dead_letter``): stage, reason, source, source_id, source_shard,
deliveries, consumer, at_ms, and ``orig_<field>`` for each field of the original entry (t, gid, d).
Replay decides per entry by the family of its reason (``pipeline.cli.deadletters``): it re-validates the
original bytes (or, when they are gone or invalid, another copy of the group the DLQ holds), writes them to
their source stream (or ``--to``) without the dedupe check (backpressure still applies), clearing the
markers that would stop the group on its way (``pipeline.cli.recovery``: a group is never trained twice),
and deletes the dead letter only once that write succeeded. An entry it cannot replay stays, with one line
saying why and what to do instead.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Final

import redis.asyncio as aioredis

from pipeline.cli.commands.common import (
    add_command,
    namespace_keys,
    run,
    with_redis,
)
from pipeline.cli.deadletters import ORIG, TARGETS, PromptReplay, Refusal
from pipeline.cli.locate import advice
from pipeline.cli.namespaces import absent_note
from pipeline.cli.recovery import DeadLetterIndex, assess, dead_letter_index, send_again
from pipeline.cli.resample import dlq_resample, replay_prompt
from pipeline.cli.streamstats import server_time
from pipeline.cli.summaries import one_line, summarize_entry, summarize_message
from pipeline.config import StreamSettings, add_redis_args, redis_settings_from_args
from pipeline.stages.exits import EXIT_FAILED, EXIT_USAGE, CliError
from pipeline.transport.keys import Keys
from pipeline.transport.producer import F_DATA, BackpressureTimeout
from pipeline.transport.sharding import get_shards
from schemas import DecodeError, decode

_PAGE: Final = 100
#: A stream entry id: milliseconds, optionally ``-sequence`` (each part fits 64 bits).
ENTRY_ID: Final = re.compile(r"[0-9]{1,19}(-[0-9]{1,19})?")

# Count entries with id <= ARGV[1] in pages, server-side (dead letters carry whole payloads).
_COUNT_UPTO: Final = """
local n, start, last = 0, '-', ''
while true do
  local page = redis.call('XRANGE', KEYS[1], start, ARGV[1], 'COUNT', 500)
  n = n + #page
  if #page > 0 then last = page[#page][1] end
  if #page < 500 then return {n, last} end
  start = '(' .. last
end
"""


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = add_command(sub, "dlq", "list, show, replay or purge dead letters",
                    "Inspect dead letters (entries a stage could not handle, with the reason), re-validate and "
                    "replay them onto their stream, or delete them. distillq dlq ACTION --help for each action.")
    dsub = p.add_subparsers(dest="dlq_command", required=True, metavar="ACTION")

    ls = add_command(dsub, "list", "the newest dead letters, oldest first",
                     "List the newest dead letters, oldest first: group id, stage, source stream, deliveries and "
                     "reason. The total goes to stderr.")
    ls.add_argument("--count", "-n", type=int, default=20, metavar="N", help="entries to show")
    ls.add_argument("--json", action="store_true", help="one JSON object per line (with the payload size)")
    ls.set_defaults(func=main_list)

    show = add_command(dsub, "show", "every field of one dead letter and its decoded payload",
                       "Show every field of one dead letter, its payload decoded and summarised (or why it "
                       "does not decode), and what dlq replay would do with it (or why it cannot, and what to do "
                       "instead). Exit status 1 if there is no such entry.")
    show.add_argument("entry_id", metavar="ENTRY_ID", help="the dead letter's entry id, as dlq list shows it "
                      "(e.g. 1732451234567-0)")
    show.add_argument("--json", action="store_true", help="one JSON object")
    show.set_defaults(func=main_show)

    rp = add_command(dsub, "replay", "re-validate dead letters and write them back to their stream",
                     "Re-validate each dead letter's original payload (or another copy of its group the DLQ holds) "
                     "against its target stream, write it there (without the dedupe check; backpressure still "
                     "applies; a group never trained is batched again, one trained never is) and delete the dead "
                     "letter only after that write. An entry that cannot be replayed stays, with one line saying "
                     "why and what to do instead.")
    rp.add_argument("entry_ids", nargs="*", metavar="ENTRY_ID",
                    help="dead letters to replay (default: none; give ids or --all)")
    rp.add_argument("--all", action="store_true", help="every dead letter")
    rp.add_argument("--to", choices=sorted(TARGETS), default=None,
                    help="target stream (default: each entry's source; rollouts for a scored group: its rollout is "
                         "scored again)")
    rp.add_argument("--force", action="store_true",
                    help="also replay entries whose reason repeats until a setting changes (output_too_large, "
                         "batch_too_large, oversize_group): change the setting first")
    rp.set_defaults(func=main_replay)

    rs = add_command(dsub, "resample", "sample stale or lost groups' prompts again at the current policy version",
                     "For each group dropped as stale (a learner dead letter 'stale: ...', named by its entry id or "
                     "group id, or a feeder drop, named by its group id) or lost (distillq where says 'lost': its "
                     "entry was removed from a stream by hand and no learner acknowledged it), enqueue its prompt "
                     "again from the prompt's record, as the group <epoch>:<prompt id>@v<N> (N: the current policy "
                     "version), and delete the dead letter after that write. Once per group; only groups of prompts "
                     "from distillq enqueue (their record lives 30 days).")
    rs.add_argument("ids", nargs="+", metavar="ID", help="a dead letter's entry id, or a group id")
    rs.set_defaults(func=main_resample)

    pg = add_command(dsub, "purge", "delete dead letters",
                     "Delete all dead letters, or those older than --older-than. Asks for confirmation on a "
                     "terminal unless --yes.")
    pg.add_argument("--older-than", type=float, default=None, metavar="SECONDS",
                    help="only entries older than this (default: all)")
    pg.add_argument("--yes", "-y", action="store_true", help="do not ask for confirmation")
    pg.set_defaults(func=main_purge)

    for leaf in (ls, show, rp, rs, pg):
        add_redis_args(leaf)


def check_entry_ids(command: str, ids: list[str]) -> None:
    """A ``CliError`` (exit status 2) for an id that is not a stream entry id (``<ms>-<seq>``)."""
    for eid in ids:
        if not ENTRY_ID.fullmatch(eid):
            raise CliError(f"dlq {command}: {eid!r} is not an entry id: they look like 1732451234567-0 "
                           "(see distillq dlq list)", EXIT_USAGE)


def _s(b: bytes | None) -> str:
    return b.decode("utf-8", "replace") if b is not None else ""


def _fmt_ms(ms: str) -> str:
    try:
        return dt.datetime.fromtimestamp(int(ms) / 1000, dt.UTC).isoformat(timespec="milliseconds")
    except ValueError:
        return ms


def describe(entry_id: str, fields: dict[bytes, bytes]) -> dict[str, Any]:
    """All fields (the payload as its size) plus the payload decoded and summarised, or the decode error."""
    shown: dict[str, Any] = {}
    for k, v in fields.items():
        name = _s(k)
        shown[name] = f"<{len(v)} bytes>" if k == ORIG + F_DATA else _s(v)
    out: dict[str, Any] = {"entry_id": entry_id, "fields": shown}
    try:
        msg = decode(fields.get(ORIG + F_DATA, b""), StreamSettings().limits())
    except DecodeError as e:
        out["payload"] = {"valid": False, "field": e.field, "reason": e.reason}
    else:
        out["payload"] = {"valid": True, **summarize_message(msg)}
    return out


async def _get(redis: aioredis.Redis, keys: Keys, entry_id: str) -> dict[bytes, bytes] | None:
    rows = await redis.xrange(keys.dlq, min=entry_id, max=entry_id)
    return dict(rows[0][1]) if rows else None


async def dlq_list(redis: aioredis.Redis, keys: Keys, args: argparse.Namespace) -> int:
    total = int(await redis.xlen(keys.dlq))
    rows = await redis.xrevrange(keys.dlq, count=args.count) if args.count > 0 else []
    for eid, fields in reversed(rows):
        summary = summarize_entry(_s(eid), fields)
        print(json.dumps(summary) if args.json else one_line(summary))
    if not args.json:
        shown = f", showing the newest {len(rows)}" if len(rows) < total else ""
        print(f"{total} dead letter(s) in {keys.dlq}{shown}", file=sys.stderr)
    return 0


async def dlq_show(redis: aioredis.Redis, keys: Keys, args: argparse.Namespace) -> int:
    fields = await _get(redis, keys, args.entry_id)
    if fields is None:
        raise CliError(f"no dead letter {args.entry_id} in {keys.dlq}", EXIT_FAILED)
    info = describe(args.entry_id, fields)
    info["replay"] = advice(args.entry_id, await assess(redis, keys, args.entry_id, fields))
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"dead letter {args.entry_id}")
    for name, value in info["fields"].items():
        extra = f"  ({_fmt_ms(value)})" if name == "at_ms" else ""
        print(f"  {name:<12} {value}{extra}")
    payload = info["payload"]
    if payload["valid"]:
        print(f"payload: valid {payload['type']}")
        for k, v in payload.items():
            if k not in ("valid", "type"):
                print(f"  {k:<16} {json.dumps(v)}")
    else:
        print(f"payload: INVALID at {payload['field']}: {payload['reason']}")
    print(f"replay: {info['replay']}")
    return 0


@dataclass(slots=True)
class ReplayResult:
    entry_id: str
    ok: bool
    detail: str  # the new entry id, or why it stayed and what to do


async def replay_one(redis: aioredis.Redis, keys: Keys, entry_id: str, fields: dict[bytes, bytes] | None,
                     to: str | None, settings: StreamSettings, *, force: bool = False,
                     index: DeadLetterIndex | None = None) -> ReplayResult:
    if fields is None:
        return ReplayResult(entry_id, False, "not in the DLQ")
    plan = await assess(redis, keys, entry_id, fields, to=to, force=force, settings=settings, index=index)
    if isinstance(plan, Refusal):
        return ReplayResult(entry_id, False, plan.line())
    if isinstance(plan, PromptReplay):
        sent = await replay_prompt(redis, keys, entry_id, fields)
        return ReplayResult(entry_id, sent.ok, sent.detail)
    added = await send_again(redis, keys, plan, settings, await get_shards(redis, keys),
                             stage=fields.get(b"stage", b"").decode("utf-8", "replace"))
    await redis.xdel(keys.dlq, entry_id)  # only after the write succeeded
    gid = fields.get(ORIG + b"gid", b"").decode("utf-8", "replace")
    how = ", to be scored again" if plan.target == "rollouts" else ""
    src = f", from {plan.origin}" if plan.origin != "its dead letter" else ""
    return ReplayResult(entry_id, True, f"-> {plan.target} {added.entry_id} (group {gid}{how}{src})")


async def _entries(redis: aioredis.Redis, keys: Keys, args: argparse.Namespace
                   ) -> AsyncIterator[tuple[str, dict[bytes, bytes] | None]]:
    """The named dead letters (None for a missing one), or with ``--all`` every one, a page at a time."""
    if not args.all:
        for eid in dict.fromkeys(args.entry_ids):
            yield eid, await _get(redis, keys, eid)
        return
    start = "-"
    while True:
        page = await redis.xrange(keys.dlq, min=start, max="+", count=_PAGE)
        for eid, fields in page:
            yield _s(eid), dict(fields)
        if len(page) < _PAGE:
            return
        start = f"({_s(page[-1][0])}"


async def dlq_replay(redis: aioredis.Redis, keys: Keys, args: argparse.Namespace) -> int:
    settings = StreamSettings()
    await _note_absent(redis, keys)  # asks Redis first: an unreachable one is one line on stderr, nothing else
    print(f"replaying dead letters of namespace {keys.namespace!r} ({keys.dlq})", flush=True)
    done = total = 0
    # One pass over the DLQ for a replay of many (a lookup per dead letter would read the whole DLQ each time).
    index = await dead_letter_index(redis, keys) if args.all or len(args.entry_ids) > 1 else None
    async for eid, fields in _entries(redis, keys, args):
        total += 1
        try:
            res = await replay_one(redis, keys, eid, fields, args.to, settings, force=args.force, index=index)
        except BackpressureTimeout as e:
            res = ReplayResult(eid, False, f"backpressure: {e}")
        done += res.ok
        print(f"{'replayed' if res.ok else 'kept    '} {eid} {res.detail}", flush=True)
        if res.detail.startswith("backpressure:"):
            break  # the target stays full: stop instead of waiting once per remaining entry
    print(f"replayed {done} of {total}; {total - done} kept in the DLQ")
    return 0 if done == total else 1


def _successor(entry_id: str) -> str:
    ms, _, seq = entry_id.partition("-")
    return f"{ms}-{int(seq or 0) + 1}"


async def _note_absent(redis: aioredis.Redis, keys: Keys) -> None:
    note = await absent_note(redis, keys)
    if note is not None:
        print(f"note: {note}", file=sys.stderr, flush=True)


async def purge_plan(redis: aioredis.Redis, keys: Keys, older_than: float | None) -> tuple[int, str]:
    """(entries to delete, MINID threshold): ids below the threshold go."""
    await _note_absent(redis, keys)
    upto = "+"
    if older_than is not None:
        cutoff_ms = int((await server_time(redis) - older_than) * 1000)
        upto = f"{cutoff_ms - 1}" if cutoff_ms > 0 else "0-0"
    n, last = await redis.register_script(_COUNT_UPTO)(keys=[keys.dlq], args=[upto])
    return int(n), _successor(_s(last)) if n else "0-0"


async def purge(redis: aioredis.Redis, keys: Keys, threshold: str) -> int:
    return int(await redis.xtrim(keys.dlq, minid=threshold, approximate=False))


def _confirm(n: int, what: str) -> bool | None:
    """True/False from the operator, None when there is no terminal to ask on."""
    if sys.stdin is None or not sys.stdin.isatty():
        return None
    try:
        answer = input(f"Delete {n} {what}? [y/N] ")
    except EOFError:
        return False
    return answer.strip().lower() in ("y", "yes")


def main_list(args: argparse.Namespace) -> int:
    return run(with_redis(args, lambda r, k: dlq_list(r, k, args)))


def main_show(args: argparse.Namespace) -> int:
    check_entry_ids("show", [args.entry_id])
    return run(with_redis(args, lambda r, k: dlq_show(r, k, args)))


def main_replay(args: argparse.Namespace) -> int:
    if args.all == bool(args.entry_ids):
        raise CliError("dlq replay: give ENTRY_ID ... or --all (not both)", EXIT_USAGE)
    check_entry_ids("replay", args.entry_ids)
    return run(with_redis(args, lambda r, k: dlq_replay(r, k, args)))


def main_resample(args: argparse.Namespace) -> int:
    return run(with_redis(args, lambda r, k: dlq_resample(r, k, args)))


def main_purge(args: argparse.Namespace) -> int:
    n, threshold = run(with_redis(args, lambda r, k: purge_plan(r, k, args.older_than)))
    keys = namespace_keys(redis_settings_from_args(args))
    what = "dead letter(s)" + (f" older than {args.older_than:g} s" if args.older_than is not None else "")
    where = f"of namespace {keys.namespace!r} ({keys.dlq})"
    if n == 0:
        print(f"no {what} to delete {where}")
        return 0
    if not args.yes:
        ok = _confirm(n, f"{what} {where}")
        if ok is None:
            raise CliError(f"dlq purge: {n} {what} {where} would be deleted; no terminal to confirm on, pass --yes",
                           EXIT_USAGE)
        if not ok:
            print("nothing deleted")
            return 1
    deleted = run(with_redis(args, lambda r, k: purge(r, k, threshold)))
    print(f"deleted {deleted} {what} {where}")
    return 0
