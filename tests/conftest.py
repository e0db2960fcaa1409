from __future__ import annotations

import os
import shlex
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence

import pytest
import redis.asyncio as aioredis

from pipeline.config import RedisSettings
from pipeline.transport.connection import connect
from pipeline.transport.keys import Keys
from tests.redis_server import RedisServer

#: Packages whose warnings are distillq's own: always errors.
OWN_MODULES = r"(schemas|pipeline|workers|bench|tests)(\..*)?$"


#: How many tests carrying the ``slow`` marker this run's ``-m`` expression left out (``pytest_deselected``).
_slow_left_out: list[int] = [0]


def pytest_deselected(items: list[pytest.Item]) -> None:
    _slow_left_out[0] += sum(1 for item in items if item.get_closest_marker("slow") is not None)


def slow_tier_command(args: Sequence[str]) -> str:
    """The command that runs the slow tests a run with these command-line ``args`` left out: the same arguments
    with ``-m slow`` in place of any ``-m`` (``python -m pytest -m slow`` for the plain ``python -m pytest``)."""
    kept: list[str] = []
    skip = False
    for a in args:
        if skip:
            skip = False
        elif a == "-m":
            skip = True
        elif not a.startswith("-m"):
            kept.append(a)
    return shlex.join(["python", "-m", "pytest", "-m", "slow", *kept])


@pytest.hookimpl(trylast=True)  # after the durations: the last lines before the counts
def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """At the end of every run: how many slow tests it left out and the command that runs them. The default run
    (pyproject.toml's addopts: ``-m "not slow"``) is the fast tier; a ``-m`` on the command line replaces that one:
    ``python -m pytest -m slow`` runs the slow (end-to-end) tier, ``-m ""`` both."""
    left_out = _slow_left_out[0]
    terminalreporter.section("test tiers")
    expression = terminalreporter.config.option.markexpr
    if left_out and expression == "not slow":
        command = slow_tier_command(terminalreporter.config.invocation_params.args)
        terminalreporter.write_line(f"{left_out} slow tests left out of this run (the end-to-end tier); "
                                    f"run them with: {command}")
    elif left_out:
        terminalreporter.write_line(f"{left_out} slow tests left out by -m {expression!r}; "
                                    "the slow tier alone: python -m pytest -m slow")
    else:
        terminalreporter.write_line("no slow test left out of this run; the fast tier alone: python -m pytest; "
                                    "the slow tier alone: python -m pytest -m slow")


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
