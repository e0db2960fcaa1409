"""``distillq shards [get | set S [--force]]``: the pipeline's shard count, kept in Redis.

Changing it is explicit and refuses while sharded streams hold entries: stop producers, let the
pipeline drain (``distillq stats``), change it, then restart the workers (they read it at start).
"""

from __future__ import annotations

import argparse
import sys

from pipeline.ops.cli.common import add_redis_args, run, with_redis
from pipeline.transport.sharding import ShardConfigError, get_shards, set_shards


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("shards", help="show or set how many shards the rollouts and scored streams have")
    p.add_argument("action", choices=["get", "set"], nargs="?", default="get")
    p.add_argument("count", type=int, nargs="?", help="with set: the new shard count")
    p.add_argument("--force", action="store_true", help="set even if entries would be stranded")
    add_redis_args(p)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    if args.action == "get":
        print(run(with_redis(args, get_shards)))
        return 0
    if args.count is None:
        print("distillq shards set: give the shard count", file=sys.stderr)
        return 2
    try:
        old = run(with_redis(args, lambda r, k: set_shards(r, k, args.count, force=args.force)))
    except ShardConfigError as e:
        print(f"distillq shards: {e}", file=sys.stderr)
        return 1
    print(f"shards: {old} -> {args.count}; restart the workers so they read it", file=sys.stderr)
    return 0
