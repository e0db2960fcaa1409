"""The verifiers-compatible student endpoint (``distillq serve student``), and verifiers' rollouts as groups.

``app`` (the HTTP routes), ``service`` (sampling, tracking, groups), ``sessions`` (one tracker per rollout,
groups waiting for their rollouts), ``validation`` (request checks), ``settings`` (the command's flags,
``StudentServeSettings``). The argparse glue is ``pipeline.cli.commands.serve_student``.

Public here: the converter from verifiers' own records (``verifiers``): ``groups_from_traces``,
``trace_sequences``, ``finish_body`` and their helpers. They load on first use, so building the CLI's parser
does not import them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipeline.serve.student.verifiers import (
        BranchSample,
        branch_samples,
        finish_body,
        groups_from_traces,
        task_key,
        trace_reward,
        trace_sequences,
    )

__all__ = [
    "BranchSample",
    "branch_samples",
    "finish_body",
    "groups_from_traces",
    "task_key",
    "trace_reward",
    "trace_sequences",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("pipeline.serve.student.verifiers"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
