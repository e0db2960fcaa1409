"""Teacher-scoring worker: rollouts -> scored (``distillq worker teacher`` / ``python -m workers.teacher``)."""

from __future__ import annotations

import argparse
import asyncio
import sys

import redis.asyncio as aioredis
import structlog

from pipeline.stages.runloop import StageRunner
from pipeline.stages.scoring import Scorer, ScoringConfig
from pipeline.stages.teacher_stage import TeacherStage
from pipeline.teacher.base import TeacherBackend, TeacherConfigError
from pipeline.transport.keys import Keys
from schemas import RolloutGroup
from workers.common import (
    add_common_args,
    env,
    int_at_least,
    one_of,
    run_stage,
    shard_plan,
    standalone,
    stream_settings,
)

log = structlog.get_logger("distillq.teacher")

BACKENDS = ("vllm", "sglang", "hf", "synthetic")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=BACKENDS, type=one_of(*BACKENDS), default=env("TEACHER_BACKEND", "vllm"),
                   help="vllm, sglang (HTTP servers), hf (local transformers model), synthetic (deterministic fake "
                        "payloads, for tests and benchmarks) (env DISTILLQ_TEACHER_BACKEND)")
    p.add_argument("--model", default=env("TEACHER_MODEL"), metavar="NAME_OR_PATH",
                   help="served model name (vllm, sglang) or local path (hf) (env DISTILLQ_TEACHER_MODEL; default: "
                        "none, a vLLM server's first model)")
    p.add_argument("--url", action="append", default=None,
                   help="teacher server URL, http://host:port or the OpenAI-style http://host:port/v1; repeat for "
                        "several (default: $DISTILLQ_TEACHER_URLS, comma-separated)")
    p.add_argument("--tokenizer", default=env("TEACHER_TOKENIZER"), metavar="PATH",
                   help="teacher tokenizer, for the vocabulary check "
                        "(env DISTILLQ_TEACHER_TOKENIZER; default: --model)")
    p.add_argument("--student-tokenizer", default=env("STUDENT_TOKENIZER"), metavar="PATH",
                   help="compare vocabularies with this tokenizer at startup; refuse to start if they differ "
                        "(env DISTILLQ_STUDENT_TOKENIZER; default: no check)")
    p.add_argument("--top-k", type=int_at_least(1), default=env("TOP_K") or "20", metavar="K",
                   help="default k; a group's group_overrides.teacher_top_k replaces it (env DISTILLQ_TOP_K)")
    p.add_argument("--max-batch-tokens", type=int_at_least(1), default=env("TEACHER_MAX_BATCH_TOKENS") or "16384",
                   metavar="N", help="padded tokens per teacher call (env DISTILLQ_TEACHER_MAX_BATCH_TOKENS)")
    p.add_argument("--concurrency", type=int_at_least(1), default=env("TEACHER_CONCURRENCY") or "8", metavar="N",
                   help="teacher calls in flight per worker; the hf backend makes one at a time "
                        "(env DISTILLQ_TEACHER_CONCURRENCY)")
    p.add_argument("--timeout", type=float, default=env("TEACHER_TIMEOUT_S") or "120", metavar="SECONDS",
                   help="seconds per request, HTTP backends (env DISTILLQ_TEACHER_TIMEOUT_S)")
    p.add_argument("--retries", type=int_at_least(0), default=3, metavar="N",
                   help="extra attempts for a retryable teacher failure; then the group's payload is dropped")
    p.add_argument("--k-over-cap", choices=["clamp", "drop"], type=one_of("clamp", "drop"),
                   default=env("K_OVER_CAP", "clamp"),
                   help="a group asking for more than the server's logprob cap: clamp to the cap, or drop its "
                        "payload (env DISTILLQ_K_OVER_CAP)")
    p.add_argument("--fp16-topk", action="store_true", help="carry top-k logprobs as float16")
    p.add_argument("--rows", choices=["trained", "all"], type=one_of("trained", "all"),
                   default=env("TEACHER_ROWS") or "trained",
                   help="teacher rows scored and shipped per sequence: the rows the learner trains on "
                        "(loss_mask[r+1] == 1), or every row (env DISTILLQ_TEACHER_ROWS)")
    p.add_argument("--hf-chunk-positions", type=int_at_least(1), default=env("TEACHER_HF_CHUNK_POSITIONS") or "256",
                   metavar="N",
                   help="hf backend: rows per lm_head/log-softmax chunk; memory about 2 x N x vocabulary x 4 bytes "
                        "(env DISTILLQ_TEACHER_HF_CHUNK_POSITIONS)")
    p.add_argument("--hf-min-shared-prefix", type=int_at_least(0), default=env("TEACHER_HF_MIN_SHARED_PREFIX") or "32",
                   metavar="N", help="hf backend: shortest common prefix of a call's sequences computed once; 0 turns "
                                     "sharing off (env DISTILLQ_TEACHER_HF_MIN_SHARED_PREFIX)")
    p.add_argument("--on-drop", choices=["pass", "dlq"], type=one_of("pass", "dlq"), default=env("ON_DROP", "pass"),
                   help="groups whose payload was dropped: pass them on without payload, or dead-letter them "
                        "(env DISTILLQ_ON_DROP)")
    p.add_argument("--device", default=env("DEVICE") or "cpu", metavar="DEVICE",
                   help="hf backend: torch device of the teacher model, e.g. cuda (env DISTILLQ_DEVICE)")
    p.add_argument("--synthetic-latency", type=float, default=0.0, metavar="SECONDS",
                   help="synthetic backend: seconds per call")
    add_common_args(p)


def make_backend(args: argparse.Namespace) -> TeacherBackend:
    if args.backend == "hf":
        from pipeline.teacher.hf import HFTeacher

        if not args.model:
            raise TeacherConfigError("--model PATH is required for the hf backend")
        return HFTeacher(args.model, max_batch_tokens=args.max_batch_tokens, chunk_positions=args.hf_chunk_positions,
                         min_shared_prefix=args.hf_min_shared_prefix, device=args.device)
    if args.backend == "synthetic":
        from pipeline.teacher.synthetic import SyntheticTeacher

        return SyntheticTeacher(latency_s=args.synthetic_latency)
    from pipeline.teacher.vllm_http import HTTPTeacherConfig

    urls = tuple(args.url or [u for u in (env("TEACHER_URLS") or "").split(",") if u])
    if not urls:
        raise TeacherConfigError(f"--url is required for the {args.backend} backend")
    cfg = HTTPTeacherConfig(urls=urls, model=args.model, k=args.top_k, max_concurrency=args.concurrency,
                            timeout_s=args.timeout, startup_timeout_s=60.0)
    if args.backend == "sglang":
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

    await backend.start()
    if args.top_k > backend.max_k:
        raise TeacherConfigError(
            f"--top-k {args.top_k} exceeds the teacher's logprob cap of {backend.max_k} "
            "(raise the server's --max-logprobs or lower --top-k)"
        )
    if args.student_tokenizer:
        teacher_tok = args.tokenizer or args.model
        if not teacher_tok:
            raise TeacherConfigError("--tokenizer (or a local --model path) is needed to compare vocabularies")
        check_same_vocab(teacher_tok, args.student_tokenizer)
    checksum = await self_test_checksum(backend)
    log.info("teacher_ready", identity=backend.identity, max_k=backend.max_k, top_k=args.top_k, self_test=checksum)
    cfg = ScoringConfig(default_k=args.top_k, max_batch_tokens=args.max_batch_tokens, retries=args.retries,
                        k_over_cap=args.k_over_cap, fp16_topk=args.fp16_topk, rows=args.rows,
                        concurrent_calls=1 if args.backend == "hf" else args.concurrency)
    return Scorer(backend, cfg, limits=stream_settings(args).limits())


async def serve(args: argparse.Namespace, redis: aioredis.Redis, keys: Keys, stop: asyncio.Event) -> None:
    backend, scorer = await prepare(args)
    try:
        s = stream_settings(args)
        shards, assigned = await shard_plan(args, redis, keys, stop)
        runner = StageRunner(redis, keys, TeacherStage(scorer, drops_to_dlq=args.on_drop == "dlq"), RolloutGroup,
                             "rollouts", "scored", s, consumer_name=args.consumer_name, shards=shards,
                             assigned=assigned)
        await runner.run(stop, burst=args.burst)
    finally:
        await backend.close()


def main(args: argparse.Namespace) -> int:
    from pipeline.teacher.vocab import VocabMismatchError

    try:
        return run_stage("teacher", args, serve)
    except (TeacherConfigError, VocabMismatchError) as e:
        print(f"distillq worker teacher: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(standalone("teacher", add_arguments, main))
