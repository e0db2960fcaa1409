"""The synthetic teacher's ids: exactly ``(tokens[r+1] + j) % vocab`` however they are computed."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from pipeline.stages.scoring import Scorer, ScoringConfig
from pipeline.teacher.base import ScoreRequest, ScoreResult, result_problem
from pipeline.teacher.synthetic import SyntheticTeacher
from schemas import DistillStatus, Limits
from schemas.build import synthetic_rollout


def formula(tokens: npt.NDArray[Any], k: int, vocab: int) -> npt.NDArray[np.int32]:
    return ((tokens[1:, None].astype(np.int64) + np.arange(k)) % vocab).astype(np.int32)


def score(t: SyntheticTeacher, tokens: npt.NDArray[np.int32], k: int) -> ScoreResult:
    (res,) = asyncio.run(t.score([ScoreRequest(tokens, k)]))
    assert isinstance(res, ScoreResult)
    return res


@pytest.mark.parametrize("vocab", [7, 100, 32000, 151_936])
@pytest.mark.parametrize("k", [1, 3, 20, 64])
def test_ids_follow_the_formula(vocab: int, k: int) -> None:
    t = SyntheticTeacher(vocab_size=vocab)
    rng = np.random.default_rng(vocab + k)
    for n in (1, 2, 50, 1024):
        tokens = rng.integers(max(0, vocab - 2 * k), vocab, n, dtype=np.int32)  # many rows that must wrap
        tokens[: n // 2] = rng.integers(0, vocab, n // 2, dtype=np.int32)
        res = score(t, tokens, k)
        np.testing.assert_array_equal(res.topk_ids, formula(tokens, k, vocab))
        assert res.topk_ids.dtype == np.int32 and res.topk_ids.shape == (n - 1, k)
        if k > vocab:
            continue
        assert res.topk_ids.size == 0 or (int(res.topk_ids.min()) >= 0 and int(res.topk_ids.max()) < vocab)
        assert res.topk_ids[:, 0].tolist() == tokens[1:].tolist()  # the sampled token first, logprob -0.1
        assert all(len(set(row)) == k for row in res.topk_ids.tolist())  # distinct within a row
        assert result_problem(ScoreRequest(tokens, k), res) is None
        np.testing.assert_array_equal(score(t, tokens.copy(), k).topk_ids, res.topk_ids)  # deterministic


def test_invalid_tokens_take_the_plain_formula() -> None:
    t = SyntheticTeacher(vocab_size=100)
    tokens = np.array([5, -3, 250, 99, 2**31 - 1, 0], np.int32)
    np.testing.assert_array_equal(score(t, tokens, 4).topk_ids, formula(tokens, 4, 100))


def test_results_do_not_share_id_buffers() -> None:
    t = SyntheticTeacher(vocab_size=50)
    tokens = np.array([1, 49, 48, 2], np.int32)
    a, b = (score(t, tokens, 5) for _ in range(2))
    assert a.topk_ids.flags.writeable and not np.shares_memory(a.topk_ids, b.topk_ids)
    assert not t._cached(3, 5)[2].flags.writeable  # the shared offsets cannot be written through


async def test_synthetic_payloads_pass_the_teacher_stage_with_a_vocabulary() -> None:
    groups = [synthetic_rollout(4, [1024, 300, 2, 1], vocab=32000, seed=s) for s in range(3)]
    scorer = Scorer(SyntheticTeacher(vocab_size=32000), ScoringConfig(default_k=20), limits=Limits(vocab_size=32000))
    out = await scorer.score_groups(groups)
    assert [s.status for s in out] == [DistillStatus.OK] * 3
    for s in out:
        assert s.teacher is not None
        for t, q in zip(s.teacher, s.group.sequences, strict=True):
            rows = t.row_index(q.length)  # the trained rows: row r predicts token r + 1
            np.testing.assert_array_equal(rows, np.flatnonzero(q.loss_mask.numpy()[1:]))
            full = formula(q.tokens.numpy(), 20, 32000)
            np.testing.assert_array_equal(t.topk_ids.numpy(), full[rows])
