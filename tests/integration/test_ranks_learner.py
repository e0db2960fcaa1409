"""The multi-rank example learner (``pipeline.demo.ranks_learner``) under torchrun, 2 gloo ranks on CPU, against a
real redis-server: every batch is trained once (the union of the ranks' parts is the batch, disjoint), a rank
killed with SIGKILL mid-step makes torchrun restart both ranks and the interrupted batch trains once, a rank
killed between the checkpoint and the ack brings back a batch the checkpoint holds, which every rank
acknowledges without training; a batch of one group leaves one rank an empty part, which still steps with the
other. Nothing is lost, duplicated or left pending."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from pipeline.stages.batching import BatchingConfig
from pipeline.stages.feeder import Feeder
from pipeline.stages.kl_control import ConstantKL
from pipeline.transport.keys import Keys
from pipeline.transport.producer import StreamProducer
from schemas import BatchManifest, decode
from schemas.build import synthetic_rollout, synthetic_scored
from tests.integration.test_feeder import payload_keys
from tests.streams import fast

pytestmark = [pytest.mark.redis, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
VOCAB = 400  # within the tiny student's vocabulary (416)


async def tiny_batches(r: aioredis.Redis, keys: Keys, groups: int, per_batch: int, *, version: int = 0
                       ) -> list[BatchManifest]:
    """``groups`` scored groups of 2 or 3 sequences (8 to 40 tokens of the tiny vocabulary), batched
    ``per_batch`` at a time by the real feeder (the last batch holds the rest)."""
    prod = StreamProducer(r, keys, "scored", fast())
    for i in range(groups):
        lens = [8 + (i * 13 + j * 7) % 33 for j in range(2 + i % 2)]
        g = synthetic_rollout(len(lens), lens, group_id=f"g{i:03d}", seed=i, vocab=VOCAB, policy_version=version)
        await prod.send(synthetic_scored(g, k=4, seed=i, vocab=VOCAB))
    cfg = BatchingConfig(max_batch_groups=per_batch, max_wait_s=3600, max_staleness=None)
    await asyncio.wait_for(Feeder(r, keys, cfg, ConstantKL(0.1), fast()).run(asyncio.Event(), burst=True), 30)
    out = []
    for _, f in await r.xrange(keys.stream("batches")):
        m = decode(f[b"d"])
        assert isinstance(m, BatchManifest)
        out.append(m)
    return out


def torchrun(*args: str, restarts: int) -> list[str]:
    """The documented launcher line: a fresh rendezvous port per launch (``--standalone``)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "--max-restarts", str(restarts), "--monitor-interval", "0.5", "-m", "pipeline.demo.ranks_learner", *args]


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


async def state(r: aioredis.Redis, keys: Keys) -> tuple[int, int, int, int]:
    """Batches left, pending to the learner group, payload keys left, dead letters."""
    pending = int((await r.xpending(keys.stream("batches"), "learner"))["pending"])
    return await r.xlen(keys.stream("batches")), pending, len(await payload_keys(r, keys)), await r.xlen(keys.dlq)


def run_killing_holds(cmd: list[str], record: Path, log: Path, timeout: float) -> tuple[int, list[float]]:
    """Run ``cmd``; each time a rank records a ``hold``, SIGKILL that rank's process. Returns the exit code and,
    per kill, the seconds until both ranks of the next start recorded ``start``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    killed: dict[int, float] = {}  # restart number -> when its held rank was killed
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    end = time.monotonic() + timeout
    try:
        while proc.poll() is None:
            assert time.monotonic() < end, f"torchrun still running after {timeout} s:\n{log.read_text()[-4000:]}"
            assert not re.search(r"failed \(exitcode: (?!-9\))", log.read_text()), log.read_text()[-4000:]  # by itself
            for x in records(record):
                if x["event"] == "hold" and x["restart"] not in killed:
                    os.kill(x["pid"], signal.SIGKILL)
                    killed[x["restart"]] = time.time()
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    starts: dict[int, list[float]] = defaultdict(list)
    for x in records(record):
        if x["event"] == "start":
            starts[x["restart"]].append(x["t"])
    restart_s = [max(starts[n + 1]) - t for n, t in sorted(killed.items()) if len(starts[n + 1]) == 2]
    return proc.returncode, restart_s


@pytest.mark.timeout(600)
async def test_two_ranks_under_torchrun_survive_kill_9_with_each_batch_trained_once(
    r: aioredis.Redis, keys: Keys, redis_url: str, tmp_path: Path
) -> None:
    from pipeline.demo.tinymodels import ensure_tiny_models
    from pipeline.learner.checkpoint import _read_state
    from pipeline.models.weights import published_versions

    student = ensure_tiny_models().student
    batches = await tiny_batches(r, keys, 16, 3)  # 6 batches; the last one holds one group
    assert [len(m.refs) for m in batches] == [3, 3, 3, 3, 3, 1]
    by_id = {m.batch_id: m for m in batches}
    weights, record, log = tmp_path / "weights", tmp_path / "record.jsonl", tmp_path / "torchrun.log"
    cmd = torchrun("--student", str(student), "--weights-dir", str(weights), "--steps", str(len(batches)),
                   "--redis-url", redis_url, "--namespace", keys.namespace, "--record", str(record),
                   "--batch-timeout", "60",
                   "--hold", "0:2:forward",      # first start: rank 1 killed mid-step 2 (after its forward)
                   "--hold", "1:4:checkpoint",   # second start: rank 1 killed after checkpoint 4, before its ack
                   restarts=2)
    rc, restart_s = run_killing_holds(cmd, record, log, 480)
    assert rc == 0, log.read_text()[-4000:]
    recs = records(record)
    print(f"restart seconds (kill -9 to both ranks started again): {restart_s}")
    assert len(restart_s) == 2
    holds = [x for x in recs if x["event"] == "hold"]
    assert [(x["restart"], x["step"], x["phase"]) for x in holds] == [(0, 2, "forward"), (1, 4, "checkpoint")]
    # Trained once: one "trained" record (after the checkpoint that holds it) per rank and batch, in batch order.
    trained = [x for x in recs if x["event"] == "trained"]
    counts = Counter((x["rank"], x["batch_id"]) for x in trained)
    assert counts == {(rank, m.batch_id): 1 for rank in (0, 1) for m in batches}, counts
    for rank in (0, 1):
        assert [x["batch_id"] for x in trained if x["rank"] == rank] == [m.batch_id for m in batches]
    # The parts of each batch are disjoint and cover it; the one-group batch left a rank an empty part.
    parts: dict[str, list[list[str]]] = defaultdict(list)
    for x in trained:
        parts[x["batch_id"]].append(x["groups"])
    for bid, ps in parts.items():
        flat = [g for p in ps for g in p]
        assert sorted(flat) == sorted(ref.group_id for ref in by_id[bid].refs) and len(flat) == len(set(flat))
    assert sorted(len(p) for p in parts[batches[-1].batch_id]) == [0, 1]
    # The interrupted batch: handed out in the first start, trained in the second, redelivered.
    b2 = holds[0]["batch_id"]
    steps_b2 = [x for x in recs if x["event"] == "step" and x["batch_id"] == b2]
    assert sorted((x["restart"], x["redelivered"]) for x in steps_b2) == [(0, False), (0, False), (1, True), (1, True)]
    assert {x["restart"] for x in trained if x["batch_id"] == b2} == {1}
    # The batch checkpointed but not acknowledged by every rank: acknowledged on both ranks without training.
    b4 = holds[1]["batch_id"]
    skipped = [x for x in recs if x["event"] == "skipped"]
    assert sorted((x["rank"], x["restart"], x["batch_id"], x["ok"]) for x in skipped) == [
        (0, 2, b4, True), (1, 2, b4, True)]
    # Nothing lost, nothing left: every batch settled, every payload deleted, nothing dead-lettered.
    assert await state(r, keys) == (0, 0, 0, 0)
    ckpt = _read_state(weights / "checkpoint")
    assert ckpt is not None and ckpt["step"] == len(batches) and ckpt["batch_ids"] == [m.batch_id for m in batches]
    assert int(await r.get(keys.policy_version)) == len(batches)
    assert max(published_versions(weights)) == len(batches)


@pytest.mark.timeout(600)
async def test_fsdp2_ranks_restart_from_their_checkpoint_and_train_each_batch_once(
    r: aioredis.Redis, keys: Keys, redis_url: str, tmp_path: Path
) -> None:
    from pipeline.demo.tinymodels import ensure_tiny_models
    from pipeline.learner.checkpoint import _read_state
    from pipeline.models.weights import load_causal_lm, load_weights

    student = ensure_tiny_models().student
    batches = await tiny_batches(r, keys, 7, 3)  # 3 batches; the last one holds one group
    weights, record, log = tmp_path / "weights", tmp_path / "record.jsonl", tmp_path / "torchrun.log"
    cmd = torchrun("--student", str(student), "--weights-dir", str(weights), "--steps", str(len(batches)),
                   "--shard", "fsdp", "--redis-url", redis_url, "--namespace", keys.namespace,
                   "--record", str(record), "--hold", "0:2:forward", restarts=1)
    rc, restart_s = run_killing_holds(cmd, record, log, 420)
    assert rc == 0, log.read_text()[-4000:]
    print(f"FSDP2 restart seconds: {restart_s}")
    recs = records(record)
    trained = [x for x in recs if x["event"] == "trained"]
    assert Counter((x["rank"], x["batch_id"]) for x in trained) == {
        (rank, m.batch_id): 1 for rank in (0, 1) for m in batches}
    assert [x["restart"] for x in recs if x["event"] == "start"] == [0, 0, 1, 1]
    restored = [x for x in recs if x["event"] == "start" and x["restart"] == 1]
    assert all(x["restored"] and x["step"] == 1 for x in restored)  # both ranks loaded checkpoint 1
    assert await state(r, keys) == (0, 0, 0, 0)
    ckpt = _read_state(weights / "checkpoint")
    assert ckpt is not None and ckpt["batch_ids"] == [m.batch_id for m in batches]
    # The published version is the full model: it loads into an unsharded student, and changed from the start.
    model = load_causal_lm(student)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    assert load_weights(model, weights) == len(batches)
    assert any(not torch_equal(start[k], v) for k, v in model.state_dict().items())


def torch_equal(a: Any, b: Any) -> bool:
    import torch

    return bool(torch.equal(a, b))
