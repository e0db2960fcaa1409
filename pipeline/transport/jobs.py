"""Rollout jobs on arq: the only module that imports arq (0.28, maintenance-only; replaceable here).

* Jobs are (de)serialised with msgpack, never pickle (arq's default).
* ``enqueue_prompts`` is idempotent per (epoch, prompt id): a marker key set with NX makes
  re-enqueueing the same id for the same epoch a no-op, also after the job finished; arq's job id
  guards the window in between.
* Jobs never raise into arq (its failure records would carry exception objects): a job returns a
  status dict, and a failure is logged and counted.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import structlog
from arq import Worker, create_pool
from arq.connections import ArqRedis
from arq.connections import RedisSettings as ArqRedisSettings

from pipeline.config import RedisSettings
from pipeline.transport.connection import is_cluster_url
from pipeline.transport.keys import Keys

log = structlog.get_logger("distillq.jobs")
ROLLOUT_JOB = "rollout"
_ENC = msgspec.msgpack.Encoder()
_DEC = msgspec.msgpack.Decoder()


def _serialize(obj: dict[str, Any]) -> bytes:
    return _ENC.encode(obj)


def _deserialize(data: bytes) -> dict[str, Any]:
    out: dict[str, Any] = _DEC.decode(data)
    return out


class PromptJob(msgspec.Struct, frozen=True, kw_only=True):
    """One line of ``distillq enqueue``: a prompt (text or chat messages) and how to roll it out."""

    id: str
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    answer: str | None = None
    env_id: int = 0
    task_id: str = ""
    group_overrides: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if not self.id:
            raise ValueError("id must be non-empty")
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("exactly one of 'prompt' or 'messages' is needed")


PROMPT_DECODER = msgspec.json.Decoder(PromptJob)


def arq_settings(rs: RedisSettings) -> ArqRedisSettings:
    url = rs.jobs_redis_url or rs.redis_url
    if is_cluster_url(url):
        raise ValueError("the rollout job queue (arq) cannot use Redis Cluster: set DISTILLQ_JOBS_REDIS_URL "
                         "to a single Redis (the stage streams stay on the cluster)")
    settings: ArqRedisSettings = ArqRedisSettings.from_dsn(url)
    return settings


def job_key_patterns(keys: Keys) -> list[str]:
    """SCAN patterns of every key the job queue holds for ``keys``' namespace: its queue, health key and
    enqueue markers (``ns:arq:*``), and arq's own per-job keys, named by the job id ``<namespace>:...``."""
    from arq.constants import in_progress_key_prefix, job_key_prefix, result_key_prefix, retry_key_prefix

    per_job = (job_key_prefix, in_progress_key_prefix, retry_key_prefix, result_key_prefix)
    return [f"{keys.arq_prefix}*", *(f"{prefix}{keys.namespace}:*" for prefix in per_job)]


def _marker(keys: Keys, epoch: int, prompt_id: str) -> str:
    return f"{keys.arq_prefix}enqueued:{epoch}:{prompt_id}"


async def enqueue_prompts(
    rs: RedisSettings, keys: Keys, prompts: Sequence[PromptJob], *, epoch: int = 0, marker_ttl_s: int = 30 * 86400
) -> tuple[int, int]:
    """Enqueue one rollout job per prompt; returns (enqueued, already present)."""
    pool: ArqRedis = await create_pool(arq_settings(rs), job_serializer=_serialize, job_deserializer=_deserialize,
                                       default_queue_name=keys.arq_queue)
    new = old = 0
    try:
        for p in prompts:
            if not await pool.set(_marker(keys, epoch, p.id), b"1", nx=True, ex=marker_ttl_s):
                old += 1
                continue
            job = await pool.enqueue_job(ROLLOUT_JOB, msgspec.to_builtins(p), epoch,
                                         _job_id=f"{keys.namespace}:{epoch}:{p.id}", _queue_name=keys.arq_queue)
            new += job is not None
            old += job is None
    finally:
        await pool.aclose(close_connection_pool=True)
    return new, old


RolloutFn = Callable[[PromptJob, int], Awaitable[str]]


@dataclass
class JobStats:
    done: int = 0
    failed: int = 0


def build_worker(
    rs: RedisSettings,
    keys: Keys,
    rollout: RolloutFn,
    *,
    max_jobs: int = 4,
    burst: bool = False,
    job_timeout_s: float = 600,
    stats: JobStats | None = None,
) -> Worker:
    """An arq worker running ``rollout(prompt, epoch)`` for each job (signals are the caller's)."""
    counters = stats or JobStats()

    async def rollout_job(ctx: dict[str, Any], prompt: dict[str, Any], epoch: int) -> dict[str, Any]:
        try:
            job = msgspec.convert(prompt, PromptJob)
            group_id = await rollout(job, epoch)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            counters.failed += 1
            log.exception("rollout_job_failed", job_id=ctx.get("job_id"), error=str(e))
            return {"status": "error", "reason": f"{type(e).__name__}: {e}"}
        counters.done += 1
        return {"status": "ok", "group_id": group_id}

    rollout_job.__qualname__ = ROLLOUT_JOB
    from arq.worker import func

    return Worker(
        functions=[func(rollout_job, name=ROLLOUT_JOB)],
        redis_settings=arq_settings(rs),
        queue_name=keys.arq_queue,
        burst=burst,
        max_jobs=max_jobs,
        job_timeout=job_timeout_s,
        keep_result=0,
        handle_signals=False,
        job_serializer=_serialize,
        job_deserializer=_deserialize,
        health_check_key=f"{keys.arq_prefix}health",
        max_tries=3,
        poll_delay=0.2,
    )


class JobWorker:
    """An arq worker driven by its caller's lifecycle (``pipeline.stages.lifecycle``): ``start`` it, ``stop_taking``
    new jobs, give its ``in_flight`` jobs time to finish, then ``close`` it (what still runs is cancelled)."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.main: asyncio.Task[None] | None = None

    def start(self) -> asyncio.Task[None]:
        """Run the worker (until its queue is drained with ``burst``, else until ``close``)."""
        self.main = asyncio.create_task(self.worker.async_run(), name="arq-worker")
        return self.main

    def stop_taking(self) -> None:
        self.worker.allow_pick_jobs = False  # what arq's own graceful handler does: take no new jobs

    @property
    def in_flight(self) -> list[asyncio.Task[Any]]:
        """The job tasks arq holds (finished ones until its next poll)."""
        return list(self.worker.tasks.values())

    async def close(self) -> None:
        """Stop the worker if it still runs, cancel the jobs still running, close its connections."""
        if self.main is not None and not self.main.done():
            self.main.cancel()
            await asyncio.gather(self.main, return_exceptions=True)
        await self.worker.close()
