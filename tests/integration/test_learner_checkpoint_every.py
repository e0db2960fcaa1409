"""The example learner with ``--checkpoint-every 4``: it acknowledges a batch only once a checkpoint holds it, so
crashes between checkpoints and between a checkpoint and its acks lose no batch and train none twice.

Ten one-group batches, three runs of ``pipeline.demo.learner.train`` in one namespace:

1. crashes after step 6: the checkpoint of step 4 holds batches 1-4 (acked); 5 and 6 are trained, unacked;
2. restores step 4, gets 5 and 6 again and trains them (from the checkpoint), publishes its weights above the
   versions the first run published after its checkpoint, and crashes after the checkpoint of step 8, before
   its first ack;
3. restores step 8, acknowledges the redelivered 5-8 untrained, trains 9 and 10 and stops at step 10.

In the end the last checkpoint is step 10 (every batch trained into the weights once) and no batch is left
pending or in the stream.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from pipeline.config import RedisSettings
from pipeline.demo.learner import LearnerConfig, check_config, train
from pipeline.errors import ConfigurationError
from pipeline.learner.client import Learner
from pipeline.stages.batching import BatchingConfig
from pipeline.stages.feeder import Feeder
from pipeline.stages.kl_control import ConstantKL
from pipeline.transport.connection import connect
from pipeline.transport.keys import Keys
from pipeline.transport.producer import StreamProducer
from schemas.build import synthetic_rollout, synthetic_scored
from tests.streams import fast

pytestmark = [pytest.mark.redis, pytest.mark.timeout(300)]
BATCHES = 10


class Crash(Exception):
    pass


#: One group a batch, sent at once, never stale.
ONE_GROUP = BatchingConfig(max_batch_groups=1, max_wait_s=0.0, max_staleness=1000)


async def _score(r: Any, keys: Keys, vocab: int, n: int, prefix: str) -> None:
    """``n`` scored groups of 2 sequences on the ``scored`` stream."""
    prod = StreamProducer(r, keys, "scored", fast())
    for i in range(n):
        g = synthetic_rollout(2, 12, vocab=vocab, prompt_len=4, group_id=f"{prefix}{i:02d}", seed=i)
        await prod.send(synthetic_scored(g, k=4, vocab=vocab, seed=i))


async def _write_batches(url: str, keys: Keys, vocab: int) -> None:
    r = connect(RedisSettings(redis_url=url))
    try:
        await _score(r, keys, vocab, BATCHES, "g")
        await asyncio.wait_for(Feeder(r, keys, ONE_GROUP, ConstantKL(0.1), fast()).run(asyncio.Event(), burst=True),
                               60)
        assert await r.xlen(keys.stream("batches")) == BATCHES
    finally:
        await r.aclose()


async def _left(url: str, keys: Keys) -> tuple[int, int]:
    r = connect(RedisSettings(redis_url=url))
    try:
        pending: Any = await r.xpending(keys.stream("batches"), "learner")
        return int(await r.xlen(keys.stream("batches"))), int(pending["pending"])
    finally:
        await r.aclose()


def _checkpoint_step(ckpt_dir: Path) -> int:
    latest = (ckpt_dir / "latest").read_text().strip()
    return int(json.loads((ckpt_dir / latest / "state.json").read_text())["step"])


@pytest.mark.slow
def test_checkpoint_every_4_survives_crashes_between_checkpoints_and_before_acks(
    tmp_path: Path, redis_url: str, keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pipeline.demo.tinymodels import ensure_tiny_models
    from pipeline.models.weights import load_causal_lm

    student = ensure_tiny_models().student
    vocab = int(load_causal_lm(student).config.vocab_size)
    asyncio.run(_write_batches(redis_url, keys, vocab))
    cfg = LearnerConfig(student=str(student), weights_dir=str(tmp_path / "w"), steps=BATCHES, lr=1e-3,
                        checkpoint_every=4, batch_timeout_s=5.0, redis_url=redis_url, namespace=keys.namespace)
    ckpt_dir = tmp_path / "w" / "checkpoint"
    records: list[dict[str, float]] = []

    def crash_after(step: int) -> Any:
        def on_step(rec: dict[str, float]) -> None:
            records.append(rec)
            if rec["step"] == step and "loss" in rec:
                raise Crash(f"after step {step}")
        return on_step

    # 1. a crash after step 6: 5 and 6 trained since the checkpoint of step 4, not acknowledged
    with pytest.raises(Crash):
        train(cfg, on_step=crash_after(6))
    assert _checkpoint_step(ckpt_dir) == 4
    assert asyncio.run(_left(redis_url, keys))[0] == BATCHES - 4
    first = [r for r in records if "loss" in r]
    assert [r["step"] for r in first] == [1, 2, 3, 4, 5, 6]
    assert [r["checkpoint_s"] > 0 for r in first] == [False, False, False, True, False, False]
    assert [r["held"] for r in first] == [1, 2, 3, 0, 1, 2]
    for r in first:
        for name in ("wait_s", "forward_backward_s", "optimizer_s", "publish_s", "eval_s", "wall_s", "ratio_kl",
                     "clip_frac"):
            assert r[name] >= 0, name
        assert r["publish_s"] > 0  # a version every step

    # 2. trains 5 and 6 again from the checkpoint, then crashes after the checkpoint of step 8, before any ack
    records.clear()
    real_ack = Learner.ack

    def failing_ack(self: Learner, batch: Any) -> bool:
        raise Crash("in the ack after the checkpoint")

    monkeypatch.setattr(Learner, "ack", failing_ack)
    with pytest.raises(Crash):
        train(cfg, on_step=records.append)
    monkeypatch.setattr(Learner, "ack", real_ack)
    assert _checkpoint_step(ckpt_dir) == 8
    second = [r for r in records if "loss" in r]
    assert [r["step"] for r in second] == [5, 6, 7]  # the 8th record was never emitted: it crashed in its ack
    # versions 5 and 6 of the first run are lost with it: the restored weights went out as 7, so step 5 is 8
    assert records[0]["policy_version"] == 7 and second[0]["policy_version"] == 8
    assert asyncio.run(_left(redis_url, keys))[0] == BATCHES - 4  # nothing acked in this run

    # 3. acknowledges the redelivered 5-8 untrained (the checkpoint holds them), trains 9 and 10
    records.clear()
    train(cfg, on_step=records.append)
    third = [r for r in records if "loss" in r]
    assert [r["step"] for r in third] == [9, 10]
    assert _checkpoint_step(ckpt_dir) == BATCHES  # each batch trained into the weights exactly once
    assert asyncio.run(_left(redis_url, keys)) == (0, 0)


@pytest.mark.parametrize("value", [0, 65])
def test_checkpoint_every_out_of_range_is_refused(tmp_path: Path, value: int) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigurationError, match="--checkpoint-every must be at"):
        check_config(LearnerConfig(student=str(tmp_path), weights_dir=str(tmp_path), checkpoint_every=value))


def test_a_feeder_capped_below_checkpoint_every_does_not_stall_the_learner(
    tmp_path: Path, redis_url: str, keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A feeder that sends at most one unacknowledged batch and a learner that checkpoints every 3 steps: the learner
    would wait for a second batch the feeder sends only after the first is acked. It checkpoints what it holds
    once the next batch is ``HELD_WAIT_S`` late, so every batch is trained, checkpointed and acknowledged."""
    import threading

    import pipeline.demo.learner as example
    from pipeline.demo.tinymodels import ensure_tiny_models
    from pipeline.models.weights import load_causal_lm

    monkeypatch.setattr(example, "HELD_WAIT_S", 0.5)
    student = ensure_tiny_models().student
    vocab = int(load_causal_lm(student).config.vocab_size)
    groups = 4

    ready = threading.Event()
    held: dict[str, Any] = {}

    async def feed() -> None:
        held["loop"], held["stop"] = asyncio.get_running_loop(), asyncio.Event()
        ready.set()
        r = connect(RedisSettings(redis_url=redis_url))
        try:
            await _score(r, keys, vocab, groups, "c")
            await Feeder(r, keys, ONE_GROUP, ConstantKL(0.1), fast(), max_ready_batches=1).run(held["stop"])
        finally:
            await r.aclose()

    feeder = threading.Thread(target=asyncio.run, args=(feed(),), daemon=True)
    feeder.start()
    assert ready.wait(30)
    try:
        cfg = LearnerConfig(student=str(student), weights_dir=str(tmp_path / "w"), steps=groups, lr=1e-3,
                            checkpoint_every=3, batch_timeout_s=20.0, redis_url=redis_url, namespace=keys.namespace)
        records = train(cfg)
    finally:
        held["loop"].call_soon_threadsafe(held["stop"].set)
        feeder.join(30)
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert _checkpoint_step(tmp_path / "w" / "checkpoint") == groups
    assert asyncio.run(_left(redis_url, keys)) == (0, 0)
