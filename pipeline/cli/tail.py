"""``distillq tail STREAM``: read entries without consuming them (XREVRANGE / XREAD, no consumer group)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import redis.asyncio as aioredis

from pipeline.cli.common import add_redis_args, run, stream_name, with_redis
from pipeline.inspect import decode_entry, one_line, summarize_entry
from pipeline.keys import Keys
from schemas import DecodeError, Message, RolloutGroup, ScoredGroup
from schemas.atropos import to_atropos


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("tail", help="show the newest entries of a stream without consuming them")
    p.add_argument("stream", type=stream_name, help="rollouts, scored, batches or dlq")
    p.add_argument("--count", "-n", type=int, default=10, help="entries to show (default 10)")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing new entries")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.add_argument("--format", choices=["summary", "atropos"], default="summary",
                   help="atropos: the reference ScoredDataGroup layout, one JSON object per line")
    p.add_argument("--group-id", default=None, help="only entries of this group id")
    p.add_argument("--status", choices=["ok", "skipped", "dropped"], default=None, help="only scored groups with it")
    add_redis_args(p)
    p.set_defaults(func=main)


def _matches(args: argparse.Namespace, summary: dict[str, Any]) -> bool:
    if args.group_id is not None and summary.get("group_id") != args.group_id:
        return False
    return args.status is None or summary.get("status") == args.status


def render(args: argparse.Namespace, entry_id: str, fields: dict[bytes, bytes]) -> str | None:
    summary = summarize_entry(entry_id, fields)
    if not _matches(args, summary):
        return None
    if args.format == "atropos":
        msg: Message | DecodeError = decode_entry(fields)
        if isinstance(msg, RolloutGroup | ScoredGroup):
            obj = to_atropos(msg)
            obj["entry_id"] = entry_id
            return json.dumps(obj)
        return json.dumps({**summary, "error": str(msg) if isinstance(msg, DecodeError) else "not a group"})
    return json.dumps(summary) if args.json else one_line(summary)


async def tail(redis: aioredis.Redis, keys: Keys, args: argparse.Namespace) -> int:
    key = keys.stream(args.stream)
    entries = await redis.xrevrange(key, count=args.count) if args.count > 0 else []
    last = "$"
    for eid, fields in reversed(entries):
        out = render(args, eid.decode(), fields)
        if out is not None:
            print(out, flush=True)
        last = eid.decode()
    if entries:
        last = entries[0][0].decode()
    while args.follow:
        resp = await redis.xread({key: last}, block=1000, count=100)
        for _stream, items in resp or ():
            for eid, fields in items:
                last = eid.decode()
                out = render(args, last, fields)
                if out is not None:
                    print(out, flush=True)
    return 0


def main(args: argparse.Namespace) -> int:
    try:
        return run(with_redis(args, lambda r, k: tail(r, k, args)))
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:
        sys.stderr.close()
        return 0
