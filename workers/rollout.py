"""Rollout worker: arq jobs -> sampled, rewarded groups on ``rollouts``
(``distillq worker rollout`` / ``python -m workers.rollout``)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
import redis.asyncio as aioredis
import structlog

from pipeline import metrics
from pipeline.config import redis_settings_from_args
from pipeline.rollout.rewards import get_reward, reward_names
from pipeline.rollout.sampler import sample_group
from pipeline.rollout.students.base import GenParams, StudentBackend
from pipeline.rollout.sync_engines import ENGINES
from pipeline.rollout.synced import SyncedStudent
from pipeline.rollout.weight_sync import attribute, attribution
from pipeline.stages.lifecycle import Heartbeat, RunStats, default_consumer_name
from pipeline.transport.jobs import JobStats, PromptJob, arq_settings, build_worker, run_worker_until
from pipeline.transport.keys import Keys
from pipeline.transport.producer import StreamProducer
from schemas import RolloutGroup
from workers.common import add_common_args, env, one_of, run_stage, shard_plan, standalone, stream_settings

log = structlog.get_logger("distillq.rollout")
#: Times a group is sampled again when the servers' weights changed while it was sampled.
RESAMPLES = 2


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=["vllm", "hf"], type=one_of("vllm", "hf"),
                   default=env("STUDENT_BACKEND", "vllm"),
                   help="vllm (a student server) or hf (a local transformers model) (env DISTILLQ_STUDENT_BACKEND)")
    p.add_argument("--model", default=env("STUDENT_MODEL"), metavar="NAME_OR_PATH",
                   help="required: served model name (vllm) or local path (hf) (env DISTILLQ_STUDENT_MODEL; "
                        "default: none)")
    p.add_argument("--url", action="append", default=None, metavar="URL[,URL...]",
                   help="student server URL(s), required for vllm: repeat or separate by commas for several servers, "
                        "used round-robin (env DISTILLQ_STUDENT_URL; default: none)")
    p.add_argument("--tokenizer", default=env("STUDENT_TOKENIZER"), metavar="PATH",
                   help="student tokenizer (env DISTILLQ_STUDENT_TOKENIZER; default: --model)")
    p.add_argument("--group-size", type=int, default=env("GROUP_SIZE") or "8", metavar="N",
                   help="completions per prompt (env DISTILLQ_GROUP_SIZE)")
    p.add_argument("--max-tokens", type=int, default=env("MAX_TOKENS") or "256", metavar="N",
                   help="tokens per completion at most (env DISTILLQ_MAX_TOKENS)")
    p.add_argument("--temperature", type=float, default=1.0, metavar="T", help="sampling temperature")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling")
    p.add_argument("--reward", default=env("REWARD", "none"), metavar="NAME",
                   help=f"reward function: {', '.join(reward_names())} (env DISTILLQ_REWARD)")
    p.add_argument("--max-jobs", type=int, default=env("MAX_JOBS") or "4", metavar="N",
                   help="prompts sampled at once (env DISTILLQ_MAX_JOBS)")
    p.add_argument("--weights-dir", default=env("WEIGHTS_DIR"), metavar="DIR",
                   help="keep the student on the newest version a learner publishes here (hf: reloaded in "
                        "process; vllm: every --url server reloaded in place); groups are tagged with the version "
                        "that sampled them, read from the server (env DISTILLQ_WEIGHTS_DIR; default: none)")
    p.add_argument("--weights-sync", choices=ENGINES, type=one_of(*ENGINES), default=env("WEIGHTS_SYNC", "vllm"),
                   help="how the servers load a version: vllm (reload_weights, VLLM_SERVER_DEV_MODE=1), vllm-lora "
                        "(a PEFT adapter per version, --enable-lora) or sglang (update_weights_from_disk) "
                        "(env DISTILLQ_WEIGHTS_SYNC)")
    p.add_argument("--device", default=env("DEVICE") or "cpu", metavar="DEVICE",
                   help="hf backend: torch device of the student model, e.g. cuda (env DISTILLQ_DEVICE)")
    add_common_args(p)


def make_backend(args: argparse.Namespace) -> StudentBackend:
    if not args.model:
        raise SystemExit("distillq worker rollout: --model is required")
    if args.backend == "hf":
        from pipeline.rollout.students.hf import HFStudent

        return HFStudent.from_pretrained(args.model, device=args.device)
    urls = [u.strip() for arg in (args.url or [env("STUDENT_URL") or ""]) for u in arg.split(",") if u.strip()]
    if not urls:
        raise SystemExit("distillq worker rollout: --url is required for the vllm backend")
    from transformers import AutoTokenizer

    from pipeline.rollout.students.vllm import VLLMStudent

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
    try:
        students = [VLLMStudent(u, args.model, tokenizer) for u in urls]
        if len(students) == 1 and not args.weights_dir:
            return students[0]
        from pipeline.rollout.sync_engines import make_engine
        from pipeline.rollout.synced import SyncedStudent

        engines = [make_engine(args.weights_sync, u, served_name=args.model) for u in urls]
        return SyncedStudent(students, engines, args.weights_dir)
    except ValueError as e:  # a malformed --url: one line, not a traceback
        raise SystemExit(f"distillq worker rollout: {e}") from None


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


async def serve(args: argparse.Namespace, redis: aioredis.Redis, keys: Keys, stop: asyncio.Event) -> None:
    backend = make_backend(args)
    reward = get_reward(args.reward)
    params = GenParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p)
    shards, _ = await shard_plan(args, redis, keys, stop)
    producer = StreamProducer(redis, keys, "rollouts", stream_settings(args), shards=shards)
    name = args.consumer_name or default_consumer_name("rollout")
    stats, job_stats = RunStats(), JobStats()

    loaded: list[int] = [-1]  # version of the weights in the local model (weights-dir mode)
    reload_lock = asyncio.Lock()
    synced = backend if isinstance(backend, SyncedStudent) and backend.synced else None

    async def current_version() -> int:
        raw = await redis.get(keys.policy_version)
        version = int(raw) if raw is not None else 0
        load = getattr(backend, "load_weights", None)  # local (hf) students only
        if not args.weights_dir or load is None:
            return version  # a server's weights follow the published version
        async with reload_lock:
            if version > loaded[0]:
                got = await load(args.weights_dir)
                if got is not None:
                    loaded[0] = got
                    log.info("weights_reloaded", version=got)
        return max(loaded[0], 0)

    async def sample(job: PromptJob, epoch: int) -> RolloutGroup | None:
        prompt: Any = job.messages if job.messages is not None else job.prompt

        async def once() -> RolloutGroup:
            return await sample_group(
                backend, prompt, group_size=args.group_size,
                params=params, reward_fn=reward, answer=job.answer, group_id=f"{epoch}:{job.id}", env_id=job.env_id,
                task_id=job.task_id, policy_version=await current_version() if synced is None else 0,
                group_overrides=job.group_overrides, metadata=job.metadata,
            )

        return await once() if synced is None else await sample_attributed(once)

    async def rollout(job: PromptJob, epoch: int) -> str:
        group = await sample(job, epoch)
        if group is None:
            return f"{epoch}:{job.id}"
        version = group.policy_version
        added = await producer.send(group, stop=stop)  # waits while the pipeline is full
        stats.handled += 1
        stats.outcomes[added.result.value] += 1
        log.info("group_pushed", group_id=group.group_id, policy_version=version, result=added.result.value)
        return group.group_id

    worker = build_worker(redis_settings_from_args(args), keys, rollout, max_jobs=args.max_jobs, burst=args.burst,
                          stats=job_stats)
    heartbeat = Heartbeat(redis, keys.heartbeat("rollout", name), stream_settings(args).heartbeat_interval_s)
    hb = asyncio.create_task(heartbeat.run(stop, stats))
    try:
        async with keep_synced(synced, stop):
            await run_worker_until(worker, stop, grace_s=stream_settings(args).shutdown_grace_s)
    finally:
        hb.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await hb
        await heartbeat.clear()
        log.info("rollout_worker_stopped", groups=stats.handled, failed_jobs=job_stats.failed)


def main(args: argparse.Namespace) -> int:
    if not args.check:
        try:
            arq_settings(redis_settings_from_args(args))  # before a model loads: one line, not a traceback
        except ValueError as e:  # a Cluster URL for the job queue
            raise SystemExit(f"distillq worker rollout: {e}") from None
    return run_stage("rollout", args, serve)


if __name__ == "__main__":
    sys.exit(standalone("rollout", add_arguments, main))
