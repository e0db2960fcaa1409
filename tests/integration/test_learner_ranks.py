"""Learner ranks against a real redis-server: each rank gets its part of the same batch, a batch is acked once
all ranks acked it, and a rank killed with SIGKILL mid-batch brings the whole batch back to every rank."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from pipeline.learner.client import AsyncLearner
from pipeline.learner.parts import split_by_tokens
from pipeline.stages.batching import BatchingConfig
from pipeline.stages.feeder import Feeder
from pipeline.stages.kl_control import ConstantKL
from pipeline.transport.keys import Keys
from pipeline.transport.producer import StreamProducer
from schemas import BatchManifest, decode
from schemas.build import synthetic_rollout, synthetic_scored
from tests.integration.test_feeder import payload_keys
from tests.streams import fast

pytestmark = [pytest.mark.redis, pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parents[2]
GROUPS, PER_BATCH = 24, 6


async def batches_of_uneven_groups(r: aioredis.Redis, keys: Keys) -> list[tuple[str, BatchManifest]]:
    """24 scored groups of 2 to 4 sequences of 8 to 80 tokens, batched 6 at a time by the real feeder."""
    prod = StreamProducer(r, keys, "scored", fast())
    for i in range(GROUPS):
        lens = [8 + (i * 37 + j * 11) % 73 for j in range(2 + i % 3)]
        await prod.send(synthetic_scored(synthetic_rollout(len(lens), lens, group_id=f"g{i:03d}", seed=i), k=4, seed=i))
    cfg = BatchingConfig(max_batch_groups=PER_BATCH, max_wait_s=3600, max_staleness=None)
    await asyncio.wait_for(Feeder(r, keys, cfg, ConstantKL(0.1), fast()).run(asyncio.Event(), burst=True), 30)
    out = []
    for eid, f in await r.xrange(keys.stream("batches")):
        m = decode(f[b"d"])
        assert isinstance(m, BatchManifest)
        out.append((eid.decode(), m))
    assert [len(m.refs) for _, m in out] == [PER_BATCH] * (GROUPS // PER_BATCH)
    assert all(ref.tokens > 0 for _, m in out for ref in m.refs)  # the feeder writes each group's tokens
    return out


def check_split(m: BatchManifest, parts: list[list[str]]) -> None:
    """Disjoint, covering, balanced by tokens (within the largest group), in batch order."""
    tokens = {ref.group_id: ref.tokens for ref in m.refs}
    order = [ref.group_id for ref in m.refs]
    flat = [g for p in parts for g in p]
    assert sorted(flat) == sorted(order) and len(flat) == len(set(flat))
    loads = [sum(tokens[g] for g in p) for p in parts]
    assert max(loads) - min(loads) <= max(tokens.values()), loads
    for p in parts:
        assert p == [g for g in order if g in p]


def rank_proc(url: str, ns: str, rank: int, out: Path, *extra: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(f"{out}.log", "ab") as log:  # the child keeps its own descriptor
        return subprocess.Popen([sys.executable, "-m", "tests.learner_rank", url, ns, str(rank), "2", str(out), *extra],
                                cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=log)


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


async def wait_for(pred: Any, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        await asyncio.sleep(0.05)
    return bool(pred())


async def settled_state(r: aioredis.Redis, keys: Keys) -> tuple[int, int, int, int]:
    pending = int((await r.xpending(keys.stream("batches"), "learner"))["pending"])
    return await r.xlen(keys.stream("batches")), pending, len(await payload_keys(r, keys)), await r.xlen(keys.dlq)


@pytest.mark.slow
async def test_two_rank_processes_share_each_batch(r: aioredis.Redis, keys: Keys, redis_url: str,
                                                  tmp_path: Path) -> None:
    batches = await batches_of_uneven_groups(r, keys)
    outs = [tmp_path / f"rank{i}.jsonl" for i in range(2)]
    procs = [rank_proc(redis_url, keys.namespace, i, outs[i], "--batches", "4", "--idle-s", "60") for i in range(2)]
    for p in procs:
        assert p.wait(60) == 0, Path(f"{outs[procs.index(p)]}.log").read_text()[-3000:]
    got = [[x for x in records(o) if x["event"] == "got"] for o in outs]
    acks = [x for o in outs for x in records(o) if x["event"] == "ack"]
    assert [[g["entry"] for g in rank] for rank in got] == [[e for e, _ in batches]] * 2  # same batches, in order
    for i, (eid, m) in enumerate(batches):
        parts = [got[0][i]["groups"], got[1][i]["groups"]]
        check_split(m, parts)
        expected = split_by_tokens([ref.tokens for ref in m.refs], 2)
        assert parts == [[m.refs[j].group_id for j in idx] for idx in expected]
        assert not got[0][i]["redelivered"] and not got[1][i]["redelivered"]
        assert sorted(a["code"] for a in acks if a["entry"] == eid) == [1, 2]  # settled once, by the second ack
    assert await settled_state(r, keys) == (0, 0, 0, 0)


async def test_a_batch_is_acknowledged_only_when_every_rank_acked(r: aioredis.Redis, keys: Keys,
                                                                  redis_url: str) -> None:
    batches = await batches_of_uneven_groups(r, keys)
    ranks = [AsyncLearner(redis_url, namespace=keys.namespace, settings=fast(), rank=i, world_size=2)
             for i in range(2)]
    try:
        a, b = await asyncio.wait_for(asyncio.gather(*(x.next_batch(10) for x in ranks)), 20)
        assert a is not None and b is not None and a.entry_id == b.entry_id == batches[0][0]
        check_split(batches[0][1], [a.group_ids, b.group_ids])
        assert (a.rank, a.world_size, b.rank) == (0, 2, 1)
        assert a.batch.stats is not None and a.batch.stats["groups"] == PER_BATCH  # the global batch's stats
        assert await ranks[0].ack(a)
        # Rank 0 acked: the entry is still pending and its payloads are all there; rank 0 cannot move on.
        assert await settled_state(r, keys) == (4, 1, GROUPS, 0)
        assert await ranks[0].next_batch(0.5) is None
        with pytest.raises(RuntimeError, match="ack the current batch"):
            await ranks[1].next_batch(0.5)  # rank 1 holds the batch and has not acked it
        assert await ranks[1].ack(b)
        assert await settled_state(r, keys) == (3, 0, GROUPS - PER_BATCH, 0)
        a2, b2 = await asyncio.gather(*(x.next_batch(10) for x in ranks))
        assert a2 is not None and b2 is not None and a2.entry_id == b2.entry_id == batches[1][0]
    finally:
        for x in ranks:
            await x.aclose()


@pytest.mark.slow
async def test_killed_rank_brings_the_whole_batch_back_to_every_rank(r: aioredis.Redis, keys: Keys,
                                                                     redis_url: str, tmp_path: Path) -> None:
    batches = await batches_of_uneven_groups(r, keys)
    entries = [e for e, _ in batches]
    out0, out1, out1b = tmp_path / "r0.jsonl", tmp_path / "r1.jsonl", tmp_path / "r1b.jsonl"
    # Rank 0 acks batch 1, batch 2 (before the kill), batch 2 again, 3 and 4: five acks; the restarted rank 1
    # acks batches 2, 3 and 4. They wait as long as it takes the restarted rank to start.
    r0 = rank_proc(redis_url, keys.namespace, 0, out0, "--step-s", "0.2", "--batches", "5", "--idle-s", "60")
    r1 = rank_proc(redis_url, keys.namespace, 1, out1, "--hold-at", "2", "--idle-s", "60")
    procs = [r0, r1]
    try:
        e2 = entries[1]
        # Rank 1 holds batch 2 mid-step; rank 0 trained its part and acked it.
        assert await wait_for(lambda: any(x["event"] == "ack" and x["entry"] == e2 for x in records(out0)), 30), \
            out0.with_suffix(".jsonl.log").read_text()[-3000:]
        assert any(x["event"] == "got" and x["entry"] == e2 for x in records(out1))
        r1.send_signal(signal.SIGKILL)
        r1.wait(10)
        await asyncio.sleep(1.0)
        # Nothing moved: batch 2 is pending, in the stream with all its payloads; rank 0 waits for it.
        assert await settled_state(r, keys) == (3, 1, GROUPS - PER_BATCH, 0)
        assert [x["entry"] for x in records(out0) if x["event"] == "got"] == entries[:2]
        r1b = rank_proc(redis_url, keys.namespace, 1, out1b, "--batches", "3", "--idle-s", "60")
        procs.append(r1b)
        assert r0.wait(90) == 0 and r1b.wait(90) == 0, out0.with_suffix(".jsonl.log").read_text()[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    recs0, recs1, recs1b = records(out0), records(out1), records(out1b)
    got0 = [x for x in recs0 if x["event"] == "got"]
    got1 = [x for x in recs1 + recs1b if x["event"] == "got"]
    assert [x["entry"] for x in got0] == [entries[0], e2, e2, *entries[2:]]
    assert [x["entry"] for x in got1] == [entries[0], e2, e2, *entries[2:]]
    # The whole batch came back to both ranks, marked redelivered, split the same way.
    for got in (got0, got1):
        first, again = got[1], got[2]
        assert again["redelivered"] and not first["redelivered"] and again["generation"] > first["generation"]
        assert again["groups"] == first["groups"]
    check_split(batches[1][1], [got0[2]["groups"], got1[2]["groups"]])
    # Each batch settled exactly once; rank 0's ack from before the kill did not count towards it.
    acks = [x for x in recs0 + recs1 + recs1b if x["event"] == "ack"]
    settled = Counter(a["entry"] for a in acks if a["code"] == 2)
    assert settled == {e: 1 for e in entries}
    trained: dict[str, list[str]] = defaultdict(list)
    for x in got0[:1] + got0[2:] + got1[:1] + got1[2:]:
        trained[x["entry"]] += x["groups"]
    assert sorted(g for gs in trained.values() for g in gs) == [f"g{i:03d}" for i in range(GROUPS)]
    assert await settled_state(r, keys) == (0, 0, 0, 0)  # nothing lost, nothing left behind


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
async def test_ddp_ranks_gradients_equal_one_process_on_the_whole_batch(
    r: aioredis.Redis, keys: Keys, redis_url: str, tmp_path: Path
) -> None:
    torch = pytest.importorskip("torch")
    from safetensors import safe_open
    from safetensors.torch import load_file

    from pipeline.learner.torch_batch import to_torch
    from pipeline.stages.batching import materialize
    from schemas import ScoredGroup
    from tests.learner_ddp import loss_sums, tiny_model

    batches = await batches_of_uneven_groups(r, keys)
    _, m = batches[0]
    groups = [decode(x, expect=ScoredGroup) for x in await r.mget([ref.key for ref in m.refs])]
    # One process on the whole batch: the mean losses' gradients.
    tb = to_torch(materialize(m, groups))
    model = tiny_model()
    pg, kd = loss_sums(model, tb)
    (pg / tb.loss_mask.sum() + kd / tb.distill_mask.sum()).backward()
    want = {n: p.grad for n, p in model.named_parameters()}
    port, env = str(free_port()), {**os.environ, "PYTHONPATH": str(ROOT)}
    outs = [tmp_path / f"grads{i}.safetensors" for i in range(2)]
    procs = [subprocess.Popen([sys.executable, "-m", "tests.learner_ddp", redis_url, keys.namespace, str(i), "2",
                               port, str(outs[i])], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT) for i in range(2)]
    for p in procs:
        text = p.communicate(timeout=90)[0].decode()
        assert p.returncode == 0, text[-3000:]
    parts = []
    for out in outs:
        with safe_open(str(out), framework="pt") as f:
            parts.append((f.metadata() or {})["groups"].split(","))
        got = load_file(str(out))
        assert got.keys() == want.keys()
        for n, g in got.items():
            torch.testing.assert_close(g, want[n], atol=1e-6, rtol=0)
    check_split(m, parts)
    assert all(parts)  # each rank trained on a non-empty part
    xlen, pending, _, dlq = await settled_state(r, keys)
    assert (xlen, pending, dlq) == (3, 0, 0)  # the batch was acknowledged once both ranks acked it


async def test_a_rank_with_an_empty_part_still_gets_and_acks_the_batch(r: aioredis.Redis, keys: Keys,
                                                                      redis_url: str) -> None:
    prod = StreamProducer(r, keys, "scored", fast())
    for i in range(2):
        await prod.send(synthetic_scored(synthetic_rollout(2, 16, group_id=f"g{i}", seed=i), k=4, seed=i))
    cfg = BatchingConfig(max_wait_s=3600, max_staleness=None)
    await asyncio.wait_for(Feeder(r, keys, cfg, ConstantKL(0.1), fast()).run(asyncio.Event(), burst=True), 30)
    ranks = [AsyncLearner(redis_url, namespace=keys.namespace, settings=fast(), rank=i, world_size=3)
             for i in range(3)]
    try:
        got = await asyncio.wait_for(asyncio.gather(*(x.next_batch(10) for x in ranks)), 20)
        assert all(b is not None for b in got)
        parts = [b.group_ids for b in got if b is not None]
        assert sorted(len(p) for p in parts) == [0, 1, 1] and sorted(g for p in parts for g in p) == ["g0", "g1"]
        for x, b in zip(ranks, got, strict=True):
            assert b is not None and await x.ack(b)
        assert await settled_state(r, keys) == (0, 0, 0, 0)
    finally:
        for x in ranks:
            await x.aclose()
