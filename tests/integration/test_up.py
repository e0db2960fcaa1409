"""``distillq up`` as operators get it wrong: killed with -9 (its workers stop with it, none left running as an
orphan), started twice on one namespace (the second run's workers are refused, naming the first run's), and one
run per teacher pool (distinct consumer names)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from pipeline.cli.commands.up import specs
from pipeline.transport.keys import Keys
from tests.integration.test_exit_status import DISTILLQ, ROOT, events
from tests.reliability.harness import wait_until

pytestmark = [pytest.mark.redis]


def up_args(**kw: object) -> argparse.Namespace:
    base = dict(rollout=0, teachers=0, feeders=0, rollout_args="", teacher_args="", feeder_args="")
    return argparse.Namespace(**{**base, **kw})


def test_each_teacher_pool_gets_names_of_its_own() -> None:
    names = [s.name for s in specs(up_args(teachers=2, teacher_args="--backend vllm --pool math"))]
    assert names == ["teacher-math-0", "teacher-math-1"]
    names = [s.name for s in specs(up_args(teachers=1, feeders=1, teacher_args="--pool=default"))]
    assert names == ["teacher-0", "feeder-0"]
    (spec,) = specs(up_args(teachers=1, teacher_args="--pool code"))
    assert spec.argv[-2:] == ["--consumer-name", "teacher-code-0"]


def start_up(redis_url: str, keys: Keys, logs: Path) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTILLQ_")}
    env.update(DISTILLQ_LOG_JSON="1", DISTILLQ_HEARTBEAT_INTERVAL_S="0.5")
    return subprocess.Popen([*DISTILLQ, "up", "--feeders", "1", "--teachers", "0", "--log-dir", str(logs),
                             "--redis-url", redis_url, "--namespace", keys.namespace], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)


async def feeder_pid(r: aioredis.Redis, keys: Keys) -> int | None:
    raw = await r.get(keys.heartbeat("feeder", "feeder-0"))
    return None if raw is None else int(json.loads(raw)["pid"])


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_a_killed_up_takes_its_workers_and_a_second_up_is_refused_naming_the_first(
    r: aioredis.Redis, keys: Keys, redis_url: str, tmp_path: Path
) -> None:
    first = start_up(redis_url, keys, tmp_path / "first")
    try:
        assert await wait_until(lambda: feeder_pid(r, keys), 60, every_s=0.2)
        pid = await feeder_pid(r, keys)
        assert pid is not None
        second = start_up(redis_url, keys, tmp_path / "second")
        _, err = await asyncio.to_thread(second.communicate, timeout=60)  # its only worker refused: it ends
        (refusal,) = events(err, "process_refused_config")
        assert refusal["name"] == "feeder-0" and refusal["restarted"] is False
        assert refusal["reason"].startswith(f"distillq: feeder consumer feeder-0 is held by a live process (pid {pid} "
                                            f"on host {os.uname().nodename} since ")
        assert await feeder_pid(r, keys) == pid  # the first run's feeder is untouched
        first.send_signal(signal.SIGKILL)  # up itself, killed outright
        await asyncio.to_thread(first.communicate, timeout=30)

        async def stopped() -> bool:
            return gone(pid) and await r.exists(keys.heartbeat("feeder", "feeder-0")) == 0

        assert await wait_until(stopped, 30)  # SIGTERM from the kernel: a graceful stop, its name released
        assert (tmp_path / "first" / "feeder-0.log").read_text().count('"shutdown_requested"') == 1
    finally:
        if first.poll() is None:
            first.kill()
            first.communicate()
