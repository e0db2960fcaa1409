from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
import redis.asyncio as aioredis

from pipeline.config import RedisSettings
from pipeline.transport.connection import connect
from pipeline.transport.keys import Keys
from tests.redis_server import RedisServer


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One private redis-server for the test session (a free port; stopped by pid)."""
    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    return redis_server.url


@pytest.fixture
def keys() -> Keys:
    """A fresh namespace per test: isolation without flushing anything."""
    return Keys(f"t{uuid.uuid4().hex[:10]}")


@pytest.fixture
async def r(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = connect(RedisSettings(redis_url=redis_url))
    yield client
    await client.aclose()
