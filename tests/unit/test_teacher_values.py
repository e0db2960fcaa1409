"""Teacher values checked before they ship, and the teacher report's ``clamped_k`` / ``slow`` / ``unhealthy``.

A value no logprob can have (NaN, +-inf, above 0, at or below the floor: vLLM's -9999.0 for -inf) in any
sequence's sampled or top-k logprobs drops the whole group's payload as ``invalid_logprobs`` through the real
``Scorer`` and ``TeacherStage``; a start-up self-test answer holding one refuses to start."""

from __future__ import annotations

from typing import Any

import httpx
import numpy as np
import pytest
import structlog

from pipeline.stages.runloop import Emit
from pipeline.stages.scoring import SLOW_WINDOW, Scorer, ScoringConfig
from pipeline.stages.teacher_stage import TeacherStage
from pipeline.teacher.base import ScoreFailure, ScoreRequest, ScoreResult, TeacherConfigError
from pipeline.teacher.vllm_http import classify_exception
from pipeline.teacher.vocab import self_test_checksum
from schemas import DistillStatus, Limits, ScoredGroup, decode, encode
from schemas.validate import LOGPROB_FLOOR, InvalidLogprobs, teacher_logprob_problem
from tests.unit.test_scoring import Behaviour, FakeTeacher, good, group, with_value

BAD = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf, "above_0": 0.5, "vllm_sentinel": -9999.0,
       "at_floor": LOGPROB_FLOOR}
WHY = {"nan": "not finite", "inf": "not finite", "-inf": "not finite", "above_0": "above 0",
       "vllm_sentinel": "at or below the floor -1000", "at_floor": "at or below the floor -1000"}


def sampled_is(value: float) -> Behaviour:
    def rule(r: ScoreRequest) -> ScoreResult:
        res = good(r)
        sampled = res.sampled_logprobs.copy()
        sampled[2] = value  # row 3 of the request: loss_mask starts at 2, so row r is payload row r - 1
        return ScoreResult(res.topk_ids, res.topk_logprobs, sampled)

    return rule


def topk_last_is(value: float) -> Behaviour:
    """The last entry of payload row 4 (a sorted row stays sorted with a value below the rest)."""

    def rule(r: ScoreRequest) -> ScoreResult:
        res = good(r)
        k = res.topk_logprobs.shape[1]
        lps = with_value(res.topk_logprobs, 4, k - 1, value)
        if value > 0:  # a value above 0 at the front keeps the row sorted
            lps = with_value(res.topk_logprobs, 4, 0, value)
        return ScoreResult(res.topk_ids, lps, res.sampled_logprobs)

    return rule


async def score_through_stage(rule: Behaviour) -> tuple[list[ScoredGroup], Scorer, TeacherStage, FakeTeacher]:
    teacher = FakeTeacher(rules={201: rule})
    scorer = Scorer(teacher, ScoringConfig(default_k=4, retries=3))
    stage = TeacherStage(scorer)
    groups = [group(100, [9, 9]), group(200, [9, 9, 9]), group(300, [9])]
    with structlog.testing.capture_logs() as logs:
        outcomes = await stage.handle(groups)
    scored = [o.msg for o in outcomes if isinstance(o, Emit)]
    assert len(scored) == 3 and all(isinstance(s, ScoredGroup) for s in scored)
    assert not [e for e in logs if e["event"] == "teacher_backend_failing"]  # the answer is wrong, not the backend
    return scored, scorer, stage, teacher  # type: ignore[return-value]


@pytest.mark.parametrize("kind", list(BAD))
async def test_bad_sampled_logprob_drops_the_whole_group(kind: str) -> None:
    out, _, stage, teacher = await score_through_stage(sampled_is(BAD[kind]))
    assert [s.status for s in out] == [DistillStatus.OK, DistillStatus.DROPPED, DistillStatus.OK]
    dropped = out[1]
    assert dropped.teacher is None and dropped.reason is not None
    value = f"{BAD[kind]:g}"
    assert dropped.reason.startswith(f"invalid_logprobs: sampled_logprobs row 3 (token 4) is {value}: {WHY[kind]}")
    assert dropped.reason.endswith("(sequence 1)")
    assert len(teacher.calls) == 1  # never retried: the same answer would come back
    report = stage.report()
    assert report["drops"] == {"invalid_logprobs": 1} and report["status"] == {"ok": 2, "dropped": 1}
    assert report["unhealthy"] is None and report["slow"] is None
    for s in out:  # what flows on is valid on the wire; the dropped group carries no payload
        decode(encode(s), Limits(), expect=ScoredGroup)


@pytest.mark.parametrize("kind", list(BAD))
async def test_bad_topk_logprob_drops_the_whole_group(kind: str) -> None:
    out, _, stage, _ = await score_through_stage(topk_last_is(BAD[kind]))
    assert [s.status for s in out] == [DistillStatus.OK, DistillStatus.DROPPED, DistillStatus.OK]
    entry = 0 if BAD[kind] > 0 else 3  # a value above 0 goes first, where it keeps the row sorted
    want = f"invalid_logprobs: topk_logprobs row 5, entry {entry} (token 6) is {BAD[kind]:g}: {WHY[kind]}"
    assert (out[1].reason or "").startswith(want) and (out[1].reason or "").endswith("(sequence 1)")
    assert stage.report()["drops"] == {"invalid_logprobs": 1}


async def test_values_just_inside_the_bounds_pass() -> None:
    def edge(r: ScoreRequest) -> ScoreResult:
        res = good(r)
        k = res.topk_logprobs.shape[1]
        lps = with_value(res.topk_logprobs, 4, k - 1, -999.0)  # a very unlikely token: not a sentinel
        lps[3, 0] = 0.0005  # float rounding above 0, within the tolerance
        sampled = res.sampled_logprobs.copy()
        sampled[3] = lps[3, 0]
        return ScoreResult(res.topk_ids, lps, sampled)

    out, _, stage, _ = await score_through_stage(edge)
    assert [s.status for s in out] == [DistillStatus.OK] * 3
    assert stage.report()["drops"] == {}


def test_readers_refuse_what_the_teacher_would_have_dropped() -> None:
    """The feeder and the learner decode with the same rule: a payload built around the teacher stage (an
    Atropos environment's arrays, a bug) with a sentinel never reaches a batch."""
    res = good(ScoreRequest(np.arange(9, dtype=np.int32), 4, np.arange(1, 8, dtype=np.int32)))
    from schemas.build import make_teacher

    g = group(100, [9])
    lps = with_value(res.topk_logprobs, 2, 3, -9999.0)
    s = ScoredGroup(group=g, status=DistillStatus.OK, k=4,
                    teacher=[make_teacher(res.topk_ids, lps, res.sampled_logprobs, rows=np.arange(1, 8))])
    with pytest.raises(InvalidLogprobs, match=r"scored.teacher\[0\].topk_logprobs: logprob -9999 at flat index 11"):
        decode(encode(s), Limits(), expect=ScoredGroup)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_value_check_matches_its_definition(dtype: Any) -> None:
    """The two-reduction fast path (bit views for float16) finds exactly what the plain comparison finds."""
    rng = np.random.default_rng(5)
    lim = Limits()
    specials = [np.nan, np.inf, -np.inf, 0.0, -0.0, 5e-4, 2e-3, 0.5, -999.0, -1000.0, -1000.5, -9999.0, -65504.0]
    for trial in range(400):
        x = (-rng.exponential(5.0, int(rng.integers(1, 30)))).astype(dtype)
        for _ in range(int(rng.integers(0, 3))):
            x[rng.integers(0, x.size)] = rng.choice(specials)
        flat = x.astype(np.float64)
        bad = np.flatnonzero(~((flat > lim.logprob_floor) & (flat <= lim.logprob_tolerance)))
        got = teacher_logprob_problem(x, lim)
        assert (got[0] if got else None) == (int(bad[0]) if bad.size else None), (trial, x)


# --- the start-up self-test ------------------------------------------------------------------------------


class OneAnswer(FakeTeacher):
    def __init__(self, answer: Any) -> None:
        super().__init__(max_k=8)
        self.answer = answer

    async def score(self, reqs: list[ScoreRequest]) -> list[Any]:
        return [self.answer(r) for r in reqs]


@pytest.mark.parametrize("value", [np.nan, -9999.0, 0.5])
async def test_self_test_refuses_a_bad_answer_as_a_configuration_error(value: float) -> None:
    with pytest.raises(TeacherConfigError, match="teacher self-test answer refused: invalid_logprobs: sampled"):
        await self_test_checksum(OneAnswer(sampled_is(value)))
    assert len(await self_test_checksum(OneAnswer(good))) == 12


async def test_self_test_failure_kinds() -> None:
    with pytest.raises(TeacherConfigError, match="http 400"):
        await self_test_checksum(OneAnswer(lambda r: ScoreFailure("http 400: no", retryable=False)))
    with pytest.raises(RuntimeError, match="http 503") as info:  # a retry (a restart) may cure it
        await self_test_checksum(OneAnswer(lambda r: ScoreFailure("http 503: busy", retryable=True)))
    assert not isinstance(info.value, TeacherConfigError)


# --- the report's clamped_k, slow and unhealthy ------------------------------------------------------------


async def test_clamped_k_is_reported_and_logged_per_group() -> None:
    scorer = Scorer(FakeTeacher(max_k=4), ScoringConfig(default_k=3, k_over_cap="clamp"))
    stage = TeacherStage(scorer)
    groups = [group(100, [9], group_overrides={"teacher_top_k": 8}), group(200, [9]),
              group(300, [9], group_overrides={"teacher_top_k": 6})]
    with structlog.testing.capture_logs() as logs:
        out = await scorer.score_groups(groups)
    assert [s.k for s in out] == [4, 3, 4] and all(s.status is DistillStatus.OK for s in out)
    clamped = [(e["group_id"], e["asked_k"], e["used_k"]) for e in logs if e["event"] == "teacher_k_clamped"]
    assert clamped == [("g100", 8, 4), ("g300", 6, 4)]
    assert stage.report()["clamped_k"] == 2


def timeout_after(seconds: float) -> Behaviour:
    return lambda r: ScoreFailure(f"timeout after {seconds:g} s (ReadTimeout)", retryable=True, timeout_s=seconds)


def refused(r: ScoreRequest) -> ScoreFailure:
    return ScoreFailure("connection error (ConnectError: [Errno 111] Connection refused)", retryable=True)


async def test_a_slow_teacher_is_slow_and_one_that_answers_nothing_in_time_unhealthy() -> None:
    scorer = Scorer(FakeTeacher(rules={100: timeout_after(10)}), ScoringConfig(default_k=4, retries=0))
    stage = TeacherStage(scorer)
    with structlog.testing.capture_logs() as logs:
        for i in range(3):  # three calls, every request of them times out
            (s,) = await scorer.score_groups([group(100, [9], gid=f"t{i}")])
            assert s.status is DistillStatus.DROPPED
            assert s.reason == "teacher_error: timeout after 10 s (ReadTimeout) (sequence 0)"
        # three in a row and no answer: not merely slow, it answers nothing (--check answers 1)
        assert stage.report()["unhealthy"] == ("teacher backend answers nothing in time: the last 3 calls all timed "
                                               "out after 10 s")
        await scorer.score_groups([group(200, [9])])  # one call answered
    report = stage.report()
    assert report["unhealthy"] is None
    assert report["slow"] == "teacher slow: 3 of the last 4 calls timed out after 10 s"
    assert [e["event"] for e in logs if e["event"].startswith("teacher_backend")] == ["teacher_backend_slow"]
    for i in range(SLOW_WINDOW):  # answered calls push the timeouts out of the window
        await scorer.score_groups([group(200, [9], gid=f"ok{i}")])
    assert stage.report()["slow"] is None


async def test_an_unreachable_teacher_is_unhealthy_not_slow() -> None:
    teacher = FakeTeacher(rules={100: refused})
    scorer = Scorer(teacher, ScoringConfig(default_k=4, retries=0))
    stage = TeacherStage(scorer)
    for i in range(2):
        await scorer.score_groups([group(100, [9], gid=f"r{i}")])
    report = stage.report()
    assert report["slow"] is None
    assert report["unhealthy"] == ("teacher backend failing: last 2 call(s) failed, latest: connection error "
                                   "(ConnectError: [Errno 111] Connection refused)")
    teacher.rules[100] = timeout_after(5)  # it takes connections again, answering too late: slow, not failing
    await scorer.score_groups([group(100, [9], gid="t")])
    report = stage.report()
    assert report["unhealthy"] is None and report["slow"] == "teacher slow: 1 of the last 3 calls timed out after 5 s"


def test_http_timeouts_are_slow_and_connection_failures_are_not() -> None:
    req = httpx.Request("POST", "http://t/v1/completions")
    read = classify_exception(httpx.ReadTimeout("timed out", request=req), 10.0)
    assert read.timeout_s == 10.0 and read.retryable and read.reason == "timeout after 10 s (ReadTimeout)"
    pool = classify_exception(httpx.PoolTimeout("no connection free", request=req), 10.0)
    assert pool.timeout_s == 10.0  # every connection busy with slow answers
    for exc in (httpx.ConnectTimeout("timed out", request=req), httpx.ConnectError("refused", request=req)):
        f = classify_exception(exc, 10.0)
        assert f.timeout_s is None and f.retryable and f.reason.startswith("connection error")
