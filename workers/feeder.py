"""Trainer-feeder worker: scored -> batches (``distillq worker feeder`` / ``python -m workers.feeder``)."""

from __future__ import annotations

import argparse
import asyncio
import sys

import redis.asyncio as aioredis

from pipeline.stages.batching import BatchingConfig
from pipeline.stages.feeder import Feeder
from pipeline.stages.kl_control import AdaptiveKL, ConstantKL
from pipeline.transport.keys import Keys
from workers.common import (
    add_common_args,
    env,
    int_at_least,
    one_of,
    run_stage,
    shard_plan,
    standalone,
    stream_settings,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-batch-tokens", type=int, default=env("MAX_BATCH_TOKENS") or "65536",
                   metavar="N", help="token budget per batch (env DISTILLQ_MAX_BATCH_TOKENS)")
    p.add_argument("--max-batch-groups", type=int, default=None, metavar="N",
                   help="groups per batch at most (default: no limit)")
    p.add_argument("--token-count", choices=["sum", "padded"], default="sum",
                   help="how a batch's tokens count: sum of lengths, or padded (sequences x longest)")
    p.add_argument("--max-staleness", type=int, default=env("MAX_STALENESS") or "4", metavar="N",
                   help="drop groups more than this many policy versions old, -1: never (env DISTILLQ_MAX_STALENESS)")
    p.add_argument("--missing-distill", choices=["keep", "drop"], type=one_of("keep", "drop"),
                   default=env("MISSING_DISTILL", "keep"),
                   help="groups without teacher payload: keep (task reward only) or drop "
                        "(env DISTILLQ_MISSING_DISTILL)")
    p.add_argument("--reward-weight", type=float, default=0.0, metavar="W",
                   help="weight of the group-normalised task reward in the advantages")
    p.add_argument("--length-bucketing", action="store_true", help="fill batches with groups of similar length")
    p.add_argument("--max-wait", type=float, default=2.0, metavar="SECONDS",
                   help="flush a partial batch when its oldest group has waited this long")
    p.add_argument("--kl-coef", type=float, default=1.0, metavar="C",
                   help="constant KL coefficient (the initial one if adaptive)")
    p.add_argument("--kl-target", type=float, default=None, metavar="KL",
                   help="adaptive KL controller with this target, Ziegler et al. (default: none, constant --kl-coef)")
    p.add_argument("--kl-horizon", type=float, default=10_000.0, metavar="N",
                   help="adaptive KL controller horizon")
    p.add_argument("--max-buffered-groups", type=int, default=1024, metavar="N",
                   help="scored groups held while waiting for a batch")
    p.add_argument("--max-ready-batches", type=int_at_least(0), default=env("MAX_READY_BATCHES") or "8", metavar="N",
                   help="wait while the batches stream holds N batches not yet acknowledged by the learner, "
                        "0: only DISTILLQ_MAX_BACKLOG (env DISTILLQ_MAX_READY_BATCHES)")
    add_common_args(p)


def config(args: argparse.Namespace) -> BatchingConfig:
    return BatchingConfig(
        max_batch_tokens=args.max_batch_tokens, max_batch_groups=args.max_batch_groups, token_count=args.token_count,
        max_staleness=None if args.max_staleness < 0 else args.max_staleness, missing_distill=args.missing_distill,
        reward_weight=args.reward_weight, length_bucketing=args.length_bucketing, max_wait_s=args.max_wait,
    )


async def serve(args: argparse.Namespace, redis: aioredis.Redis, keys: Keys, stop: asyncio.Event) -> None:
    ctl = (AdaptiveKL(args.kl_coef, args.kl_target, args.kl_horizon) if args.kl_target is not None
           else ConstantKL(args.kl_coef))
    shards, assigned = await shard_plan(args, redis, keys, stop)
    feeder = Feeder(redis, keys, config(args), ctl, stream_settings(args), consumer_name=args.consumer_name,
                    max_buffered_groups=args.max_buffered_groups, shards=shards, assigned=assigned,
                    max_ready_batches=args.max_ready_batches or None)
    await feeder.run(stop, burst=args.burst)


def main(args: argparse.Namespace) -> int:
    return run_stage("feeder", args, serve)


if __name__ == "__main__":
    sys.exit(standalone("feeder", add_arguments, main))
