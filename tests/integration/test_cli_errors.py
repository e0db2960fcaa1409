"""What a newcomer sees when something is wrong or the output is not a terminal: one line per error with the
exit status docs/cli.md gives, full-width output in files and pipes, and no warnings or progress bars."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis.asyncio as aioredis
import structlog
from rich.console import Console

from pipeline.cli.commands.common import make_console
from pipeline.cli.main import main
from pipeline.transport.keys import Keys
from pipeline.transport.producer import StreamProducer
from schemas.atropos import to_atropos
from schemas.build import synthetic_rollout, synthetic_scored
from tests.redis_server import free_port

pytestmark = pytest.mark.redis

ROOT = Path(__file__).resolve().parents[2]
SECRET = "s3cret-pw"


@pytest.fixture(autouse=True)
def _reset_logging(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("COLUMNS", raising=False)  # as in a log file or CI: no width given
    monkeypatch.delenv("DISTILLQ_REDIS_URL", raising=False)
    yield
    structlog.reset_defaults()


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def distillq(*argv: str, env: dict[str, str] | None = None, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    """``distillq ARGV`` as a process, its output captured (a pipe, not a terminal), no COLUMNS."""
    base = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "DISTILLQ_REDIS_URL")}
    return subprocess.run([sys.executable, "-m", "pipeline.cli.main", *argv], env={**base, **(env or {})},
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT, check=False)


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    groups = tmp_path / "groups.jsonl"
    groups.write_text(json.dumps(to_atropos(synthetic_rollout(1, 6, prompt_len=2, group_id="g"))) + "\n")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "q1", "prompt": "1+2="}\n')
    return {"GROUPS": str(groups), "PROMPTS": str(prompts)}


# --- 1. one line and a documented exit status, never a traceback ---------------------------------------

UNREACHABLE = {
    "push": ["push", "GROUPS"],
    "stats": ["stats"],
    "tail": ["tail", "scored"],
    "dlq list": ["dlq", "list"],
    "dlq show": ["dlq", "show", "1-0"],
    "dlq replay": ["dlq", "replay", "--all"],
    "dlq purge": ["dlq", "purge", "--yes"],
    "shards": ["shards"],
    "shards set": ["shards", "set", "2"],
    "enqueue": ["enqueue", "PROMPTS"],
    "where": ["where", "g"],
    "namespaces": ["namespaces"],
}


@pytest.mark.parametrize("command", list(UNREACHABLE))
def test_unreachable_redis_is_one_line_with_status_3(
    command: str, files: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    port = free_port()  # nothing listens there
    url = f"redis://user:{SECRET}@127.0.0.1:{port}/0"
    argv = [files.get(a, a) for a in UNREACHABLE[command]]
    code, out, err = run_cli(capsys, *argv, "--redis-url", url)
    assert code == 3
    assert out == ""
    assert err == f"distillq: cannot reach Redis at redis://user:***@127.0.0.1:{port}/0: Connection refused\n"


def test_unreachable_redis_as_a_process_prints_no_traceback(files: dict[str, str]) -> None:
    port = free_port()
    for argv in (["stats"], ["enqueue", files["PROMPTS"]]):
        p = distillq(*argv, "--redis-url", f"redis://127.0.0.1:{port}/0")
        assert (p.returncode, p.stdout) == (3, "")
        assert p.stderr.splitlines() == [f"distillq: cannot reach Redis at redis://127.0.0.1:{port}/0: "
                                         "Connection refused"], p.stderr


def test_demo_checks_a_given_redis_before_building_models(tmp_path: Path) -> None:
    port = free_port()
    p = distillq("demo", "--steps", "1", "--out", str(tmp_path / "out"), "--redis-url",
                 f"redis://:{SECRET}@127.0.0.1:{port}/0")
    assert (p.returncode, p.stdout) == (3, "")
    assert p.stderr.splitlines() == [f"using Redis at redis://:***@127.0.0.1:{port}/0, namespace demo",
                                     f"distillq: cannot reach Redis at redis://:***@127.0.0.1:{port}/0: "
                                     "Connection refused"], p.stderr
    assert not (tmp_path / "out").exists()


def test_unknown_host_and_invalid_url(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "stats", "--redis-url", "redis://no-such-host.invalid:6379/0")
    assert code == 3 and len(err.splitlines()) == 1
    assert re.fullmatch(r"distillq: cannot reach Redis at redis://no-such-host\.invalid:6379/0: .+\n", err), err
    code, _, err = run_cli(capsys, "stats", "--redis-url", "localhost:6379")
    assert code == 2 and err == ("distillq: invalid setting redis_url: redis_url must start with redis://, "
                                 "rediss://, unix:// or redis+cluster://\n")
    code, _, err = run_cli(capsys, "stats", "--namespace", "two words")
    assert code == 2 and err == "distillq: invalid namespace 'two words': use letters, digits, '_', '.', '-'\n"


def test_worker_check_with_redis_unreachable_is_unhealthy_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port()
    code, out, err = run_cli(capsys, "worker", "teacher", "--check", "--redis-url",
                             f"redis://:{SECRET}@127.0.0.1:{port}/0")
    assert (code, out) == (1, "")  # a health check says unhealthy (1), as docker expects
    assert err == f"cannot reach Redis at redis://:***@127.0.0.1:{port}/0: Connection refused\n"


@pytest.mark.parametrize("command", ["push", "enqueue"])
def test_missing_or_unreadable_input_file(
    command: str, tmp_path: Path, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run_cli(capsys, command, "nosuch.jsonl", "--redis-url", redis_url)
    assert (code, out, err) == (2, "", "distillq: cannot read nosuch.jsonl: No such file or directory\n")
    code, _, err = run_cli(capsys, command, str(tmp_path), "--redis-url", redis_url)
    assert (code, err) == (2, f"distillq: cannot read {tmp_path}: Is a directory\n")
    binary = tmp_path / "binary.jsonl"
    head = b'{"a": "'
    binary.write_bytes(head + b'\xff\xfe"}\n')
    code, _, err = run_cli(capsys, command, str(binary), "--redis-url", redis_url)
    assert (code, err) == (2, f"distillq: cannot read {binary}: not UTF-8 text (byte {len(head)})\n")


@pytest.mark.parametrize(("argv", "line"), [
    (["shards", "set"], "distillq: shards set: give the shard count"),
    (["tail", "scored", "--decode", "--format", "atropos"],
     "distillq: tail: --decode applies to --format summary only"),
    (["dlq", "replay"], "distillq: dlq replay: give ENTRY_ID ... or --all (not both)"),
    (["up", "--rollout", "0", "--teachers", "0", "--feeders", "0"],
     "distillq: nothing to run: give --rollout, --teachers or --feeders"),
    (["serve", "atropos", "--batch-wait-s", "-1"],
     "distillq: --batch-wait-s must be a number of seconds from 0 to 60, got -1.0"),
])
def test_a_flag_a_command_cannot_use_is_one_line_with_status_2(
    argv: list[str], line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused before Redis is asked (the URL here is never reachable), through the one failure path."""
    code, out, err = run_cli(capsys, *argv, "--redis-url", "redis://127.0.0.1:9/0")
    assert (code, out, err) == (2, "", line + "\n")


@pytest.mark.parametrize("action", ["show", "replay"])
def test_dlq_malformed_entry_id(action: str, keys: Keys, redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(capsys, "dlq", action, "notanid", "--redis-url", redis_url, "--namespace", keys.namespace)
    assert (code, out) == (2, "")
    assert err == (f"distillq: dlq {action}: 'notanid' is not an entry id: they look like 1732451234567-0 "
                   "(see distillq dlq list)\n")


async def test_a_redis_error_reply_is_one_line(
    r: aioredis.Redis, keys: Keys, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    await r.set(keys.dlq, "not a stream")  # any command on it gets WRONGTYPE
    capsys.readouterr()
    code = await asyncio.to_thread(main, ["dlq", "list", "--redis-url", redis_url, "--namespace", keys.namespace])
    out, err = capsys.readouterr()
    assert (code, out) == (3, "")
    assert err.startswith(f"distillq: Redis at {redis_url} replied with an error: WRONGTYPE ") and err.count("\n") == 1


def test_wrong_password_is_one_line(redis_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    url = redis_url.replace("redis://", f"redis://nobody:{SECRET}@")
    code, _, err = run_cli(capsys, "shards", "--redis-url", url)
    assert code == 3 and err.count("\n") == 1 and SECRET not in err
    assert err.startswith(f"distillq: Redis at {url.replace(SECRET, '***')} refused the credentials: ")


# --- 2. output in a file or a pipe: full width ---------------------------------------------------------


async def test_stats_table_is_not_cut_when_output_is_not_a_terminal(
    r: aioredis.Redis, keys: Keys, redis_url: str
) -> None:
    for i in range(3):
        await StreamProducer(r, keys, "rollouts").send(synthetic_rollout(1, 8, group_id=f"g{i}"))
    await StreamProducer(r, keys, "scored").send(synthetic_scored(synthetic_rollout(1, 8, group_id="s"), k=4))
    p = await asyncio.to_thread(distillq, "stats", "--redis-url", redis_url, "--namespace", keys.namespace)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert "…" not in p.stdout
    header = next(line for line in lines if "stream" in line and "length" in line)
    for word in ("stream", "length", "memory", "added/s", "group", "lag", "pending", "oldest pending", "read/s",
                 "consumers"):
        assert word in header, header
    rollouts = next(line for line in lines if "rollouts" in line)
    assert "teacher" in rollouts and " 3 " in rollouts  # one row per stream: nothing wrapped onto a second line
    assert f"streams (namespace {keys.namespace})" in lines
    (summary,) = [line for line in lines if line.startswith("dead letters: ")]  # one line, not wrapped
    assert summary.startswith("dead letters: 0   policy version: never set   prompts queued: 0   backlog cap: 1000 "
                              "entries per stream key   Redis memory: ")
    assert summary.endswith(" (no maxmemory)   added/s: ≥ ids of the last window still queued; exact rates show "
                            "with --watch")

    p = await asyncio.to_thread(distillq, "stats", "rollouts", "--watch", "0.05", "--refreshes", "3",
                                "--redis-url", redis_url, "--namespace", keys.namespace)
    assert p.returncode == 0 and p.stdout.count(f"streams (namespace {keys.namespace})") == 3  # every refresh


def test_long_error_lines_are_not_wrapped_when_stderr_is_not_a_terminal(tmp_path: Path, redis_url: str) -> None:
    deep = tmp_path / ("a-rather-long-directory-name-" * 3) / "more"
    deep.mkdir(parents=True)
    path = deep / "groups-with-a-long-name.jsonl"
    bad = to_atropos(synthetic_rollout(1, 6, prompt_len=2, group_id="short"))
    bad["masks"][0] = bad["masks"][0][:-1]
    path.write_text("{not json\n" + json.dumps(bad) + "\n")
    p = distillq("push", str(path), "--redis-url", redis_url)
    assert p.returncode == 1
    assert p.stderr.splitlines() == [
        f"error {path}: line 1: invalid JSON: Expecting property name enclosed in double quotes at column 2",
        f"error {path}: line 2: masks[0]: length 5 != 6 tokens",
        "nothing pushed: 2 bad line(s)",
    ]


def test_demo_report_console_is_full_width_off_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    from pipeline.demo.tiny import DemoResult, report

    notes = {f"reason_{i}_with_a_long_name": i for i in range(8)}
    result = DemoResult(history=[{"step": 0.0, "heldout_reverse_kl": 2.0}, {"step": 1.0, "heldout_reverse_kl": 0.5}],
                        stages={"teacher": {"handled": 5, "started": 0.0, "outcomes": notes, "drops": {}}},
                        elapsed_s=3.0)
    capsys.readouterr()
    report(result, make_console(stderr=True))
    err = capsys.readouterr().err
    joined = ", ".join(f"{k}={v}" for k, v in sorted(notes.items()))
    assert joined in err  # the notes cell in one piece
    assert "held-out reverse KL(student || teacher): 2.000 -> 0.500 (75% lower) over 1 steps" in err.splitlines()
    narrow = Console(stderr=True, width=80)  # what a default console did: the same report cut into pieces
    report(result, narrow)
    assert joined not in capsys.readouterr().err


# --- 3. no noise: warnings, progress bars ---------------------------------------------------------------


def test_teacher_pretraining_and_learner_step_raise_no_warning(tmp_path: Path) -> None:
    import torch

    from pipeline.demo.learner import LearnerConfig, optimiser_step
    from pipeline.demo.pretrain import train_teacher
    from pipeline.demo.tinymodels import TinyModels, ensure_tiny_models
    from pipeline.models.weights import load_causal_lm
    from schemas import Array, TrainBatch

    cached = ensure_tiny_models()
    tiny = TinyModels(root=tmp_path, tokenizer=cached.tokenizer, teacher=cached.teacher, student=cached.student)
    losses: list[float] = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the requires_grad UserWarning (float() of a loss) fails here
        out = train_teacher(tiny, steps=2, batch=4, progress=lambda step, loss: losses.append(loss))
        assert (out / "DONE").exists() and len(losses) == 2 and all(np.isfinite(losses))

        student = load_causal_lm(cached.student)
        vocab = student.config.vocab_size
        group = synthetic_scored(synthetic_rollout(2, 24, vocab=vocab, prompt_len=8, seed=3), k=4, vocab=vocab)
        adv = [Array.from_numpy(np.full(s.length, 0.5, np.float32)) for s in group.group.sequences]
        batch = TrainBatch(batch_id="b", groups=[group], advantages=adv)
        opt = torch.optim.AdamW(student.parameters(), lr=1e-3)
        loss, pg, kd = optimiser_step(student, opt, batch, LearnerConfig(student="", weights_dir=""))
    assert all(isinstance(x, float) and np.isfinite(x) for x in (loss, pg, kd))


@pytest.mark.slow
def test_model_loading_progress_bars_stay_out_of_worker_output(keys: Keys, redis_url: str) -> None:
    from pipeline.demo.tinymodels import ensure_tiny_models

    teacher = str(ensure_tiny_models().teacher)
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_DISABLE_PROGRESS_BARS"}
    # Without the entry point's set-up, loading this model draws a bar: the check below can fail.
    load = ("from pipeline.models.weights import load_causal_lm; import sys; load_causal_lm(sys.argv[1])")
    bare = subprocess.run([sys.executable, "-c", load, teacher], env=env, capture_output=True, text=True,
                          timeout=120, cwd=ROOT, check=False)
    assert bare.returncode == 0 and "Loading weights" in bare.stderr, bare.stderr[-2000:]

    p = subprocess.run([sys.executable, "-m", "pipeline.cli.main", "worker", "teacher", "--backend", "hf",
                        "--model", teacher, "--burst", "--redis-url", redis_url, "--namespace", keys.namespace],
                       env=env, capture_output=True, text=True, timeout=120, cwd=ROOT, check=False)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "teacher_ready" in p.stderr
    assert "Loading weights" not in p.stderr and "it/s]" not in p.stderr, p.stderr[-3000:]
    events = [json.loads(line)["event"] for line in p.stderr.splitlines()]  # every line is a JSON log line
    assert "stage_stopped" in events


def test_python_m_workers_standalone_help() -> None:
    p = subprocess.run([sys.executable, "-m", "workers.feeder", "--help"], capture_output=True, text=True,
                       timeout=60, cwd=ROOT, check=False, env={**os.environ, "COLUMNS": "200"})
    assert p.returncode == 0 and p.stdout.startswith("usage: python -m workers.feeder")
    assert "Trainer feeder: reads scored groups" in p.stdout
    assert "token budget per batch (env DISTILLQ_MAX_BATCH_TOKENS) (default: 65536)" in p.stdout


@pytest.mark.parametrize(("env", "argv", "said"), [
    ({"DISTILLQ_TEACHER_ROWS": "bogus"}, ["worker", "teacher", "--backend", "synthetic"],
     "argument --rows: invalid choice"),
    ({"DISTILLQ_TEACHER_BACKEND": "x"}, ["worker", "teacher"], "argument --backend: invalid choice"),
    ({}, ["worker", "teacher", "--top-k", "0"], "argument --top-k: 0 is below 1"),
    ({"DISTILLQ_MISSING_DISTILL": "maybe"}, ["worker", "feeder"], "argument --missing-distill: invalid choice"),
])
def test_bad_worker_settings_from_flags_or_the_environment_are_usage_errors(
    env: dict[str, str], argv: list[str], said: str
) -> None:
    proc = subprocess.run([sys.executable, "-m", "pipeline.cli.main", *argv], capture_output=True, text=True,
                          timeout=60, env={**os.environ, **env}, check=False)
    assert proc.returncode == 2 and said in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_redis_at_maxmemory_is_named_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.redis_server import RedisServer

    server = RedisServer(extra_args=["--maxmemory", "1mb", "--maxmemory-policy", "noeviction"]).start()
    try:
        prompts = tmp_path / "prompts.jsonl"
        prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": "x" * 4000}) + "\n" for i in range(400)))
        code, _, err = run_cli(capsys, "enqueue", str(prompts), "--redis-url", server.url, "--namespace", "full")
        assert code == 3 and err.count("\n") == 1, err
        assert err == (f"distillq: Redis at {server.url} is full: it refuses writes at its maxmemory (noeviction); "
                       "free memory or raise maxmemory, then run this again (distillq stats shows used and "
                       "maxmemory)\n")
    finally:
        server.stop()
