"""The demo end to end (the held-out reverse KL falls by at least half)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.redis, pytest.mark.slow]


@pytest.mark.timeout(600)
def test_demo_distills_and_cleans_up(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    proc = subprocess.run([sys.executable, "-m", "pipeline.ops.cli.main", "demo", "--steps", "100", "--out", str(out)],
                          capture_output=True, text=True, timeout=540, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    start, end = report["heldout_reverse_kl_start"], report["heldout_reverse_kl_end"]
    print(f"held-out reverse KL {start:.3f} -> {end:.3f}")
    assert end <= start / 2
    assert (out / "reverse_kl.png").stat().st_size > 10_000
    for stage in ("rollout", "teacher", "feeder"):
        assert report["stages"][stage]["groups"] > 0
    assert report["exit_codes"]["learner"] == 0
    # nothing left running: every process of the demo (and its embedded server) is gone
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout
    assert str(out) not in ps
