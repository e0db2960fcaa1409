"""What the transport rows share: workloads, the private Redis's key space, clients, meters, measurement.

Imported by ``bench.transport`` (distillq's stages), ``bench.stub_pipeline`` (the raw-bytes floor) and the
other rows; it imports neither, so the benchmark modules form no cycle.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import redis.asyncio as aioredis
import structlog

from pipeline.config import RedisSettings, StreamSettings
from pipeline.transport.connection import connect
from pipeline.transport.keys import Keys
from schemas import RolloutGroup, encode
from schemas.build import synthetic_rollout, synthetic_scored

VOCAB = 32000
BATCH_TOKENS = 65536


def quiet_logs() -> None:
    """Warnings only: the stages log one line per batch at INFO."""
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
                        logger_factory=structlog.PrintLoggerFactory())


@dataclass(frozen=True)
class Workload:
    """Groups of ``seqs`` sequences of ``seq_len`` tokens, teacher top-k ``k``."""

    seqs: int = 8
    seq_len: int = 1024
    k: int = 20

    @property
    def label(self) -> str:
        return f"{self.seqs}x{self.seq_len}"

    @property
    def group_tokens(self) -> int:
        return self.seqs * self.seq_len

    @property
    def batch_groups(self) -> int:
        """Whole groups per train batch of ``BATCH_TOKENS`` tokens."""
        return max(1, BATCH_TOKENS // self.group_tokens)

    def rollout(self) -> RolloutGroup:
        return synthetic_rollout(self.seqs, self.seq_len, vocab=VOCAB, seed=1)

    def payload_sizes(self) -> dict[str, int]:
        """Encoded bytes of one rollout and one scored group."""
        r = self.rollout()
        return {"rollout": len(encode(r)), "scored": len(encode(synthetic_scored(r, self.k, vocab=VOCAB)))}


def new_group(template: RolloutGroup, gid: str) -> RolloutGroup:
    """``template`` under a fresh group id (arrays shared, nothing copied)."""
    return msgspec.structs.replace(template, group_id=gid, created_at=time.time())


def new_keys() -> Keys:
    return Keys(f"bench{uuid.uuid4().hex[:8]}")


def client(url: str) -> aioredis.Redis:
    return connect(RedisSettings(redis_url=url))


async def drop_namespace(r: aioredis.Redis, keys: Keys) -> None:
    """Delete every key of ``keys``' namespace, ``ns:*`` and ``{ns:*`` (our private server only)."""
    for pattern in (f"{keys.namespace}:*", f"{{{keys.namespace}:*"):
        batch: list[Any] = []
        async for k in r.scan_iter(match=pattern, count=1000):
            batch.append(k)
            if len(batch) >= 1000:
                await r.unlink(*batch)
                batch.clear()
        if batch:
            await r.unlink(*batch)


async def redis_cpu(r: aioredis.Redis) -> float:
    """Redis server CPU seconds so far (user + sys)."""
    info = await r.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def machine_cpu() -> tuple[float, float]:
    """(busy, total) jiffies of all CPUs from ``/proc/stat``: busy cores = d(busy) / d(total) x nproc."""
    with open("/proc/stat") as f:
        vals = [float(x) for x in f.readline().split()[1:]]
    return sum(vals) - vals[3] - vals[4], sum(vals)


class Window:
    """Closed-loop flow control: at most ``size`` groups between push and learner ack."""

    def __init__(self, size: int) -> None:
        self.size, self.open = size, 0
        self._cond = asyncio.Condition()

    async def acquire(self) -> None:
        async with self._cond:
            await self._cond.wait_for(lambda: self.open < self.size)
            self.open += 1

    async def release(self, n: int) -> None:
        async with self._cond:
            self.open -= n
            self._cond.notify_all()

    async def close(self) -> None:
        """Let every waiting producer through (it then sees the stop event)."""
        await self.release(10**9)


@dataclass
class Meter:
    """Groups acked by the learner over time, plus process and Redis CPU at the window edges."""

    marks: list[tuple[float, int]] = field(default_factory=list)
    total: int = 0

    def add(self, n: int) -> None:
        self.total += n
        self.marks.append((time.perf_counter(), self.total))


@dataclass
class Throughput:
    """One measured run."""

    groups_per_s: float
    groups: int
    seconds: float
    cpu_per_group_ms: float  # this process
    redis_cpu_per_group_ms: float
    machine_cores: float  # busy cores of the whole machine (other sessions included) during the window

    def as_dict(self) -> dict[str, float]:
        return {"groups_per_s": self.groups_per_s, "groups": self.groups, "seconds": self.seconds,
                "cpu_ms": self.cpu_per_group_ms, "redis_cpu_ms": self.redis_cpu_per_group_ms,
                "machine_cores": self.machine_cores}


Runner = Callable[[asyncio.Event, Window, Meter], list[Awaitable[Any]]]


async def measure(url: str, start: Runner, warmup_s: float, duration_s: float, window: int) -> Throughput:
    """Run the tasks ``start`` returns; count groups acked during ``duration_s`` after ``warmup_s``."""
    stop, win, meter = asyncio.Event(), Window(window), Meter()
    probe = client(url)
    tasks = [asyncio.ensure_future(t) for t in start(stop, win, meter)]
    try:
        await asyncio.sleep(warmup_s)
        g0, c0, r0, m0, t0 = meter.total, time.process_time(), await redis_cpu(probe), machine_cpu(), time.time()
        await asyncio.sleep(duration_s)
        g1, c1, r1, m1, t1 = meter.total, time.process_time(), await redis_cpu(probe), machine_cpu(), time.time()
    finally:
        stop.set()
        await win.close()
        done, pending = await asyncio.wait(tasks, timeout=30)
        for t in pending:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for t in done:
            if not t.cancelled() and t.exception() is not None:
                raise RuntimeError("a pipeline task failed") from t.exception()
        await probe.aclose()
    n = g1 - g0
    per = max(n, 1)
    busy = (m1[0] - m0[0]) / (m1[1] - m0[1]) * (os.cpu_count() or 1)
    return Throughput(n / (t1 - t0), n, t1 - t0, (c1 - c0) * 1e3 / per, (r1 - r0) * 1e3 / per, busy)


def stream_settings() -> StreamSettings:
    return StreamSettings(max_backlog=10_000, heartbeat_interval_s=5.0, shutdown_grace_s=10.0)
