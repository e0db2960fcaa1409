"""``distillq shards [get | set S [--force]]``: the pipeline's shard count, kept in Redis.

Changing it is explicit and refuses while sharded streams hold entries: stop producers, let the
pipeline drain (``distillq stats``), change it, then restart the workers (they read it at start).
"""

from __future__ import annotations

import argparse

from pipeline.cli.commands.common import add_command, run, with_redis
from pipeline.config import add_redis_args, redis_settings_from_args
from pipeline.stages.exits import EXIT_FAILED, EXIT_USAGE, CliError
from pipeline.transport.sharding import ShardConfigError, get_shards, set_shards


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = add_command(sub, "shards", "show or set how many shards the rollouts and scored streams have",
                    "Show or set the shard count of the rollouts and scored streams (kept in Redis; workers read it "
                    "when they start). To change it: stop the producers, let the pipeline drain (distillq stats), "
                    "set it, then restart the workers.")
    p.add_argument("action", choices=["get", "set"], nargs="?", default="get",
                   help="get: print the shard count (1 when never set); set: change it to COUNT")
    p.add_argument("count", type=int, nargs="?", metavar="COUNT",
                   help="with set: the new shard count, 1 to 1024 (default: none, required with set)")
    p.add_argument("--force", action="store_true",
                   help="set even while rollouts or scored hold entries (they would be stranded on shards nobody "
                        "reads)")
    add_redis_args(p)
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    if args.action == "get":
        print(run(with_redis(args, get_shards)))
        return 0
    if args.count is None:
        raise CliError("shards set: give the shard count", EXIT_USAGE)
    try:
        old = run(with_redis(args, lambda r, k: set_shards(r, k, args.count, force=args.force)))
    except ShardConfigError as e:
        raise CliError(f"shards: {e}", EXIT_FAILED) from e
    ns = redis_settings_from_args(args).namespace
    print(f"shards of namespace {ns!r}: {old} -> {args.count}; restart the workers so they read it")
    return 0
