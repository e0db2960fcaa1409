"""Every Prometheus metric of distillq is defined in ``pipeline/metrics.py``: no other module of the project makes a
``Counter``, ``Gauge``, ``Histogram``, ``Summary`` or ``Info``, so one file lists what ``/metrics`` serves."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KINDS = {"Counter", "Gauge", "Histogram", "Summary", "Info", "Enum"}


def metric_kinds_imported(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("prometheus_client"):
            out |= {a.name for a in node.names} & KINDS
        elif isinstance(node, ast.Attribute) and node.attr in KINDS and isinstance(node.value, ast.Name) \
                and node.value.id in ("prometheus_client", "prom"):
            out.add(node.attr)
    return out


def test_metrics_are_defined_in_one_module() -> None:
    home = ROOT / "pipeline" / "metrics.py"
    found = {str(p.relative_to(ROOT)): kinds for package in ("pipeline", "workers", "distillq", "schemas")
             for p in sorted((ROOT / package).rglob("*.py")) if p != home and (kinds := metric_kinds_imported(p))}
    assert found == {}, f"metrics defined outside pipeline/metrics.py: {found}"
    assert metric_kinds_imported(home) >= {"Counter", "Gauge", "Histogram"}
