"""``distillq models tiny``: the demo's models, prompts in their format and the demo's commands, usable as
printed (the enqueue command runs against a real redis-server and enqueues every prompt)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.redis, pytest.mark.slow, pytest.mark.timeout(900)]
ROOT = Path(__file__).resolve().parents[2]


def distillq(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pipeline.cli.main", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=850, check=False, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_models_tiny_prints_paths_prompts_and_working_commands(redis_url: str, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    p = distillq("models", "tiny", "--json", "--commands", "--prompts", str(prompts), "--count", "12",
                 "--out", str(tmp_path / "run"), "--redis-url", redis_url, "--namespace", "tinycli")
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout)
    for name in ("student", "teacher", "teacher_untrained"):
        assert Path(out[name]).is_absolute() and (Path(out[name]) / "config.json").exists()
    assert (Path(out["tokenizer"]) / "tokenizer.json").exists()
    lines = [json.loads(x) for x in prompts.read_text().splitlines()]
    assert len(lines) == 12 and all(x["messages"][0]["content"].endswith("=") and x["answer"].isdigit()
                                    for x in lines)
    cmds = [shlex.split(c) for c in out["commands"]]
    assert [c[:3] for c in cmds] == [["distillq", "enqueue", str(prompts)], ["distillq", "worker", "rollout"],
                                     ["distillq", "worker", "teacher"], ["distillq", "worker", "feeder"],
                                     ["python", "-m", "pipeline.demo.learner"]]
    assert all(c[-4:] == ["--redis-url", redis_url, "--namespace", "tinycli"] for c in cmds)
    assert out["student"] in cmds[1] and out["teacher"] in cmds[2]
    enq = distillq(*cmds[0][1:])  # the printed enqueue command, as printed
    assert enq.returncode == 0 and "enqueued 12 prompt(s)" in enq.stdout, enq.stderr[-2000:]
    plain = distillq("models", "tiny")
    assert plain.returncode == 0 and plain.stdout.split()[:2] == ["tokenizer", out["tokenizer"]]
