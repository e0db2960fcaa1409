"""Latency from push to the train batch being readable by the learner, at a steady fraction of max load.

The in-process distillq pipeline of ``bench.transport`` (synthetic no-op teacher). First its maximum
throughput is measured closed-loop for the same batch size; then the producer pushes open-loop at
``fraction`` of it: group i is due at ``t0 + i / rate`` and its latency runs from that due time (so a
late producer counts against the pipeline, no coordinated omission) to the moment
``AsyncLearner.next_batch`` returned the batch holding it (read, decoded, validated).

With ``batch_groups=1`` every group is a batch: pure transport latency. With larger batches a group
also waits for the batch to fill (about ``batch_groups / rate``); the ``completing`` figures take each
batch from its last group's due time, which leaves the fill wait out. Teacher time is the Scorer's
call latency over the same run (``ScoringStats.latencies_s``).
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field

import numpy as np

from bench.common import Workload, client, drop_namespace, machine_cpu, measure, new_group, new_keys
from bench.transport import Pipeline, distillq_runner


@dataclass
class LatencyResult:
    batch_groups: int
    max_rate: float  # groups/s, closed loop
    rate: float  # offered groups/s
    achieved: float  # groups/s reaching the learner in the window
    machine_cores: float = float("nan")  # busy cores of the whole machine during the window
    per_group_ms: list[float] = field(default_factory=list)
    completing_ms: list[float] = field(default_factory=list)
    teacher_ms: list[float] = field(default_factory=list)

    @staticmethod
    def pct(xs: list[float], q: float) -> float:
        return float(np.percentile(xs, q)) if xs else float("nan")

    @property
    def target_ms(self) -> float:
        """50 ms plus the teacher's p99 call time."""
        return 50.0 + self.pct(self.teacher_ms, 99)


async def max_rate(url: str, work: Workload, batch_groups: int, warmup_s: float, duration_s: float) -> float:
    p = Pipeline(url, new_keys(), work, batch_groups=batch_groups)
    try:
        t = await measure(url, distillq_runner(p), warmup_s, duration_s, window=4 * batch_groups)
    finally:
        probe = client(url)
        await drop_namespace(probe, p.keys)
        await probe.aclose()
        await p.close()
    return t.groups_per_s


async def open_loop(url: str, work: Workload, rate: float, batch_groups: int, warmup_s: float,
                    duration_s: float) -> LatencyResult:
    """Push at ``rate`` groups/s for ``warmup_s + duration_s``; latencies of groups due after the warm-up."""
    p = Pipeline(url, new_keys(), work, batch_groups=batch_groups)
    stop = asyncio.Event()
    due: dict[str, float] = {}
    res = LatencyResult(batch_groups, 0.0, rate, 0.0)
    template, producer, learner = work.rollout(), p.producer(), p.learner()
    t0 = time.perf_counter() + 0.2
    measure_from, end = t0 + warmup_s, t0 + warmup_s + duration_s

    async def produce() -> None:
        i = 0
        while (at := t0 + i / rate) < end:
            if (wait := at - time.perf_counter()) > 0:
                await asyncio.sleep(wait)
            gid = f"g{i}"
            due[gid] = at
            await producer.send(new_group(template, gid))
            i += 1

    async def learn() -> None:
        received = 0
        while not stop.is_set():
            b = await learner.next_batch(timeout_s=0.2)
            if b is None:
                continue
            now = time.perf_counter()
            times = [due[g] for g in b.group_ids]
            await learner.ack(b)
            if min(times) >= measure_from:
                res.per_group_ms += [(now - t) * 1e3 for t in times]
                res.completing_ms.append((now - max(times)) * 1e3)
                received += len(times)
            res.achieved = received / duration_s

    tasks = [asyncio.ensure_future(t) for t in (produce(), learn(), *p.stages(stop), _machine(res, measure_from, end))]
    try:
        await tasks[0]
        deadline = time.perf_counter() + 10
        while time.perf_counter() < deadline and len(res.per_group_ms) < len(
            [t for t in due.values() if t >= measure_from]
        ):
            await asyncio.sleep(0.05)
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        if p.scorer is not None:
            res.teacher_ms = [x * 1e3 for x in p.scorer.stats.latencies_s]
        probe = client(url)
        await drop_namespace(probe, p.keys)
        await probe.aclose()
        await p.close()
    return res


async def _machine(res: LatencyResult, start: float, end: float) -> None:
    """Busy cores of the whole machine between ``start`` and ``end`` (perf_counter times)."""
    await asyncio.sleep(max(0.0, start - time.perf_counter()))
    m0 = machine_cpu()
    await asyncio.sleep(max(0.0, end - time.perf_counter()))
    m1 = machine_cpu()
    res.machine_cores = (m1[0] - m0[0]) / (m1[1] - m0[1]) * (os.cpu_count() or 1)


async def latency(url: str, work: Workload, batch_groups: int, fraction: float, warmup_s: float,
                  duration_s: float, *, max_groups_per_s: float | None = None) -> LatencyResult:
    """Measure max load (unless given), then latency at ``fraction`` of it."""
    top = max_groups_per_s or await max_rate(url, work, batch_groups, 1.0, max(2.0, duration_s / 3))
    res = await open_loop(url, work, fraction * top, batch_groups, warmup_s, duration_s)
    res.max_rate = top
    return res


def summary(r: LatencyResult) -> dict[str, float]:
    return {
        "p50_ms": r.pct(r.per_group_ms, 50), "p99_ms": r.pct(r.per_group_ms, 99),
        "max_ms": max(r.per_group_ms, default=float("nan")),
        "completing_p50_ms": r.pct(r.completing_ms, 50), "completing_p99_ms": r.pct(r.completing_ms, 99),
        "teacher_p50_ms": r.pct(r.teacher_ms, 50), "teacher_p99_ms": r.pct(r.teacher_ms, 99),
        "groups": float(len(r.per_group_ms)), "rate": r.rate, "max_rate": r.max_rate, "achieved": r.achieved,
        "machine_cores": r.machine_cores,
    }
