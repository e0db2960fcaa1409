"""``python -m bench.gpu --tiny``: the GPU section's harness runs on CPU with a tiny Qwen2 configuration and
prints one row per model and backend, with positive throughputs and the teacher at or below its limit's
order (the figures themselves are measured on a GPU machine only)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.vllm_server import VLLM_PYTHON, needs_vllm

pytestmark = pytest.mark.slow  # a benchmark harness, run end to end

ROOT = Path(__file__).resolve().parents[2]
ROW = re.compile(r"^\| tiny \| (\S+) \| ([\d,]+) \| ([\d,]+) \(([\d.]+)\) \| ([\d,]+) \(([\d.]+)\) \|$", re.M)


def run_bench(*extra: str) -> list[tuple[str, ...]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "2", "DISTILLQ_VLLM_PYTHON": str(VLLM_PYTHON)}
    cmd = [sys.executable, "-m", "bench.gpu", "--tiny", *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=560, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = ROW.findall(out.stdout)
    assert rows, out.stdout
    for _backend, limit, k64, f64, k256, f256 in rows:
        assert min(int(x.replace(",", "")) for x in (limit, k64, k256)) > 0
        assert float(f64) > 0 and float(f256) > 0
    return rows


@pytest.mark.timeout(600)
def test_bench_gpu_tiny_hf() -> None:
    rows = run_bench("--backends", "hf")
    assert [r[0] for r in rows] == ["hf"]


def test_bench_gpu_refuses_without_cuda() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "bench.gpu"], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=120, check=False)  # fmt: skip
    assert out.returncode == 2 and "no CUDA device" in out.stderr


@pytest.mark.vllm
@pytest.mark.timeout(600)
@needs_vllm
def test_bench_gpu_tiny_vllm_engine_and_server() -> None:
    """Both vLLM backends, then the row of the engine's throughput over the stock server's."""
    rows = run_bench("--backends", "vllm-engine", "vllm-http")
    assert [r[0] for r in rows] == ["vllm-engine", "vllm-http"]


def test_engine_over_server_row() -> None:
    from bench.gpu import table

    rows = [("m", "vllm-engine", {"limit": 100.0, "k=64": 80.0, "k=256": 60.0}),
            ("m", "vllm-http", {"limit": 100.0, "k=64": 40.0, "k=256": 10.0}),
            ("m", "hf", {"limit": 50.0, "k=64": 50.0, "k=256": 25.0})]  # fmt: skip
    out = table(rows, [64, 256])
    assert out.splitlines()[-1] == "| m | vllm-engine / vllm-http | 1.00x | 2.00x | 6.00x |"
    assert "/ vllm-http" not in table(rows[:1] + rows[2:], [64, 256])
