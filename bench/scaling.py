"""Horizontal scaling of teacher workers whose teacher takes a fixed 50 ms per call.

One worker = ``StageRunner`` + ``TeacherStage`` + ``Scorer(SyntheticTeacher(latency_s=0.05))`` reading
``per_call`` groups at a time with one teacher call at a time (``concurrent_calls=1``: a teacher that
serves one batch at a time, a GPU) and ``max_in_flight = 2 x per_call``, the ratio of the defaults (8 and
16): the next batch is read and waits for the teacher while the previous batch's outputs are written, so
the teacher does not idle during Redis writes. N workers share the ``rollouts`` consumer group.

Modes: ``tasks`` (N workers as asyncio tasks in this process: honest here, the 50 ms is a sleep that
uses no CPU) and ``procs`` (N ``python -m pipeline.cli.main worker teacher --backend synthetic
--synthetic-latency 0.05`` processes, stopped with SIGTERM; not ``--burst``, which would exit whenever
the backlog touches zero). A filler keeps the rollouts backlog topped up (raw XADD
of encoded groups) and a drain trims the scored stream, so only the workers limit the rate, measured
from the scored stream's ``entries-added`` over a window once all N workers are running. Reported per
point: groups/s, the ratio to N x the 1-worker rate, Redis CPU and the workers' CPU (cores).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from bench.common import VOCAB, Workload, client, drop_namespace, machine_cpu, new_group, new_keys, redis_cpu
from bench.reference_transport import proc_cpu
from pipeline.config import StreamSettings
from pipeline.stages.runloop import StageRunner
from pipeline.stages.scoring import Scorer, ScoringConfig
from pipeline.stages.teacher_stage import TeacherStage
from pipeline.teacher.synthetic import SyntheticTeacher
from pipeline.transport.keys import Keys
from pipeline.transport.producer import F_DATA, F_ID, F_TYPE
from schemas import RolloutGroup, encode

LATENCY_S = 0.05
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class ScalePoint:
    mode: str
    workers: int
    groups_per_s: float
    redis_cores: float  # Redis CPU seconds per second
    worker_cores: float  # CPU of the workers (this process in ``tasks`` mode, including filler and drain)
    machine_cores: float  # all processes on the machine (other sessions included)


async def _filler(r: aioredis.Redis, keys: Keys, work: Workload, target: int, stop: asyncio.Event) -> None:
    """Keep at least ``target`` rollouts waiting."""
    template, key, i = work.rollout(), keys.stream("rollouts"), 0
    while not stop.is_set():
        missing = target - int(await r.xlen(key))
        if missing > 0:
            async with r.pipeline(transaction=False) as p:
                for _ in range(missing):
                    gid = f"g{i}"
                    p.xadd(key, {F_TYPE: b"rollout", F_ID: gid, F_DATA: encode(new_group(template, gid))})
                    i += 1
                await p.execute()
        await asyncio.sleep(0.02)


async def _drain(r: aioredis.Redis, keys: Keys, stop: asyncio.Event) -> None:
    while not stop.is_set():
        await r.xtrim(keys.stream("scored"), maxlen=0)
        await asyncio.sleep(0.1)


async def _added(r: aioredis.Redis, keys: Keys) -> int:
    try:
        info: Any = await r.xinfo_stream(keys.stream("scored"))
    except Exception:  # stream not created yet
        return 0
    return int(info["entries-added"])


def _settings(per_call: int) -> StreamSettings:
    return StreamSettings(read_count=per_call, max_in_flight=2 * per_call, max_backlog=100_000, shutdown_grace_s=5.0)


class _Tasks:
    """N in-process workers."""

    def __init__(self, url: str, keys: Keys, work: Workload, n: int, per_call: int) -> None:
        self.clients = [client(url) for _ in range(n)]
        self.stop = asyncio.Event()
        cfg = ScoringConfig(default_k=work.k, concurrent_calls=1)
        self.runners = [
            StageRunner(c, keys, TeacherStage(Scorer(SyntheticTeacher(vocab_size=VOCAB, latency_s=LATENCY_S), cfg)),
                        RolloutGroup, "rollouts", "scored", _settings(per_call), consumer_name=f"teacher-{i}")
            for i, c in enumerate(self.clients)
        ]
        self.tasks = [asyncio.ensure_future(r.run(self.stop)) for r in self.runners]

    async def ready(self) -> None:
        await asyncio.sleep(0.3)

    def cpu(self) -> float:
        return time.process_time()

    def check(self) -> None:
        for t in self.tasks:
            if t.done():
                raise RuntimeError("a teacher worker task ended during the measurement") from t.exception()

    async def close(self) -> None:
        self.stop.set()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for c in self.clients:
            await c.aclose()


class _Procs:
    """N worker processes (the CLI)."""

    def __init__(self, url: str, keys: Keys, work: Workload, n: int, per_call: int) -> None:
        self.keys, self.n, self.probe = keys, n, client(url)
        env = {**os.environ, "DISTILLQ_LOG_LEVEL": "WARNING"}
        cmd = [sys.executable, "-m", "pipeline.cli.main", "worker", "teacher", "--backend", "synthetic",
               "--synthetic-latency", str(LATENCY_S), "--top-k", str(work.k), "--read-count",
               str(per_call), "--max-in-flight", str(2 * per_call), "--concurrency", "1", "--redis-url", url,
               "--namespace", keys.namespace]
        self.procs = [subprocess.Popen([*cmd, "--consumer-name", f"teacher-{i}"], cwd=ROOT, env=env,
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for i in range(n)]

    async def ready(self) -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            beats = [k async for k in self.probe.scan_iter(match=self.keys.heartbeat_pattern("teacher"))]
            if len(beats) >= self.n:
                await asyncio.sleep(0.5)
                return
            if any(p.poll() is not None for p in self.procs):
                raise RuntimeError("a teacher worker process exited early")
            await asyncio.sleep(0.2)
        raise RuntimeError("teacher worker processes did not start")

    def cpu(self) -> float:
        return sum(proc_cpu(p.pid) for p in self.procs if p.poll() is None)

    def check(self) -> None:
        if any(p.poll() is not None for p in self.procs):
            raise RuntimeError("a teacher worker process exited during the measurement")

    async def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        await self.probe.aclose()


async def point(url: str, mode: str, n: int, work: Workload, per_call: int, warmup_s: float,
                duration_s: float) -> ScalePoint:
    """Throughput of ``n`` workers in ``mode`` (``tasks`` or ``procs``)."""
    keys, r, stop = new_keys(), client(url), asyncio.Event()
    aux = [asyncio.ensure_future(_filler(r, keys, work, max(200, 4 * n * per_call * 4), stop)),
           asyncio.ensure_future(_drain(client(url), keys, stop))]
    make: Callable[..., Any] = _Tasks if mode == "tasks" else _Procs
    workers = make(url, keys, work, n, per_call)
    try:
        await workers.ready()
        await asyncio.sleep(warmup_s)
        a0, r0, c0, m0, t0 = await _added(r, keys), await redis_cpu(r), workers.cpu(), machine_cpu(), time.time()
        await asyncio.sleep(duration_s)
        a1, r1, c1, m1, t1 = await _added(r, keys), await redis_cpu(r), workers.cpu(), machine_cpu(), time.time()
        workers.check()
        for t in aux:
            if t.done():
                raise RuntimeError("the backlog filler or the drain stopped") from t.exception()
    finally:
        stop.set()
        await workers.close()
        await asyncio.gather(*aux, return_exceptions=True)
        await drop_namespace(r, keys)
        await r.aclose()
    dt = t1 - t0
    busy = (m1[0] - m0[0]) / (m1[1] - m0[1]) * (os.cpu_count() or 1)
    return ScalePoint(mode, n, (a1 - a0) / dt, (r1 - r0) / dt, (c1 - c0) / dt, busy)


def efficiency(points: list[ScalePoint]) -> dict[tuple[str, int], float]:
    """Throughput of each point over N x the 1-worker throughput of its mode."""
    one = {p.mode: p.groups_per_s for p in points if p.workers == 1}
    return {(p.mode, p.workers): p.groups_per_s / (p.workers * one[p.mode]) for p in points if p.mode in one}
