"""GPU section: teacher-worker tokens/s at k = 64 and 256 against the same model's bare prefill, the limit.

Run on a GPU machine: ``python -m bench.gpu`` (``--tiny`` runs a tiny configuration on CPU to check the
harness; ``--markdown`` prints rows for bench/RESULTS.md).

Models: random weights built locally (no hub) from real architecture configs, ``Qwen2ForCausalLM`` of
Qwen2.5-1.5B and Qwen2.5-7B shapes (vocabulary 151,936 / 152,064), bfloat16, cached under
``.cache/bench``. Workload: ``--batch`` unrelated sequences (16 x 2048 by default), every row scored.

Per model and backend:

* **hf**: the limit is one packed forward of the full model (decoder + lm_head over every row: the logits
  a plain prefill produces); the teacher is ``HFTeacher.score`` (packed, chunked lm_head, float32
  log-softmax, top-k).
* **vllm-engine**: the limit is the engine prefilling the same sequences without prompt logprobs
  (``VLLMEngineTeacher.prefill``); the teacher is ``VLLMEngineTeacher.score``.
* **vllm-http**: the stock vLLM OpenAI server with the same engine settings; the limit is the server
  completing one token per sequence without prompt logprobs; the teacher is ``VLLMTeacher.score``
  (``prompt_logprobs`` as JSON). Where both vLLM backends ran, one more row per model gives
  vllm-engine's throughput over vllm-http's at each k (the target: 5x at k=256).

Each figure is the best of ``--reps`` calls after one warm-up; ``teacher / limit`` is the fraction of
the bare prefill throughput the teacher keeps.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.teacher_k import ROOT, http_server, server_flags, started, time_call
from pipeline.teacher.base import ScoreRequest, TeacherBackend


@dataclass(frozen=True)
class Arch:
    """A Qwen2 architecture: the fields of its config that shape the compute."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tie: bool


ARCHS = {
    "qwen2.5-1.5b": Arch(1536, 28, 12, 2, 8960, 151_936, True),
    "qwen2.5-7b": Arch(3584, 28, 28, 4, 18944, 152_064, False),
    "tiny": Arch(64, 2, 2, 1, 128, 1024, False),  # --tiny: the harness on CPU
}


def build(name: str, dtype: str, device: str) -> Path:
    """Random-weight ``Qwen2ForCausalLM`` of ``ARCHS[name]`` with a tokenizer, saved once under .cache/bench."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from pipeline.demo.tinymodels import DEFAULT_CACHE, ensure_tiny_models

    a = ARCHS[name]
    path = DEFAULT_CACHE.parent / "bench" / f"{name}-{dtype}"
    if (path / "DONE").exists():
        return path
    cfg = Qwen2Config(vocab_size=a.vocab, hidden_size=a.hidden, num_hidden_layers=a.layers,
                      num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, intermediate_size=a.intermediate,
                      max_position_embeddings=32768, tie_word_embeddings=a.tie,
                      rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg).to(getattr(torch, dtype))
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path), safe_serialization=True)
    AutoTokenizer.from_pretrained(str(ensure_tiny_models().tokenizer)).save_pretrained(str(path))
    (path / "DONE").write_text("ok\n")
    del model
    return path


def sequences(n: int, length: int, vocab: int, seed: int) -> list[np.ndarray[Any, Any]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, length).astype(np.int32) for _ in range(n)]


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


async def hf_rows(path: Path, arch: Arch, args: argparse.Namespace) -> dict[str, float]:
    """tokens/s: packed full forward (the limit), then the teacher at each k."""
    import torch

    from pipeline.teacher.hf import HFTeacher
    from pipeline.teacher.hf_pack import pack

    t = HFTeacher(path, max_batch_tokens=args.batch[0] * args.batch[1], min_shared_prefix=0, chunk_positions=None,
                  device=args.device, dtype=args.dtype)  # fmt: skip
    out: dict[str, float] = {}
    async with started(t):
        model, n_tok = t._model, args.batch[0] * args.batch[1]
        assert model is not None

        def bare(seed: int) -> float:
            pk = pack(sequences(args.batch[0], args.batch[1], arch.vocab, seed), varlen=True)
            ids, pos = torch.from_numpy(pk.ids).to(args.device), torch.from_numpy(pk.positions).to(args.device)
            sync(args.device)
            t0 = time.perf_counter()
            with torch.inference_mode():
                logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
                del logits
            sync(args.device)
            return time.perf_counter() - t0

        bare(99)
        out["limit"] = n_tok / min(bare(r) for r in range(args.reps))
        out.update(await teacher_rows(t, arch, args))
    return out


async def teacher_rows(t: TeacherBackend, arch: Arch, args: argparse.Namespace) -> dict[str, float]:
    """Scored tokens/s of ``t`` at each k: best of ``args.reps`` calls after one warm-up call."""
    out: dict[str, float] = {}
    for k in args.k:
        reqs = [ScoreRequest(s, k) for s in sequences(args.batch[0], args.batch[1], arch.vocab, 7)]
        await time_call(t, reqs)
        best = min([await time_call(t, reqs) for _ in range(args.reps)])
        out[f"k={k}"] = args.batch[0] * (args.batch[1] - 1) / best
    return out


def engine_settings(args: argparse.Namespace) -> dict[str, Any]:
    """``VLLMEngineConfig``'s engine fields, for the engine and, as flags, for the stock server."""
    return {"dtype": args.dtype, "gpu_memory_utilization": args.gpu_memory_utilization, "max_logprobs": max(args.k),
            "max_model_len": max(args.batch[1], 256), "max_num_batched_tokens": args.max_num_batched_tokens,
            "enforce_eager": args.enforce_eager}  # fmt: skip


async def engine_rows(path: Path, arch: Arch, args: argparse.Namespace) -> dict[str, float]:
    from pipeline.teacher.vllm_engine import VLLMEngineConfig, VLLMEngineTeacher

    cfg = VLLMEngineConfig(model=str(path), python=args.vllm_python, k=1, **engine_settings(args))
    out: dict[str, float] = {}
    n_tok = args.batch[0] * args.batch[1]
    async with started(VLLMEngineTeacher(cfg)) as eng:
        assert isinstance(eng, VLLMEngineTeacher)
        await eng.prefill(sequences(args.batch[0], args.batch[1], arch.vocab, 99))
        times = []
        for r in range(args.reps):
            seqs = sequences(args.batch[0], args.batch[1], arch.vocab, r)
            t0 = time.perf_counter()
            await eng.prefill(seqs)
            times.append(time.perf_counter() - t0)
        out["limit"] = n_tok / min(times)
        out.update(await teacher_rows(eng, arch, args))
    return out


async def http_rows(path: Path, arch: Arch, args: argparse.Namespace) -> dict[str, float]:
    """The stock server: one-token completions without prompt logprobs (the limit), then the teacher."""
    import httpx

    from pipeline.teacher.vllm_http import HTTPTeacherConfig, VLLMTeacher
    from tests.redis_server import free_port

    extra = server_flags(engine_settings(args))
    out: dict[str, float] = {}
    n_tok = args.batch[0] * args.batch[1]
    with http_server(args.vllm_python, path, free_port(), extra, Path(args.log_dir) / "bench-gpu-vllm-http.log") as url:
        async with httpx.AsyncClient(base_url=url, timeout=3600.0) as client:

            async def bare(seed: int) -> float:
                seqs = sequences(args.batch[0], args.batch[1], arch.vocab, seed)
                body = {"model": "teacher", "max_tokens": 1, "temperature": 0.0}
                t0 = time.perf_counter()
                answers = await asyncio.gather(*(client.post("/v1/completions", json={**body, "prompt": s.tolist()})
                                                 for s in seqs))  # fmt: skip
                dt = time.perf_counter() - t0
                for a in answers:
                    a.raise_for_status()
                return dt

            await bare(99)
            out["limit"] = n_tok / min([await bare(r) for r in range(args.reps)])
        t = VLLMTeacher(HTTPTeacherConfig(urls=(url,), k=1, timeout_s=3600.0, max_concurrency=args.batch[0]))
        async with started(t):
            out.update(await teacher_rows(t, arch, args))
    return out


RUNS = {"hf": hf_rows, "vllm-engine": engine_rows, "vllm-http": http_rows}


def table(rows: list[tuple[str, str, dict[str, float]]], ks: list[int]) -> str:
    """One row per model and backend; then, per model where both vLLM backends ran, engine over HTTP."""
    cols = " | ".join(f"k={k} tok/s (of limit)" for k in ks)
    head = f"| model | backend | bare prefill tok/s (limit) | {cols} |"
    lines = [head, "|---|---|---|" + "---|" * len(ks)]
    for model, backend, r in rows:
        cells = " | ".join(f"{r[f'k={k}']:,.0f} ({r[f'k={k}'] / r['limit']:.2f})" for k in ks)
        lines.append(f"| {model} | {backend} | {r['limit']:,.0f} | {cells} |")
    by = {(model, backend): r for model, backend, r in rows}
    for model in dict.fromkeys(m for m, _, _ in rows):
        e, h = by.get((model, "vllm-engine")), by.get((model, "vllm-http"))
        if e and h:
            ratios = " | ".join(f"{e[f'k={k}'] / h[f'k={k}']:.2f}x" for k in ks)
            lines.append(f"| {model} | vllm-engine / vllm-http | {e['limit'] / h['limit']:.2f}x | {ratios} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--models", nargs="+", choices=sorted(ARCHS), default=["qwen2.5-1.5b", "qwen2.5-7b"])
    p.add_argument("--backends", nargs="+", choices=list(RUNS), default=list(RUNS))
    p.add_argument("--k", type=int, nargs="+", default=[64, 256])
    p.add_argument("--batch", type=int, nargs=2, default=[16, 2048], metavar=("N", "LEN"))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--vllm-python", default=os.environ.get("DISTILLQ_VLLM_PYTHON", sys.executable))
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--log-dir", default="/tmp", help="where the vllm-http server's log goes")
    p.add_argument("--tiny", action="store_true",
                   help="check the harness on CPU: the tiny model, float32, 2 x 64 tokens, one rep")  # fmt: skip
    args = p.parse_args(argv)
    if args.tiny:
        args.models, args.device, args.dtype, args.batch, args.reps = ["tiny"], "cpu", "float32", [2, 64], 1
        args.gpu_memory_utilization, args.enforce_eager = 0.15, True
        if args.vllm_python == sys.executable and (ROOT / ".venv-vllm/bin/python").exists():
            args.vllm_python = str(ROOT / ".venv-vllm/bin/python")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            print("bench.gpu: no CUDA device (use --tiny to check the harness on CPU)", file=sys.stderr)
            return 2
    rows: list[tuple[str, str, dict[str, float]]] = []
    for name in args.models:
        path = build(name, args.dtype, args.device)
        for backend in args.backends:
            r = asyncio.run(RUNS[backend](path, ARCHS[name], args))
            print(f"{name} {backend}: {r}", file=sys.stderr, flush=True)
            rows.append((name, backend, r))
    print(table(rows, args.k))
    return 0


if __name__ == "__main__":
    sys.exit(main())
