"""Weight sync into a real vLLM server (CPU build in .venv-vllm) vs restarting the server on the new weights.

    python -m bench.weight_sync [--models tiny,135m] [--syncs 4] [--restarts 2] [--throughput-s 20]
    python -m bench.weight_sync --store [--store-steps 20]     # through a redis:// store: bench/weight_store.py

Per model: start a vLLM server (``VLLM_SERVER_DEV_MODE=1``), then, side by side in the same run,
(a) publish ``--syncs`` new versions (``publish_weights``) and sync the server in place (``VLLMEngine.sync``:
pause, reload_weights, update_weight_version, resume), timing publish and pause-to-resume, and (b) stop the
server and start it again on the newest checkpoint folder ``--restarts`` times (what a loop without weight
sync does), timing start to ready (the stop is not counted). ``135m`` is a random-weight Llama of
SmolLM2-135M's shapes (hidden 576,
30 layers, 9 heads, 3 key/value heads, intermediate 1536, vocabulary 49,152, tied embeddings) built here.
Rollout throughput: sampled tokens per second from 4 concurrent requests for ``--throughput-s``, with no
sync, then with a publish + sync every ``--step-s`` seconds (a learner step), on the tiny model.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from pipeline.demo.tinymodels import ensure_tiny_models
from pipeline.learner.publish import publish_weights
from pipeline.models.weights import latest, load_causal_lm
from pipeline.rollout.students.base import GenParams
from pipeline.rollout.students.vllm import VLLMStudent
from pipeline.rollout.sync_engines import VLLMEngine
from tests.redis_server import free_port
from tests.vllm_server import vllm_server

EXTRA = ("--max-model-len", "512", "--max-num-seqs", "8", "--gpu-memory-utilization", "0.1")
DEV = {"VLLM_SERVER_DEV_MODE": "1"}
NAME = "student"


def build_135m(out: Path) -> None:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                      tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(str(out), safe_serialization=True)
    AutoTokenizer.from_pretrained(str(ensure_tiny_models().tokenizer)).save_pretrained(str(out))


def model_folder(which: str, root: Path) -> Path:
    out = root / which
    if which == "tiny":
        shutil.copytree(ensure_tiny_models().student, out)
    else:
        build_135m(out)
    return out


def nudge(model: Any, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1e-3 * torch.randn(p.shape, generator=g))


@contextlib.contextmanager
def server(folder: Path, log: Path, port: int) -> Iterator[str]:
    with vllm_server(folder, NAME, log, *EXTRA, port=port, env=DEV) as url:
        yield url


async def sync_rows(url: str, model: Any, weights: Path, syncs: int, first: int) -> dict[str, Any]:
    engine = VLLMEngine(url)
    publish_s, sync_s, nbytes = [], [], 0
    try:
        for i in range(syncs):
            nudge(model, first + i)
            t0 = time.perf_counter()
            publish_weights(model, first + i, weights, keep=2, publish=lambda v: None)
            publish_s.append(time.perf_counter() - t0)
            ckpt = latest(weights)
            assert ckpt is not None
            nbytes = ckpt.nbytes
            t0 = time.perf_counter()
            await engine.sync(ckpt)
            sync_s.append(time.perf_counter() - t0)
            assert await engine.version(anything_published=True) == ckpt.version
    finally:
        await engine.aclose()
    return {"publish_s": publish_s, "sync_s": sync_s, "bytes": nbytes}


def restart_rows(weights: Path, log: Path, restarts: int) -> list[float]:
    ckpt = latest(weights)
    assert ckpt is not None
    times = []
    for _ in range(restarts):
        t0 = time.perf_counter()
        with server(ckpt.path, log, free_port()):
            times.append(time.perf_counter() - t0)
    return times


async def throughput(url: str, model: Any, weights: Path, seconds: float, step_s: float | None, first: int) -> float:
    from transformers import AutoTokenizer

    student = VLLMStudent(url, NAME, AutoTokenizer.from_pretrained(str(ensure_tiny_models().student)))
    engine = VLLMEngine(url)
    tokens = 0
    end = time.monotonic() + seconds

    async def sampler(seed: int) -> None:
        nonlocal tokens
        while time.monotonic() < end:
            comps = await student.generate([3, 310, 16, 24, 34, 4], GenParams(max_tokens=32, seed=seed), n=4)
            tokens += sum(len(c.token_ids) for c in comps)

    async def learner() -> None:
        v = first
        while step_s is not None and time.monotonic() < end:
            await asyncio.sleep(step_s)
            nudge(model, v)
            await asyncio.to_thread(publish_weights, model, v, weights, 2, publish=lambda x: None)
            ckpt = latest(weights)
            assert ckpt is not None
            await engine.sync(ckpt)
            v += 1

    t0 = time.perf_counter()
    await asyncio.gather(learner(), *(sampler(s) for s in range(4)))
    rate = tokens / (time.perf_counter() - t0)
    await student.aclose()
    await engine.aclose()
    return rate


def fmt(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} ({min(xs):.3f}-{max(xs):.3f})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.weight_sync", description=__doc__.split("\n")[0])
    p.add_argument("--models", default="tiny,135m")
    p.add_argument("--syncs", type=int, default=4)
    p.add_argument("--restarts", type=int, default=2)
    p.add_argument("--throughput-s", type=float, default=20.0)
    p.add_argument("--step-s", type=float, default=1.0)
    p.add_argument("--store", action="store_true",
                   help="instead: weights through a redis:// store on the real pair's student (bench/weight_store.py)")
    p.add_argument("--store-steps", type=int, default=20)
    a = p.parse_args(argv)
    if a.store:
        from bench import weight_store

        print(weight_store.table(weight_store.run(a.store_steps, "alternate")))
        return 0
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            check=False).stdout.strip()
    load = Path("/proc/loadavg").read_text().split()[:3]
    print(f"date {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit {commit}, "
          f"{platform.processor() or platform.machine()}, load average at start {' '.join(load)}")
    print("| model | checkpoint bytes | publish s | sync s (pause to resume) | restart s (start to ready) "
          "| restart / sync |")
    print("|---|---|---|---|---|---|")
    rates: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for which in a.models.split(","):
            folder = model_folder(which, root)
            model = load_causal_lm(folder)
            weights, log = root / f"{which}-weights", root / f"{which}.log"
            with server(folder, log, free_port()) as url:
                got = asyncio.run(sync_rows(url, model, weights, a.syncs, 1))
                if which == "tiny" and a.throughput_s > 0:
                    base = asyncio.run(throughput(url, model, weights, a.throughput_s, None, 1000))
                    synced = asyncio.run(throughput(url, model, weights, a.throughput_s, a.step_s, 2000))
                    rates.append(f"| {which} | {base:.0f} | {synced:.0f} | {synced / base:.2f} |")
            restarts = restart_rows(weights, log, a.restarts)
            ratio = statistics.median(restarts) / statistics.median(got["sync_s"])
            print(f"| {which} | {got['bytes']:,} | {fmt(got['publish_s'])} | {fmt(got['sync_s'])} | {fmt(restarts)} | "
                  f"{ratio:.0f}x |", flush=True)
    if rates:
        print(f"\nrollout throughput, 4 concurrent requests of n=4 x 32 tokens, sync every {a.step_s} s:")
        print("| model | tokens/s, no sync | tokens/s, publish + sync every step | kept |\n|---|---|---|---|")
        print("\n".join(rates))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
