"""Options and helpers shared by CLI commands."""

from __future__ import annotations

import argparse
import asyncio
import os
from collections.abc import Awaitable, Callable
from typing import TypeVar

import redis.asyncio as aioredis

from pipeline import config
from pipeline.config import RedisSettings
from pipeline.transport.connection import connect
from pipeline.transport.keys import STREAMS, Keys

T = TypeVar("T")


def add_redis_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--redis-url", default=None, help="redis://[user:password@]host:port/db or rediss:// "
                   "(default: $DISTILLQ_REDIS_URL or redis://127.0.0.1:6379/0)")
    p.add_argument("--namespace", default=None, help="key namespace (default: $DISTILLQ_NAMESPACE or distillq)")


def redis_settings(args: argparse.Namespace) -> RedisSettings:
    return config.redis_settings(getattr(args, "redis_url", None), getattr(args, "namespace", None))


def stream_name(value: str) -> str:
    if value not in STREAMS:
        raise argparse.ArgumentTypeError(f"unknown stream {value!r}; choose from {', '.join(STREAMS)}")
    return value


async def with_redis(args: argparse.Namespace, fn: Callable[[aioredis.Redis, Keys], Awaitable[T]]) -> T:
    settings = redis_settings(args)
    client = connect(settings)
    try:
        return await fn(client, Keys(settings.namespace))
    finally:
        await client.aclose()


def run(coro: Awaitable[T]) -> T:
    return asyncio.run(coro)  # type: ignore[arg-type]


def env_default(name: str, default: str | None = None) -> str | None:
    return os.environ.get(f"DISTILLQ_{name}", default)
