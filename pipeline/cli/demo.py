"""``distillq demo``: the pipeline end to end on one machine, on an embedded Redis by default."""

from __future__ import annotations

import argparse
import asyncio
import time

from rich.console import Console

from pipeline.cli.common import add_redis_args, redis_settings
from pipeline.config import RedisSettings, StreamSettings
from pipeline.connection import connect
from pipeline.consumer import StreamConsumer
from pipeline.embedded import EmbeddedRedis
from pipeline.keys import Keys
from pipeline.producer import StreamProducer
from schemas import RolloutGroup, decode
from schemas.build import synthetic_rollout

console = Console(stderr=True)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("demo", help="run the pipeline end to end (embedded Redis unless --redis-url is given)")
    p.add_argument("--groups", type=int, default=64)
    add_redis_args(p)
    p.set_defaults(func=main)


async def smoke(url: str, namespace: str, n: int) -> float:
    redis = connect(RedisSettings(redis_url=url))
    keys = Keys(namespace)
    try:
        s = StreamSettings()
        prod = StreamProducer(redis, keys, "rollouts", s)
        cons = StreamConsumer(redis, keys, "rollouts", "demo", s)
        await cons.ensure_group()
        t0 = time.perf_counter()
        for i in range(n):
            await prod.send(synthetic_rollout(8, 1024, group_id=f"demo-{i}", seed=i))
        got = 0
        while got < n:
            batch = await cons.read(16)
            for d in batch:
                decode(d.payload, expect=RolloutGroup)
            await cons.ack(batch)
            got += len(batch)
        return n / (time.perf_counter() - t0)
    finally:
        await redis.aclose()


def main(args: argparse.Namespace) -> int:
    embedded = None
    if args.redis_url:
        url = args.redis_url
    else:
        embedded = EmbeddedRedis().start()
        url = embedded.url
        console.print(f"embedded Redis on {url}")
    try:
        rate = asyncio.run(smoke(url, redis_settings(args).namespace + "-demo", args.groups))
        console.print(f"transport smoke run: {args.groups} groups of 8 x 1024 tokens, {rate:.0f} groups/s")
    finally:
        if embedded is not None:
            embedded.stop()
    return 0
