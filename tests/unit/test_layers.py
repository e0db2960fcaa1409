"""The package layout is the architecture: imports run one way between layers, and no module cycle exists.

cli commands -> demo -> cli support -> workers -> stages -> transport -> (config, metrics, logs) -> schemas;
teacher, rollout, models and learner sit beside them as drawn in ALLOWED; ``distillq`` (the public API)
re-exports from above them all.
``pipeline.errors`` (the exception hierarchy, built on ``schemas.errors``) sits below them all: every layer but
``schemas`` may import it.
A new import that breaks a rule fails here with its file.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("distillq", "schemas", "pipeline", "workers", "bench")
BASE = {"pipeline.config", "pipeline.flags", "pipeline.metrics", "pipeline.logs", "pipeline.urls", "pipeline.backoff"}

# layer -> the layers it may import (besides itself and EVERYWHERE)
ALLOWED: dict[str, set[str]] = {
    "schemas": set(),
    "pipeline.errors": {"schemas"},
    "pipeline.base": {"schemas"},
    "pipeline.models": set(),
    "pipeline.teacher": {"schemas", "pipeline.base", "pipeline.models"},
    "pipeline.rollout": {"schemas", "pipeline.base", "pipeline.models"},
    "pipeline.transport": {"schemas", "pipeline.base"},
    # weights in Redis or object storage: the codec, the stores (their Redis client and retries from
    # pipeline.transport.connection), a learner's uploads, a reader's local folder
    "pipeline.weightstore": {"pipeline.base", "pipeline.models", "pipeline.transport"},
    "pipeline.stages": {"schemas", "pipeline.base", "pipeline.transport", "pipeline.teacher", "pipeline.rollout"},
    "pipeline.learner": {
        "schemas", "pipeline.base", "pipeline.transport", "pipeline.stages", "pipeline.models", "pipeline.weightstore",
    },
    "pipeline.serve": {"schemas", "pipeline.base", "pipeline.transport", "pipeline.rollout", "pipeline.stages"},
    "workers": {
        "schemas", "pipeline.base", "pipeline.transport", "pipeline.stages", "pipeline.teacher", "pipeline.rollout",
        "pipeline.weightstore",
    },
    # what the commands run: inspection, stats, recovery, the supervisor, embedded Redis
    "pipeline.cli": {
        "schemas", "pipeline.base", "pipeline.transport", "pipeline.stages", "pipeline.learner", "pipeline.serve",
        "workers",
    },
    # the demo, its tiny and real pairs, their tasks and evaluation, the example learner
    "pipeline.demo": {
        "schemas", "pipeline.base", "pipeline.transport", "pipeline.stages", "pipeline.teacher", "pipeline.models",
        "pipeline.weightstore", "pipeline.learner", "pipeline.cli",
    },
    # the entry point and one module per subcommand: on top of everything
    "pipeline.cli.commands": {
        "schemas", "pipeline.base", "pipeline.transport", "pipeline.stages", "pipeline.rollout", "pipeline.models",
        "pipeline.weightstore", "pipeline.serve", "workers", "pipeline.cli", "pipeline.demo",
    },
    # the public API: re-exports only, and no layer imports it
    "distillq": {
        "schemas", "pipeline.transport", "pipeline.stages", "pipeline.learner", "pipeline.serve", "pipeline.teacher",
        "pipeline.rollout", "pipeline.models", "pipeline.weightstore", "pipeline.demo",
    },
}
#: Layers every layer but ``schemas`` may import: the exception hierarchy.
EVERYWHERE: set[str] = {"pipeline.errors"}


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def layer(module: str) -> str:
    if module in BASE or module == "pipeline":
        return "pipeline.base"
    parts = module.split(".")
    if parts[:3] == ["pipeline", "cli", "commands"] or module == "pipeline.cli.main":
        return "pipeline.cli.commands"
    if parts[0] == "pipeline":
        return ".".join(parts[:2])
    return parts[0]


def imports(path: Path) -> set[str]:
    """Project modules that ``path`` imports, at any depth of the file (lazy imports count too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] not in PACKAGES:
                continue
            for alias in node.names:  # ``from pipeline import metrics`` names a module
                sub = f"{node.module}.{alias.name}"
                found.add(sub if (ROOT / Path(*sub.split("."))).with_suffix(".py").exists() else node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] in PACKAGES}
    return found


def sources(*packages: str) -> list[Path]:
    return sorted(p for pkg in packages for p in (ROOT / pkg).rglob("*.py"))


def test_every_pipeline_module_lives_in_a_known_layer() -> None:
    stray = [module_name(p) for p in sources("pipeline") if layer(module_name(p)) not in ALLOWED]
    assert stray == [], f"modules outside the layers of tests/unit/test_layers.py: {stray}"


@pytest.mark.parametrize("path", sources("distillq", "schemas", "pipeline", "workers"), ids=module_name)
def test_imports_follow_the_layers(path: Path) -> None:
    own = layer(module_name(path))
    allowed = ALLOWED[own] | (EVERYWHERE if own != "schemas" else set())
    bad = sorted(m for m in imports(path) if layer(m) != own and layer(m) not in allowed)
    assert bad == [], f"{module_name(path)} ({own}) may not import {bad}"


def test_no_import_cycles() -> None:
    graph = {module_name(p): {m for m in imports(p) if m != module_name(p)} for p in sources(*PACKAGES)}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                cycle = [*stack[stack.index(n):], n]
                # a package importing its own submodules from __init__ is not a cycle users can hit
                if not all(c.startswith(cycle[0]) or cycle[0].startswith(c) for c in cycle):
                    pytest.fail("import cycle: " + " -> ".join(cycle))
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_every_grant_is_used() -> None:
    """``ALLOWED`` states the architecture as it is: each layer may import exactly the layers it does import (a
    grant no module uses fails here, so the table never fences more than the code needs)."""
    used: dict[str, set[str]] = {own: set() for own in ALLOWED}
    for path in sources("distillq", "schemas", "pipeline", "workers"):
        own = layer(module_name(path))
        used[own] |= {layer(m) for m in imports(path)} - {own} - EVERYWHERE
    unused = {own: sorted(ALLOWED[own] - used[own]) for own in ALLOWED if ALLOWED[own] - used[own]}
    assert unused == {}, f"grants no module uses (remove them from ALLOWED): {unused}"
