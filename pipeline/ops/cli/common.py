"""Options and helpers shared by CLI commands."""

from __future__ import annotations

import argparse
import asyncio
import os
from collections.abc import Awaitable, Callable
from typing import TypeVar

import redis.asyncio as aioredis

from pipeline.config import add_redis_args, redis_settings_from_args
from pipeline.transport.connection import connect
from pipeline.transport.keys import STREAMS, Keys

T = TypeVar("T")

__all__ = ["add_redis_args", "env_default", "redis_settings_from_args", "run", "stream_name", "with_redis"]


def stream_name(value: str) -> str:
    if value not in STREAMS:
        raise argparse.ArgumentTypeError(f"unknown stream {value!r}; choose from {', '.join(STREAMS)}")
    return value


async def with_redis(args: argparse.Namespace, fn: Callable[[aioredis.Redis, Keys], Awaitable[T]]) -> T:
    settings = redis_settings_from_args(args)
    client = connect(settings)
    try:
        return await fn(client, Keys(settings.namespace))
    finally:
        await client.aclose()


def run(coro: Awaitable[T]) -> T:
    return asyncio.run(coro)  # type: ignore[arg-type]


def env_default(name: str, default: str | None = None) -> str | None:
    return os.environ.get(f"DISTILLQ_{name}", default)
