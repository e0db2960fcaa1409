"""The rollout stage logic: a prompt in, a sampled and rewarded group out (the worker is ``rollout_worker``).

``RolloutStage`` is the stage logic, without Redis: ``sample(job, epoch)`` samples one group of ``group_size``
completions of the job's prompt and rewards them. Its policy version comes from where the weights are:

* a ``SyncedStudent`` (servers kept on the newest published version, ``keep_synced``): the version the servers
  say sampled the group; a group sampled while the weights changed under it is sampled again up to
  ``RESAMPLES`` times, then given up (``None``: the worker retries the prompt later), each counted
  (``distillq_unattributed_samples_total``);
* a local student with a weights directory: the newest version the learner published (``published``) is
  loaded into it first (``weights_reloaded``), and the group is tagged with the version loaded;
* otherwise: the published version, read before each sample.
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
from pipeline.rollout.rewards import RewardFn
from pipeline.rollout.sampler import sample_group
from pipeline.rollout.students.base import GenParams, StudentBackend, WeightReloader
from pipeline.rollout.synced import SyncedStudent
from pipeline.rollout.weight_sync import attribute, attribution
from pipeline.transport.connection import retry_transient
from pipeline.transport.keys import Keys
from pipeline.transport.prompts import PromptJob
from pipeline.transport.prompts import group_id as prompt_group_id
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
    """The ``VersionSource`` of a namespace: its ``policy_version`` key (waiting for a Redis that is away)."""

    async def read() -> int:
        raw = await retry_transient(lambda: redis.get(keys.policy_version), redis=redis)
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
        self.reloader = backend if isinstance(backend, WeightReloader) else None  # a local student's own loads
        self.loaded = -1  # version of the weights in the local model (weights-dir mode)
        self.sampled_version: int | None = None  # the policy version of the last group sampled
        self._reload_lock = asyncio.Lock()

    def report(self) -> dict[str, object]:
        """Figures for the heartbeat: ``checkpoint_not_loadable``, the published version the student refused and
        the one it samples with (``pipeline.rollout.refusals``), while such a refusal is in force (``stats``
        names it under ``attention:``); ``weights_version``, the policy version of the last group it sampled
        (``stats`` shows it per rollout worker)."""
        follower = self.reloader or self.synced  # the student that loads published weights, if any
        return {"checkpoint_not_loadable": follower.checkpoint_refusals.report() if follower is not None else None,
                "weights_version": self.sampled_version}

    async def current_version(self) -> int:
        """The published version; a local student with a weights directory loads it first (if newer)."""
        version = await self.published()
        if not self.cfg.weights_dir or self.reloader is None:
            return version  # a server's weights follow the published version
        async with self._reload_lock:
            if version > self.loaded:
                got = await self.reloader.load_weights(self.cfg.weights_dir)
                if got is not None:
                    self.loaded = got
                    log.info("weights_reloaded", version=got)
        return max(self.loaded, 0)

    async def sample(self, job: PromptJob, epoch: int, group_id: str | None = None) -> RolloutGroup | None:
        """One group for ``job`` (group id ``group_id``, by default ``<epoch>:<job id>``); None if it could not be
        attributed."""
        prompt: Any = job.messages if job.messages is not None else job.prompt
        gid = group_id or prompt_group_id(epoch, job.id)

        async def once() -> RolloutGroup:
            return await sample_group(
                self.backend, prompt, group_size=self.cfg.group_size, params=self.cfg.params,
                reward_fn=self.reward, answer=job.answer, group_id=gid, env_id=job.env_id,
                task_id=job.task_id, policy_version=await self.current_version() if self.synced is None else 0,
                group_overrides=job.group_overrides, metadata=job.metadata,
            )

        group = await once() if self.synced is None else await sample_attributed(once)
        if group is not None:
            self.sampled_version = group.policy_version
        return group
