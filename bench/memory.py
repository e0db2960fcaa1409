"""Memory: Redis bytes per stored group versus its payload, and worker RSS over a long run.

* Redis: ``INFO memory`` ``used_memory`` before and after ``StreamProducer.send`` of ``count`` groups to a
  stream nobody reads (dedupe markers included), divided by ``count`` and by the encoded message size.
* RSS: a teacher worker (synthetic no-op teacher) and a feeder run as CLI processes; this process
  pushes 8 x 1024 groups open-loop at ``rate`` groups/s and acks every batch as the learner. VmRSS of
  both workers (``/proc/<pid>/status``, what each would read from ``/proc/self/status``) and Redis
  ``used_memory`` are sampled every second; the slope is a least-squares fit after a warm-up.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import redis.asyncio as aioredis

from bench.common import VOCAB, Workload, client, drop_namespace, new_group, new_keys
from pipeline.config import StreamSettings
from pipeline.learner.client import AsyncLearner
from pipeline.transport.keys import Keys
from pipeline.transport.producer import StreamProducer
from schemas import BatchManifest, Message, RolloutGroup, ScoredGroup, decode, encode
from schemas.build import synthetic_scored

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


async def used_memory(r: Any) -> int:
    return int((await r.info("memory"))["used_memory"])


@dataclass
class Stored:
    kind: str
    work: Workload
    count: int
    payload_bytes: int
    redis_bytes_per_group: float

    @property
    def ratio(self) -> float:
        return self.redis_bytes_per_group / self.payload_bytes


async def redis_per_group(url: str, work: Workload, kind: str, count: int) -> Stored:
    """Redis memory per ``kind`` (``rollout`` or ``scored``) message stored through the producer."""
    rollout = work.rollout()
    template: Message = rollout if kind == "rollout" else synthetic_scored(rollout, work.k, vocab=VOCAB)
    stream = "rollouts" if kind == "rollout" else "scored"
    keys, r = new_keys(), client(url)
    producer = StreamProducer(r, keys, stream, StreamSettings(max_backlog=100_000))
    try:
        await producer.send(_renamed(template, "warm"))  # stream, script and first marker exist
        before = await used_memory(r)
        for i in range(count):
            await producer.send(_renamed(template, f"g{i}"))
        after = await used_memory(r)
    finally:
        await drop_namespace(r, keys)
        await r.aclose()
    return Stored(kind, work, count, len(encode(template)), (after - before) / count)


def _renamed(msg: Message, gid: str) -> Message:
    if isinstance(msg, ScoredGroup):
        return msgspec.structs.replace(msg, group=new_group(msg.group, gid))
    assert isinstance(msg, RolloutGroup)
    return new_group(msg, gid)


def vm_rss_mb(pid: int | str = "self") -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


@dataclass
class Soak:
    minutes: float
    rate: float
    groups: int = 0
    t: list[float] = field(default_factory=list)
    rss: dict[str, list[float]] = field(default_factory=dict)  # MB per series: teacher, feeder, redis
    backlog: dict[str, list[int]] = field(default_factory=dict)  # entries per stream
    payload_keys_left: int = 0  # claim-checked payloads still in Redis at the end
    payloads_in_flight: int = 0  # of those, held by scored entries or by batches not yet acked
    markers_left: int = 0  # dedupe markers at the end (they live for dedupe_ttl_s)

    def slope_mb_per_min(self, name: str, skip_frac: float = 0.2) -> float:
        t, y = np.asarray(self.t), np.asarray(self.rss[name])
        keep = t >= t[-1] * skip_frac
        if keep.sum() < 3:
            return float("nan")
        return float(np.polyfit(t[keep] / 60, y[keep], 1)[0])

    def after_warmup(self, name: str, skip_frac: float = 0.2) -> tuple[float, float]:
        t, y = np.asarray(self.t), np.asarray(self.rss[name])
        kept = y[t >= t[-1] * skip_frac]
        return float(kept[0]), float(kept[-1])


def _spawn(stage: str, url: str, keys: Keys, extra: list[str]) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "pipeline.cli.main", "worker", stage, "--redis-url", url, "--namespace",
           keys.namespace, "--consumer-name", f"{stage}-0", *extra]
    env = {**os.environ, "DISTILLQ_LOG_LEVEL": "WARNING"}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def _wait_ready(r: Any, keys: Keys, procs: list[subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("a worker process exited early")
        beats = [k async for k in r.scan_iter(match=keys.heartbeat_pattern())]
        if len(beats) >= len(procs):
            return
        await asyncio.sleep(0.2)
    raise RuntimeError("worker processes did not start")


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        p.wait(30)


async def _count_leftovers(r: aioredis.Redis, keys: Keys, out: Soak) -> None:
    """Payload keys and dedupe markers left once the pipeline is at rest, and the payloads still owned."""
    out.payload_keys_left = sum([1 async for _ in r.scan_iter(match=f"{{{keys.namespace}:scored*:payload:*")])
    batches = [decode(f[b"d"]) for _, f in await r.xrange(keys.stream("batches"))]
    out.payloads_in_flight = int(await r.xlen(keys.stream("scored"))) + sum(
        len(b.refs) for b in batches if isinstance(b, BatchManifest))
    out.markers_left = sum([1 async for _ in r.scan_iter(match=f"{{{keys.namespace}:*:seen:*")])


async def soak(url: str, minutes: float, rate: float, work: Workload | None = None) -> Soak:
    """Run teacher + feeder processes for ``minutes`` at ``rate`` groups/s, sampling RSS every second."""
    work = work or Workload(8, 1024)
    keys, r = new_keys(), client(url)
    procs = [_spawn("teacher", url, keys, ["--backend", "synthetic", "--top-k", str(work.k)]),
             _spawn("feeder", url, keys, ["--max-batch-tokens", "65536", "--max-staleness", "-1"])]
    out = Soak(minutes, rate, rss={"teacher": [], "feeder": [], "redis": []})
    stop = asyncio.Event()
    learner = AsyncLearner(namespace=keys.namespace, redis=client(url))
    producer = StreamProducer(client(url), keys, "rollouts", StreamSettings())
    template = work.rollout()

    async def produce() -> None:
        t0, i = time.perf_counter(), 0
        while not stop.is_set():
            if (wait := t0 + i / rate - time.perf_counter()) > 0:
                await asyncio.sleep(wait)
            await producer.send(new_group(template, f"g{i}"), stop=stop)
            i += 1

    async def learn() -> None:
        while not stop.is_set():
            b = await learner.next_batch(timeout_s=0.5)
            if b is not None:
                await learner.ack(b)
                out.groups += len(b.batch.groups)

    try:
        await _wait_ready(r, keys, procs)
        tasks = [asyncio.ensure_future(produce()), asyncio.ensure_future(learn())]
        start = time.perf_counter()
        while (now := time.perf_counter() - start) < minutes * 60:
            out.t.append(now)
            out.rss["teacher"].append(vm_rss_mb(procs[0].pid))
            out.rss["feeder"].append(vm_rss_mb(procs[1].pid))
            out.rss["redis"].append(await used_memory(r) / 2**20)
            for name in ("rollouts", "scored", "batches"):
                out.backlog.setdefault(name, []).append(int(await r.xlen(keys.stream(name))))
            await asyncio.sleep(1.0)
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        await learner.aclose()
        _stop(procs)  # the workers first, so the count below is of a pipeline at rest
        await _count_leftovers(r, keys, out)
    finally:
        _stop(procs)
        await drop_namespace(r, keys)
        for c in (r, learner.redis, producer.redis):
            await c.aclose()
    return out
