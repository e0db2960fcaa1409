"""``distillq namespaces``: the distillq namespaces a Redis holds, with their stream lengths."""

from __future__ import annotations

import argparse
import json
import sys

import redis.asyncio as aioredis
from rich.table import Table

from pipeline.cli.commands.common import add_command, make_console, run, with_redis
from pipeline.cli.namespaces import list_namespaces
from pipeline.config import add_redis_args
from pipeline.transport.keys import STREAMS, Keys


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = add_command(sub, "namespaces", "list the distillq namespaces this Redis holds",
                    "List every distillq namespace with at least one key in this Redis (found with SCAN): its "
                    "stream lengths, live workers and key count. The chosen namespace (--namespace) is marked.")
    p.add_argument("--json", action="store_true", help="one JSON object per namespace, one per line")
    add_redis_args(p)
    p.set_defaults(func=main)


async def show(redis: aioredis.Redis, keys: Keys, args: argparse.Namespace) -> int:
    found = await list_namespaces(redis)
    if args.json:
        for i in found:
            print(json.dumps({"namespace": i.name, "streams": i.streams, "live_workers": i.workers, "keys": i.keys,
                              "chosen": i.name == keys.namespace}))
        return 0
    if not found:
        print("no distillq namespace in this Redis", file=sys.stderr)
        return 0
    t = Table(title="namespaces", title_justify="left")
    for col in ("namespace", *STREAMS, "live workers", "keys"):
        t.add_column(col, justify="left" if col == "namespace" else "right")
    for i in found:
        name = f"{i.name} (chosen)" if i.name == keys.namespace else i.name
        t.add_row(name, *(str(i.streams.get(s, "-")) for s in STREAMS), str(i.workers), str(i.keys))
    make_console().print(t)
    if all(i.name != keys.namespace for i in found):
        print(f"the chosen namespace {keys.namespace!r} has no keys here", file=sys.stderr)
    return 0


def main(args: argparse.Namespace) -> int:
    return run(with_redis(args, lambda r, k: show(r, k, args)))
