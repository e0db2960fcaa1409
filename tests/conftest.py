from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
import redis.asyncio as aioredis

from pipeline.config import RedisSettings
from pipeline.transport.connection import connect
from pipeline.transport.keys import Keys
from tests.redis_server import RedisServer

#: Packages whose warnings are distillq's own: always errors.
OWN_MODULES = r"(schemas|pipeline|workers|bench|tests)(\..*)?$"


#: The commands of the two test tiers (README's test command runs the first; CI runs both).
FAST_TIER = "python -m pytest"
SLOW_TIER = "python -m pytest -m slow"
#: How many tests carrying the ``slow`` marker this run's ``-m`` expression left out (``pytest_deselected``).
_slow_left_out: list[int] = [0]


def pytest_deselected(items: list[pytest.Item]) -> None:
    _slow_left_out[0] += sum(1 for item in items if item.get_closest_marker("slow") is not None)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """At the end of every run: how many slow tests it left out and the command that runs them (the default
    ``-m "not slow"`` of pyproject.toml's addopts leaves out the end-to-end tier; a ``-m`` given on the command
    line replaces it: ``-m slow`` runs that tier alone, ``-m ""`` both)."""
    left_out = _slow_left_out[0]
    terminalreporter.section("test tiers")
    if left_out:
        terminalreporter.write_line(f"{left_out} slow tests left out of this run (the end-to-end tier); "
                                    f"run them with: {SLOW_TIER}")
    else:
        terminalreporter.write_line(f"no slow test left out; the fast tier alone: {FAST_TIER}; "
                                    f"the slow tier alone: {SLOW_TIER}")


def pytest_configure(config: pytest.Config) -> None:
    """``DISTILLQ_THIRD_PARTY_WARNINGS=report`` (ops/deps.sh newest|floor): a deprecation raised by a third-party
    package is shown, not failed; one raised from distillq's own modules still fails. The tests in
    tests/unit/test_third_party_apis.py keep failing on any warning: each names the API it concerns."""
    if os.environ.get("DISTILLQ_THIRD_PARTY_WARNINGS") != "report":
        return
    for category in ("DeprecationWarning", "PendingDeprecationWarning", "FutureWarning"):
        config.addinivalue_line("filterwarnings", f"default::{category}")
        config.addinivalue_line("filterwarnings", f"error::{category}:{OWN_MODULES}")


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
