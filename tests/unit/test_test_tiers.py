"""The two test tiers: the default run leaves out the tests marked slow, and its summary names the command that
runs them (tests/conftest.py)."""

from __future__ import annotations

import shlex
import tomllib
from pathlib import Path

import pytest

from tests.conftest import slow_tier_command

ROOT = Path(__file__).resolve().parents[2]


def test_the_default_run_leaves_out_the_slow_tier() -> None:
    ini = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    args = shlex.split(ini["addopts"])
    assert args[args.index("-m") + 1] == "not slow"
    assert any(m.startswith("slow:") for m in ini["markers"])


@pytest.mark.parametrize(("args", "command"), [
    ([], "python -m pytest -m slow"),
    (["-q", "tests/integration/test_demo.py"], "python -m pytest -m slow -q tests/integration/test_demo.py"),
    (["-m", "not vllm", "-x"], "python -m pytest -m slow -x"),
    (["-mredis", "-k", "a b"], "python -m pytest -m slow -k 'a b'"),
])
def test_the_slow_tier_command_keeps_the_other_arguments(args: list[str], command: str) -> None:
    assert slow_tier_command(args) == command
