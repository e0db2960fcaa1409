"""Every ``DISTILLQ_*`` variable is read through ``pipeline.config`` (its ``env()`` or a settings class): a
direct read (``os.environ[...]``, ``os.environ.get``, ``os.getenv``, ``... in os.environ``) of a ``DISTILLQ_``
name anywhere in ``pipeline/``, ``workers/`` or ``distillq/`` but ``pipeline/config.py`` fails here with its
file and line. Writing a child process's environment is not a read and is not flagged."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("pipeline", "workers", "distillq")
ALLOWED = {ROOT / "pipeline" / "config.py"}
PREFIX = "DISTILLQ_"


def _is_environ(node: ast.expr) -> bool:
    """``os.environ`` or a bare ``environ`` (``from os import environ``)."""
    if isinstance(node, ast.Attribute):
        return node.attr == "environ" and isinstance(node.value, ast.Name) and node.value.id == "os"
    return isinstance(node, ast.Name) and node.id == "environ"


def _names_distillq(node: ast.expr) -> bool:
    """A key that is, or starts with, a ``DISTILLQ_`` string: a constant, an f-string or ``"DISTILLQ_" + x``."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and node.value.startswith(PREFIX)
    if isinstance(node, ast.JoinedStr):
        return bool(node.values) and _names_distillq(node.values[0])
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _names_distillq(node.left)
    return False


def direct_reads(source: str) -> list[int]:
    """The lines of ``source`` that read a ``DISTILLQ_`` variable without ``pipeline.config``."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        key: ast.expr | None = None
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_environ(node.value):
            key = node.slice
        elif isinstance(node, ast.Call) and node.args:
            f = node.func
            reads_environ = (isinstance(f, ast.Attribute) and f.attr in ("get", "setdefault", "pop")
                             and _is_environ(f.value))
            getenv = (isinstance(f, ast.Attribute) and f.attr == "getenv" and isinstance(f.value, ast.Name)
                      and f.value.id == "os") or (isinstance(f, ast.Name) and f.id == "getenv")
            if reads_environ or getenv:
                key = node.args[0]
        elif (isinstance(node, ast.Compare) and any(isinstance(op, ast.In | ast.NotIn) for op in node.ops)
              and any(_is_environ(c) for c in node.comparators)):
            key = node.left
        if key is not None and _names_distillq(key):
            lines.append(node.lineno)
    return lines


def test_the_scan_finds_every_form_of_direct_read() -> None:
    source = "\n".join([
        'import os', 'from os import environ, getenv',
        'a = os.environ["DISTILLQ_A"]', 'b = os.environ.get("DISTILLQ_B", "x")', 'c = os.getenv("DISTILLQ_C")',
        'd = environ.get(f"DISTILLQ_{name}")', 'e = getenv("DISTILLQ_" + name)', 'f = "DISTILLQ_F" in os.environ',
        'g = os.environ.setdefault("DISTILLQ_G", "1")',
        # not reads of a DISTILLQ_ name: other variables, and writes for a child process
        'h = os.environ.get("HOME")', 'i = os.environ.get(var)', 'os.environ["DISTILLQ_X"] = "1"',
        'child = {**os.environ, "DISTILLQ_Y": "1"}',
    ])
    assert direct_reads(source) == [3, 4, 5, 6, 7, 8, 9]


def test_distillq_variables_are_read_through_pipeline_config() -> None:
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path in ALLOWED:
                continue
            found += [f"{path.relative_to(ROOT)}:{line}" for line in direct_reads(path.read_text(encoding="utf-8"))]
    assert not found, ("read DISTILLQ_* variables through pipeline.config.env() or a settings class, not "
                       f"os.environ: {', '.join(found)}")
