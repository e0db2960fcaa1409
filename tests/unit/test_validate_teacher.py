"""The teacher half of a scored group checked on its own, and the fast value checks against references.

``validate_teacher_part`` is what the teacher stage runs on the groups it scores and what
``validate_scored`` runs after ``validate_rollout``: each rule here must still raise its ``field: reason``.
The single-pass id check, the float16 finiteness check, the spot-check rewrite and the flat sortedness
check are compared with straightforward reference implementations on many random and mutated inputs.
"""

from __future__ import annotations

from typing import Any, NoReturn

import msgspec
import numpy as np
import numpy.typing as npt
import pytest

from pipeline.teacher.base import ScoreRequest, ScoreResult, result_problem, rows_sorted
from schemas.arrays import FLOAT16, FLOAT16_MAX_RELATIVE_ERROR, FLOAT32, INT32, UINT8, Array
from schemas.build import make_sequence, make_teacher, synthetic_rollout, synthetic_scored, synthetic_teacher
from schemas.messages import DistillStatus, ScoredGroup, TeacherPayload
from schemas.validate import (
    DecodeError,
    Limits,
    _check_convention,
    _Convention,
    _finite,
    _ids,
    validate_rollout,
    validate_scored,
    validate_teacher_part,
)

replace = msgspec.structs.replace
VOCAB = 500
T1 = "scored.teacher[1]"


def scored(
    k: int = 5, lengths: tuple[int, ...] = (7, 12, 1, 60), fp16: bool = False, all_rows: bool = True
) -> ScoredGroup:
    """Dense payloads (every row, the schema 1 layout) unless ``all_rows`` is False."""
    g = synthetic_rollout(len(lengths), list(lengths), vocab=VOCAB, prompt_len=3, seed=4)
    s = synthetic_scored(g, k, vocab=VOCAB, seed=9, all_rows=all_rows)
    if fp16:
        teacher = [synthetic_teacher(q, k, vocab=VOCAB, seed=20 + i, fp16=True, all_rows=all_rows)
                   for i, q in enumerate(g.sequences)]
        s = replace(s, teacher=teacher)
    return s


def with_array(s: ScoredGroup, i: int, field: str, values: npt.NDArray[Any], dtype: str | None = None) -> ScoredGroup:
    assert s.teacher is not None
    ts = list(s.teacher)
    ts[i] = replace(ts[i], **{field: Array.from_numpy(values, dtype or getattr(ts[i], field).dtype)})
    return replace(s, teacher=ts)


def arr(s: ScoredGroup, i: int, field: str) -> npt.NDArray[Any]:
    assert s.teacher is not None
    out: npt.NDArray[Any] = getattr(s.teacher[i], field).numpy().copy()
    return out


def rejects(s: ScoredGroup, field: str, match: str, limits: Limits | None = None) -> None:
    """Both ``validate_teacher_part`` alone and ``validate_scored`` raise ``field: ...match...``."""
    for check in (validate_teacher_part, validate_scored):
        with pytest.raises(DecodeError) as info:
            check(s, limits or Limits())
        assert info.value.field == field, (check.__name__, info.value)
        assert match in info.value.reason, (check.__name__, info.value)


def test_valid_groups_pass_both() -> None:
    for s in (scored(), scored(k=1), scored(fp16=True), scored(lengths=(300, 2))):
        validate_teacher_part(s, Limits(vocab_size=VOCAB))
        validate_scored(s, Limits(vocab_size=VOCAB))


@pytest.mark.parametrize("field", ["topk_logprobs", "sampled_logprobs"])
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_non_finite_logprobs(field: str, value: float) -> None:
    s = scored()
    a = arr(s, 1, field)
    a.reshape(-1)[3] = value
    rejects(with_array(s, 1, field, a), f"{T1}.{field}", "non-finite value at flat index 3")


def test_float16_overflow_is_non_finite() -> None:
    s = scored(fp16=True)
    a = arr(s, 3, "topk_logprobs")
    a[40, 2] = np.inf
    rejects(with_array(s, 3, "topk_logprobs", a, FLOAT16), "scored.teacher[3].topk_logprobs", "flat index 202")


def test_negative_and_out_of_vocabulary_ids() -> None:
    s = scored()
    ids = arr(s, 1, "topk_ids")
    ids[2, 4] = -3
    rejects(with_array(s, 1, "topk_ids", ids), f"{T1}.topk_ids", "negative token id -3")
    ids = arr(s, 3, "topk_ids")
    ids[50, 0] = VOCAB + 7
    over = with_array(s, 3, "topk_ids", ids)
    field, reason = "scored.teacher[3].topk_ids", f"token id {VOCAB + 7} outside vocabulary of {VOCAB}"
    rejects(over, field, reason, Limits(vocab_size=VOCAB))
    validate_teacher_part(over, Limits())  # no vocabulary configured: only ids >= 0 are required
    ids[50, 1] = -(2**31)  # both kinds: the negative one is named, as before
    rejects(
        with_array(s, 3, "topk_ids", ids),
        "scored.teacher[3].topk_ids",
        f"negative token id {-(2**31)}",
        Limits(vocab_size=VOCAB),
    )


@pytest.mark.parametrize(
    ("field", "values", "match"),
    [
        ("topk_ids", lambda s: np.zeros((12, 5), np.int32), "shape (12, 5) != (11, 5)"),  # L rows, not L-1
        ("topk_ids", lambda s: arr(s, 1, "topk_ids")[:, :4].copy(), "shape (11, 4) != (11, 5)"),
        ("topk_logprobs", lambda s: arr(s, 1, "topk_logprobs")[:-1].copy(), "shape (10, 5) != (11, 5)"),
        ("sampled_logprobs", lambda s: np.zeros(12, np.float32), "shape (12,) != (11,)"),
    ],
)  # fmt: skip
def test_wrong_shapes(field: str, values: Any, match: str) -> None:
    s = scored()
    rejects(with_array(s, 1, field, values(s)), f"{T1}.{field}", match)


def test_wrong_dtype() -> None:
    s = scored()
    rejects(with_array(s, 0, "topk_ids", arr(s, 0, "topk_ids").astype(np.float32), FLOAT32),
            "scored.teacher[0].topk_ids", "expected <i4")  # fmt: skip


def test_status_count_and_k_consistency() -> None:
    s = scored()
    assert s.teacher is not None
    rejects(replace(s, teacher=s.teacher[:3]), "scored.teacher", "3 payloads for 4 sequences")
    rejects(replace(s, teacher=None), "scored.teacher", "none payloads")
    rejects(replace(s, status=DistillStatus.SKIPPED), "scored.teacher", "status skipped")
    rejects(ScoredGroup(group=s.group, status=DistillStatus.DROPPED), "scored.reason", "needs a reason")
    ts = list(s.teacher)
    ts[1] = synthetic_teacher(s.group.sequences[1], 4, vocab=VOCAB)
    rejects(replace(s, teacher=ts), f"{T1}.k", "4 != group k 5")
    rejects(scored(k=9), "scored.teacher[0].k", "9 outside [1, 8]", Limits(max_k=8))


def test_convention_rules() -> None:
    s = scored()
    lps = arr(s, 3, "topk_logprobs")
    lps[-1] = lps[-1][::-1]  # the last row is always spot-checked
    rejects(with_array(s, 3, "topk_logprobs", lps), "scored.teacher[3].topk_logprobs", "row 58 is not sorted")
    lps = arr(s, 0, "topk_logprobs")
    lps[0] += 1.0 - lps[0, 0]  # sorted, but starts above 0: every value is checked, not the spot rows only
    rejects(with_array(s, 0, "topk_logprobs", lps), "scored.teacher[0].topk_logprobs",
            "logprob 1 at flat index 0 above 0")
    sampled = arr(s, 3, "sampled_logprobs")
    sampled[0] = 0.0  # the token is not in row 0's top k (ids are random), yet sampled above its last entry
    rejects(with_array(s, 3, "sampled_logprobs", sampled), "scored.teacher[3].sampled_logprobs", "row 0 disagrees")


def test_teacher_part_does_not_check_the_rollout_but_validate_scored_does() -> None:
    s = scored()
    seqs = list(s.group.sequences)
    mask = seqs[0].loss_mask.numpy().copy()
    mask[5] = 2
    tokens = seqs[3].tokens.numpy().copy()
    tokens[0] = -1  # row -1 does not exist: the convention check never reads tokens[0]
    assert seqs[1].logprobs is not None
    lp = seqs[1].logprobs.numpy().copy()
    lp[4] = np.nan
    cases = [
        (replace(seqs[0], loss_mask=Array.from_numpy(mask, UINT8)), 0, "scored.group.sequences[0].loss_mask"),
        (replace(seqs[3], tokens=Array.from_numpy(tokens, INT32)), 3, "scored.group.sequences[3].tokens"),
        (replace(seqs[1], logprobs=Array.from_numpy(lp, FLOAT32)), 1, "scored.group.sequences[1].logprobs"),
    ]
    for bad, i, field in cases:
        g = replace(s.group, sequences=[bad if j == i else q for j, q in enumerate(seqs)])
        broken = replace(s, group=g)
        validate_teacher_part(broken, Limits())
        with pytest.raises(DecodeError) as info:
            validate_scored(broken, Limits())
        assert info.value.field == field
        with pytest.raises(DecodeError):
            validate_rollout(g, Limits())
    with pytest.raises(DecodeError) as info:
        validate_scored(replace(s, group=replace(s.group, group_id="")), Limits())
    assert info.value.field == "scored.group.group_id"


def test_rollout_error_is_reported_before_a_teacher_error() -> None:
    s = scored()
    a = arr(s, 1, "sampled_logprobs")
    a[0] = np.nan
    s = with_array(s, 1, "sampled_logprobs", a)
    g = replace(s.group, group_id="")
    with pytest.raises(DecodeError) as info:
        validate_scored(replace(s, group=g), Limits())
    assert info.value.field == "scored.group.group_id"


# --- the fast value checks against references ------------------------------------------------------


def reference_ids(x: npt.NDArray[Any], limits: Limits) -> str | None:
    if not x.size:
        return None
    lo, hi = int(x.min()), int(x.max())
    if lo < 0:
        return f"negative token id {lo}"
    if limits.vocab_size is not None and hi >= limits.vocab_size:
        return f"token id {hi} outside vocabulary of {limits.vocab_size}"
    return None


def outcome(f: Any, *args: Any) -> str | None:
    try:
        f(*args)
    except DecodeError as e:
        return str(e)
    return None


def test_single_pass_id_check_matches_min_max() -> None:
    rng = np.random.default_rng(0)
    for trial in range(400):
        x = rng.integers(0, 1000, int(rng.integers(0, 50)), dtype=np.int32)
        if x.size and trial % 2:
            x[rng.integers(0, x.size)] = rng.choice([-1, -(2**31), 999, 1000, 1001, 2**31 - 1])
        for vocab in (None, 1000, 1001, 2**31, 2**40):
            lim = Limits(vocab_size=vocab)
            want = reference_ids(x, lim)
            assert outcome(_ids, x, "ids", "", lim) == (None if want is None else f"ids: {want}"), (x, vocab)


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_finite_check_matches_isfinite(dtype: type[np.floating[Any]]) -> None:
    rng = np.random.default_rng(1)
    for trial in range(300):
        x = (-rng.exponential(3.0, int(rng.integers(1, 40)))).astype(dtype)
        if trial % 2:
            x[rng.integers(0, x.size)] = rng.choice([np.nan, np.inf, -np.inf])
        bad = np.flatnonzero(~np.isfinite(x))
        want = None if not bad.size else f"x: non-finite value at flat index {bad[0]}"
        assert outcome(_finite, x, "x") == want
    assert outcome(_finite, np.array([-65504.0, 0.0, -0.0], np.float16), "x") is None  # the largest magnitude is finite


def reference_convention(parts: list[_Convention], limits: Limits) -> None:
    """The position-convention spot check as first written (per-part fancy indexing, one pass)."""
    picked = []
    for name, ids, lps, sampled, labels_of, index in parts:
        n_rows = ids.shape[0]
        if n_rows:
            m = min(limits.check_rows, n_rows)
            rows = np.arange(m) * (n_rows - 1) // max(m - 1, 1)
            rel = FLOAT16_MAX_RELATIVE_ERROR if lps.dtype == np.float16 else 0.0
            named = rows if index is None else index[rows]
            picked.append((name, named, rel, ids[rows], lps[rows], sampled[rows], labels_of[rows]))
    if not picked:
        return
    counts = [len(p[1]) for p in picked]
    r_ids = np.concatenate([p[3] for p in picked])
    r_lps = np.concatenate([p[4] for p in picked]).astype(np.float64)
    r_sampled = np.concatenate([p[5] for p in picked]).astype(np.float64)
    labels = np.concatenate([p[6] for p in picked])
    atol = limits.logprob_tolerance
    tol = atol + np.repeat([p[2] for p in picked], counts) * np.abs(r_sampled)

    def fail(flat: Any, field: str, reason: str) -> NoReturn:
        i = int(np.flatnonzero(flat)[0])
        for (name, rows, *_), c in zip(picked, counts, strict=True):
            if i < c:
                raise DecodeError(f"{name}.{field}", reason.format(r=int(rows[i]), token=int(labels[i])))
            i -= c
        raise AssertionError("unreachable")

    unsorted = (r_lps[:, 1:] - r_lps[:, :-1] > atol).any(axis=1)
    if unsorted.any():
        fail(unsorted, "topk_logprobs", "row {r} is not sorted by logprob, highest first")
    hit = r_ids == labels[:, None]
    in_topk = hit.any(axis=1)
    got = r_lps[np.arange(r_lps.shape[0]), hit.argmax(axis=1)]
    bad = np.where(in_topk, np.abs(got - r_sampled) > tol, r_sampled > r_lps[:, -1] + tol)
    if bad.any():
        fail(
            bad,
            "sampled_logprobs",
            "row {r} disagrees with top-k for token {token}: "
            "teacher arrays must be logits-aligned (row r predicts tokens[r+1])",
        )


def _parts(rng: np.random.Generator, fp16: bool) -> list[_Convention]:
    k = int(rng.integers(1, 6))
    lengths = [int(n) for n in rng.integers(1, 90, int(rng.integers(1, 5)))]
    g = synthetic_rollout(len(lengths), lengths, vocab=40, seed=int(rng.integers(1 << 30)))
    parts: list[_Convention] = []
    for i, q in enumerate(g.sequences):
        dense = bool(rng.random() < 0.5)
        t: TeacherPayload = synthetic_teacher(q, k, vocab=40, seed=int(rng.integers(1 << 30)), fp16=fp16,
                                              all_rows=dense)
        index = t.row_index(q.length)
        labels = q.tokens.numpy()[index + 1]
        ids, lps, sampled = t.topk_ids.numpy().copy(), t.topk_logprobs.numpy().copy(), t.sampled_logprobs.numpy().copy()
        if ids.shape[0] and rng.random() < 0.5:  # corrupt one row one way
            r = int(rng.integers(0, ids.shape[0]))
            kind = int(rng.integers(0, 5))
            if kind == 0:
                lps[r] = lps[r][::-1]
            elif kind == 1:
                lps[r] += np.float32(rng.uniform(-0.01, 0.01)) - lps[r, 0]
            elif kind == 2:
                sampled[r] += np.float32(rng.choice([-1e-2, -1e-4, 1e-4, 1e-2, 0.5]))
            elif kind == 3:
                ids[r, int(rng.integers(0, k))] = labels[r]
            else:
                sampled = np.roll(sampled, 1)
        parts.append((f"t[{i}]", ids, lps, sampled, labels, None if dense else index))
    return parts


@pytest.mark.parametrize("fp16", [False, True])
def test_convention_check_matches_reference(fp16: bool) -> None:
    rng = np.random.default_rng(7 + fp16)
    seen = set()
    for _ in range(600):
        parts = _parts(rng, fp16)
        lim = Limits(check_rows=int(rng.choice([1, 2, 5, 32])))
        want = outcome(reference_convention, parts, lim)
        assert outcome(_check_convention, parts, lim) == want
        seen.add(next((kind for kind in ("not sorted", "disagrees") if want and kind in want), want))
    assert seen == {None, "not sorted", "disagrees"}  # every verdict was exercised (values above 0: _logprobs)


# --- the per-sequence check the teacher stage runs -------------------------------------------------


def reference_sorted(lps: npt.NDArray[Any]) -> bool:
    return not (lps.shape[1] > 1 and lps.shape[0] and bool((np.diff(lps, axis=1) > 0).any()))


def test_rows_sorted_matches_diff_and_checks_every_row() -> None:
    rng = np.random.default_rng(3)
    for rows in (0, 1, 2, 7):
        for k in (1, 2, 3, 6):
            lps = np.sort(-rng.exponential(1.0, (rows, k)), axis=1)[:, ::-1].astype(np.float32).copy()
            assert rows_sorted(lps)
            for r in range(rows):
                for j in range(k - 1):  # every adjacent pair of every row, including the last row and column
                    bad = lps.copy()
                    bad[r, j + 1] = bad[r, j] + 0.5
                    assert not rows_sorted(bad) and not reference_sorted(bad)
                    nan = lps.copy()
                    nan[r, j] = np.nan
                    assert not rows_sorted(nan)  # a NaN is never "sorted"
    rising = np.array([[-1.0, -2.0], [0.0, -0.5]], np.float32)  # rows rise from one to the next: allowed
    assert rows_sorted(rising) and rows_sorted(np.asfortranarray(rising))
    assert not rows_sorted(np.asfortranarray(rising[:, ::-1]))
    ties = np.full((4, 3), -1.0, np.float32)
    assert rows_sorted(ties)


def test_result_problem_values_flag() -> None:
    tok = np.arange(6, dtype=np.int32)
    req = ScoreRequest(tok, 3)
    ids = np.tile(np.arange(3, dtype=np.int32), (5, 1))
    lps = np.tile(np.array([-0.1, -1.0, -2.0], np.float32), (5, 1))
    sampled = np.full(5, -0.1, np.float32)
    assert result_problem(req, ScoreResult(ids, lps, sampled)) is None
    neg = ids.copy()
    neg[3, 1] = -1
    assert result_problem(req, ScoreResult(neg, lps, sampled)) == "misaligned: negative token id"  # the full check
    assert result_problem(req, ScoreResult(neg, lps, sampled), values=False) is None  # left to validate_teacher_part
    bad_sampled = sampled.copy()
    bad_sampled[2] = np.nan
    inf = lps.copy()
    inf[1, 2] = -np.inf
    nan = lps.copy()
    nan[4, 1] = np.nan
    unsorted = lps.copy()
    unsorted[4] = unsorted[4][::-1]
    for values in (True, False):  # logprob values are always checked, whatever ``values`` says
        got = result_problem(req, ScoreResult(ids, lps, bad_sampled), values=values)
        assert got == "invalid_logprobs: sampled_logprobs row 2 (token 3) is nan: not finite"
        got = result_problem(req, ScoreResult(ids, inf, sampled), values=values)
        assert got == "invalid_logprobs: topk_logprobs row 1, entry 2 (token 2) is -inf: not finite"
        got = result_problem(req, ScoreResult(ids, nan, sampled), values=values)
        assert got == "invalid_logprobs: topk_logprobs row 4, entry 1 (token 5) is nan: not finite"
        got = result_problem(req, ScoreResult(ids, unsorted, sampled), values=values)
        assert got == "misaligned: top-k rows not sorted descending"
        got = result_problem(req, ScoreResult(ids[:, :2], lps, sampled), values=values)
        assert got is not None and got.startswith("misaligned: top-k shapes")
        got = result_problem(req, ScoreResult(ids, lps, sampled[:-1]), values=values)
        assert got is not None and got.startswith("misaligned: sampled shape")


def test_make_teacher_payload_of_a_checked_result_validates() -> None:
    """What the teacher stage builds from a result that passed ``result_problem`` is a valid payload."""
    seq = make_sequence(np.array([3, 1, 4, 1, 5], np.int32), [0, 0, 1, 1, 1], prompt_len=2)
    nxt = seq.tokens.numpy()[1:]
    ids = np.stack([nxt, (nxt + 1) % 10, (nxt + 2) % 10], axis=1).astype(np.int32)
    lps = np.tile(np.array([-0.1, -1.0, -2.0], np.float32), (4, 1))
    res = ScoreResult(ids, lps, lps[:, 0].copy())
    assert result_problem(ScoreRequest(seq.tokens.numpy().astype(np.int32), 3), res, values=False) is None
    g = replace(synthetic_rollout(1, 5, vocab=10), sequences=[seq])
    for fp16 in (False, True):
        s = ScoredGroup(
            group=g, status=DistillStatus.OK, teacher=[make_teacher(ids, lps, res.sampled_logprobs, fp16=fp16)], k=3
        )
        validate_teacher_part(s, Limits(vocab_size=10))


# --- teacher rows only where the learner trains (schema 2) ------------------------------------------


def test_trained_rows_payloads_hold_exactly_the_trained_rows_and_validate() -> None:
    s = scored(all_rows=False)
    assert s.teacher is not None
    for t, q in zip(s.teacher, s.group.sequences, strict=True):
        trained = np.flatnonzero(q.loss_mask.numpy()[1:])
        assert t.rows is not None and np.array_equal(t.row_index(q.length), trained)
        assert t.topk_ids.shape == (trained.shape[0], 5)
        dense = t.dense_sampled(q.length)  # spread over L - 1 rows, 0.0 where the payload holds none
        assert dense.shape == (q.length - 1,)
        assert np.array_equal(dense[trained], t.sampled_logprobs.numpy())
        assert not dense[np.setdiff1d(np.arange(q.length - 1), trained)].any()
    for check in (validate_teacher_part, validate_scored):
        check(s, Limits())
    assert sum(t.topk_ids.shape[0] for t in s.teacher) < sum(q.length - 1 for q in s.group.sequences)


def with_rows(s: ScoredGroup, i: int, rows: npt.NDArray[Any]) -> ScoredGroup:
    """Sequence ``i``'s payload re-cut to ``rows`` (taken from a dense payload, so values stay consistent)."""
    assert s.teacher is not None
    dense = scored()  # same rollout and seed, every row
    assert dense.teacher is not None
    t = dense.teacher[i]
    ts = list(s.teacher)
    ts[i] = make_teacher(t.topk_ids.numpy()[rows], t.topk_logprobs.numpy()[rows], t.sampled_logprobs.numpy()[rows],
                         rows=rows)
    return replace(s, teacher=ts)


def test_rows_must_be_increasing_in_range_and_cover_every_trained_row() -> None:
    s = scored(all_rows=False)
    assert s.teacher is not None
    q = s.group.sequences[1]  # 12 tokens, prompt 3: trained rows 2..10
    trained = np.flatnonzero(q.loss_mask.numpy()[1:]).astype(np.int32)
    extra = np.concatenate([[0, 1], trained]).astype(np.int32)  # more rows than trained: allowed
    validate_scored(with_rows(s, 1, extra), Limits())
    rejects(with_rows(s, 1, trained[::-1].copy()), f"{T1}.rows", "strictly increasing")
    rejects(with_rows(s, 1, np.concatenate([trained[:1], trained]).astype(np.int32)), f"{T1}.rows",
            "strictly increasing")
    missing = np.delete(trained, 3)
    rejects(with_rows(s, 1, missing), f"{T1}.rows", f"trained row {trained[3]} (loss_mask[{trained[3] + 1}] = 1)")
    bad = replace(s.teacher[1], rows=Array.from_numpy(np.append(trained, 11).astype(np.int32), INT32))
    rejects(replace(s, teacher=[s.teacher[0], bad, *s.teacher[2:]]), f"{T1}.rows", "in [0, 11)")
    short = replace(s.teacher[1], rows=Array.from_numpy(trained[:-1].copy(), INT32))  # arrays longer than rows
    rejects(replace(s, teacher=[s.teacher[0], short, *s.teacher[2:]]), f"{T1}.rows", "has no teacher row")
    wrong = replace(s.teacher[1], rows=Array.from_numpy(trained.astype(np.float32), FLOAT32))
    rejects(replace(s, teacher=[s.teacher[0], wrong, *s.teacher[2:]]), f"{T1}.rows", "dtype")


def test_a_payload_cut_to_other_rows_fails_the_convention_check_naming_the_real_row() -> None:
    s = scored(all_rows=False)
    dense = scored()
    assert s.teacher is not None and dense.teacher is not None
    q, t, d = s.group.sequences[3], s.teacher[3], dense.teacher[3]  # 60 tokens
    rows = t.row_index(q.length)
    src = np.minimum(rows + 1, q.length - 2)  # each row carries the next row's answer: misaligned
    moved = make_teacher(d.topk_ids.numpy()[src], d.topk_logprobs.numpy()[src], d.sampled_logprobs.numpy()[src],
                         rows=rows)
    with pytest.raises(DecodeError) as info:
        validate_scored(replace(s, teacher=[*s.teacher[:3], moved]), Limits(check_rows=64))
    assert info.value.field == "scored.teacher[3].sampled_logprobs"
    row = int(info.value.reason.split("row ")[1].split()[0])
    assert row in rows.tolist() and row >= 2  # a real row of the sequence (trained rows start at 2), not an index
