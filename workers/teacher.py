"""Teacher-scoring worker: rollouts -> scored (``distillq worker teacher`` / ``python -m workers.teacher``)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import TYPE_CHECKING, get_args

import redis.asyncio as aioredis
import structlog

from pipeline.flags import add_flags, from_args
from pipeline.stages.runloop import StageRunner
from pipeline.stages.scoring import Scorer
from pipeline.stages.teacher_stage import TeacherStage
from pipeline.teacher.base import TeacherBackend, TeacherConfigError
from pipeline.transport.keys import Keys, pool_stream
from pipeline.transport.pools import register_pool
from schemas import RolloutGroup
from schemas.pools import pool_problem
from workers.common import add_common_args, run_stage, shard_plan, standalone, stream_settings
from workers.settings import (
    Dtype,
    TeacherBackendName,
    TeacherSettings,
    auto_or_positive,
    http_teacher_config,
    scoring_config,
    vllm_engine_config,
)

if TYPE_CHECKING:
    from pipeline.teacher.crossscore import CrossTokenizer

__all__ = ["BACKENDS", "DTYPES", "add_arguments", "auto_or_positive", "main", "make_backend", "prepare", "serve"]

log = structlog.get_logger("distillq.teacher")

DTYPES = get_args(Dtype)
BACKENDS = get_args(TeacherBackendName)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_flags(p, TeacherSettings)
    add_common_args(p)


def make_backend(args: argparse.Namespace) -> TeacherBackend:
    s = from_args(TeacherSettings, args)
    if s.backend == "hf":
        from pipeline.teacher.hf import HFTeacher

        if not s.model:
            raise TeacherConfigError("--model PATH is required for the hf backend")
        return HFTeacher(s.model, max_batch_tokens=s.max_batch_tokens, device=s.device, dtype=s.dtype,
                         chunk_positions=s.hf_chunk_positions, min_shared_prefix=s.hf_min_shared_prefix)
    if s.backend == "vllm-engine":
        from pipeline.teacher.vllm_engine import VLLMEngineTeacher

        if not s.model:
            raise TeacherConfigError("--model PATH is required for the vllm-engine backend")
        return VLLMEngineTeacher(vllm_engine_config(s, s.model, s.vllm_python or sys.executable))
    if s.backend == "synthetic":
        from pipeline.teacher.synthetic import SyntheticTeacher

        return SyntheticTeacher(latency_s=s.synthetic_latency)
    urls = tuple(s.url or ())
    if not urls:
        raise TeacherConfigError(f"--url is required for the {s.backend} backend")
    cfg = http_teacher_config(s, urls)
    if s.backend == "sglang":
        from pipeline.teacher.sglang_http import SGLangTeacher

        return SGLangTeacher(cfg)
    from pipeline.teacher.vllm_http import VLLMTeacher

    return VLLMTeacher(cfg)


async def prepare(args: argparse.Namespace) -> tuple[TeacherBackend, Scorer]:
    """Start the backend and run the startup checks (cap, vocabulary, self-test)."""
    backend = make_backend(args)
    try:
        return backend, await _checked(backend, args)
    except BaseException:
        await backend.close()  # a failed start-up check leaves no thread or HTTP client behind
        raise


async def _checked(backend: TeacherBackend, args: argparse.Namespace) -> Scorer:
    """Start ``backend``, run the start-up checks, and build the scorer."""
    from pipeline.teacher.vocab import check_same_vocab, self_test_checksum

    max_k = stream_settings(args).max_k
    if args.top_k > max_k:  # a local model's cap is its vocabulary: every group would fail the readers' check
        raise TeacherConfigError(
            f"--top-k {args.top_k} exceeds DISTILLQ_MAX_K={max_k}, the largest k any reader accepts "
            "(raise DISTILLQ_MAX_K for every worker and the learner, or lower --top-k)"
        )
    await backend.start()
    if args.top_k > backend.max_k:
        raise TeacherConfigError(
            f"--top-k {args.top_k} exceeds the teacher's logprob cap of {backend.max_k} "
            "(raise the server's --max-logprobs or lower --top-k)"
        )
    cross = None
    if args.cross_tokenizer:
        cross = cross_tokenizer(args)
    elif args.student_tokenizer:
        teacher_tok = args.tokenizer or args.model
        if not teacher_tok:
            raise TeacherConfigError("--tokenizer (or a local --model path) is needed to compare vocabularies")
        check_same_vocab(teacher_tok, args.student_tokenizer)
    checksum = await self_test_checksum(backend)
    log.info("teacher_ready", identity=backend.identity, max_k=backend.max_k, top_k=args.top_k, self_test=checksum)
    return Scorer(backend, scoring_config(from_args(TeacherSettings, args)), limits=stream_settings(args).limits(),
                  pool=args.pool, cross=cross)


def cross_tokenizer(args: argparse.Namespace) -> CrossTokenizer:
    """``--cross-tokenizer``: both tokenizers' byte tables and the teacher-to-student id map, built once."""
    from pipeline.teacher.crossscore import CrossTokenizer

    teacher_tok = args.tokenizer or args.model
    if not args.student_tokenizer or not teacher_tok:
        raise TeacherConfigError("--cross-tokenizer needs --student-tokenizer and the teacher's --tokenizer (or a "
                                 "local --model path)")
    if args.rows != "trained":
        raise TeacherConfigError("--cross-tokenizer ships the trained rows only: drop --rows all")
    cross = CrossTokenizer.load(teacher_tok, args.student_tokenizer)
    log.info("cross_tokenizer", teacher=str(teacher_tok), student=str(args.student_tokenizer),
             teacher_ids=len(cross.teacher_vocab), student_ids=len(cross.student),
             mapped_share=round(cross.mapped_share(), 4), teacher_bos=cross.bos_id)
    return cross


async def serve(args: argparse.Namespace, redis: aioredis.Redis, keys: Keys, stop: asyncio.Event) -> None:
    backend, scorer = await prepare(args)
    try:
        s = stream_settings(args)
        shards, assigned = await shard_plan(args, redis, keys, stop)
        await register_pool(redis, keys, args.pool)
        runner = StageRunner(redis, keys, TeacherStage(scorer, drops_to_dlq=args.on_drop == "dlq"), RolloutGroup,
                             pool_stream(args.pool), "scored", s, consumer_name=args.consumer_name, shards=shards,
                             assigned=assigned)
        await runner.run(stop, burst=args.burst)
    finally:
        await backend.close()


def check_pool_flag(args: argparse.Namespace) -> None:
    """``--pool`` is a valid pool name, else a ``ConfigurationError`` (exit status 2, one line)."""
    if (problem := pool_problem(args.pool)) is not None:
        raise TeacherConfigError(f"--pool: {problem}")


def main(args: argparse.Namespace) -> int:
    """Run the stage; a configuration it refuses raises a ``ConfigurationError`` (``run_command``: exit status 2)."""
    check_pool_flag(args)
    return run_stage("teacher", args, serve)


if __name__ == "__main__":
    sys.exit(standalone("teacher", add_arguments, main))
