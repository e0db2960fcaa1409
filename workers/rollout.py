"""Rollout worker: prompts (``distillq enqueue``) -> sampled, rewarded groups on ``rollouts``
(``distillq worker rollout`` / ``python -m workers.rollout``): flags, the student backend they name, and the
process entry point. The stage logic is ``pipeline.stages.rollout_stage``, the worker
``pipeline.stages.rollout_worker``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys

import redis.asyncio as aioredis

from pipeline.errors import ConfigurationError
from pipeline.flags import add_flags, from_args
from pipeline.rollout.rewards import get_reward
from pipeline.rollout.students.base import StudentBackend
from pipeline.stages.rollout_stage import RolloutConfig, RolloutStage, published_version
from pipeline.stages.rollout_worker import RolloutWorker
from pipeline.transport.keys import Keys
from pipeline.weightstore.follow import Follower
from schemas.pools import pool_problem
from workers.common import add_common_args, run_stage, shard_plan, standalone, stream_settings
from workers.settings import RolloutSettings, gen_params, student_urls

__all__ = ["add_arguments", "main", "make_backend", "serve"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_flags(p, RolloutSettings)
    add_common_args(p)


def make_backend(args: argparse.Namespace) -> StudentBackend:
    if not args.model:
        raise ConfigurationError("--model is required: the student's served model name (vllm) or local path (hf)")
    if args.backend == "hf":
        from pipeline.rollout.students.hf import HFStudent

        return HFStudent.from_pretrained(args.model, device=args.device, dtype=args.dtype)
    urls = student_urls(from_args(RolloutSettings, args))
    if not urls:
        raise ConfigurationError("--url is required for the vllm backend")
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
        raise ConfigurationError(str(e)) from None


async def serve(args: argparse.Namespace, redis: aioredis.Redis, keys: Keys, stop: asyncio.Event) -> None:
    # a URL: mirrored into a local folder every loader reads (--weights-cache)
    follower = Follower.open(args.weights_dir, local_dir=args.weights_cache)
    if follower is not None:
        args = argparse.Namespace(**{**vars(args), "weights_dir": str(follower.local_dir)})
    backend = make_backend(args)
    published = published_version(redis, keys)
    if follower is not None:
        refusals = getattr(backend, "checkpoint_refusals", None)
        if refusals is not None:
            follower.on_refused = lambda e: refusals.refuse(e, kept=follower.version)
        published = follower.version_source(published)
    cfg = RolloutConfig(group_size=args.group_size, weights_dir=args.weights_dir,
                        params=gen_params(from_args(RolloutSettings, args)))
    stage = RolloutStage(backend, get_reward(args.reward), cfg, published)
    shards, _ = await shard_plan(args, redis, keys, stop)
    worker = RolloutWorker(redis, keys, stage, stream_settings(args), consumer_name=args.consumer_name, shards=shards,
                           max_jobs=args.max_jobs, burst=args.burst, teacher=args.teacher,
                           pace=None if args.max_ahead is None else (args.max_ahead, args.groups_per_step))
    async with follower.running(stop) if follower is not None else contextlib.nullcontext():
        await worker.run(stop)


def main(args: argparse.Namespace) -> int:
    if args.teacher is not None and (problem := pool_problem(args.teacher)) is not None:
        raise ConfigurationError(f"--teacher: {problem}")
    return run_stage("rollout", args, serve)


if __name__ == "__main__":
    sys.exit(standalone("rollout", add_arguments, main))
