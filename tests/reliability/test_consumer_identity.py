"""One live process per consumer identity, as orchestrators and people restart learners (real processes, real Redis).

The plants: a second ``learner-0`` started while the first still holds a batch (a rolling restart that starts the
new process first; a person restarting a learner that had not died); the first killed with -9 while it holds a
batch, its successor started at once; the first paused past its heartbeat TTL (a stopped container, a long GC)
while its successor takes the name, then resumed. In each, every group is acknowledged exactly once, and what
happened is named (one line from the refused process, an incident in ``distillq stats``).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from pipeline.cli.main import main as cli_main
from pipeline.transport.keys import Keys
from tests.integration.test_learner_delivery import feed, push
from tests.reliability.harness import wait_until
from tests.streams import process_env

pytestmark = [pytest.mark.redis, pytest.mark.slow, pytest.mark.timeout(90)]
ROOT = Path(__file__).resolve().parents[2]


STARTED: list[subprocess.Popen[str]] = []


@pytest.fixture(autouse=True)
def _no_process_outlives_its_test() -> Iterator[None]:
    yield
    while STARTED:
        p = STARTED.pop()
        if p.poll() is None:
            p.kill()
        if p.stderr is not None and not p.stderr.closed:
            p.communicate()
        p.wait()


def start(redis_url: str, keys: Keys, record: Path, *extra: str) -> subprocess.Popen[str]:
    env = {**os.environ, **process_env(), "DISTILLQ_REDIS_URL": redis_url, "DISTILLQ_NAMESPACE": keys.namespace}
    p = subprocess.Popen([sys.executable, "-m", "tests.hold_learner", "--name", "learner-0", "--record",
                          str(record), *extra], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    STARTED.append(p)
    return p


def events(record: Path, pid: int | None = None) -> list[dict[str, Any]]:
    if not record.exists():
        return []
    rows = [json.loads(line) for line in record.read_text().splitlines()]
    return [e for e in rows if pid is None or e["pid"] == pid]


def acked_groups(record: Path) -> Counter[str]:
    """Each group id, the times a batch holding it was acknowledged (``ack`` returned True)."""
    handed = {(e["pid"], e["entry"]): e["groups"] for e in events(record) if e["event"] == "batch"}
    return Counter(g for e in events(record) if e["event"] == "acked" and e["ok"]
                   for g in handed[(e["pid"], e["entry"])])


async def holding(record: Path, pid: int) -> bool:
    return any(e["event"] == "batch" for e in events(record, pid))


async def eight_groups_in_four_batches(r: aioredis.Redis, keys: Keys) -> list[str]:
    ids = await push(r, keys, [0] * 8)
    await feed(r, keys, max_batch_groups=2, max_staleness=None)
    assert await r.xlen(keys.stream("batches")) == 4
    return ids


def finish(p: subprocess.Popen[str], timeout: float = 60) -> tuple[int, str]:
    _, err = p.communicate(timeout=timeout)
    return p.returncode, err


async def test_a_second_live_learner_under_one_name_is_refused_and_nothing_is_trained_twice(
    r: aioredis.Redis, keys: Keys, redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ids = await eight_groups_in_four_batches(r, keys)
    record = tmp_path / "record.jsonl"
    first = start(redis_url, keys, record, "--hold-first", "8")
    assert await wait_until(lambda: holding(record, first.pid), 30)
    second = start(redis_url, keys, record)  # a rolling restart: the new process before the old one stopped
    code, err = await asyncio.to_thread(finish, second, 30)
    lines = [x for x in err.splitlines() if x.startswith("distillq:")]
    assert code == 2, err
    assert lines == [f"distillq: learner consumer learner-0 rank 0 is held by a live process (pid {first.pid} on host "
                     f"{os.uname().nodename} since {lines[0].split(' since ')[1].split(')')[0]}): stop it, or start "
                     "this one under another name"], err
    assert events(record, second.pid) == []  # refused when its Learner was made: it did nothing
    assert (await asyncio.to_thread(finish, first))[0] == 0
    assert acked_groups(record) == Counter({g: 1 for g in ids})  # every group once, all by the first
    capsys.readouterr()
    assert await asyncio.to_thread(cli_main, ["stats", "--redis-url", redis_url, "--namespace", keys.namespace]) == 0
    out = capsys.readouterr().out
    assert "(name_refused, learner consumer learner-0 rank 0): learner consumer learner-0 rank 0 is held" in out
    # the name is free again once its holder stopped: a restart now takes it at once
    again = start(redis_url, keys, record, "--idle-exit", "0.5")
    assert (await asyncio.to_thread(finish, again))[0] == 0 and events(record, again.pid) == [
        {"pid": again.pid, "event": "start"}]


async def test_a_learner_killed_holding_a_batch_is_succeeded_under_its_name_and_the_batch_trained_once(
    r: aioredis.Redis, keys: Keys, redis_url: str, tmp_path: Path
) -> None:
    ids = await eight_groups_in_four_batches(r, keys)
    record = tmp_path / "record.jsonl"
    first = start(redis_url, keys, record, "--hold-first", "60")
    assert await wait_until(lambda: holding(record, first.pid), 30)
    first.kill()  # -9: its claim is not released, it expires with its heartbeat
    first.communicate()
    successor = start(redis_url, keys, record)
    code, err = await asyncio.to_thread(finish, successor)
    assert code == 0, err
    mine = [e for e in events(record, successor.pid) if e["event"] == "batch"]
    assert len(mine) == 4 and mine[0]["redelivered"]  # the killed one's batch comes back first
    assert acked_groups(record) == Counter({g: 1 for g in ids})


async def test_a_learner_paused_past_its_ttl_loses_its_name_and_cannot_ack_what_its_successor_trains(
    r: aioredis.Redis, keys: Keys, redis_url: str, tmp_path: Path
) -> None:
    ids = await eight_groups_in_four_batches(r, keys)
    record = tmp_path / "record.jsonl"
    first = start(redis_url, keys, record, "--hold-first", "3")
    assert await wait_until(lambda: holding(record, first.pid), 30)
    os.kill(first.pid, signal.SIGSTOP)  # paused: its heartbeat stops, the name expires
    try:
        successor = start(redis_url, keys, record, "--idle-exit", "6")
        assert await wait_until(lambda: holding(record, successor.pid), 30)
    finally:
        os.kill(first.pid, signal.SIGCONT)
    code, err = await asyncio.to_thread(finish, first)
    assert code == 2 and "learner consumer learner-0 rank 0 was taken by another process (pid " \
        f"{successor.pid}" in err, err
    assert [e["event"] for e in events(record, first.pid)] == ["start", "batch"]  # its held batch never acked
    assert (await asyncio.to_thread(finish, successor))[0] == 0
    assert acked_groups(record) == Counter({g: 1 for g in ids})
