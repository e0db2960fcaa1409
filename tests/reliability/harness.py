"""Shared machinery of the reliability tests: worker processes, a recording learner, figures.

Workers run as real processes (``python -m pipeline.cli.main worker ...``) so faults are real: SIGKILL,
lost connections, a Redis that goes away. Every process is started here and ended by its own pid.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.config import RedisSettings, StreamSettings
from pipeline.learner.client import AsyncLearner, LearnerBatch
from pipeline.teacher.base import ScoreRequest, ScoreResult
from pipeline.teacher.synthetic import SyntheticTeacher
from pipeline.transport.connection import TRANSIENT, connect
from schemas import DistillStatus, Limits, RolloutGroup, ScoredGroup
from schemas.build import trained_rows
from tests.streams import process_env, process_settings

#: Settings every worker process of these tests gets: ``tests.streams.PROCESS``, JSON logs.
FAST_ENV: dict[str, str] = {**process_env(), "DISTILLQ_LOG_JSON": "1", "DISTILLQ_LOG_LEVEL": "INFO"}
#: The in-test side's settings (learner, producer), matching ``FAST_ENV``.
fast_settings = process_settings


#: Every figure line of this test run; tests/reliability/conftest.py prints them in the terminal summary,
#: so the figures show in any pytest run (CI's included), not only with -s.
REPORTS: list[str] = []


def report(title: str, **figures: object) -> None:
    """One greppable line of figures per test."""
    body = " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in figures.items())
    line = f"RELIABILITY {title}: {body}"
    REPORTS.append(line)
    print(f"\n{line}", flush=True)


class WorkerProc:
    """One worker process, restartable under the same consumer name; output goes to a log file."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_dir: Path) -> None:
        self.name, self.argv, self.log_path = name, argv, log_dir / f"{name}.log"
        self.env = {**os.environ, **FAST_ENV, **env}
        self.popen: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self) -> WorkerProc:
        with open(self.log_path, "ab") as log:
            self.popen = subprocess.Popen(self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True)
        self.starts += 1
        return self

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def kill(self) -> None:
        """SIGKILL (a crash), by pid."""
        if self.popen is not None and self.popen.poll() is None:
            self.popen.send_signal(signal.SIGKILL)
            self.popen.wait(10)

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL after ``grace_s``; the exit code."""
        if self.popen is None:
            return None
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.popen.returncode

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def worker_argv(stage: str, redis_url: str, namespace: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "pipeline.cli.main", "worker", stage, "--redis-url", redis_url,
            "--namespace", namespace, *extra]


@dataclass
class Workers:
    """The worker processes of one test; ``close`` ends every one of them (by pid)."""

    redis_url: str
    namespace: str
    log_dir: Path
    env: dict[str, str] = field(default_factory=dict)
    procs: dict[str, WorkerProc] = field(default_factory=dict)

    def add(self, name: str, stage: str, *extra: str, env: dict[str, str] | None = None) -> WorkerProc:
        argv = worker_argv(stage, self.redis_url, self.namespace, "--consumer-name", name, *extra)
        proc = WorkerProc(name, argv, {**self.env, **(env or {})}, self.log_dir)
        self.procs[name] = proc
        return proc.start()

    def teacher(self, name: str, *extra: str) -> WorkerProc:
        return self.add(name, "teacher", "--backend", "synthetic", *extra)

    def feeder(self, name: str, *extra: str) -> WorkerProc:
        return self.add(name, "feeder", "--max-batch-groups", "8", "--max-wait", "0.2", "--max-staleness", "-1",
                        *extra)

    def all_alive(self) -> bool:
        return all(p.alive for p in self.procs.values())

    def task_stacks(self, wait_s: float = 1.0) -> dict[str, list[str]]:
        """SIGUSR1 every live worker (``pipeline.stages.worker_main``: it logs each asyncio task's await chain)
        and return the ``task_stack`` lines each logged: where a worker that stopped making progress waits."""
        sent = {n: len(p.log_text()) for n, p in self.procs.items() if p.alive}
        for n in sent:
            self.procs[n].popen.send_signal(signal.SIGUSR1)  # type: ignore[union-attr]
        time.sleep(wait_s)
        return {n: [line for line in self.procs[n].log_text()[at:].splitlines() if '"task_stack"' in line]
                for n, at in sent.items()}

    def close(self) -> None:
        for p in self.procs.values():
            p.stop()


async def wait_until(cond: Callable[[], Awaitable[bool]], timeout_s: float, every_s: float = 0.1) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if await cond():
            return True
        await asyncio.sleep(every_s)
    return await cond()


async def heartbeat_pid(redis: Any, key: str) -> int | None:
    import json

    raw = await redis.get(key)
    return None if raw is None else int(json.loads(raw).get("pid", -1))


class RecordingLearner:
    """A learner that records every group it is handed (by group id) and acks each batch.

    ``paused`` cleared stalls it. Transient Redis errors are retried; the ack of a recorded batch is
    retried until it succeeds, so a redelivery is the pipeline's doing, never this learner's.
    """

    def __init__(self, redis_url: str, namespace: str, settings: StreamSettings | None = None,
                 limits: Limits | None = None) -> None:
        self.client = AsyncLearner(redis_url, namespace=namespace, settings=settings or fast_settings(),
                                   limits=limits or StreamSettings().limits())
        self.counts: Counter[str] = Counter()
        self.first: dict[str, ScoredGroup] = {}
        self.arrived: dict[str, float] = {}  # first arrival
        self.times: dict[str, list[float]] = {}  # every arrival
        self.batches = 0
        self.transient_errors = 0
        self.running = asyncio.Event()
        self.running.set()
        OPEN.append(self.client)

    @property
    def duplicates(self) -> int:
        return sum(n - 1 for n in self.counts.values() if n > 1)

    def duplicates_between(self, start: float, end: float) -> int:
        """Repeat deliveries (second and later) that arrived in ``[start, end)``."""
        return sum(1 for ts in self.times.values() for t in ts[1:] if start <= t < end)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.running.wait()
            try:
                b = await self.client.next_batch(timeout_s=0.2)
            except TRANSIENT:
                self.transient_errors += 1
                await asyncio.sleep(0.1)
                continue
            if b is None:
                continue
            self._record(b)
            await self._ack(b, stop)

    def _record(self, b: LearnerBatch) -> None:
        self.batches += 1
        now = time.time()
        for g in b.batch.groups:
            self.counts[g.group_id] += 1
            self.first.setdefault(g.group_id, g)
            self.arrived.setdefault(g.group_id, now)
            self.times.setdefault(g.group_id, []).append(now)

    async def _ack(self, b: LearnerBatch, stop: asyncio.Event) -> None:
        while True:
            try:
                await self.client.ack(b)
                return
            except TRANSIENT:
                self.transient_errors += 1
                await asyncio.sleep(0.1)

    async def aclose(self) -> None:
        await self.client.aclose()


async def synthetic_reference(group: RolloutGroup, k: int) -> list[ScoreResult]:
    """The same arrays computed by ``SyntheticTeacher.score`` itself (a clean run of the backend), at the
    trained rows the teacher workers ask for."""
    teacher = SyntheticTeacher()
    reqs = [ScoreRequest(s.tokens.numpy().astype(np.int32), k, trained_rows(s)) for s in group.sequences]
    outs = await teacher.score(reqs)
    assert all(isinstance(o, ScoreResult) for o in outs)
    return [o for o in outs if isinstance(o, ScoreResult)]


def teacher_matches(got: ScoredGroup, want: RolloutGroup, ref: list[ScoreResult]) -> str | None:
    """Why ``got`` differs from a clean run on ``want`` (tokens and teacher arrays), or None."""
    if got.status is not DistillStatus.OK or got.teacher is None:
        return f"status {got.status.value} ({got.reason})"
    for i, (seq, t, r, orig) in enumerate(zip(got.group.sequences, got.teacher, ref, want.sequences, strict=True)):
        if not np.array_equal(seq.tokens.numpy(), orig.tokens.numpy()):
            return f"sequence {i}: tokens differ"
        if not np.array_equal(t.row_index(seq.length), trained_rows(orig)):
            return f"sequence {i}: teacher rows differ"
        for name, a, b in (("topk_ids", t.topk_ids.numpy(), r.topk_ids),
                           ("topk_logprobs", t.topk_logprobs.numpy(), r.topk_logprobs),
                           ("sampled_logprobs", t.sampled_logprobs.numpy(), r.sampled_logprobs)):
            if a.shape != b.shape or not np.array_equal(a, b):
                return f"sequence {i}: {name} differs"
    return None


#: Every client and learner a test opens; ``close_all`` (an autouse fixture) closes them, failures included.
OPEN: list[Any] = []


def redis_client(url: str) -> Any:
    client = connect(RedisSettings(redis_url=url))
    OPEN.append(client)
    return client


async def close_all() -> None:
    while OPEN:
        await OPEN.pop().aclose()
