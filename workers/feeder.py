"""Trainer-feeder worker: scored -> batches (``distillq worker feeder`` / ``python -m workers.feeder``)."""

from __future__ import annotations

import argparse
import asyncio
import sys

import redis.asyncio as aioredis

from pipeline.flags import add_flags, from_args
from pipeline.stages.batching import BatchingConfig
from pipeline.stages.feeder import Feeder
from pipeline.stages.kl_control import AdaptiveKL, ConstantKL
from pipeline.transport.keys import Keys
from workers.common import add_common_args, run_stage, shard_plan, standalone, stream_settings
from workers.settings import FeederSettings, batching_config


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_flags(p, FeederSettings)
    add_common_args(p)


def config(args: argparse.Namespace) -> BatchingConfig:
    return batching_config(from_args(FeederSettings, args))


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
