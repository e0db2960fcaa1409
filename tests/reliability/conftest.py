"""Fixtures of the reliability tests: a private redis-server per test and worker processes."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from tests.redis_server import RedisServer
from tests.reliability.harness import Workers, close_all


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The figures every reliability test measured, shown at the end of the run."""
    from tests.reliability.harness import REPORTS

    if REPORTS:
        terminalreporter.section("reliability figures")
        for line in REPORTS:
            terminalreporter.write_line(line)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "reliability: fault-injection and security tests; print figures")


@pytest.fixture
def private_redis() -> Iterator[RedisServer]:
    """A redis-server of this test only (memory figures and crashes must not touch other tests)."""
    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture
def namespace() -> str:
    return f"rel{uuid.uuid4().hex[:8]}"


@pytest.fixture
def workers(private_redis: RedisServer, namespace: str, tmp_path: Path) -> Iterator[Workers]:
    """Worker processes against ``private_redis``; every one is stopped (by pid) at the end."""
    w = Workers(private_redis.url, namespace, tmp_path)
    yield w
    w.close()


@pytest.fixture(autouse=True)
async def _close_clients() -> AsyncIterator[None]:
    """Close every Redis client and learner the test opened, also when it failed half-way."""
    yield
    await close_all()
