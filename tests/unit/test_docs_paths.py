"""Every module path the README and the docs name exists: a file path (``pipeline/transport/bigio.py``, a
folder ``pipeline/serve/``) is a file or folder of the repository, and a dotted name (``pipeline.learner.chunked``,
``pipeline.stages.runloop.StageRunner``) is a module, or a name defined at the top of the longest module it starts
with. A moved or deleted module fails here with the page and the name."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
PACKAGES = ("pipeline", "schemas", "workers", "bench", "distillq")
_ROOTS = "|".join(PACKAGES)
#: ``pipeline/transport/bigio.py``, ``pipeline/serve/``, ``schemas/messages.py``, ``tests/...`` is not checked.
FILE_PATH = re.compile(rf"(?<![\w./-])(?:{_ROOTS})(?:/[\w.-]+)+/?")
#: ``pipeline.learner.chunked``, ``schemas.validate.validate_teacher_part``.
DOTTED = re.compile(rf"(?<![\w./-])(?:{_ROOTS})(?:\.[A-Za-z_]\w*)+")


def mentions(text: str) -> tuple[set[str], set[str]]:
    """The file paths and the dotted names in ``text`` (a trailing ``.`` of a sentence is not part of one)."""
    paths = {m.rstrip(".") for m in FILE_PATH.findall(text)}
    dotted = {m for m in DOTTED.findall(text) if "/" not in m}
    return paths, dotted


@cache
def top_level_names(path: Path) -> frozenset[str]:
    """Names a module defines at its top level: functions, classes, assignments, imports, ``__all__``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                names |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets) and node.value is not None:
                names |= {c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant)
                          and isinstance(c.value, str)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.If):  # ``if TYPE_CHECKING:`` imports of lazily loaded names
            for sub in node.body:
                if isinstance(sub, (ast.Import, ast.ImportFrom)):
                    names |= {(a.asname or a.name).split(".")[0] for a in sub.names}
    return frozenset(names)


def module_file(parts: list[str]) -> Path | None:
    base = ROOT.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def dotted_problem(name: str) -> str | None:
    """Why ``name`` names nothing, or None when it names a module or a top-level name of one."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        found = module_file(parts[:i])
        if found is None:
            continue
        if i == len(parts) or parts[i] in top_level_names(found):
            return None
        return f"{'.'.join(parts[:i])} defines no {parts[i]!r}"
    return "no such module"


def test_the_path_patterns_find_what_pages_write() -> None:
    paths, dotted = mentions(
        "See `pipeline/transport/bigio.py`, `pipeline/serve/` and `pipeline.stages.runloop.StageRunner`. "
        "Run `python -m pipeline.demo.learner`; read pipeline.config. Not distillq-checkpoint.json, "
        "not tests/unit/test_layers.py, not docs/pipeline.md."
    )
    assert paths == {"pipeline/transport/bigio.py", "pipeline/serve/"}
    assert dotted == {"pipeline.stages.runloop.StageRunner", "pipeline.demo.learner", "pipeline.config"}


def test_a_missing_module_or_name_is_reported() -> None:
    assert dotted_problem("pipeline.learner.chunked") is None
    assert dotted_problem("pipeline.stages.runloop.StageRunner") is None
    assert dotted_problem("pipeline.learner.to_torch") is None  # loaded on first use, named in __all__
    assert dotted_problem("pipeline.torch_batch.to_torch") is not None  # pipeline has no torch_batch
    assert dotted_problem("pipeline.stages.runloop.NoSuchRunner") == "pipeline.stages.runloop defines no 'NoSuchRunner'"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_module_path_a_page_names_exists(page: Path) -> None:
    paths, dotted = mentions(page.read_text(encoding="utf-8"))
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    unknown = sorted(f"{d} ({why})" for d in dotted if (why := dotted_problem(d)) is not None)
    assert missing == [] and unknown == [], f"{page.relative_to(ROOT)} names {missing + unknown}"
