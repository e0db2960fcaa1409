"""Module paths from before a move keep working: the old name imports the very module at the new path."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import pipeline.ops
import pipeline.rollout
import pipeline.serve
from pipeline.moved import OldPaths

MOVED = sorted({**pipeline.ops.MOVED, **pipeline.serve.MOVED, **pipeline.rollout.MOVED}.items())


@pytest.mark.parametrize(("old", "new"), MOVED, ids=[old for old, _ in MOVED])
def test_an_old_path_imports_the_moved_module(old: str, new: str) -> None:
    moved = importlib.import_module(old)
    assert moved is importlib.import_module(new)
    assert moved.__name__ == new
    assert moved.__spec__ is not None and moved.__spec__.name == new  # the real spec, not the old name's


def test_old_names_give_the_same_objects() -> None:
    from pipeline.ops.cli.main import main as old_main
    from pipeline.ops.cli.push import parse_file as old_parse_file
    from pipeline.ops.supervisor import Supervisor as OldSupervisor

    from pipeline.cli.commands.push import parse_file
    from pipeline.cli.main import main
    from pipeline.cli.supervisor import Supervisor

    assert old_main is main
    assert old_parse_file is parse_file
    assert OldSupervisor is Supervisor


def test_old_serve_and_rollout_names_give_the_same_objects() -> None:
    from pipeline.rollout.student_base import StudentBackend as OldStudentBackend
    from pipeline.rollout.student_vllm import VLLMStudent as OldVLLMStudent
    from pipeline.serve.atropos_server import ServeConfig as OldServeConfig
    from pipeline.serve.student_verifiers import groups_from_traces as old_groups_from_traces

    from pipeline.rollout.students.base import StudentBackend
    from pipeline.rollout.students.vllm import VLLMStudent
    from pipeline.serve.atropos.startup import ServeConfig
    from pipeline.serve.student import groups_from_traces

    assert OldStudentBackend is StudentBackend
    assert OldVLLMStudent is VLLMStudent
    assert OldServeConfig is ServeConfig
    assert old_groups_from_traces is groups_from_traces


def test_the_student_package_offers_its_public_converter() -> None:
    from pipeline.serve import student
    from pipeline.serve.student import verifiers

    assert student.__all__ and all(getattr(student, name) is getattr(verifiers, name) for name in student.__all__)
    with pytest.raises(AttributeError):
        _ = student.no_such_name


def test_an_old_package_offers_its_moved_modules() -> None:
    from pipeline.ops.cli import dlq, main

    import pipeline.cli.commands.dlq
    import pipeline.cli.main

    assert main is pipeline.cli.main
    assert dlq is pipeline.cli.commands.dlq


def test_a_name_never_moved_is_still_missing() -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("pipeline.ops.no_such_module")
    assert OldPaths({"a.b": "c.d"}).find_spec("a.c", None) is None


def test_python_m_runs_the_moved_entry_point() -> None:
    proc = subprocess.run([sys.executable, "-m", "pipeline.ops.cli.main", "--help"], capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: distillq")
