"""The README's learner (the fenced python block after ``<!-- learner-example -->``) runs as written: in its own
process, against a real redis-server holding a few batches, it trains on every batch and acknowledges it, so
the batches stream empties, nothing stays pending and every group's payload is deleted."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from pipeline.stages.batching import BatchingConfig
from pipeline.stages.feeder import Feeder
from pipeline.stages.kl_control import ConstantKL
from pipeline.transport.keys import Keys
from tests.integration.test_feeder import payload_keys, push_scored
from tests.streams import fast

pytestmark = [pytest.mark.redis, pytest.mark.timeout(120)]
ROOT = Path(__file__).resolve().parents[2]
MARKER = "<!-- learner-example -->"


def readme_learner() -> str:
    """The code of the README's learner block; fails when the marker or its block is gone."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    m = re.search(re.escape(MARKER) + r"\n```python\n(.*?)\n```", text, re.DOTALL)
    assert m is not None, f"README.md has no ```python block right after {MARKER}"
    return m.group(1) + "\n"


async def state(r: aioredis.Redis, keys: Keys) -> tuple[int, int, int]:
    """Entries on the batches stream, entries pending to the learner group, payload keys left."""
    stream = keys.stream("batches")
    pending = sum(g["pending"] for g in await r.xinfo_groups(stream)) if await r.exists(stream) else 0
    return await r.xlen(stream), pending, len(await payload_keys(r, keys))


def test_the_block_is_the_learner_loop() -> None:
    code = readme_learner()
    assert "from distillq import" in code and "learner.batches(" in code and "learner.ack(" in code


async def test_the_readme_learner_trains_and_acks_every_batch(
    r: aioredis.Redis, keys: Keys, redis_url: str, tmp_path: Path
) -> None:
    await push_scored(r, keys, 6)
    config = BatchingConfig(max_batch_groups=2, max_wait_s=3600, max_staleness=None)
    await asyncio.wait_for(Feeder(r, keys, config, ConstantKL(0.1), fast()).run(asyncio.Event(), burst=True), 20)
    written, _, payloads = await state(r, keys)
    assert written == 3 and payloads == 6

    script = tmp_path / "learner.py"
    script.write_text(readme_learner(), encoding="utf-8")
    env = {**os.environ, "DISTILLQ_REDIS_URL": redis_url, "DISTILLQ_NAMESPACE": keys.namespace}
    log = tmp_path / "learner.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, env=env, stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while (now := await state(r, keys)) != (0, 0, 0):
            assert proc.poll() is None, f"the README learner exited {proc.returncode}:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"batches, pending, payloads left: {now}\n{log.read_text()}"
            await asyncio.sleep(0.2)
        groups = await r.xinfo_groups(keys.stream("batches"))
        assert [(g["name"], g["entries-read"]) for g in groups] == [(b"learner", written)]
        assert proc.poll() is None, f"the README learner exited {proc.returncode}:\n{log.read_text()}"
    finally:
        proc.terminate()
        proc.wait(10)
