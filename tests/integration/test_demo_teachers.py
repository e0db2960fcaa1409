"""``distillq demo --teachers 2`` end to end: two teacher pools, each knowing its own tiny task, one student; the
held-out reverse KL to each teacher on its own task at least halves within the demo's default time."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.redis, pytest.mark.slow]


@pytest.mark.timeout(900)
def test_both_teachers_kl_at_least_halves(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    proc = subprocess.run([sys.executable, "-m", "pipeline.cli.main", "demo", "--teachers", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=800, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    teachers = report["teachers"]
    assert set(teachers) == {"add", "sub"}
    for pool, row in teachers.items():
        print(f"teacher {pool}: held-out reverse KL {row['heldout_reverse_kl_start']:.3f} -> "
              f"{row['heldout_reverse_kl_end']:.3f}")
        assert row["heldout_reverse_kl_end"] <= row["heldout_reverse_kl_start"] / 2, (pool, row)
    assert report["exit_codes"]["learner"] == 0
    assert {"teacher-add", "teacher-sub"} <= set(report["exit_codes"])
    # each pool's worker read its own pool's stream, and both pools got their share of the groups
    handled = {}
    for pool in ("add", "sub"):
        events = [json.loads(line) for line in (out / "logs" / f"teacher-{pool}.log").read_text().splitlines()
                  if line.startswith("{")]
        (started,) = [e for e in events if e.get("event") == "stage_started"]
        assert started["stream"] == f"rollouts.{pool}"
        (stopped,) = [e for e in events if e.get("event") == "stage_stopped"]
        handled[pool] = stopped["handled"]
    assert min(handled.values()) > 0.3 * sum(handled.values()), handled  # prompts of both tasks, in turn
    assert (out / "reverse_kl.png").stat().st_size > 10_000
