"""Scoring stage rules with a recording fake teacher: k overrides, skip/discard, drops, retries, packing."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import structlog

import schemas.validate
from pipeline.stages.scoring import Scorer, ScoringConfig, ScoringStats, pack
from pipeline.teacher.base import ScoreFailure, ScoreOutcome, ScoreRequest, ScoreResult
from schemas import DistillStatus, Limits, RolloutGroup, ScoredGroup, decode, encode
from schemas.build import make_sequence, make_teacher
from schemas.validate import validate_teacher_part

VOCAB = 1000
Behaviour = Callable[[ScoreRequest], ScoreOutcome | None]


def good(req: ScoreRequest) -> ScoreResult:
    """A valid result: the prompt token first in every row, logprobs strictly decreasing."""
    nxt = req.tokens.astype(np.int64)[req.row_index() + 1]  # the tokens the requested rows predict
    rows, k = req.n_rows, req.k
    ids = ((nxt[:, None] + np.arange(k)[None, :]) % VOCAB).astype(np.int32)
    lps = np.tile(-0.1 - 0.5 * np.arange(k, dtype=np.float32), (rows, 1)) - (nxt[:, None] % 7).astype(np.float32)
    return ScoreResult(ids, lps.astype(np.float32), lps[:, 0].astype(np.float32).copy())


def with_value(a: npt.NDArray[Any], row: int, col: int, value: float) -> npt.NDArray[Any]:
    """A copy of ``a`` with one entry replaced."""
    out = a.copy()
    out[row, col] = value
    return out


class FakeTeacher:
    """Records every call; ``rules`` map a sequence's first token to a behaviour (None = good)."""

    identity = "fake-teacher"

    def __init__(self, max_k: int = 64, rules: dict[int, Behaviour] | None = None) -> None:
        self.max_k = max_k
        self.rules = rules or {}
        self.calls: list[list[ScoreRequest]] = []
        self.raise_next = 0

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def score(self, reqs: list[ScoreRequest]) -> list[ScoreOutcome]:
        self.calls.append(list(reqs))
        if self.raise_next:
            self.raise_next -= 1
            raise RuntimeError("backend exploded")
        out: list[ScoreOutcome] = []
        for r in reqs:
            rule = self.rules.get(int(r.tokens[0]))
            res = rule(r) if rule else None
            out.append(res if res is not None else good(r))
        return out

    def sent_first_tokens(self) -> list[int]:
        return [int(r.tokens[0]) for call in self.calls for r in call]


def group(first: int, lengths: list[int], gid: str | None = None, **kw: object) -> RolloutGroup:
    """A group whose sequence i starts with token ``first + i`` (so rules can target it)."""
    seqs = []
    for i, n in enumerate(lengths):
        tok = (np.arange(n) * 13 + 5) % VOCAB
        tok[0] = first + i
        mask = np.zeros(n, np.uint8)
        mask[min(2, n - 1) :] = 1
        seqs.append(make_sequence(tok, mask))
    return RolloutGroup(group_id=gid or f"g{first}", sequences=seqs, **kw)  # type: ignore[arg-type]


async def run(groups: list[RolloutGroup], teacher: FakeTeacher, **cfg: object) -> tuple[list[ScoredGroup], Scorer]:
    sleeps: list[float] = []

    async def fake_sleep(s: float) -> None:
        sleeps.append(s)

    scorer = Scorer(teacher, ScoringConfig(**cfg), sleep=fake_sleep)  # type: ignore[arg-type]
    scorer.sleeps = sleeps  # type: ignore[attr-defined]
    return await scorer.score_groups(groups), scorer


def roundtrip(s: ScoredGroup) -> ScoredGroup:
    return decode(encode(s), Limits(vocab_size=VOCAB), expect=ScoredGroup)


async def test_k_rules_and_payload_shapes() -> None:
    groups = [
        group(100, [10, 7]),
        group(200, [12], group_overrides={"teacher_top_k": 5}),
        group(300, [9], group_overrides={"teacher_top_k": 0}),
        group(400, [9], group_overrides={"teacher_top_k": -3}),
        group(500, [6], group_overrides=None),
        group(600, [6], group_overrides={"teacher_top_k": -1}),
    ]
    teacher = FakeTeacher()
    out, _ = await run(groups, teacher, default_k=8)
    assert [s.group_id for s in out] == [g.group_id for g in groups]
    assert [s.k for s in out[:3] + out[4:5]] == [8, 5, 1, 8]
    for s, k in ((out[3], -3), (out[5], -1)):  # teacher_top_k <= -1: no teacher at all, never sent
        assert s.status is DistillStatus.SKIPPED and s.reason == f"teacher_top_k={k}: no teacher" and s.teacher is None
    assert not {400, 600} & set(teacher.sent_first_tokens())
    for s, g in zip(out[:3] + out[4:5], groups[:3] + groups[4:5], strict=True):
        assert s.status is DistillStatus.OK and s.teacher_id == "fake-teacher" and s.scored_at > 0
        assert s.teacher is not None and len(s.teacher) == len(g.sequences)
        for t, seq in zip(s.teacher, g.sequences, strict=True):
            trained = np.flatnonzero(seq.loss_mask.numpy()[1:]).astype(np.int32)  # rows r: loss_mask[r + 1] == 1
            assert t.topk_ids.shape == (trained.shape[0], s.k) and trained.shape[0] == seq.length - 2
            np.testing.assert_array_equal(t.row_index(seq.length), trained)
            expect = good(ScoreRequest(seq.tokens.numpy().astype(np.int32), s.k, trained))
            np.testing.assert_array_equal(t.topk_ids.numpy(), expect.topk_ids)
            np.testing.assert_array_equal(t.sampled_logprobs.numpy(), expect.sampled_logprobs)
        roundtrip(s)  # valid under the wire contract (position convention included)


async def test_only_trained_rows_are_requested_and_shipped_unless_all_rows_are_asked_for() -> None:
    prompt_only = make_sequence(np.array([700, 5, 6, 7], np.int32), np.zeros(4, np.uint8))
    multi_turn = np.zeros(12, np.uint8)
    multi_turn[[3, 4, 8, 9, 10]] = 1  # two assistant turns around a tool output
    turns = make_sequence((np.arange(12, dtype=np.int32) * 3 + 600) % VOCAB, multi_turn)
    g = RolloutGroup(group_id="mt", sequences=[turns, prompt_only])
    teacher = FakeTeacher()
    out, scorer = await run([g], teacher, default_k=3)
    assert [[r.rows.tolist() if r.rows is not None else None for r in c] for c in teacher.calls] == [[[2, 3, 7, 8, 9]]]
    s = roundtrip(out[0])
    assert s.status is DistillStatus.OK and s.teacher is not None
    assert s.teacher[0].row_index(12).tolist() == [2, 3, 7, 8, 9] and s.teacher[0].topk_ids.shape == (5, 3)
    assert s.teacher[1].topk_ids.shape == (0, 3)  # no trained row: no teacher call, an empty payload
    assert scorer.stats.rows_scored == 5 and scorer.stats.tokens_scored == 16
    teacher = FakeTeacher()
    out, scorer = await run([g], teacher, default_k=3, rows="all")
    s = roundtrip(out[0])
    assert s.teacher is not None and s.teacher[0].rows is None and s.teacher[0].topk_ids.shape == (11, 3)
    assert [len(c) for c in teacher.calls] == [2] and scorer.stats.rows_scored == 14


async def test_skip_and_discard_never_reach_teacher() -> None:
    teacher = FakeTeacher()
    groups = [
        group(100, [8]),
        group(200, [8], group_overrides={"skip_teacher_top_k": True}),
        RolloutGroup(group_id="d", sequences=group(300, [8, 8]).sequences, discard=True),
        group(400, [8], group_overrides={"skip_teacher_top_k": False}),
    ]
    out, scorer = await run(groups, teacher)
    assert [(s.status, s.reason) for s in out] == [
        (DistillStatus.OK, None),
        (DistillStatus.SKIPPED, "skip_teacher_top_k"),
        (DistillStatus.SKIPPED, "discarded"),
        (DistillStatus.OK, None),
    ]
    assert out[1].teacher is None and out[2].teacher is None
    assert sorted(teacher.sent_first_tokens()) == [100, 400]
    assert scorer.stats.groups == {"ok": 2, "skipped": 2}
    assert scorer.stats.reasons == {"skip_teacher_top_k": 1, "discarded": 1}
    for s in out:
        roundtrip(s)


@pytest.mark.parametrize(
    ("rule", "prefix"),
    [
        (lambda r: ScoreFailure("http 400: bad", retryable=False), "teacher_error: http 400"),
        (lambda r: ScoreResult(good(r).topk_ids[:-1], good(r).topk_logprobs[:-1], good(r).sampled_logprobs[:-1]),
         "misaligned: top-k shapes"),
        (lambda r: ScoreResult(good(r).topk_ids[:, :1], good(r).topk_logprobs, good(r).sampled_logprobs),
         "misaligned: top-k shapes"),
        (lambda r: ScoreResult(good(r).topk_ids, with_value(good(r).topk_logprobs, 3, 2, np.nan),
                               good(r).sampled_logprobs),
         "invalid_logprobs: topk_logprobs row 4, entry 2 (token 5) is nan: not finite"),
        (lambda r: ScoreResult(good(r).topk_ids, good(r).topk_logprobs[:, ::-1].copy(), good(r).sampled_logprobs),
         "misaligned: top-k rows not sorted"),
        (lambda r: ScoreFailure("misaligned: 3 entries for 9 tokens", retryable=False), "misaligned: 3 entries"),
        (lambda r: ScoreResult(good(r).topk_ids, good(r).topk_logprobs, np.full(r.n_rows, np.nan, np.float32)),
         "invalid_logprobs: sampled_logprobs row 1 (token 2) is nan: not finite"),
        (lambda r: ScoreResult(good(r).topk_ids, with_value(good(r).topk_logprobs, 5, 3, -np.inf),
                               good(r).sampled_logprobs),
         "invalid_logprobs: topk_logprobs row 6, entry 3 (token 7) is -inf: not finite"),
        # Values the per-sequence check leaves to the group check of the encoded payload (read once):
        # the reason names the sequence by its field, scored.teacher[1].
        (lambda r: ScoreResult(with_value(good(r).topk_ids, 4, 1, -7), good(r).topk_logprobs, good(r).sampled_logprobs),
         "misaligned: scored.teacher[1].topk_ids: negative token id -7"),
    ],
)  # fmt: skip
async def test_bad_sequence_drops_whole_group(rule: Behaviour, prefix: str) -> None:
    teacher = FakeTeacher(rules={201: rule})
    groups = [group(100, [9, 9]), group(200, [9, 9, 9]), group(300, [9])]
    with structlog.testing.capture_logs() as logs:
        out, scorer = await run(groups, teacher, default_k=4)
    assert [s.status for s in out] == [DistillStatus.OK, DistillStatus.DROPPED, DistillStatus.OK]
    dropped = out[1]
    assert dropped.teacher is None and dropped.reason is not None
    assert dropped.reason.startswith(prefix)
    assert "(sequence 1)" in dropped.reason or "scored.teacher[1]." in prefix  # the bad sequence is named
    assert len(teacher.calls) == 1  # non-retryable: no second attempt
    drops = [e for e in logs if e["event"] == "teacher_payload_dropped"]
    assert [(e["group_id"], e["reason"]) for e in drops] == [("g200", dropped.reason)]
    assert scorer.stats.groups == {"ok": 2, "dropped": 1}
    assert scorer.stats.reasons == {prefix.split(":", maxsplit=1)[0]: 1}
    roundtrip(dropped)


async def test_unsorted_row_outside_the_spot_check_drops_the_group() -> None:
    """Every row's order is checked per sequence; the group-level convention check only samples rows."""
    n, k = 200, 4
    spot = {int(r) for r in np.arange(32) * (n - 2) // 31}  # the rows Limits().check_rows=32 samples
    row = 1
    assert row not in spot

    def swapped(r: ScoreRequest) -> ScoreResult:
        res = good(r)
        return ScoreResult(res.topk_ids, with_value(res.topk_logprobs, row, k - 1, 0.0), res.sampled_logprobs)

    out, scorer = await run([group(200, [9, n, 9]), group(300, [n])], FakeTeacher(rules={201: swapped}), default_k=k)
    assert [s.status for s in out] == [DistillStatus.DROPPED, DistillStatus.OK]
    assert out[0].reason == "misaligned: top-k rows not sorted descending (sequence 1)"
    assert scorer.stats.reasons == {"misaligned": 1}
    # The spot check alone would have let this payload through: the per-sequence check is what catches it.
    seqs = out[0].group.sequences
    results = [
        (swapped if i == 1 else good)(ScoreRequest(q.tokens.numpy().astype(np.int32), k)) for i, q in enumerate(seqs)
    ]
    teacher = [make_teacher(x.topk_ids, x.topk_logprobs, x.sampled_logprobs) for x in results]
    validate_teacher_part(ScoredGroup(group=out[0].group, status=DistillStatus.OK, teacher=teacher, k=k), Limits())


async def test_ids_outside_the_configured_vocabulary_drop_the_group() -> None:
    def over(r: ScoreRequest) -> ScoreResult:
        res = good(r)
        return ScoreResult(with_value(res.topk_ids, r.n_rows - 1, 2, VOCAB), res.topk_logprobs, res.sampled_logprobs)

    groups = [group(100, [9, 9]), group(200, [9])]
    scorer = Scorer(FakeTeacher(rules={101: over}), ScoringConfig(default_k=4), limits=Limits(vocab_size=VOCAB))
    out = await scorer.score_groups(groups)
    assert [s.status for s in out] == [DistillStatus.DROPPED, DistillStatus.OK]
    assert out[0].reason == f"misaligned: scored.teacher[1].topk_ids: token id {VOCAB} outside vocabulary of {VOCAB}"
    out = await Scorer(FakeTeacher(rules={101: over}), ScoringConfig(default_k=4)).score_groups(groups)
    assert out[0].status is DistillStatus.OK  # no vocabulary configured: only ids >= 0 are required


async def test_float16_rounding_onto_the_floor_is_caught_on_the_encoded_payload() -> None:
    """Sorted float32 logprobs just above the floor that float16 rounds onto it: only the bytes on the wire show
    it (a float16 overflow needs a value beyond the floor or above 0, which the per-sequence check refuses)."""

    def low(r: ScoreRequest) -> ScoreResult:
        res = good(r)
        lps = res.topk_logprobs.copy()
        lps[2] = np.array([-999.6, -999.7, -999.8, -999.9], np.float32)  # float16: -999.5, -999.5, -1000, -1000
        sampled = res.sampled_logprobs.copy()
        sampled[2] = lps[2, 0]  # the sampled token is each row's first entry
        return ScoreResult(res.topk_ids, lps, sampled)

    out, scorer = await run([group(100, [9, 9])], FakeTeacher(rules={100: low}), default_k=4, fp16_topk=True)
    assert out[0].status is DistillStatus.DROPPED
    assert out[0].reason == ("invalid_logprobs: scored.teacher[0].topk_logprobs: logprob -1000 at flat index 10 at "
                             "or below the floor -1000 (a sentinel such as vLLM's -9999, not a logprob)")
    assert scorer.stats.reasons == {"invalid_logprobs": 1}
    out, _ = await run([group(100, [9, 9])], FakeTeacher(rules={100: low}), default_k=4)
    assert out[0].status is DistillStatus.OK  # float32 on the wire keeps them above the floor


async def test_each_check_runs_once_and_the_rollout_is_not_revalidated(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = validate_teacher_part

    def counting(s: ScoredGroup, limits: Limits, name: str = "scored") -> None:
        calls.append(len(s.group.sequences))
        real(s, limits, name)

    def no_rollout(*args: object, **kw: object) -> None:
        raise AssertionError("the teacher stage re-validated the rollout half")

    monkeypatch.setattr("pipeline.stages.scoring.validate_teacher_part", counting)
    monkeypatch.setattr(schemas.validate, "validate_rollout", no_rollout)
    skipped = group(300, [9], group_overrides={"skip_teacher_top_k": True})
    out, _ = await run([group(100, [9, 9]), group(200, [9, 9, 9]), skipped], FakeTeacher())
    assert [s.status for s in out] == [DistillStatus.OK, DistillStatus.OK, DistillStatus.SKIPPED]
    assert calls == [2, 3]  # once per scored group, none for the skipped one


async def test_retries_then_success_with_capped_backoff() -> None:
    left = {"n": 3}

    def flaky(r: ScoreRequest) -> ScoreOutcome | None:
        if left["n"]:
            left["n"] -= 1
            return ScoreFailure("timeout", retryable=True)
        return None

    teacher = FakeTeacher(rules={100: flaky})
    out, scorer = await run(
        [group(100, [9, 9]), group(200, [9])], teacher, retries=4, backoff_base_s=0.5, backoff_max_s=1.5
    )
    assert [s.status for s in out] == [DistillStatus.OK, DistillStatus.OK]
    sleeps = scorer.sleeps  # type: ignore[attr-defined]
    assert len(sleeps) == 3 and all(0 <= s <= c for s, c in zip(sleeps, (0.5, 1.0, 1.5), strict=True))  # jittered
    # Only the failing sequence is re-sent.
    assert [[int(r.tokens[0]) for r in call] for call in teacher.calls[1:]] == [[100], [100], [100]]
    assert scorer.stats.retries == 3


async def test_retries_exhausted_and_backend_exception() -> None:
    teacher = FakeTeacher(rules={100: lambda r: ScoreFailure("http 503: busy", retryable=True)})
    out, scorer = await run([group(100, [9]), group(200, [9])], teacher, retries=2)
    assert out[0].status is DistillStatus.DROPPED
    assert out[0].reason == "teacher_error: http 503: busy (sequence 0)"
    assert out[1].status is DistillStatus.OK
    sleeps = scorer.sleeps  # type: ignore[attr-defined]
    assert len(teacher.calls) == 3 and len(sleeps) == 2 and 0 <= sleeps[0] <= 0.5 and 0 <= sleeps[1] <= 1.0

    boom = FakeTeacher()
    boom.raise_next = 1
    out, _ = await run([group(100, [9])], boom, retries=1)
    assert out[0].status is DistillStatus.OK and len(boom.calls) == 2
    boom.raise_next = 5
    out, _ = await run([group(100, [9])], boom, retries=1)
    assert out[0].status is DistillStatus.DROPPED
    assert out[0].reason is not None and "backend exploded" in out[0].reason


async def test_other_sequences_of_failed_group_not_retried() -> None:
    teacher = FakeTeacher(
        rules={
            100: lambda r: ScoreFailure("http 400", retryable=False),
            101: lambda r: ScoreFailure("timeout", retryable=True),
        }
    )
    out, _ = await run([group(100, [9, 9])], teacher, retries=3)
    assert out[0].status is DistillStatus.DROPPED and len(teacher.calls) == 1


async def test_packing_respects_token_budget() -> None:
    rng = np.random.default_rng(1)
    groups = [group(100 * (g + 1), [int(n) for n in rng.integers(2, 30, 5)]) for g in range(6)]
    groups.append(group(900, [400]))  # longer than the budget: goes alone
    teacher = FakeTeacher()
    out, scorer = await run(groups, teacher, max_batch_tokens=300)
    assert all(s.status is DistillStatus.OK for s in out)
    for call in teacher.calls:
        lens = [int(r.tokens.shape[0]) for r in call]
        assert len(call) == 1 or len(call) * max(lens) <= 300
    sent = sorted(teacher.sent_first_tokens())
    assert sent == sorted(int(s.tokens.numpy()[0]) for g in groups for s in g.sequences)
    assert len(teacher.calls) < sum(len(g.sequences) for g in groups)  # several groups share calls
    assert any(len({int(r.tokens[0]) // 100 for r in call}) > 1 for call in teacher.calls)
    assert scorer.stats.tokens_scored == sum(g.num_tokens for g in groups)
    assert scorer.stats.teacher_calls == len(teacher.calls) == len(scorer.stats.latencies_s)


def test_pack_function_covers_all() -> None:
    from pipeline.stages.scoring import _Item

    items = [_Item(0, i, ScoreRequest(np.zeros(n, np.int32), 1)) for i, n in enumerate([5, 50, 20, 20, 7, 100])]
    calls = pack(items, 60)
    assert sorted(it.seq for c in calls for it in c) == list(range(6))
    for c in calls:
        assert len(c) == 1 or len(c) * max(int(it.req.tokens.shape[0]) for it in c) <= 60


def test_pack_keeps_a_group_in_one_call_when_it_fits() -> None:
    from pipeline.stages.scoring import _Item

    def items(g: int, lengths: list[int]) -> list[_Item]:
        return [_Item(g, i, ScoreRequest(np.zeros(n, np.int32), 1)) for i, n in enumerate(lengths)]

    # Interleaved lengths: sorting sequences across groups would split every group over two calls.
    a, b, c = items(0, [40, 10, 40, 10]), items(1, [30, 35, 30, 35]), items(2, [200, 10])  # c: over the budget
    calls = pack(a + b + c, 160)
    where = {(it.group, it.seq): i for i, call in enumerate(calls) for it in call}
    assert len({where[(0, s)] for s in range(4)}) == 1 and len({where[(1, s)] for s in range(4)}) == 1
    assert where[(0, 0)] != where[(1, 0)]  # 8 x 40 > 160: the two groups go to separate calls
    assert [len(call) for call in calls if call[0].group == 2] == [1, 1]  # cut on its own, longest first
    for call in calls:
        assert len(call) == 1 or len(call) * max(int(it.req.tokens.shape[0]) for it in call) <= 160
    small = pack(items(3, [5, 6]) + items(4, [7, 8]), 160)
    assert len(small) == 1  # small groups still share a call


@pytest.mark.parametrize("rule", ["clamp", "drop"])
async def test_k_over_cap(rule: str) -> None:
    teacher = FakeTeacher(max_k=6)
    groups = [group(100, [9], group_overrides={"teacher_top_k": 10}), group(200, [9])]
    out, scorer = await run(groups, teacher, default_k=4, k_over_cap=rule)
    assert out[1].status is DistillStatus.OK and out[1].k == 4
    if rule == "clamp":
        assert out[0].status is DistillStatus.OK and out[0].k == 6
        assert out[0].teacher is not None and out[0].teacher[0].topk_ids.shape == (7, 6)  # 9 tokens, 7 trained
        assert scorer.stats.clamped_groups == 1
    else:
        assert out[0].status is DistillStatus.DROPPED and out[0].reason is not None
        assert out[0].reason.startswith("k_over_cap")
        assert teacher.sent_first_tokens() == [200]


async def test_bad_override_type_drops() -> None:
    out, _ = await run([group(100, [9], group_overrides={"teacher_top_k": "5"})], FakeTeacher())
    assert out[0].status is DistillStatus.DROPPED and out[0].reason is not None
    assert out[0].reason.startswith("bad_override")


async def test_fp16_option_and_hooks() -> None:
    seen: list[float] = []
    stats = ScoringStats()
    stats.latency_hooks.append(seen.append)
    scorer = Scorer(FakeTeacher(), ScoringConfig(default_k=3, fp16_topk=True), stats=stats)
    (s,) = await scorer.score_groups([group(100, [9, 5])])
    assert s.teacher is not None and s.teacher[0].topk_logprobs.dtype == "<f2"
    assert s.teacher[0].sampled_logprobs.dtype == "<f4"
    assert len(seen) == 1 and seen[0] >= 0
    roundtrip(s)


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="default_k"):
        ScoringConfig(default_k=0)
    with pytest.raises(ValueError, match="k_over_cap"):
        ScoringConfig(k_over_cap="ignore")  # type: ignore[arg-type]
    cfg = ScoringConfig(backoff_base_s=1.0, backoff_max_s=5.0)
    for attempt, ceiling in zip((1, 2, 3, 4, 5, 10**6), (1.0, 2.0, 4.0, 5.0, 5.0, 5.0), strict=True):
        delays = [cfg.backoff(attempt) for _ in range(50)]
        assert all(0.0 <= d <= ceiling for d in delays)
        assert len(set(delays)) > 1  # full jitter: teacher workers that failed together do not retry in lockstep


class SlowTeacher(FakeTeacher):
    """Takes ``delay`` per call and records how many calls overlapped at most."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay, self.active, self.peak = delay, 0, 0

    async def score(self, reqs: list[ScoreRequest]) -> list[ScoreOutcome]:
        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            await asyncio.sleep(self.delay)
            return await super().score(reqs)
        finally:
            self.active -= 1


@pytest.mark.parametrize("limit", [1, 2])
async def test_concurrent_calls_limits_the_whole_scorer_not_one_batch(limit: int) -> None:
    """A worker with two read batches in flight (the default) must still send at most ``concurrent_calls``
    calls at once: a GPU teacher scores one batch while the previous batch's outputs are written."""
    teacher = SlowTeacher(0.05)
    scorer = Scorer(teacher, ScoringConfig(default_k=4, concurrent_calls=limit))
    batches = [[group(10 * b + i, [8, 8]) for i in range(2)] for b in range(4)]
    results = await asyncio.gather(*(scorer.score_groups(b) for b in batches))
    assert teacher.peak == limit
    assert all(s.status is DistillStatus.OK for r in results for s in r)
    assert len(teacher.calls) == 4  # one call per batch (both groups packed together)
