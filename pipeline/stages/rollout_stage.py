"""The rollout stage: prompt jobs (arq) in, sampled and rewarded groups out on ``rollouts``.

``RolloutStage`` is the stage logic, without Redis: ``sample(job, epoch)`` samples one group of ``group_size``
completions of the job's prompt and rewards them. Its policy version comes from where the weights are:

* a ``SyncedStudent`` (servers kept on the newest published version, ``keep_synced``): the version the servers
  say sampled the group; a group sampled while the weights changed under it is sampled again up to
  ``RESAMPLES`` times, then dropped (``None``), each counted (``distillq_unattributed_samples_total``);
* a local student with a weights directory: the newest version the learner published (``published``) is
  loaded into it first (``weights_reloaded``), and the group is tagged with the version loaded;
* otherwise: the published version, read before each sample.

``RolloutWorker`` runs the stage as a worker under ``WorkerLifecycle``: arq jobs in (``max_jobs`` at once),
each group pushed with backpressure (``group_pushed``), the heartbeat ``health:rollout:<consumer>`` written,
and on stop no new job taken, the jobs in flight given ``shutdown_grace_s`` (``rollout_worker_draining``),
the rest cancelled (arq runs them again), then ``rollout_worker_stopped``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import redis.asyncio as aioredis
import structlog

from pipeline import metrics
from pipeline.config import RedisSettings, StreamSettings
from pipeline.rollout.rewards import RewardFn
from pipeline.rollout.sampler import sample_group
from pipeline.rollout.students.base import GenParams, StudentBackend
from pipeline.rollout.synced import SyncedStudent
from pipeline.rollout.weight_sync import attribute, attribution
from pipeline.stages.lifecycle import Heartbeat, RunStats, WorkerLifecycle, default_consumer_name
from pipeline.transport.jobs import JobStats, JobWorker, PromptJob, build_worker
from pipeline.transport.keys import Keys
from pipeline.transport.producer import StreamProducer
from schemas import RolloutGroup

log = structlog.get_logger("distillq.rollout")
#: Times a group is sampled again when the servers' weights changed while it was sampled.
RESAMPLES = 2
#: Reads the policy version the learner published last (0: none yet).
VersionSource = Callable[[], Awaitable[int]]


async def sample_attributed(once: Callable[[], Awaitable[RolloutGroup]]) -> RolloutGroup | None:
    """A group tagged with the version the servers say sampled it: sampled again up to ``RESAMPLES`` times
    when the weights changed under it, then dropped (``None``), each counted."""
    for attempt in range(RESAMPLES + 1):
        with attribution() as seen:
            group = await once()
        got = attribute(seen)
        if got is not None:
            return msgspec.structs.replace(group, policy_version=got)
        outcome = "resampled" if attempt < RESAMPLES else "dropped"
        metrics.UNATTRIBUTED_SAMPLES.labels(outcome).inc()
        log.warning("group_not_attributable", group_id=group.group_id, versions=seen, outcome=outcome)
    return None


@contextlib.asynccontextmanager
async def keep_synced(student: SyncedStudent | None, stop: asyncio.Event) -> AsyncIterator[None]:
    """Servers synced once before the first job, then kept on the newest version until ``stop``."""
    if student is None:
        yield
        return
    await student.start()
    task = asyncio.create_task(student.run(stop))
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await student.aclose()


def published_version(redis: aioredis.Redis, keys: Keys) -> VersionSource:
    """The ``VersionSource`` of a namespace: its ``policy_version`` key."""

    async def read() -> int:
        raw = await redis.get(keys.policy_version)
        return int(raw) if raw is not None else 0

    return read


@dataclass(frozen=True)
class RolloutConfig:
    group_size: int = 8
    params: GenParams = field(default_factory=GenParams)
    #: Where a learner publishes weights: a local student reloads them (servers: ``SyncedStudent``).
    weights_dir: str | None = None


class RolloutStage:
    """Samples and rewards one group per prompt job (see the module for its policy version)."""

    name = "rollout"

    def __init__(self, backend: StudentBackend, reward: RewardFn, cfg: RolloutConfig, published: VersionSource) -> None:
        self.backend, self.reward, self.cfg, self.published = backend, reward, cfg, published
        self.synced = backend if isinstance(backend, SyncedStudent) and backend.synced else None
        self.loaded = -1  # version of the weights in the local model (weights-dir mode)
        self._reload_lock = asyncio.Lock()

    async def current_version(self) -> int:
        """The published version; a local student with a weights directory loads it first (if newer)."""
        version = await self.published()
        load = getattr(self.backend, "load_weights", None)  # local (hf) students only
        if not self.cfg.weights_dir or load is None:
            return version  # a server's weights follow the published version
        async with self._reload_lock:
            if version > self.loaded:
                got = await load(self.cfg.weights_dir)
                if got is not None:
                    self.loaded = got
                    log.info("weights_reloaded", version=got)
        return max(self.loaded, 0)

    async def sample(self, job: PromptJob, epoch: int) -> RolloutGroup | None:
        """One group for ``job`` (group id ``<epoch>:<job id>``); None if it could not be attributed."""
        prompt: Any = job.messages if job.messages is not None else job.prompt

        async def once() -> RolloutGroup:
            return await sample_group(
                self.backend, prompt, group_size=self.cfg.group_size, params=self.cfg.params,
                reward_fn=self.reward, answer=job.answer, group_id=f"{epoch}:{job.id}", env_id=job.env_id,
                task_id=job.task_id, policy_version=await self.current_version() if self.synced is None else 0,
                group_overrides=job.group_overrides, metadata=job.metadata,
            )

        return await once() if self.synced is None else await sample_attributed(once)


class RolloutWorker:
    """``stage`` as a worker: jobs from the namespace's arq queue, groups pushed to its ``rollouts`` stream."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        stage: RolloutStage,
        redis_settings: RedisSettings,
        settings: StreamSettings | None = None,
        *,
        consumer_name: str | None = None,
        shards: int = 1,
        max_jobs: int = 4,
        burst: bool = False,
    ) -> None:
        self.redis, self.keys, self.stage = redis, keys, stage
        self.settings = s = settings or StreamSettings()
        self.producer = StreamProducer(redis, keys, "rollouts", s, shards=shards)
        self.name = consumer_name or default_consumer_name("rollout")
        self.stats, self.job_stats = RunStats(), JobStats()
        self.jobs = JobWorker(build_worker(redis_settings, keys, self.rollout, max_jobs=max_jobs, burst=burst,
                                           stats=self.job_stats))
        self.heartbeat = Heartbeat(redis, keys.heartbeat("rollout", self.name), s.heartbeat_interval_s)
        self._stop = asyncio.Event()

    async def rollout(self, job: PromptJob, epoch: int) -> str:
        """One job: its group sampled and pushed (waiting while the pipeline is full); the group id."""
        group = await self.stage.sample(job, epoch)
        if group is None:
            return f"{epoch}:{job.id}"
        version = group.policy_version
        added = await self.producer.send(group, stop=self._stop)
        self.stats.handled += 1
        self.stats.outcomes[added.result.value] += 1
        log.info("group_pushed", group_id=group.group_id, policy_version=version, result=added.result.value)
        return group.group_id

    async def run(self, stop: asyncio.Event) -> RunStats:
        """Take jobs until ``stop`` (or, with ``burst``, until the queue is drained)."""
        self._stop = stop
        life = WorkerLifecycle("rollout", stop, self.stats, heartbeat=self.heartbeat,
                               grace_s=self.settings.shutdown_grace_s)
        try:
            async with life, keep_synced(self.stage.synced, stop):
                main = self.jobs.start()
                if not await life.until_stopped(main):
                    self.jobs.stop_taking()
                    log.info("rollout_worker_draining", grace_s=life.grace_s, in_flight=len(self.jobs.in_flight))
                    await life.within_grace(self.jobs.in_flight)
                await self.jobs.close()
        finally:
            log.info("rollout_worker_stopped", groups=self.stats.handled, failed_jobs=self.job_stats.failed)
        return self.stats
