"""Backpressure waits of any length never crash (the retry policy's exponent is capped: ``pipeline.backoff``).

A producer waiting on a full stream tries again every few milliseconds; at that pace an uncapped
``base * 2**attempt`` overflowed a float after about 1030 tries (263 s), ending ``distillq push``, the feeder
and the teacher's emits with ``OverflowError``. These tests run the wait far past that attempt count with the
producer's sleeps made instant (no 263-second tests) and run ``distillq push`` against a stream that stays full.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from pipeline.config import StreamSettings
from pipeline.transport import producer as producer_module
from pipeline.transport.keys import Keys
from pipeline.transport.producer import AddResult, BackpressureTimeout, StreamProducer
from schemas.atropos import to_atropos
from schemas.build import synthetic_rollout

pytestmark = pytest.mark.redis

#: The tries after which an uncapped ``base * 2**attempt`` overflows a float (2**1024), with some margin.
OVERFLOW_TRIES = 1100
#: Well past that.
TRIES = 3000


class _InstantSleeps:
    """``asyncio`` as the producer module sees it, but ``sleep`` returns at once and records its delay."""

    def __init__(self) -> None:
        self.asked: list[float] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(asyncio, name)

    async def sleep(self, delay: float) -> None:
        self.asked.append(delay)
        await asyncio.sleep(0)


@pytest.fixture
def instant_sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The producer's waits return at once (only the producer's: the test's own sleeps stay real); the
    delays it asked for are recorded."""
    fake = _InstantSleeps()
    monkeypatch.setattr(producer_module, "asyncio", fake)
    return fake.asked


async def test_a_producer_waits_thousands_of_tries_past_the_old_overflow_then_writes(
    r: aioredis.Redis, keys: Keys, instant_sleeps: list[float]
) -> None:
    settings = StreamSettings(max_backlog=1, backpressure_timeout_s=600)
    prod = StreamProducer(r, keys, "rollouts", settings)
    assert (await prod.send(synthetic_rollout(2, 5, group_id="first"))).result is AddResult.ADDED
    sending = asyncio.create_task(prod.send(synthetic_rollout(2, 5, group_id="second")))
    while len(instant_sleeps) < TRIES and not sending.done():
        await asyncio.sleep(0.01)
    assert not sending.done(), sending.exception()  # still waiting, no OverflowError
    assert all(0.0 <= d <= 0.5 + 0.005 for d in instant_sleeps)  # the producer's cap (plus its 5 ms floor)
    assert max(instant_sleeps) > 0.4  # the cap was reached long ago, and the delays stay there
    (first_id, _), = await r.xrange(keys.stream("rollouts"))
    await r.xdel(keys.stream("rollouts"), first_id)  # the consumer takes the first: room for the second
    added = await asyncio.wait_for(sending, 30)
    assert added.result is AddResult.ADDED and len(instant_sleeps) >= TRIES
    assert [f[b"gid"] for _, f in await r.xrange(keys.stream("rollouts"))] == [b"second"]


async def test_a_wait_past_its_timeout_ends_with_backpressure_timeout_not_an_overflow(
    r: aioredis.Redis, keys: Keys, instant_sleeps: list[float]
) -> None:
    settings = StreamSettings(max_backlog=1, backpressure_timeout_s=2.0)
    prod = StreamProducer(r, keys, "rollouts", settings)
    await prod.send(synthetic_rollout(2, 5, group_id="first"))
    with pytest.raises(BackpressureTimeout, match="held >= 1 unconsumed entries for 2 s"):
        await prod.send(synthetic_rollout(2, 5, group_id="second"))
    # 2 s of instant sleeps is a few thousand tries (under 2,000 on a loaded 2-core machine): past the overflow point
    assert len(instant_sleeps) > OVERFLOW_TRIES


def test_push_onto_a_stream_that_stays_full_says_how_many_got_in(redis_url: str, keys: Keys, tmp_path: Path) -> None:
    """The operator's repro: ``DISTILLQ_MAX_BACKLOG=1``, no teacher, ``distillq push`` of 3 groups."""
    path = tmp_path / "groups.jsonl"
    path.write_text("".join(json.dumps(to_atropos(synthetic_rollout(2, 9, prompt_len=3, group_id=f"g{i}", seed=i)))
                            + "\n" for i in range(3)))
    env = {**os.environ, "DISTILLQ_MAX_BACKLOG": "1", "DISTILLQ_BACKPRESSURE_TIMEOUT_S": "3"}
    done = subprocess.run([sys.executable, "-m", "pipeline.cli.main", "push", str(path), "--redis-url", redis_url,
                           "--namespace", keys.namespace], check=False, env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr and "OverflowError" not in done.stderr
    assert f"pushed 1 of 3 group(s) onto rollouts in namespace '{keys.namespace}', then it stayed full" in done.stderr
