"""The demo's clean start on a Redis of the user's: the keys of a namespace it made (prompts and their records
included) go, nothing else does; a namespace with live workers, or holding keys the demo did not make (a
deployment's), is refused; the deployment's DISTILLQ_REDIS_URL in the environment is left alone."""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, cast

import pytest

from pipeline.cli.commands.demo import demo_namespace, start_redis
from pipeline.cli.embedded import EmbeddedRedis
from pipeline.config import RedisSettings
from pipeline.demo.tiny import clear_namespace, live_workers
from pipeline.transport.connection import connect
from pipeline.transport.keys import Keys
from pipeline.transport.prompts import PromptJob, enqueue_prompts

pytestmark = [pytest.mark.redis]


async def _fill(settings: RedisSettings, keys: Keys) -> None:
    r = connect(settings)
    await r.xadd(keys.stream("rollouts"), {"x": "1"})
    await r.set(keys.seen("rollouts", "g1"), "1")
    await r.set(keys.policy_version, "150")
    await r.hset(keys.config, "shards", "1")
    await enqueue_prompts(r, keys, [PromptJob(id=f"p{i}", prompt="1+1=") for i in range(3)])
    await r.aclose()


async def _keys(url: str) -> set[str]:
    r = connect(RedisSettings(redis_url=url))
    found = {k.decode() async for k in r.scan_iter(count=1000)}
    await r.aclose()
    return found


def test_clear_namespace_deletes_its_keys_only(redis_url: str, keys: Keys) -> None:
    other = Keys(keys.namespace + "x")  # a namespace that starts like it
    settings = RedisSettings(redis_url=redis_url, namespace=keys.namespace)
    asyncio.run(_fill(settings, keys))
    asyncio.run(_fill(settings.model_copy(update={"namespace": other.namespace}), other))
    before = asyncio.run(_keys(redis_url))
    mine = {k for k in before if keys.namespace + ":" in k and other.namespace not in k}
    assert keys.prompt_record(0, "p1") in mine and keys.stream("prompts") in mine and len(mine) == 8
    deleted = asyncio.run(clear_namespace(settings, keys))
    after = asyncio.run(_keys(redis_url))
    assert deleted == len(mine)
    assert after == before - mine | {keys.demo_owned}  # marked as the demo's now
    assert other.prompt_record(0, "p1") in after  # the other's prompts stay


@pytest.mark.slow
def test_a_namespace_with_live_workers_is_refused(redis_url: str, keys: Keys, tmp_path: Path) -> None:
    async def beat() -> None:
        r = connect(RedisSettings(redis_url=redis_url))
        await r.set(keys.heartbeat("teacher", "teacher-0"), "{}", ex=60)
        await r.set(keys.policy_version, "7")
        await r.aclose()

    asyncio.run(beat())
    assert asyncio.run(live_workers(RedisSettings(redis_url=redis_url), keys)) == 1
    proc = subprocess.run([sys.executable, "-m", "pipeline.cli.main", "demo", "--redis-url", redis_url,
                           "--namespace", keys.namespace, "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        f"distillq: namespace {keys.namespace} at {redis_url} has 1 live worker(s); the demo deletes its "
        "namespace's keys first: pass --namespace with one of its own")
    assert asyncio.run(_keys(redis_url)) >= {keys.policy_version}  # nothing deleted


def test_a_deployments_namespace_is_never_cleared_and_its_environment_is_left_alone(
    redis_url: str, keys: Keys, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = RedisSettings(redis_url=redis_url, namespace=keys.namespace)
    asyncio.run(_fill(settings, keys))  # a deployment's data, its workers stopped
    before = asyncio.run(_keys(redis_url))
    env = {**os.environ, "DISTILLQ_REDIS_URL": redis_url, "DISTILLQ_NAMESPACE": keys.namespace}
    proc = subprocess.run([sys.executable, "-m", "pipeline.cli.main", "demo", "--redis-url", redis_url,
                           "--namespace", keys.namespace, "--out", str(tmp_path / "out")],
                          check=False, capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"distillq: namespace {keys.namespace} at {redis_url} holds 8 keys that distillq demo did not make (a "
        "deployment's?); the demo deletes only namespaces it made: pass --namespace with a new name")
    assert asyncio.run(_keys(redis_url)) == before  # nothing deleted
    console: list[str] = []
    args = argparse.Namespace(redis_url=None, namespace=None)
    servers: list[EmbeddedRedis] = []
    monkeypatch.setenv("DISTILLQ_REDIS_URL", redis_url)
    monkeypatch.setenv("DISTILLQ_NAMESPACE", keys.namespace)
    try:
        url = start_redis(args, demo_namespace(args), cast(Any, Recorder(console)), servers)
    finally:
        for server in servers:
            server.stop()
    assert url != redis_url and len(servers) == 1  # an embedded Redis of its own
    assert "DISTILLQ_REDIS_URL and DISTILLQ_NAMESPACE left alone" in console[0]
    assert asyncio.run(_keys(redis_url)) == before


class Recorder:
    def __init__(self, lines: list[str]) -> None:
        self.lines = lines

    def print(self, text: str) -> None:
        self.lines.append(text)
