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
from redis.exceptions import RedisError

from pipeline.config import StreamSettings, add_redis_args, redis_settings_from_args
from pipeline.logs import configure_logging
from pipeline.stages.worker_main import check_health, run_worker
from pipeline.transport.connection import redis_error_line, retry_transient
from pipeline.transport.keys import Keys
from pipeline.transport.sharding import get_shards, parse_assigned

Serve = Callable[[argparse.Namespace, aioredis.Redis, Keys, asyncio.Event], Awaitable[Any]]


def env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(f"DISTILLQ_{name}", default)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows each option's default (``(default: X)``) unless it is None or off, or the help text
    already says it (a default that comes from elsewhere, such as ``$DISTILLQ_REDIS_URL``)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        off = action.default is None or action.default is False or action.default is argparse.SUPPRESS
        if off or action.default == [] or "default:" in text or "%(default)" in text:  # not `in (...)`: 0 == False
            return text
        if action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            return f"{text} (default: %(default)s)"
        return text


def add_common_args(p: argparse.ArgumentParser) -> None:
    add_redis_args(p)
    p.add_argument("--burst", action="store_true",
                   help="drain the input (teacher, feeder: the input stream; rollout: the job queue), then exit 0")
    p.add_argument("--check", action="store_true",
                   help="exit 0 if this host's worker of this stage wrote its heartbeat in the last 30 s, else 1 "
                        "(container health check; prints why)")
    p.add_argument("--any-host", action="store_true", help="with --check: a worker of the stage on any host counts")
    p.add_argument("--metrics-port", type=int, default=env("METRICS_PORT") or "0", metavar="PORT",
                   help="Prometheus /metrics port, 0: off (env DISTILLQ_METRICS_PORT)")
    p.add_argument("--metrics-host", default=env("METRICS_HOST", "127.0.0.1"), metavar="HOST",
                   help="address the metrics endpoint binds (env DISTILLQ_METRICS_HOST)")
    p.add_argument("--consumer-name", default=env("CONSUMER_NAME"), metavar="NAME",
                   help="stable consumer name: a restart under the same name gets its own unacknowledged entries "
                        "back first (env DISTILLQ_CONSUMER_NAME; default: <stage>-<host>-<pid>-<random>)")
    p.add_argument("--max-in-flight", type=int, default=None, metavar="N",
                   help="messages handled at once, teacher only (default: $DISTILLQ_MAX_IN_FLIGHT or 16)")
    p.add_argument("--read-count", type=int, default=None, metavar="N",
                   help="entries per read, teacher and feeder (default: $DISTILLQ_READ_COUNT or 8)")
    p.add_argument("--shards", default=env("SHARDS"), metavar="LIST",
                   help="read only these shards of a sharded input stream, e.g. 0,2; teacher and feeder "
                        "(env DISTILLQ_SHARDS; default: all)")


def one_of(*options: str) -> Callable[[str], str]:
    """An argparse ``type`` accepting ``options`` only. Unlike ``choices=``, argparse also applies it to a
    string default, so a bad value from the environment (``DISTILLQ_TEACHER_ROWS=bogus``) is a usage error."""

    def parse(value: str) -> str:
        if value not in options:
            raise argparse.ArgumentTypeError(f"invalid choice {value!r} (choose from {', '.join(options)})")
        return value

    parse.__name__ = "choice"
    return parse


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer ``>= low`` (applied to environment defaults too)."""

    def parse(value: str) -> int:
        try:
            n = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid integer {value!r}") from None
        if n < low:
            raise argparse.ArgumentTypeError(f"{n} is below {low}")
        return n

    parse.__name__ = "integer"
    return parse


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
    """``python -m workers.<stage>``: the same flags and exit codes as ``distillq worker <stage>``."""
    p = argparse.ArgumentParser(prog=f"python -m workers.{stage}", formatter_class=HelpFormatter,
                                description=STAGE_DESCRIPTIONS[stage])
    add_arguments(p)
    args = p.parse_args()
    configure_logging()
    return main(args)


#: What each stage does, for ``--help``.
STAGE_DESCRIPTIONS = {
    "teacher": "Teacher-scoring worker: reads rollout groups from the rollouts stream (consumer group teacher), "
               "attaches the teacher's top-k logprobs and the logprob of each sampled token, and writes them to "
               "the scored stream. Runs until SIGTERM or SIGINT (graceful), or with --burst until drained.",
    "feeder": "Trainer feeder: reads scored groups (consumer group feeder), computes per-token advantages, and "
              "writes token-budgeted batches to the batches stream for the learner. Run one per pipeline.",
    "rollout": "Rollout worker: takes prompt jobs from the queue (distillq enqueue), samples --group-size "
               "completions per prompt from the student, rewards them and writes each group to the rollouts "
               "stream.",
}
