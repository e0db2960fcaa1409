"""``python -m bench.vs_trl --quick``: distillq's pipeline and TRL's DistillationTrainer each train the real pair's
student for 2 steps of 4 samples; the report has every figure for both, evaluated by distillq's code, and both
students moved (their held-out reverse KL is not the start's)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.smollm2 import require_smollm2_wheel

pytestmark = [pytest.mark.slow, pytest.mark.redis]
require_smollm2_wheel()
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(2400)
def test_quick_comparison_reports_both_sides_trained(tmp_path: Path) -> None:
    out = tmp_path / "vs-trl"
    proc = subprocess.run([sys.executable, "-m", "bench.vs_trl", "--quick", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=2300, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((out / "report.json").read_text())
    print("\n".join(proc.stdout.splitlines()[-10:]))
    assert {"date", "commit", "machine"} <= set(report["provenance"])
    assert report["task_prompts"] == 6 and report["kl_prompts"] == 3
    figures = ("heldout_reverse_kl", "task_accuracy", "task_accuracy_se", "answer_logprob")
    for part in (report["start"], report["distillq"]["figures"], report["trl"]["figures"]):
        assert all(math.isfinite(part[f]) for f in figures)
        assert 0 <= part["task_accuracy"] <= 1
    assert 0 <= report["teacher"]["task_accuracy"] <= 1 and math.isfinite(report["teacher"]["answer_logprob"])
    for side in ("distillq", "trl"):
        s = report[side]
        assert (s["steps"], s["samples"]) == (2, 8), side  # equal samples
        assert s["wall_s"] > 0 and s["s_per_step"] > 0
        # trained: its held-out reverse KL (same prompts, same sampling seed) is no longer the start's
        assert s["figures"]["heldout_reverse_kl"] != pytest.approx(report["start"]["heldout_reverse_kl"], abs=1e-6)
    assert report["distillq"]["extra"]["exit_codes"]["learner"] == 0
    assert report["distillq"]["extra"]["policy_version"] == 2
    assert set(report["distillq"]["extra"]["learner_phase_mean_s"]) == {
        "wait_s", "forward_backward_s", "optimizer_s", "checkpoint_s", "publish_s"}
    assert report["trl"]["extra"]["trl"].startswith("1.16")
    assert "| held-out reverse KL |" in proc.stdout and "| s per step |" in proc.stdout
