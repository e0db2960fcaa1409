"""The synthetic (no-op) teacher: valid, deterministic payloads; ids wrap below the vocabulary."""

from __future__ import annotations

import asyncio

import numpy as np

from pipeline.teacher.base import ScoreRequest, ScoreResult, result_problem
from pipeline.teacher.synthetic import SyntheticTeacher


def test_payloads_are_valid_deterministic_and_wrap_at_the_vocabulary() -> None:
    t = SyntheticTeacher(vocab_size=100)
    tokens = np.array([5, 97, 3, 99, 0], np.int32)
    a, b = asyncio.run(t.score([ScoreRequest(tokens, 4), ScoreRequest(tokens.copy(), 4)]))
    assert isinstance(a, ScoreResult) and isinstance(b, ScoreResult)
    expected = (tokens[1:, None].astype(np.int64) + np.arange(4)) % 100
    np.testing.assert_array_equal(a.topk_ids, expected)
    assert a.topk_ids.dtype == np.int32 and int(a.topk_ids.max()) < 100
    np.testing.assert_array_equal(a.topk_ids, b.topk_ids)
    np.testing.assert_allclose(a.topk_logprobs[0], [-0.1, -1.1, -2.1, -3.1], rtol=1e-6)
    assert (a.sampled_logprobs == np.float32(-0.1)).all() and a.topk_ids[:, 0].tolist() == tokens[1:].tolist()
    assert result_problem(ScoreRequest(tokens, 4), a) is None
    assert not a.topk_logprobs.flags.writeable  # shared between results: nobody may write to it


def test_no_wrap_needed_keeps_ids_and_cache_is_bounded() -> None:
    t = SyntheticTeacher(vocab_size=32000)
    t.CACHE_SIZE = 8
    asyncio.run(t.score([ScoreRequest(np.arange(n, dtype=np.int32), 3) for n in range(2, 40)]))
    assert len(t._logprobs) == 8
    (r,) = asyncio.run(t.score([ScoreRequest(np.array([1, 2, 3], np.int32), 3)]))
    assert isinstance(r, ScoreResult)
    assert r.topk_ids.tolist() == [[2, 3, 4], [3, 4, 5]]
