"""The benchmarks still run: every row of ``python -m bench --quick`` alone (one test per row, so a failure
names the row), with the date, commit and machine of the run in its first line; every runnable module under
bench/ answers ``--help`` (imports and parses its arguments; nothing is measured, no GPU code runs); and
``bench.provenance`` reads the commit, with ``-dirty`` for changed tracked files and ``unknown`` outside a
checkout; and the reference JSON of ``bench.codec`` places each teacher row at its position. The figures
themselves are not checked here (they depend on the machine): bench/RESULTS.md."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pytest

from bench.codec import reference_back, reference_json
from bench.provenance import git_commit, header, run_info
from bench.run import ROWS
from schemas.build import synthetic_rollout, synthetic_scored

ROOT = Path(__file__).resolve().parents[2]
HEADER = re.compile(r"^distillq performance suite, (\d{4}-\d\d-\d\d \d\d:\d\d) UTC, commit (\S+); (.+), nproc \d+, ")
# The table's first column for each row of ``python -m bench``.
PREFIX = {"codec": "1 codec", "transport": "2 transport", "reference": "2 transport", "teacher": "3 teacher",
          "scaling": "4 scaling", "latency": "5 latency", "memory": "6 memory", "rss": "6 memory rss"}  # fmt: skip


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "2"}


def runnable_modules() -> list[str]:
    """``bench.X`` for every bench/X.py with a ``__main__`` block, and ``bench`` itself."""
    found = sorted(p.stem for p in (ROOT / "bench").glob("*.py") if 'if __name__ == "__main__"' in p.read_text())
    return ["bench", *(f"bench.{m}" for m in found)]


def test_every_row_has_a_smoke_run() -> None:
    assert set(PREFIX) == set(ROWS)


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("row", ROWS)
def test_quick_row(row: str, tmp_path: Path) -> None:
    out_json = tmp_path / "out.json"
    before = datetime.now(UTC).replace(second=0, microsecond=0)
    cmd = [sys.executable, "-m", "bench", "--quick", "--rows", row, "--json", str(out_json)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env(), cwd=ROOT, timeout=230, check=False)
    assert out.returncode == 0, out.stderr[-4000:]
    head = HEADER.match(out.stdout)
    assert head, out.stdout[:500]
    when = datetime.strptime(head[1], "%Y-%m-%d %H:%M").replace(tzinfo=UTC)
    assert before <= when <= datetime.now(UTC)  # the time of this run, not one written into the code
    commit = head[2].removesuffix("-dirty")  # HEAD itself may have moved since (commits beside the test)
    subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}"], cwd=ROOT, check=True)
    data = json.loads(out_json.read_text())
    assert data["run"]["commit"] == head[2] and data["run"]["date"] == f"{head[1]} UTC"
    rows = data["rows"]
    assert rows, out.stdout
    for r in rows:
        assert r["row"].startswith(PREFIX[row]), r
        assert "run failed" not in r["what"], r
        assert f"| {r['row']} | {r['what']} |" in out.stdout
    if row == "reference":
        assert all("reference" in r["what"] for r in rows), rows


# Runs each module as ``python -m MODULE --help`` would (``runpy``, ``sys.argv``), all in one child process so
# torch and the rest are imported once; writes {module: {"code": exit status or traceback, "stdout": ...}}.
HELP_ALL = """
import contextlib, io, json, runpy, sys, traceback, warnings
warnings.simplefilter("ignore", RuntimeWarning)  # runpy: a module imported by an earlier one runs again as __main__
dest, out = sys.argv[1], {}
for module in sys.argv[2:]:
    buf, code = io.StringIO(), None
    try:
        sys.argv = [module, "--help"]
        with contextlib.redirect_stdout(buf):
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code
    except BaseException:
        code = traceback.format_exc()
    out[module] = {"code": code, "stdout": buf.getvalue()}
with open(dest, "w") as f:
    json.dump(out, f)
"""


@pytest.fixture(scope="module")
def helps(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, object]]:
    dest = tmp_path_factory.mktemp("help") / "help.json"
    cmd = [sys.executable, "-c", HELP_ALL, str(dest), *runnable_modules()]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env(), cwd=ROOT, timeout=300, check=False)
    assert out.returncode == 0 and dest.exists(), out.stderr[-3000:]
    got: dict[str, dict[str, object]] = json.loads(dest.read_text())
    return got


@pytest.mark.timeout(320)
@pytest.mark.parametrize("module", runnable_modules())
def test_module_answers_help(module: str, helps: dict[str, dict[str, object]]) -> None:
    got = helps[module]
    assert got["code"] == 0, got["code"]
    assert str(got["stdout"]).startswith("usage:"), got["stdout"]


def git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid", *args], cwd=repo,
                   check=True, capture_output=True)  # fmt: skip


def test_git_commit_marks_a_dirty_checkout(tmp_path: Path) -> None:
    git(tmp_path, "init", "-q")
    (tmp_path / "a.txt").write_text("1")
    git(tmp_path, "add", "a.txt")
    git(tmp_path, "commit", "-q", "-m", "one")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tmp_path, capture_output=True, text=True,
                          check=True).stdout.strip()  # fmt: skip
    (tmp_path / "new.txt").write_text("untracked files do not count")
    assert git_commit(tmp_path) == head
    (tmp_path / "a.txt").write_text("2")
    assert git_commit(tmp_path) == f"{head}-dirty"


def test_git_commit_outside_a_checkout_is_unknown(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))  # no repository above tmp_path either
    assert git_commit(tmp_path) == "unknown"
    monkeypatch.setenv("PATH", str(tmp_path))  # no git at all
    assert git_commit(ROOT) == "unknown"


def test_header_time_is_now() -> None:
    line = header("t", run_info())
    stamp = datetime.strptime(line.split(", ")[1], "%Y-%m-%d %H:%M UTC").replace(tzinfo=UTC)
    assert abs(datetime.now(UTC) - stamp) < timedelta(minutes=2)
    assert re.search(r", commit [0-9a-f]{7,}(-dirty)?; ", line), line


@pytest.mark.parametrize("all_rows", [False, True])
def test_reference_json_places_each_row_at_its_position(all_rows: bool) -> None:
    """The reference layout of a payload with trained rows only (or every row): entry ``r + 1`` holds row
    ``r`` (sampled token, then the top-k), every other entry is empty, and the arrays come back."""
    msg = synthetic_scored(synthetic_rollout(2, 24, vocab=50, seed=3), 4, vocab=50, all_rows=all_rows)
    assert msg.teacher is not None
    data = reference_json(msg)
    obj = json.loads(data)
    for i, (seq, t) in enumerate(zip(msg.group.sequences, msg.teacher, strict=True)):
        tok, rows = seq.tokens.numpy(), t.row_index(len(seq.tokens.numpy()))
        assert (len(rows) == len(tok) - 1) == all_rows
        held = [p for p, e in enumerate(obj["distill_token_ids"][i]) if e]
        assert held == [int(r) + 1 for r in rows]
        assert [e[0] for e in obj["distill_token_ids"][i] if e] == tok[rows + 1].tolist()
        _tok, _mask, _lp, ids, lps = reference_back(data)[i]
        assert np.array_equal(ids[:, 1:], t.topk_ids.numpy())
        assert np.array_equal(lps[:, 1:], t.topk_logprobs.numpy())
        assert np.array_equal(lps[:, 0], t.sampled_logprobs.numpy())
