"""Flags every worker takes, and the shared ``main`` that runs one stage as a process."""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis

from pipeline.config import StreamSettings, add_redis_args, redis_settings_from_args
from pipeline.logs import configure_logging
from pipeline.stages.worker_main import check_health, run_worker
from pipeline.transport.connection import retry_transient
from pipeline.transport.keys import Keys
from pipeline.transport.sharding import get_shards, parse_assigned

Serve = Callable[[argparse.Namespace, aioredis.Redis, Keys, asyncio.Event], Awaitable[Any]]


def env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(f"DISTILLQ_{name}", default)


def add_common_args(p: argparse.ArgumentParser) -> None:
    add_redis_args(p)
    p.add_argument("--burst", action="store_true", help="drain the input stream, then exit 0")
    p.add_argument("--check", action="store_true",
                   help="exit 0 if this host's worker of this stage is healthy, else 1 (container health check)")
    p.add_argument("--any-host", action="store_true", help="with --check: any worker of the stage counts")
    p.add_argument("--metrics-port", type=int, default=int(env("METRICS_PORT", "0") or 0),
                   help="Prometheus port (0: off; env DISTILLQ_METRICS_PORT)")
    p.add_argument("--metrics-host", default=env("METRICS_HOST", "127.0.0.1"),
                   help="address the metrics endpoint binds (default 127.0.0.1)")
    p.add_argument("--consumer-name", default=env("CONSUMER_NAME"),
                   help="stable consumer name (default: <stage>-<host>-<pid>-<random>); a restart under the "
                        "same name gets its own unacknowledged entries back first")
    p.add_argument("--max-in-flight", type=int, default=None, help="messages handled at once")
    p.add_argument("--read-count", type=int, default=None, help="entries per read")
    p.add_argument("--shards", default=env("SHARDS"),
                   help="read only these shards of a sharded input stream, e.g. 0,2 (default: all)")


async def shard_plan(
    args: argparse.Namespace, redis: aioredis.Redis, keys: Keys, stop: asyncio.Event | None = None
) -> tuple[int, list[int]]:
    """The pipeline's shard count (from Redis, shared by all workers) and the shards this worker reads."""
    shards = await retry_transient(lambda: get_shards(redis, keys), stop=stop)  # Redis may not be up yet: wait
    return shards, parse_assigned(getattr(args, "shards", None), shards)


def stream_settings(args: argparse.Namespace, **overrides: Any) -> StreamSettings:
    given = {k: getattr(args, k) for k in ("max_in_flight", "read_count") if getattr(args, k, None) is not None}
    return StreamSettings(**{**given, **overrides})


def run_stage(stage: str, args: argparse.Namespace, serve: Serve) -> int:
    """``--check`` or run the stage until a signal (or, with ``--burst``, until drained)."""
    rs = redis_settings_from_args(args)
    if args.check:
        ok, why = asyncio.run(check_health(rs, stage, host=None if args.any_host else socket.gethostname()))
        print(why, file=sys.stdout if ok else sys.stderr)
        return 0 if ok else 1

    async def main(redis: aioredis.Redis, keys: Keys, stop: asyncio.Event) -> None:
        await serve(args, redis, keys, stop)

    return asyncio.run(run_worker(stage, rs, main, metrics_port=args.metrics_port, metrics_host=args.metrics_host))


def standalone(
    stage: str, add_arguments: Callable[[argparse.ArgumentParser], None], main: Callable[[argparse.Namespace], int]
) -> int:
    """``python -m workers.<stage>``: the same flags and exit codes as ``distillq worker <stage>``."""
    p = argparse.ArgumentParser(prog=f"python -m workers.{stage}")
    add_arguments(p)
    args = p.parse_args()
    configure_logging()
    return main(args)
