"""verifiers 0.4 rollouts as ``RolloutGroup``s, from verifiers' own records (no verifiers import needed).

A ``Trace`` (``agent.run``, ``Episode.traces``) or its JSON record (``trace.to_record()``, a line of
``outputs/<run>/traces.jsonl``) holds a message graph whose nodes carry ``token_ids``, ``mask`` (True on
sampled tokens) and ``logprobs`` (one per sampled token). Each root-to-leaf path (``Trace.branches``) is
one training sample: ``groups_from_traces`` turns every trainable branch into a sequence scored with the
trace's reward (the sum of ``score * weight`` over ``trace.rewards``) and groups the traces by task key
(``trace.task.key``, else ``trace.task.hash``), built by the server's own ``build_group`` (same group id,
same metadata). A ``Trace`` object's ``branches`` are read as verifiers computes them; a record's are
rebuilt by the same rule (leaves in node order, a compaction attempt trainable only when a ``compaction``
link resumes from it).

Records round per-token floats to 4 decimals unless written with ``to_record(float_decimals=None)``;
live ``Trace`` objects keep full precision. Traces that are not ``ok`` and traces of an agent marked not
trainable are skipped unless asked for, as are branches with no sampled token.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import structlog

from pipeline.serve.student.sessions import FinishedRollout, GroupSpec, build_group
from schemas.build import make_sequence
from schemas.messages import RolloutGroup
from schemas.messages import Sequence as WireSequence

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class BranchSample:
    token_ids: list[int]
    sampled_mask: list[bool]
    logprobs: list[float]  # aligned to token_ids, 0.0 where not sampled
    trainable: bool = True


def _get(obj: Any, name: str, default: Any = None) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(name, default)
    return getattr(obj, name, default)


def _spread(nodes: list[Mapping[str, Any]]) -> list[float]:
    """Per-sampled-token node logprobs widened to the branch's tokens (0.0 elsewhere)."""
    out: list[float] = []
    for node in nodes:
        values = list(node.get("logprobs") or [])
        it = iter(values)
        out.extend(float(next(it, 0.0)) if m else 0.0 for m in node.get("mask") or [])
    return out


def _record_branches(record: Mapping[str, Any]) -> list[BranchSample]:
    nodes: list[Mapping[str, Any]] = list(record.get("nodes") or [])
    parents = {n.get("parent") for n in nodes if n.get("parent") is not None}
    resumed = {
        link.get("node") for n in nodes for link in n.get("semantic_parents") or [] if link.get("type") == "compaction"
    }
    out = []
    for leaf in (i for i in range(len(nodes)) if i not in parents):
        path: list[Mapping[str, Any]] = []
        nid: int | None = leaf
        while nid is not None:
            path.append(nodes[nid])
            nid = nodes[nid].get("parent")
        path.reverse()
        attempt = any(link.get("type") == "compaction_attempt" for link in nodes[leaf].get("semantic_parents") or [])
        out.append(
            BranchSample(
                token_ids=[int(t) for n in path for t in n.get("token_ids") or []],
                sampled_mask=[bool(m) for n in path for m in n.get("mask") or []],
                logprobs=_spread(path),
                trainable=not attempt or leaf in resumed,
            )
        )
    return out


def branch_samples(trace: Any) -> list[BranchSample]:
    """The branches of a ``Trace`` (via ``trace.branches``) or of its JSON record."""
    if isinstance(trace, Mapping):
        return _record_branches(trace)
    return [
        BranchSample(list(b.token_ids), [bool(m) for m in b.sampled_mask], list(b.logprobs), bool(b.trainable))
        for b in trace.branches
    ]


def trace_reward(trace: Any) -> float:
    """``trace.reward``: the sum of ``score * weight`` over the rewards that ran."""
    if not isinstance(trace, Mapping):
        return float(trace.reward)
    total = 0.0
    for r in (trace.get("rewards") or {}).values():
        if r is not None:
            total += float(r.get("score", 0.0)) * float(r.get("weight", 1.0))
    return total


def task_key(trace: Any) -> str:
    task = _get(trace, "task")
    key = _get(task, "key") or _get(task, "hash")
    if not key:
        raise ValueError(f"trace {_get(trace, 'id')!r} has no task key or hash")
    return str(key)


def finish_body(trace: Any) -> dict[str, Any]:
    """The ``POST /sessions/{trace.id}/finish`` body for a rollout served by ``distillq serve student``."""
    trainable = _get(_get(trace, "agent"), "trainable", True) is not False and bool(_get(trace, "ok", False))
    return {"task": task_key(trace), "reward": trace_reward(trace), "trainable": trainable}


def trace_sequences(trace: Any, *, include_untrainable: bool = False) -> list[WireSequence]:
    """One wire sequence per trainable branch with at least one sampled token, scored with the reward."""
    reward = trace_reward(trace)
    out = []
    for b in branch_samples(trace):
        if not any(b.sampled_mask) or not (b.trainable or include_untrainable):
            continue
        out.append(make_sequence(b.token_ids, b.sampled_mask, logprobs=b.logprobs, score=reward))
    return out


def _group(traces: list[Any], seqs: list[list[WireSequence]], spec: GroupSpec) -> RolloutGroup:
    """The group the server builds for these rollouts (a trace id is the X-Session-ID of its requests): same
    group id, same metadata; fewer traces than ``spec.group_size`` make a partial group, as on the server."""
    rollouts = [FinishedRollout(str(_get(t, "id")), ss) for t, ss in zip(traces, seqs, strict=True)]
    return build_group(spec, rollouts, partial=len(rollouts) < spec.group_size)


def groups_from_traces(
    traces: Iterable[Any],
    *,
    group_size: int | None = None,
    env_id: int = 0,
    policy_version: int = 0,
    include_failed: bool = False,
) -> list[RolloutGroup]:
    """Group traces by task key (in order of first appearance), ``group_size`` traces per group (all of a
    task's when None; a last, smaller group keeps the remainder, marked partial). Traces yielding no sequence
    are skipped."""
    if group_size is not None and group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    by_task: dict[str, list[tuple[Any, list[WireSequence]]]] = {}
    skipped = 0
    for t in traces:
        agent_trainable = _get(_get(t, "agent"), "trainable", True)
        if (not include_failed and not _get(t, "ok", False)) or agent_trainable is False:
            skipped += 1
            continue
        seqs = trace_sequences(t)
        if not seqs:
            skipped += 1
            continue
        by_task.setdefault(task_key(t), []).append((t, seqs))
    if skipped:
        log.info("verifiers.traces_skipped", traces=skipped)
    out = []
    for key, items in by_task.items():
        size = group_size or len(items)
        spec = GroupSpec(task=key, group_size=size, env_id=env_id, policy_version=policy_version)
        for i in range(0, len(items), size):
            chunk = items[i : i + size]
            out.append(_group([t for t, _ in chunk], [s for _, s in chunk], spec))
    return out
