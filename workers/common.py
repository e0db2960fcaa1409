"""Flags every worker takes, and the shared ``main`` that runs one stage as a process."""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from pipeline.config import StreamSettings, add_redis_args, redis_settings_from_args
from pipeline.flags import HelpFormatter, add_flags, from_args
from pipeline.logs import configure_logging
from pipeline.stages.exits import run_command
from pipeline.stages.worker_main import check_health, run_worker
from pipeline.transport.connection import redis_error_line, retry_transient
from pipeline.transport.keys import Keys
from pipeline.transport.sharding import get_shards, parse_assigned
from workers.settings import WorkerSettings

__all__ = ["STAGE_DESCRIPTIONS", "add_common_args", "run_stage", "shard_plan", "standalone", "stream_settings"]

Serve = Callable[[argparse.Namespace, aioredis.Redis, Keys, asyncio.Event], Awaitable[Any]]


def add_common_args(p: argparse.ArgumentParser) -> None:
    """``--redis-url``/``--namespace`` and the flags of ``WorkerSettings``."""
    add_redis_args(p)
    add_flags(p, WorkerSettings)


async def shard_plan(
    args: argparse.Namespace, redis: aioredis.Redis, keys: Keys, stop: asyncio.Event | None = None
) -> tuple[int, list[int]]:
    """The pipeline's shard count (from Redis, shared by all workers) and the shards this worker reads."""
    # Redis may not be up yet: wait
    shards = await retry_transient(lambda: get_shards(redis, keys), stop=stop, redis=redis)
    return shards, parse_assigned(getattr(args, "shards", None), shards)


def stream_settings(args: argparse.Namespace) -> StreamSettings:
    """``StreamSettings`` from the environment, with the worker's ``--max-in-flight`` and ``--read-count``."""
    s = from_args(WorkerSettings, args)
    return StreamSettings(max_in_flight=s.max_in_flight, read_count=s.read_count)


def run_stage(stage: str, args: argparse.Namespace, serve: Serve) -> int:
    """``--check`` or run the stage until a signal (or, with ``--burst``, until drained)."""
    rs = redis_settings_from_args(args)
    if args.check:
        try:
            ok, why = asyncio.run(check_health(rs, stage, host=None if args.any_host else socket.gethostname()))
        except (RedisError, OSError) as e:  # not healthy: say why in one line
            ok, why = False, redis_error_line(e, rs.redis_url)
        print(why, file=sys.stdout if ok else sys.stderr)
        return 0 if ok else 1

    async def main(redis: aioredis.Redis, keys: Keys, stop: asyncio.Event) -> None:
        await serve(args, redis, keys, stop)

    return asyncio.run(run_worker(stage, rs, main, metrics_port=args.metrics_port, metrics_host=args.metrics_host))


def standalone(
    stage: str, add_arguments: Callable[[argparse.ArgumentParser], None], main: Callable[[argparse.Namespace], int]
) -> int:
    """``python -m workers.<stage>``: the same flags, failure lines and exit statuses as ``distillq worker <stage>``
    (both run ``main`` through ``run_command``: a configuration error is one line and exit status 2)."""
    p = argparse.ArgumentParser(prog=f"python -m workers.{stage}", formatter_class=HelpFormatter,
                                description=STAGE_DESCRIPTIONS[stage])
    add_arguments(p)
    p.set_defaults(func=main)
    args = p.parse_args()
    configure_logging()
    return run_command(args)


#: What each stage does, for ``--help``.
STAGE_DESCRIPTIONS = {
    "teacher": "Teacher-scoring worker: reads rollout groups from the rollouts stream (consumer group teacher), "
               "attaches the teacher's top-k logprobs and the logprob of each sampled token, and writes them to "
               "the scored stream. Runs until SIGTERM or SIGINT (graceful), or with --burst until drained.",
    "feeder": "Trainer feeder: reads scored groups (consumer group feeder), computes per-token advantages, and "
              "writes token-budgeted batches to the batches stream for the learner. Run one per pipeline.",
    "rollout": "Rollout worker: reads prompts from the prompts stream (consumer group rollout; distillq enqueue "
               "writes them), samples --group-size completions per prompt from the student, rewards them, writes "
               "each group to the rollouts stream and only then acknowledges the prompt. Runs until SIGTERM or "
               "SIGINT (graceful), or with --burst until drained.",
}
