"""``distillq stats`` against a real redis-server shows a cross-tokenizer teacher's shares, from the heartbeat its
``TeacherStage`` writes (``Heartbeat``, as every worker does) after scoring groups with ``Scorer(cross=...)``."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
import structlog

from pipeline.cli.main import main
from pipeline.stages.lifecycle import Heartbeat
from pipeline.stages.scoring import Scorer, ScoringConfig
from pipeline.stages.teacher_stage import TeacherStage
from pipeline.teacher.crossscore import CrossTokenizer
from pipeline.transport.keys import Keys
from schemas import Limits
from tests.unit.test_crossscore import BigramTeacher, K, cross, group_of, tokenizers  # noqa: F401 (fixtures)

pytestmark = pytest.mark.redis


@pytest.fixture(autouse=True)
def _reset_logging(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("COLUMNS", "250")  # rich tables: no wrapping in captured output
    yield
    structlog.reset_defaults()


async def stats(capsys: pytest.CaptureFixture[str], url: str, keys: Keys, *argv: str) -> str:
    capsys.readouterr()
    code = await asyncio.to_thread(main, ["stats", *argv, "--redis-url", url, "--namespace", keys.namespace])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


@pytest.mark.timeout(120)
async def test_stats_shows_the_shares_a_cross_teacher_beats(
    r: aioredis.Redis, keys: Keys, redis_url: str, capsys: pytest.CaptureFixture[str],
    tokenizers: tuple[Any, Any, Path, Path], cross: CrossTokenizer,  # noqa: F811
) -> None:
    student, teacher_tok, _, _ = tokenizers
    stage = TeacherStage(Scorer(BigramTeacher(len(teacher_tok)), ScoringConfig(default_k=K), cross=cross,
                                limits=Limits(vocab_size=len(cross.student))))
    await stage.handle([group_of(student, tool_in_answer=True)])
    report = stage.report()
    assert 0 < report["cross_aligned_share"] < 1 and 0 < report["cross_topk_mapped_share"] < 1  # type: ignore[operator]
    await Heartbeat(r, keys, "teacher", "t-cross", 5.0).beat(handled=1, outcomes={}, **report)
    await Heartbeat(r, keys, "teacher", "t-same", 5.0).beat(handled=1, outcomes={}, pool="default")

    snap = json.loads(await stats(capsys, redis_url, keys, "--json"))
    workers = {w["consumer"]: w for w in snap["workers"]}
    assert workers["t-cross"]["cross_tokenizer"] is True
    assert workers["t-cross"]["cross_aligned_share"] == report["cross_aligned_share"]
    assert workers["t-cross"]["cross_topk_mapped_share"] == report["cross_topk_mapped_share"]
    assert workers["t-same"]["cross_tokenizer"] is False and workers["t-same"]["cross_aligned_share"] is None

    text = await stats(capsys, redis_url, keys)
    (row,) = [line for line in text.splitlines() if "t-cross" in line and "teacher" in line]
    assert f"aligned {report['cross_aligned_share']:.1%}" in row  # type: ignore[str-format]
    assert f"top-k mass mapped {report['cross_topk_mapped_share']:.1%}" in row  # type: ignore[str-format]
