"""A teacher of another tokenizer in ``distillq stats`` (its heartbeat's shares, per worker and in ``--json``) and
in its Prometheus counters, from groups scored by a real ``Scorer(cross=...)``."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY
from rich.console import Console

from pipeline.cli.commands.stats import to_json, worker_table
from pipeline.cli.streamstats import Snapshot, WorkerStats, worker_of
from pipeline.stages.liveness import Beat
from pipeline.stages.runloop import Emit
from pipeline.stages.scoring import Scorer, ScoringConfig
from pipeline.stages.teacher_stage import TeacherStage
from pipeline.teacher.crossscore import CrossTokenizer
from pipeline.transport.claimcheck import header_of
from schemas import Limits, ScoredGroup
from tests.unit.test_crossscore import BigramTeacher, K, cross, group_of, tokenizers  # noqa: F401 (fixtures)

POOL = "crossstats"


def counter(name: str, kind: str) -> float:
    return REGISTRY.get_sample_value(f"{name}_total", {"pool": POOL, "kind": kind}) or 0.0


def table_text(workers: list[WorkerStats]) -> str:
    snap = Snapshot(namespace="ns", time=0.0, streams={}, dead_letters=0, workers=workers)
    console = Console(record=True, width=300)
    console.print(worker_table(snap))
    return console.export_text()


@pytest.mark.timeout(120)
def test_a_cross_teacher_counts_its_shares_in_metrics_and_stats_shows_them(
        tokenizers: tuple[Any, Any, Path, Path], cross: CrossTokenizer) -> None:  # noqa: F811
    student, teacher_tok, _, _ = tokenizers
    stage = TeacherStage(Scorer(BigramTeacher(len(teacher_tok)), ScoringConfig(default_k=K), cross=cross,
                                limits=Limits(vocab_size=len(cross.student)), pool=POOL))
    assert stage.report()["cross_aligned_share"] is None  # nothing scored yet
    names = ("distillq_teacher_cross_tokens", "distillq_teacher_cross_topk_mass")
    before = {(n, k): counter(n, k) for n, kinds in zip(names, (("trained", "aligned"), ("total", "mapped")),
                                                      strict=True) for k in kinds}
    groups = [group_of(student, gid="a"), group_of(student, tool_in_answer=True, gid="b", rng_seed=1)]
    outcomes = asyncio.run(stage.handle(groups))
    scored = [o.msg for o in outcomes if isinstance(o, Emit)]
    assert len(scored) == 2 and all(isinstance(g, ScoredGroup) and g.status.value == "ok" for g in scored)
    headers = [header_of(g) for g in scored]  # type: ignore[arg-type]
    trained = sum(h.cross_tokens for h in headers)
    aligned = sum(h.cross_aligned for h in headers)
    assert 0 < aligned < trained  # the student-only special of group b has no teacher signal

    def delta(name: str, kind: str) -> float:
        return counter(name, kind) - before[(name, kind)]

    assert delta("distillq_teacher_cross_tokens", "trained") == trained
    assert delta("distillq_teacher_cross_tokens", "aligned") == aligned
    total, mapped = delta("distillq_teacher_cross_topk_mass", "total"), delta("distillq_teacher_cross_topk_mass",
                                                                                "mapped")
    assert 0 < mapped < total
    report = stage.report()
    assert report["cross_aligned_share"] == round(aligned / trained, 4)
    assert report["cross_topk_mapped_share"] == pytest.approx(mapped / total, abs=1e-4)

    # the heartbeat as distillq stats reads it: one column for the two shares, and both in --json
    w = worker_of(Beat("teacher", "t-cross", json.loads(json.dumps(report)), 0.5))
    same = worker_of(Beat("teacher", "t-same", {"pool": "default", "status": {"ok": 3}}, 0.5))
    assert w.cross_tokenizer and not same.cross_tokenizer
    assert w.cross_aligned_share == report["cross_aligned_share"]
    text = table_text([w, same])
    assert "cross-tokenizer" in text
    row = next(line for line in text.splitlines() if "t-cross" in line)
    assert f"aligned {aligned / trained:.1%}" in row and f"top-k mass mapped {mapped / total:.1%}" in row
    other = next(line for line in text.splitlines() if "t-same" in line)
    assert "aligned" not in other
    out = to_json(Snapshot(namespace="ns", time=0.0, streams={}, dead_letters=0, workers=[w, same]))
    by_name = {x["consumer"]: x for x in out["workers"]}  # type: ignore[attr-defined]
    assert by_name["t-cross"]["cross_topk_mapped_share"] == report["cross_topk_mapped_share"]
    assert by_name["t-same"]["cross_tokenizer"] is False and by_name["t-same"]["cross_aligned_share"] is None


def test_without_a_cross_teacher_there_is_no_column_and_a_fresh_one_shows_dashes() -> None:
    same = worker_of(Beat("teacher", "t1", {"pool": "default"}, 0.1))
    assert "cross-tokenizer" not in table_text([same])
    fresh = worker_of(Beat("teacher", "t2", {"cross_aligned_share": None, "cross_topk_mapped_share": None}, 0.1))
    assert fresh.cross_tokenizer
    row = next(line for line in table_text([fresh]).splitlines() if "t2" in line)
    assert "aligned -, top-k mass mapped -" in row
    odd = worker_of(Beat("teacher", "t3", {"cross_aligned_share": 1.7, "cross_topk_mapped_share": "x"}, 0.1))
    assert odd.cross_tokenizer and odd.cross_aligned_share is None and odd.cross_topk_mapped_share is None
    rollout = worker_of(Beat("rollout", "r1", {"cross_aligned_share": 0.5}, 0.1))
    assert not rollout.cross_tokenizer  # only a teacher's record counts
