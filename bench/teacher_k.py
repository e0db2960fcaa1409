"""Teacher cost against k: ms per token at k = 1, 20, 64 and 256, per backend, side by side in one run.

Run: ``python -m bench.teacher_k`` (``--markdown`` prints the rows for bench/RESULTS.md).

Backends: ``hf`` (``HFTeacher`` in-process), ``vllm-engine`` (``VLLMEngineTeacher``: vLLM's engine in a
child process, arrays over a pipe) and ``vllm-http`` (``VLLMTeacher``: a stock vLLM OpenAI server,
``prompt_logprobs`` as JSON). Both vLLM backends run vLLM from ``--vllm-python`` (default
``.venv-vllm/bin/python``), one at a time, with the same engine settings (dtype, eager,
``--max-num-batched-tokens``), and are skipped when it is missing. Weights are bfloat16 by default
(``--dtype``), as a GPU teacher runs; every backend takes the log-softmax in float32.

Model: a random-weight Llama whose lm_head is as wide as a 1-2B model's (hidden 1024, vocabulary 151,936;
``--layers`` decoder layers, 2 by default, to keep CPU time sane), built locally once. Shapes: 8 unrelated
sequences x 1024 tokens, every row, in one call; and one long sequence (``--long``, 4096 tokens). For each
backend the k values run back to back (``--reps`` rounds, best kept) after one 512-token warm-up, so their
ratios are measured under the same machine load. Figures: ms per scored token, the ratio k=256 / k=1,
and vllm-engine's throughput over vllm-http's at each k; then the same as CPU ms per scored token, all
processes of the run together (this one, the engine or server and its engine core): on a CPU the stock
server turns entries into objects and JSON on a core its model does not use, which wall time hides.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.teacher.base import ScoreRequest, ScoreResult, TeacherBackend

ROOT = Path(__file__).resolve().parents[1]
KS = (1, 20, 64, 256)
VOCAB = 151_936
BACKENDS = ("hf", "vllm-engine", "vllm-http")


@dataclass(frozen=True)
class Shape:
    name: str
    lengths: tuple[int, ...]

    @property
    def tokens(self) -> int:
        return sum(n - 1 for n in self.lengths)  # scored rows


def build_wide_model(hidden: int, layers: int, vocab: int = VOCAB, positions: int = 8192) -> Path:
    """A random Llama (``hidden``, ``layers``, heads of 64, intermediate 2.75 x hidden) with a tokenizer, cached."""
    from pipeline.demo.tinymodels import DEFAULT_CACHE, build_model, ensure_tiny_models

    path = DEFAULT_CACHE.parent / "bench" / f"wide-h{hidden}-l{layers}-v{vocab}-p{positions}"
    if (path / "DONE").exists():
        return path
    from transformers import AutoTokenizer

    path.mkdir(parents=True, exist_ok=True)
    build_model(path, "wide", vocab, 0, max_positions=positions, size=(hidden, layers, hidden // 64, hidden * 11 // 4))
    AutoTokenizer.from_pretrained(str(ensure_tiny_models().tokenizer)).save_pretrained(str(path))
    (path / "DONE").write_text("ok\n")
    return path


def requests(shape: Shape, vocab: int, k: int, seed: int = 0) -> list[ScoreRequest]:
    rng = np.random.default_rng(seed)
    return [ScoreRequest(rng.integers(0, vocab, n).astype(np.int32), k) for n in shape.lengths]


async def time_call(backend: TeacherBackend, reqs: list[ScoreRequest]) -> float:
    return (await timed_call(backend, reqs))[0]


async def timed_call(backend: TeacherBackend, reqs: list[ScoreRequest]) -> tuple[float, float]:
    """Wall seconds of one ``score`` call, and the CPU seconds all processes of this run spent in it."""
    c0, t0 = cpu_seconds(), time.perf_counter()
    out = await backend.score(reqs)
    dt, cpu = time.perf_counter() - t0, cpu_seconds() - c0
    bad = [o for o in out if not isinstance(o, ScoreResult)]
    if bad:
        raise RuntimeError(f"{len(bad)} requests failed: {bad[0]}")
    return dt, cpu


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and every process under it (the vLLM engine or server
    with its engine core): where a server's per-entry Python runs on a core the model does not use, wall
    time hides it and CPU time does not."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for p in (me, *me.children(recursive=True)):
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            total += t.user + t.system
    return total


#: Per shape name, per k: (wall ms per token, CPU ms per token) of the fastest round.
Figures = dict[str, dict[int, tuple[float, float]]]


async def measure(backend: TeacherBackend, shapes: list[Shape], ks: tuple[int, ...], reps: int,
                  vocab: int = VOCAB) -> Figures:  # fmt: skip
    """ms per scored token by (shape, k): best of ``reps`` rounds, each round every k back to back."""
    out: Figures = {s.name: {} for s in shapes}
    await time_call(backend, requests(Shape("warm-up", (512,)), vocab, ks[0], 99))
    for s in shapes:
        for rep in range(reps):
            for k in ks:
                dt, cpu = await timed_call(backend, requests(s, vocab, k, rep))
                ms, cpu_ms = 1000 * dt / s.tokens, 1000 * cpu / s.tokens
                if ms < out[s.name].get(k, (float("inf"), 0.0))[0]:
                    out[s.name][k] = (ms, cpu_ms)
                print(f"  {s.name} k={k}: {ms:.3f} ms/token, {cpu_ms:.3f} CPU ms/token", file=sys.stderr, flush=True)
    return out


@contextlib.asynccontextmanager
async def started(backend: TeacherBackend) -> AsyncIterator[TeacherBackend]:
    await backend.start()
    try:
        yield backend
    finally:
        await backend.close()


@contextlib.contextmanager
def http_server(python: str, model: Path, port: int, extra: list[str], log: Path) -> Iterator[str]:
    import httpx

    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name", "teacher",
           "--host", "127.0.0.1", "--port", str(port), *extra]  # fmt: skip
    with log.open("wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        t0 = time.monotonic()
        while True:
            if proc.poll() is not None or time.monotonic() - t0 > 900:
                raise RuntimeError(f"vLLM server did not start:\n{log.read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/v1/models", timeout=2.0).status_code == 200:
                    break
            time.sleep(1.0)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def engine_settings(args: argparse.Namespace) -> dict[str, Any]:
    return {"dtype": args.dtype, "gpu_memory_utilization": args.gpu_memory_utilization, "max_logprobs": max(KS),
            "max_num_batched_tokens": args.max_num_batched_tokens, "enforce_eager": args.enforce_eager,
            "max_model_len": args.max_model_len}  # fmt: skip


def server_flags(es: dict[str, Any]) -> list[str]:
    """The stock server's flags for the engine settings ``es`` (``VLLMEngineConfig``'s fields of the same names)."""
    flags = ["--dtype", es["dtype"], "--gpu-memory-utilization", str(es["gpu_memory_utilization"]),
             "--max-logprobs", str(es["max_logprobs"]), "--max-model-len", str(es["max_model_len"])]  # fmt: skip
    if es["max_num_batched_tokens"]:
        flags += ["--max-num-batched-tokens", str(es["max_num_batched_tokens"])]
    if es["enforce_eager"]:
        flags.append("--enforce-eager")
    return flags


async def run_backend(name: str, model: Path, shapes: list[Shape], args: argparse.Namespace) -> dict[str, Any]:
    ks = tuple(args.k)
    if name == "hf":
        from pipeline.teacher.hf import HFTeacher

        hf = HFTeacher(model, max_batch_tokens=args.hf_batch_tokens, min_shared_prefix=0, chunk_positions=None,
                       device=args.device, dtype=args.dtype if args.dtype != "auto" else "auto")  # fmt: skip
        async with started(hf):
            return await measure(hf, shapes, ks, args.reps)
    es = engine_settings(args)
    if name == "vllm-engine":
        from pipeline.teacher.vllm_engine import VLLMEngineConfig, VLLMEngineTeacher

        cfg = VLLMEngineConfig(model=str(model), python=args.vllm_python, k=1, **es)
        async with started(VLLMEngineTeacher(cfg)) as eng:
            return await measure(eng, shapes, ks, args.reps)
    from pipeline.teacher.vllm_http import HTTPTeacherConfig, VLLMTeacher
    from tests.redis_server import free_port

    log = Path(args.log_dir) / "vllm-http.log"
    with http_server(args.vllm_python, model, free_port(), server_flags(es), log) as url:
        t = VLLMTeacher(HTTPTeacherConfig(urls=(url,), k=1, timeout_s=3600.0, max_concurrency=16))
        async with started(t):
            return await measure(t, shapes, ks, args.reps)


def table(res: dict[str, Figures], shapes: list[Shape], ks: tuple[int, ...]) -> str:
    """Per shape: wall ms per token (throughput) and CPU ms per token (all processes), with k=last / k=first."""
    lines = []
    for s in shapes:
        for col, what in ((0, "ms per token"), (1, "CPU ms per token, all processes")):
            lines.append(f"\n{s.name} ({s.tokens:,} scored tokens), {what}:\n")
            lines.append("| backend | " + " | ".join(f"k={k}" for k in ks) + f" | k={ks[-1]} / k={ks[0]} |")
            lines.append("|---|" + "---|" * (len(ks) + 1))
            for name, by_shape in res.items():
                row = {k: v[col] for k, v in by_shape[s.name].items()}
                ratio = row[ks[-1]] / row[ks[0]]
                lines.append(f"| {name} | " + " | ".join(f"{row[k]:.3f}" for k in ks) + f" | {ratio:.2f} |")
            if "vllm-engine" in res and "vllm-http" in res:
                e, h = res["vllm-engine"][s.name], res["vllm-http"][s.name]
                label = "vllm-engine throughput / vllm-http" if col == 0 else "vllm-http CPU / vllm-engine"
                lines.append(f"| {label} | "
                             + " | ".join(f"{h[k][col] / e[k][col]:.2f}x" for k in ks) + " | |")  # fmt: skip
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    p.add_argument("--k", type=int, nargs="+", default=list(KS))
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, nargs=2, default=[8, 1024], metavar=("N", "LEN"))
    p.add_argument("--long", type=int, default=4096, help="tokens of the long-sequence shape (0: none)")
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="bfloat16", help="weights (log-softmax is float32 in every backend)")
    p.add_argument("--hf-batch-tokens", type=int, default=8192)
    p.add_argument("--vllm-python", default=os.environ.get("DISTILLQ_VLLM_PYTHON", str(ROOT / ".venv-vllm/bin/python")))
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--log-dir", default="/tmp")
    p.add_argument("--markdown", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = build_wide_model(args.hidden, args.layers)
    shapes = [Shape(f"{args.batch[0]} x {args.batch[1]}", (args.batch[1],) * args.batch[0])]
    if args.long:
        shapes.append(Shape(f"1 x {args.long}", (args.long,)))
    res: dict[str, Any] = {}
    for name in args.backends:
        if name != "hf" and not Path(args.vllm_python).exists():
            print(f"{name}: skipped ({args.vllm_python} missing)", file=sys.stderr)
            continue
        print(f"{name}:", file=sys.stderr, flush=True)
        res[name] = asyncio.run(run_backend(name, model, shapes, args))
    print(table(res, shapes, tuple(args.k)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
