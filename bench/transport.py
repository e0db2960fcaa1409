"""End-to-end transport throughput: distillq's stages versus a raw-bytes stub on the same Redis.

Topology (both sides, in-process asyncio tasks in one process, each stage with its own connection):
producer -> ``rollouts`` -> teacher worker -> ``scored`` -> feeder -> ``batches`` -> learner (ack).

* distillq: ``StreamProducer.send`` -> ``StageRunner`` + ``TeacherStage`` + ``Scorer(SyntheticTeacher())``
  -> ``pipeline.stages.feeder.Feeder`` -> ``pipeline.learner.client.AsyncLearner`` (decode, validate, ack each batch).
* stub: ``bench.stub_pipeline``: the same stream operations with pre-built bytes of the same sizes;
  ``stub_producer`` is the stub writing through ``StreamProducer.send_raw`` (the write protocol's price).

Closed loop: the producer keeps ``window`` groups between push and learner ack. Throughput is groups
acked per second after a warm-up, with the process CPU and Redis CPU (``INFO cpu``) per group.
Also shared by the other rows: the in-process pipeline builder (the workloads and meters are ``bench.common``).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis

from bench.common import (
    BATCH_TOKENS,
    VOCAB,
    Meter,
    Runner,
    Throughput,
    Window,
    Workload,
    client,
    drop_namespace,
    measure,
    new_group,
    new_keys,
    quiet_logs,
    stream_settings,
)
from pipeline.config import StreamSettings
from pipeline.learner.client import AsyncLearner
from pipeline.stages.batching import BatchingConfig
from pipeline.stages.feeder import Feeder
from pipeline.stages.kl_control import ConstantKL
from pipeline.stages.runloop import StageRunner
from pipeline.stages.scoring import Scorer, ScoringConfig
from pipeline.stages.teacher_stage import TeacherStage
from pipeline.teacher.synthetic import SyntheticTeacher
from pipeline.transport.keys import Keys
from pipeline.transport.producer import StreamProducer
from schemas import RolloutGroup


@dataclass
class Pipeline:
    """distillq's stages, in-process, on their own connections; ``tasks`` starts them."""

    url: str
    keys: Keys
    work: Workload
    batch_groups: int | None = None  # groups per train batch (default: the workload's)
    teacher_latency_s: float = 0.0
    settings: StreamSettings = field(default_factory=stream_settings)
    clients: list[aioredis.Redis] = field(default_factory=list)
    scorer: Scorer | None = None

    def _client(self) -> aioredis.Redis:
        self.clients.append(client(self.url))
        return self.clients[-1]

    def producer(self) -> StreamProducer:
        return StreamProducer(self._client(), self.keys, "rollouts", self.settings)

    def stages(self, stop: asyncio.Event) -> list[Awaitable[Any]]:
        """Teacher worker and feeder tasks."""
        s, w = self.settings, self.work
        self.scorer = Scorer(SyntheticTeacher(vocab_size=VOCAB, latency_s=self.teacher_latency_s),
                             ScoringConfig(default_k=w.k))
        teacher = StageRunner(self._client(), self.keys, TeacherStage(self.scorer), RolloutGroup,
                              "rollouts", "scored", s, consumer_name="teacher-0")
        cfg = BatchingConfig(max_batch_tokens=BATCH_TOKENS, max_batch_groups=self.batch_groups or w.batch_groups,
                             max_staleness=None, max_wait_s=0.5)
        feeder = Feeder(self._client(), self.keys, cfg, ConstantKL(1.0), s, consumer_name="feeder-0")
        return [teacher.run(stop), feeder.run(stop)]

    def learner(self) -> AsyncLearner:
        return AsyncLearner(namespace=self.keys.namespace, redis=self._client(), settings=self.settings)

    async def close(self) -> None:
        for c in self.clients:
            await c.aclose()
        self.clients.clear()


def distillq_runner(p: Pipeline) -> Runner:
    """Closed-loop producer and acking learner around ``p``'s stages."""

    def start(stop: asyncio.Event, win: Window, meter: Meter) -> list[Awaitable[Any]]:
        template, producer, learner = p.work.rollout(), p.producer(), p.learner()

        async def produce() -> None:
            i = 0
            while not stop.is_set():
                await win.acquire()
                if stop.is_set():
                    return
                await producer.send(new_group(template, f"g{i}"), stop=stop)
                i += 1

        async def learn() -> None:
            while not stop.is_set():
                b = await learner.next_batch(timeout_s=0.2)
                if b is not None:
                    await learner.ack(b)
                    meter.add(len(b.batch.groups))
                    await win.release(len(b.batch.groups))

        return [produce(), learn(), *p.stages(stop)]

    return start


async def run_distillq(url: str, work: Workload, warmup_s: float, duration_s: float) -> Throughput:
    p = Pipeline(url, new_keys(), work)
    try:
        return await measure(url, distillq_runner(p), warmup_s, duration_s, window=4 * work.batch_groups)
    finally:
        probe = client(url)
        await drop_namespace(probe, p.keys)
        await probe.aclose()
        await p.close()


async def run_stub(url: str, work: Workload, warmup_s: float, duration_s: float, *, producer: bool = False
                   ) -> Throughput:
    from bench.stub_pipeline import StubPipeline

    stub = await StubPipeline.build(url, new_keys(), work, producer=producer)
    try:
        return await measure(url, stub.start, warmup_s, duration_s, window=4 * work.batch_groups)
    finally:
        await stub.close()


@dataclass
class SideBySide:
    """Alternating runs of distillq, the stub, and the stub writing through ``StreamProducer``."""

    work: Workload
    runs: dict[str, list[Throughput]] = field(default_factory=lambda: {"distillq": [], "stub": [], "stub_producer": []})

    def best(self, name: str) -> Throughput:
        return max(self.runs[name], key=lambda t: t.groups_per_s)

    def median(self, name: str) -> float:
        return statistics.median(t.groups_per_s for t in self.runs[name])

    def ratio(self, name: str = "distillq", base: str = "stub") -> tuple[float, float]:
        """(best over best, median over median) groups/s."""
        return self.best(name).groups_per_s / self.best(base).groups_per_s, self.median(name) / self.median(base)


async def side_by_side(url: str, work: Workload, rounds: int, warmup_s: float, duration_s: float,
                       variants: tuple[str, ...] = ("distillq", "stub", "stub_producer")) -> SideBySide:
    """``rounds`` rounds of every variant, the order rotated each round so drift hits all alike."""
    out = SideBySide(work)
    for i in range(rounds):
        for name in variants[i % len(variants):] + variants[: i % len(variants)]:
            if name == "distillq":
                t = await run_distillq(url, work, warmup_s, duration_s)
            else:
                t = await run_stub(url, work, warmup_s, duration_s, producer=name == "stub_producer")
            out.runs[name].append(t)
    return out


async def _main(rounds: int, sizes: list[int], warmup_s: float, duration_s: float) -> None:
    from tests.redis_server import RedisServer

    quiet_logs()
    server = RedisServer().start()
    try:
        for n in sizes:
            s = await side_by_side(server.url, Workload(8, n), rounds, warmup_s, duration_s)
            for name, runs in s.runs.items():
                for t in runs:
                    print(s.work.label, name, {k: round(v, 2) for k, v in t.as_dict().items()})
            print(s.work.label, "distillq/stub best {:.2f} median {:.2f}".format(*s.ratio()))
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.transport``: row 2 alone, every run printed (``python -m bench`` makes the table)."""
    p = argparse.ArgumentParser(prog="python -m bench.transport", description=(__doc__ or "").splitlines()[0])
    p.add_argument("--rounds", type=int, default=2, help="rotating rounds of distillq, stub and stub_producer")
    p.add_argument("--sizes", default="1024,4096", help="sequence lengths of the 8-sequence groups")
    p.add_argument("--warmup", type=float, default=1.5, help="seconds of warm-up per run")
    p.add_argument("--duration", type=float, default=4.0, help="seconds measured per run")
    args = p.parse_args(argv)
    asyncio.run(_main(args.rounds, [int(n) for n in args.sizes.split(",")], args.warmup, args.duration))
    return 0


if __name__ == "__main__":
    sys.exit(main())
