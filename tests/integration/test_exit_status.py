"""One failure path and one exit-status convention for every entry point (docs/cli.md, "Errors and exit status").

Each stage is started misconfigured as a user would start it, a real process through each of its entry points
(``distillq ...``, ``python -m workers.STAGE``, ``python -m pipeline.demo.learner``, ...): it exits with
status 2 and says what is wrong in one line on stderr (``distillq: ...``), with no traceback. ``distillq up``
does not restart a worker that exited 2, and still restarts one that crashed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from pipeline.cli.supervisor import ProcSpec, Supervisor

ROOT = Path(__file__).resolve().parents[2]
DISTILLQ = [sys.executable, "-m", "pipeline.cli.main"]


def run(argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``argv`` as a user runs it: a process of its own, no ``DISTILLQ_*`` settings but JSON logs, output piped."""
    base = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES") and not k.startswith("DISTILLQ_")}
    return subprocess.run(argv, env={**base, "DISTILLQ_LOG_JSON": "1"}, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, stdin=subprocess.DEVNULL, check=False)


def said(p: subprocess.CompletedProcess[str]) -> list[str]:
    """What the process said on stderr, but its JSON log events."""
    return [ln for ln in p.stderr.splitlines() if ln.strip() and not ln.startswith("{")]


def events(text: str, name: str) -> list[dict[str, Any]]:
    found = []
    for line in text.splitlines():
        if line.startswith("{"):
            event = json.loads(line)
            if event.get("event") == name:
                found.append(event)
    return found


def assert_refused(p: subprocess.CompletedProcess[str], line: str) -> None:
    assert p.returncode == 2, (p.returncode, p.stderr[-3000:])
    assert said(p) == [line], p.stderr[-3000:]
    assert "Traceback" not in p.stderr + p.stdout


def namespace() -> str:
    return f"exit{uuid.uuid4().hex[:10]}"


def worker_entry_points(stage: str) -> list[list[str]]:
    """``distillq worker STAGE`` and ``python -m workers.STAGE``."""
    return [[*DISTILLQ, "worker", stage], [sys.executable, "-m", f"workers.{stage}"]]


@pytest.mark.parametrize("entry", worker_entry_points("teacher"), ids=["distillq", "python-m"])
def test_a_teacher_without_its_server_url_exits_2_in_one_line(entry: list[str], redis_url: str) -> None:
    p = run([*entry, "--backend", "vllm", "--redis-url", redis_url, "--namespace", namespace()])
    assert_refused(p, "distillq: --url is required for the vllm backend")


@pytest.mark.parametrize("entry", worker_entry_points("rollout"), ids=["distillq", "python-m"])
def test_a_rollout_worker_without_a_model_exits_2_in_one_line(entry: list[str], redis_url: str) -> None:
    p = run([*entry, "--redis-url", redis_url, "--namespace", namespace()])
    assert_refused(p, "distillq: --model is required: the student's served model name (vllm) or local path (hf)")


@pytest.mark.parametrize("entry", worker_entry_points("rollout"), ids=["distillq", "python-m"])
def test_a_rollout_worker_on_vllm_without_a_url_exits_2_in_one_line(entry: list[str], redis_url: str) -> None:
    p = run([*entry, "--backend", "vllm", "--model", "m", "--redis-url", redis_url, "--namespace", namespace()])
    assert_refused(p, "distillq: --url is required for the vllm backend")


@pytest.mark.parametrize("entry", worker_entry_points("feeder"), ids=["distillq", "python-m"])
def test_a_feeder_assigned_a_shard_the_pipeline_lacks_exits_2_in_one_line(entry: list[str], redis_url: str) -> None:
    p = run([*entry, "--shards", "5", "--redis-url", redis_url, "--namespace", namespace()])  # the pipeline has 1
    assert_refused(p, "distillq: assigned shards '5' outside [0, 1)")


@pytest.mark.parametrize("entry", [[*DISTILLQ, "serve", "student"],
                                   [sys.executable, "-m", "pipeline.cli.commands.serve_student"]],
                         ids=["distillq", "python-m"])
def test_a_student_server_without_its_model_exits_2_in_one_line(entry: list[str], redis_url: str) -> None:
    p = run([*entry, "--backend", "hf", "--redis-url", redis_url, "--namespace", namespace()])
    assert_refused(p, "distillq: --backend hf needs --model DIR")


def test_an_atropos_server_with_an_invalid_wait_exits_2_in_one_line(redis_url: str) -> None:
    p = run([*DISTILLQ, "serve", "atropos", "--batch-wait-s", "99", "--redis-url", redis_url, "--namespace",
             namespace()])
    assert_refused(p, "distillq: --batch-wait-s must be a number of seconds from 0 to 60, got 99.0")


@pytest.mark.slow
def test_the_example_learner_on_a_folder_without_a_model_exits_2_in_one_line(redis_url: str, tmp_path: Path) -> None:
    weights = tmp_path / "weights"
    p = run([sys.executable, "-m", "pipeline.demo.learner", "--student", str(tmp_path), "--weights-dir",
             str(weights), "--redis-url", redis_url, "--namespace", namespace()])
    assert_refused(p, f"distillq: --student {tmp_path}: not a model folder (no config.json there)")
    assert not weights.exists()  # refused before it wrote anything


def test_the_ranks_learner_outside_torchrun_exits_2_in_one_line(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    p = subprocess.run([sys.executable, "-m", "pipeline.demo.ranks_learner", "--student", str(tmp_path),
                        "--weights-dir", str(tmp_path / "w")], capture_output=True, text=True, timeout=120,
                       env=env, check=False)
    assert_refused(p, "distillq: pipeline.demo.ranks_learner runs under torchrun (torchrun --standalone "
                      "--nproc-per-node N -m pipeline.demo.ranks_learner ...): RANK, WORLD_SIZE and MASTER_ADDR "
                      "are not set")


@pytest.mark.slow
def test_the_example_learner_without_redis_exits_3_in_one_line(tmp_path: Path) -> None:
    from pipeline.demo.tinymodels import ensure_tiny_models

    student = ensure_tiny_models().student
    p = run([sys.executable, "-m", "pipeline.demo.learner", "--student", str(student), "--weights-dir",
             str(tmp_path / "weights"), "--redis-url", "redis://127.0.0.1:1/0"])
    assert p.returncode == 3, p.stderr[-3000:]
    assert said(p) == ["distillq: cannot reach Redis at redis://127.0.0.1:1/0: Connection refused"], p.stderr[-3000:]


@pytest.mark.slow
def test_up_does_not_restart_a_worker_that_refused_its_configuration(redis_url: str, tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    t0 = time.monotonic()
    p = run([*DISTILLQ, "up", "--rollout", "1", "--teachers", "0", "--feeders", "0", "--log-dir", str(logs),
             "--duration", "60", "--redis-url", redis_url, "--namespace", namespace()], timeout=90)
    assert p.returncode == 1 and time.monotonic() - t0 < 40, p.stderr[-3000:]  # it ended with its only worker
    (refusal,) = events(p.stderr, "process_refused_config")
    assert refusal["name"] == "rollout-0" and refusal["code"] == 2 and refusal["restarted"] is False
    assert refusal["reason"] == "distillq: --model is required: the student's served model name (vllm) or local " \
                                "path (hf)"
    assert events(p.stderr, "process_died") == [] and events(p.stderr, "process_gave_up") == []
    assert (logs / "rollout-0.log").read_text().count("--model is required") == 1  # started once


@pytest.mark.slow
def test_the_supervisor_restarts_a_crash_but_not_a_refusal(tmp_path: Path) -> None:
    def child(code: int, line: str) -> list[str]:
        return [sys.executable, "-c", f"import sys; print({line!r}); sys.exit({code})"]

    sup = Supervisor([ProcSpec("refuses", child(2, "distillq: planted refusal")),
                      ProcSpec("crashes", child(1, "boom: planted crash"))], tmp_path, max_restarts=2)
    try:
        with capture_logs() as logged:
            sup.start()
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and None in sup.poll().values():
                time.sleep(0.1)
            codes = sup.poll()
    finally:
        sup.stop(grace_s=2)
    refuses, crashes = sup.procs
    assert codes == {"refuses": 2, "crashes": 1}
    assert refuses.restarts == 0 and crashes.restarts == 2
    (refusal,) = [e for e in logged if e["event"] == "process_refused_config"]
    assert refusal["name"] == "refuses" and refusal["reason"] == "distillq: planted refusal"
    assert [e["name"] for e in logged if e["event"] == "process_died"] == ["crashes", "crashes"]
    assert (tmp_path / "refuses.log").read_text().count("planted refusal") == 1
    assert (tmp_path / "crashes.log").read_text().count("planted crash") == 3
