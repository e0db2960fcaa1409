"""``python -m bench.teacher_k`` at a toy size: each backend prints a wall-time and a CPU-time row per shape
with positive figures and the k ratio, and with both vLLM backends the engine-over-server rows (the figures
themselves are measured at the real size, bench/RESULTS.md)."""

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
TOY = ("--hidden", "64", "--layers", "1", "--batch", "2", "96", "--long", "128", "--k", "1", "4", "--dtype", "float32")
NUM = r"(\d+\.\d+)"


def run_bench(*extra: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "2", "DISTILLQ_VLLM_PYTHON": str(VLLM_PYTHON)}
    cmd = [sys.executable, "-m", "bench.teacher_k", *TOY, "--gpu-memory-utilization", "0.15", *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=560, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def rows(stdout: str, backend: str) -> list[tuple[float, float, float]]:
    """(k=1, k=4, ratio) of ``backend``'s rows, in print order: per shape, wall then CPU."""
    found = re.findall(rf"^\| {re.escape(backend)} \| {NUM} \| {NUM} \| {NUM} \|$", stdout, re.M)
    return [(float(a), float(b), float(r)) for a, b, r in found]


def check(stdout: str, backend: str) -> None:
    got = rows(stdout, backend)
    assert len(got) == 4, stdout  # 2 shapes x (wall, CPU)
    for k1, k4, ratio in got:
        assert k1 > 0 and k4 > 0 and ratio == pytest.approx(k4 / k1, abs=0.01)
    assert stdout.count("CPU ms per token, all processes") == 2


@pytest.mark.timeout(600)
def test_teacher_k_hf() -> None:
    out = run_bench("--backends", "hf")
    check(out, "hf")
    assert "2 x 96 (190 scored tokens), ms per token" in out and "1 x 128 (127 scored tokens)" in out


@pytest.mark.vllm
@pytest.mark.timeout(600)
@needs_vllm
def test_teacher_k_vllm_backends_side_by_side() -> None:
    out = run_bench("--backends", "vllm-engine", "vllm-http")
    check(out, "vllm-engine")
    check(out, "vllm-http")
    for label in ("vllm-engine throughput / vllm-http", "vllm-http CPU / vllm-engine"):
        ratios = re.findall(rf"^\| {label} \| {NUM}x \| {NUM}x \| \|$", out, re.M)
        assert len(ratios) == 2 and all(float(x) > 0 for r in ratios for x in r), out
