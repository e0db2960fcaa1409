"""Chunked vs full-logits top-k forward KL at a real vocabulary: peak memory and time per token, fwd + bwd.

Run: ``python -m bench.chunked_loss`` (``--quick``: small shapes, a smoke test). Shapes: ``V = 151,936``
(Qwen2/3), ``H = 64`` so that the lm_head dominates, ``K = 8``, every position trained, float32.

* chunked: ``pipeline.learner.chunked.topk_forward_kl(hidden, weight, ...)`` (``chunk_size`` 1024, and 256
  at ``B = 2, N = 4096``);
* unchunked: ``pipeline.learner.losses.topk_forward_kl(hidden @ weight.T, ...)``.

Each row runs in a fresh subprocess, single call: inputs are built, a tiny warm-up call makes torch's lazy
allocations, ``VmHWM`` is reset to ``VmRSS`` (``/proc/self/clear_refs``), then one forward + backward is
timed (wall and process CPU time; on a shared machine the CPU time is the steadier figure). The peak is
``VmHWM`` after minus ``VmRSS`` before; it includes the weight's gradient (``V x H x 4`` bytes). The
unchunked loss at ``B = 8, N = 4096`` would need its 20 GB of logits several times over, so it is
measured at ``B = 1`` and its peak and times are scaled by 8 (linear in tokens, printed as extrapolated);
a row is skipped (and extrapolated from a smaller one) when ``MemAvailable`` could not hold it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

if __name__ == "__main__" and not __package__:  # ``python bench/chunked_loss.py``: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VOCAB = 151_936
HIDDEN = 64
TOPK = 8
CHUNK = 1024
THREADS = 2
#: measured peak of the unchunked fwd + bwd is about 4x one float32 logits tensor; 5x is the safety estimate
UNCHUNKED_PEAK_FACTOR = 5.0


@dataclass
class Result:
    kind: str
    b: int
    n: int
    chunk: int
    peak_bytes: float
    seconds: float
    cpu_seconds: float
    loss: float
    extrapolated_from: str = ""

    @property
    def tokens(self) -> int:
        return self.b * self.n

    @property
    def logits_bytes(self) -> int:
        return self.tokens * VOCAB * 4

    def scaled(self, b: int) -> Result:
        """The same measurement linearly scaled to ``b`` sequences (per-token peak and time)."""
        f = b * self.n / self.tokens
        src = f"B={self.b},N={self.n}"
        return Result(
            self.kind,
            b,
            self.n,
            self.chunk,
            self.peak_bytes * f,
            self.seconds * f,
            self.cpu_seconds * f,
            self.loss,
            src,
        )


def _vm(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _cpu() -> float:
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def child(kind: str, b: int, n: int, chunk: int) -> dict[str, float]:
    """Runs in the fresh subprocess: one measured forward + backward."""
    import torch

    from pipeline.learner import chunked, losses

    torch.set_num_threads(THREADS)

    def setup(b: int, n: int, v: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(0)
        hidden = torch.randn(b, n, HIDDEN, generator=g).requires_grad_(True)
        weight = (torch.randn(v, HIDDEN, generator=g) * 0.05).requires_grad_(True)
        ids = torch.randint(0, v, (b, n, TOPK), generator=g)
        lps = torch.log_softmax(torch.randn(b, n, TOPK, generator=g), -1) - 1.0
        return hidden, weight, ids, lps, torch.ones(b, n)

    def step(args: tuple[torch.Tensor, ...]) -> float:
        hidden, weight, ids, lps, mask = args
        if kind == "chunked":
            loss = chunked.topk_forward_kl(hidden, weight, ids, lps, mask, "tail", chunk_size=chunk)
        else:
            loss = losses.topk_forward_kl(hidden @ weight.T, ids, lps, mask, "tail")
        torch.autograd.backward([loss])
        return float(loss.detach())

    step(setup(2, 8, 1000))  # warm-up outside the measurement
    args = setup(b, n, VOCAB)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS; without it the delta is an upper bound
    except OSError:
        pass
    before = _vm("VmRSS")
    cpu0, t0 = _cpu(), time.perf_counter()
    loss = step(args)
    seconds, cpu = time.perf_counter() - t0, _cpu() - cpu0
    return {"peak_bytes": float(_vm("VmHWM") - before), "seconds": seconds, "cpu_seconds": cpu, "loss": loss}


def measure(kind: str, b: int, n: int, chunk: int = CHUNK) -> Result:
    """``child`` in a fresh interpreter."""
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS)}
    cmd = [sys.executable, "-m", "bench.chunked_loss", "--child", kind, str(b), str(n), str(chunk)]
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=root, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} B={b} N={n} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return Result(kind, b, n, chunk, out["peak_bytes"], out["seconds"], out["cpu_seconds"], out["loss"])


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def fits(b: int, n: int) -> bool:
    """Whether the unchunked loss at ``b x n`` tokens fits in ``MemAvailable`` with margin."""
    return b * n * VOCAB * 4 * UNCHUNKED_PEAK_FACTOR < _mem_available()


def _mib(x: float) -> str:
    return f"{x / 2**20:,.0f}"


def table(rows: list[Result]) -> str:
    head = (
        "| loss | B x N | tokens | chunk | fwd+bwd peak MiB | peak KiB/token | one [B,N,V] f32 MiB | wall s"
        " | wall µs/token | CPU µs/token |\n|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in rows:
        kind = r.kind + (f" (extrapolated from {r.extrapolated_from})" if r.extrapolated_from else "")
        chunk = str(r.chunk) if r.kind == "chunked" else "-"
        per_token_kb = r.peak_bytes / r.tokens / 1024
        lines.append(
            f"| {kind} | {r.b} x {r.n} | {r.tokens:,} | {chunk} | {_mib(r.peak_bytes)} | {per_token_kb:.1f}"
            f" | {_mib(r.logits_bytes)} | {r.seconds:.2f} | {r.seconds / r.tokens * 1e6:.0f}"
            f" | {r.cpu_seconds / r.tokens * 1e6:.0f} |"
        )
    return "\n".join(lines)


def ratio(name: str, full: Result, chunk: Result) -> str:
    note = " (unchunked extrapolated)" if full.extrapolated_from else " (both measured)"
    same = "" if full.extrapolated_from else f"; loss {full.loss:.6f} vs {chunk.loss:.6f}"
    return (
        f"{name}{note}: peak memory unchunked / chunked = {full.peak_bytes / chunk.peak_bytes:.1f}x;"
        f" time per token unchunked / chunked = {full.seconds / chunk.seconds * chunk.tokens / full.tokens:.2f}x wall,"
        f" {full.cpu_seconds / chunk.cpu_seconds * chunk.tokens / full.tokens:.2f}x CPU" + same
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small shapes (B=2, N=256 / 512), a smoke test")
    ap.add_argument("--child", nargs=4, metavar=("KIND", "B", "N", "CHUNK"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        kind, b, n, chunk = args.child
        print(json.dumps(child(kind, int(b), int(n), int(chunk))))
        return 0

    big_b, n_full, n_side = (2, 512, 256) if args.quick else (8, 4096, 2048)
    t0, load0 = time.perf_counter(), _load()
    print(f"top-k forward KL (mode tail, K={TOPK}) fwd+bwd, V={VOCAB:,}, H={HIDDEN}, float32, {THREADS} threads;")
    print("peak = VmHWM - VmRSS before the call, each row in a fresh subprocess\n", flush=True)
    side_c, side_u = measure("chunked", 1, n_side), measure("unchunked", 1, n_side)
    one_c = measure("chunked", 1, n_full)
    one_u = measure("unchunked", 1, n_full) if fits(1, n_full) else None
    big_c = measure("chunked", big_b, n_full)
    # the peak depends on the chunk, not on B x N: a quarter-size chunk at B = 2 keeps the run short
    small_chunk = [] if args.quick else [measure("chunked", 2, n_full, CHUNK // 4)]
    big_u = (one_u or side_u).scaled(big_b)
    rows = [side_c, side_u, one_c] + ([one_u] if one_u else []) + [big_c, *small_chunk, big_u]
    print(table(rows))
    print()
    if one_u is None:
        print(f"unchunked B=1 x N={n_full} skipped: MemAvailable {_mib(_mem_available())} MiB is too small")
    print(ratio(f"B=1 x N={n_side}", side_u, side_c))
    if one_u is not None:
        print(ratio(f"B=1 x N={n_full}", one_u, one_c))
    print(ratio(f"B={big_b} x N={n_full}", big_u, big_c))
    print(
        f"\nunchunked at B={big_b} x N={n_full} is EXTRAPOLATED (linear in tokens from {big_u.extrapolated_from}),"
        f" not measured: one float32 logits tensor alone is {_mib(big_c.logits_bytes)} MiB."
    )
    print(f"total {time.perf_counter() - t0:.0f} s; load average {load0} before, {_load()} after")
    return 0


if __name__ == "__main__":
    sys.exit(main())
