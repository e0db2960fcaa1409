"""``distillq where GROUP_ID``: where a group is (rollouts, scored, batches, DLQ) or what became of it."""

from __future__ import annotations

import argparse
import json

import redis.asyncio as aioredis

from pipeline.cli.commands.common import add_command, run, with_redis
from pipeline.cli.locate import locate
from pipeline.config import add_redis_args
from pipeline.transport.keys import Keys


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = add_command(sub, "where", "where a group is: rollouts, scored, batches, DLQ, or what became of it",
                    "Look for one group id in rollouts, scored, the batches' manifests and the DLQ, with who holds "
                    "each entry, its dedupe markers (a push of the same id is skipped while they live) and the "
                    "feeder's drop record; then one line saying where it is or what became of it. Reads only. "
                    "Exit status 0 when anything was found, 1 when nothing was.")
    p.add_argument("group_id", metavar="GROUP_ID", help="the group id (as tail, dlq list or stats show it)")
    p.add_argument("--json", action="store_true", help="one JSON object")
    add_redis_args(p)
    p.set_defaults(func=main)


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
    return run(with_redis(args, lambda r, k: where(r, k, args)))
