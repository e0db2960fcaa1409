"""Rollout worker: arq jobs -> sampled, rewarded groups on ``rollouts``
(``distillq worker rollout`` / ``python -m workers.rollout``): flags, the student backend they name, and the
process entry point. The stage itself is ``pipeline.stages.rollout_stage``."""

from __future__ import annotations

import argparse
import asyncio
import sys

import redis.asyncio as aioredis

from pipeline.config import redis_settings_from_args
from pipeline.rollout.rewards import get_reward, reward_names
from pipeline.rollout.students.base import GenParams, StudentBackend
from pipeline.rollout.sync_engines import ENGINES
from pipeline.stages.rollout_stage import (  # RESAMPLES, sample_attributed, keep_synced: their old import path
    RESAMPLES,
    RolloutConfig,
    RolloutStage,
    RolloutWorker,
    keep_synced,
    published_version,
    sample_attributed,
)
from pipeline.transport.jobs import arq_settings
from pipeline.transport.keys import Keys
from workers.common import add_common_args, env, one_of, run_stage, shard_plan, standalone, stream_settings

__all__ = ["RESAMPLES", "add_arguments", "keep_synced", "main", "make_backend", "sample_attributed", "serve"]


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


async def serve(args: argparse.Namespace, redis: aioredis.Redis, keys: Keys, stop: asyncio.Event) -> None:
    cfg = RolloutConfig(group_size=args.group_size, weights_dir=args.weights_dir,
                        params=GenParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p))
    stage = RolloutStage(make_backend(args), get_reward(args.reward), cfg, published_version(redis, keys))
    shards, _ = await shard_plan(args, redis, keys, stop)
    worker = RolloutWorker(redis, keys, stage, redis_settings_from_args(args), stream_settings(args),
                           consumer_name=args.consumer_name, shards=shards, max_jobs=args.max_jobs, burst=args.burst)
    await worker.run(stop)


def main(args: argparse.Namespace) -> int:
    if not args.check:
        try:
            arq_settings(redis_settings_from_args(args))  # before a model loads: one line, not a traceback
        except ValueError as e:  # a Cluster URL for the job queue
            raise SystemExit(f"distillq worker rollout: {e}") from None
    return run_stage("rollout", args, serve)


if __name__ == "__main__":
    sys.exit(standalone("rollout", add_arguments, main))
