"""Local HF teacher: batched scoring equals an independent per-sequence forward pass to 1e-5."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import numpy as np
import pytest
import torch

from pipeline.models.tinymodels import ensure_tiny_models, load_causal_lm
from pipeline.stages.scoring import Scorer, ScoringConfig
from pipeline.teacher.base import ScoreFailure, ScoreRequest, ScoreResult
from pipeline.teacher.hf import HFTeacher, plan_chunks
from pipeline.teacher.vocab import VocabMismatchError, check_same_vocab, self_test_checksum
from schemas import DistillStatus, Limits, ScoredGroup, decode, encode
from schemas.build import synthetic_rollout

TOL = 1e-5
Factory = Callable[..., Awaitable[HFTeacher]]


@pytest.fixture(scope="module")
def model() -> Any:
    return load_causal_lm(ensure_tiny_models().teacher)


@pytest.fixture
async def started() -> AsyncIterator[Factory]:
    """Factory of started teachers, all closed (worker thread joined) at the end of the test."""
    made: list[HFTeacher] = []

    async def make(**kw: Any) -> HFTeacher:
        t = HFTeacher(**kw)
        made.append(t)
        await t.start()
        return t

    yield make
    for t in made:
        await t.close()


def reference(model: Any, tokens: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One sequence alone, no padding, no mask: log-softmax, top-k, prompt-token logprob."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(tokens[None].astype(np.int64))).logits[0, :-1]
    lp = torch.log_softmax(logits.double(), dim=-1)
    top = torch.topk(lp, k, dim=-1)
    sampled = lp[torch.arange(len(tokens) - 1), torch.tensor(tokens[1:].astype(np.int64))]
    return top.indices.numpy(), top.values.numpy(), sampled.numpy()


def assert_matches(model: Any, tokens: np.ndarray, res: ScoreResult, k: int) -> None:
    ids, lps, sampled = reference(model, tokens, k)
    assert res.topk_ids.dtype == np.int32 and res.topk_logprobs.dtype == np.float32
    assert res.topk_ids.shape == (len(tokens) - 1, k) and res.sampled_logprobs.shape == (len(tokens) - 1,)
    np.testing.assert_allclose(res.topk_logprobs, lps, atol=TOL, rtol=0)
    np.testing.assert_allclose(res.sampled_logprobs, sampled, atol=TOL, rtol=0)
    np.testing.assert_array_equal(res.topk_ids, ids)


async def test_batched_equals_per_sequence(model: Any, started: Factory) -> None:
    teacher = await started(model=model, max_batch_tokens=700)
    assert teacher.max_k == model.config.vocab_size
    rng = np.random.default_rng(0)
    lengths = [2, 300, 17, 64, 5, 129, 33, 250, 3, 90]
    reqs = [ScoreRequest(rng.integers(0, teacher.max_k, n).astype(np.int32), k) for n, k in
            zip(lengths, [1, 5, 20, 3, 7, 20, 2, 8, 4, 16], strict=True)]  # fmt: skip
    out = await teacher.score(reqs)
    assert len(out) == len(reqs)
    for req, res in zip(reqs, out, strict=True):
        assert isinstance(res, ScoreResult)
        assert_matches(model, req.tokens, res, req.k)


async def test_several_groups_in_one_call_through_scorer(model: Any, started: Factory) -> None:
    teacher = await started(model=model, max_batch_tokens=4096)
    vocab = teacher.max_k
    groups = [
        synthetic_rollout(3, [40, 12, 77], vocab=vocab, seed=1, group_id="a"),
        synthetic_rollout(2, [55, 9], vocab=vocab, seed=2, group_id="b", group_overrides={"teacher_top_k": 3}),
    ]
    calls: list[int] = []
    inner = teacher.score

    async def spy(reqs: list[ScoreRequest]) -> Any:
        calls.append(len(reqs))
        return await inner(reqs)

    teacher.score = spy  # type: ignore[method-assign]
    out = await Scorer(teacher, ScoringConfig(default_k=6, max_batch_tokens=4096)).score_groups(groups)
    assert calls == [5]
    for s, g in zip(out, groups, strict=True):
        assert s.status is DistillStatus.OK and s.teacher is not None
        decode(encode(s), Limits(vocab_size=vocab), expect=ScoredGroup)
        for t, seq in zip(s.teacher, g.sequences, strict=True):
            tok = seq.tokens.numpy()
            res = ScoreResult(t.topk_ids.numpy(), t.topk_logprobs.numpy(), t.sampled_logprobs.numpy())  # type: ignore[arg-type]
            assert_matches(model, tok, res, s.k)


async def test_rejections_and_edge_lengths(model: Any, started: Factory) -> None:
    teacher = await started(model=model)
    v = teacher.max_k
    reqs = [
        ScoreRequest(np.array([1, 2, 3], np.int32), v + 1),
        ScoreRequest(np.array([1, v], np.int32), 2),
        ScoreRequest(np.array([4], np.int32), 3),
        ScoreRequest(np.zeros(0, np.int32), 3),
        ScoreRequest(np.ones(model.config.max_position_embeddings + 1, np.int32), 3),
        ScoreRequest(np.array([1, 2, 3], np.int32), v),
    ]
    out = await teacher.score(reqs)
    assert isinstance(out[0], ScoreFailure) and out[0].reason.startswith("k_over_cap") and not out[0].retryable
    assert isinstance(out[1], ScoreFailure) and "token id" in out[1].reason
    assert isinstance(out[2], ScoreResult) and out[2].topk_ids.shape == (0, 3)
    assert isinstance(out[3], ScoreFailure) and isinstance(out[4], ScoreFailure)
    assert isinstance(out[5], ScoreResult)  # full vocabulary: k = max_k works
    assert_matches(model, reqs[5].tokens, out[5], v)


def test_plan_chunks_budget() -> None:
    lengths = [10, 300, 45, 45, 2, 120, 700]
    chunks = plan_chunks(lengths, 400)
    assert sorted(i for c in chunks for i in c) == list(range(len(lengths)))
    for c in chunks:
        assert len(c) == 1 or len(c) * max(lengths[i] for i in c) <= 400
    assert chunks[0] == [6]  # the 700-token sequence alone, first


async def test_vocab_check_and_checksum(model: Any, tmp_path: Any, started: Factory) -> None:
    tm = ensure_tiny_models()
    check_same_vocab(tm.teacher, tm.student)  # shared tokenizer: no error
    from transformers import AutoTokenizer

    other = AutoTokenizer.from_pretrained(str(tm.tokenizer))
    other.add_tokens(["<extra_a>", "<extra_b>"])
    other.save_pretrained(str(tmp_path))
    with pytest.raises(VocabMismatchError, match=r"teacher \d+ tokens .*student \d+ tokens.*<extra_a>"):
        check_same_vocab(tm.teacher, tmp_path)

    a, b = await started(model=model), await started(model=model)
    ca, cb = await self_test_checksum(a), await self_test_checksum(b)
    assert ca == cb and len(ca) == 12
    other_model = load_causal_lm(tm.student)
    c = await started(model=other_model)
    assert await self_test_checksum(c) != ca
