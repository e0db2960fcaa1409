"""HTTP teachers against a stub vLLM/SGLang server that serves the tiny teacher's real logprobs."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import numpy as np
import pytest

from pipeline.models.tinymodels import ensure_tiny_models, load_causal_lm
from pipeline.stages.scoring import Scorer, ScoringConfig
from pipeline.teacher.base import ScoreFailure, ScoreRequest, ScoreResult, TeacherConfigError
from pipeline.teacher.hf import HFTeacher
from pipeline.teacher.sglang_http import SGLangTeacher
from pipeline.teacher.vllm_http import HTTPTeacher, HTTPTeacherConfig, VLLMTeacher, parse_prompt_logprobs
from pipeline.teacher.vocab import self_test_checksum
from schemas import DistillStatus
from schemas.build import synthetic_rollout
from tests.stubs.vllm_stub import VLLMStub, assert_topk_matches, teacher_logprobs

TOL = 1e-5
LENGTHS = [2, 40, 7, 130, 18]


@pytest.fixture(scope="module")
def model() -> Any:
    return load_causal_lm(ensure_tiny_models().teacher)


@pytest.fixture
async def hf(model: Any) -> AsyncIterator[HFTeacher]:
    t = HFTeacher(model=model)
    await t.start()
    yield t
    await t.close()


@pytest.fixture
async def stub(model: Any) -> AsyncIterator[VLLMStub]:
    s = VLLMStub(model)
    await s.start()
    yield s
    await s.close()


_OPEN: list[HTTPTeacher] = []


@pytest.fixture(autouse=True)
async def _close_teachers() -> AsyncIterator[None]:
    """Close every teacher a test started, even when it fails halfway."""
    yield
    while _OPEN:
        await _OPEN.pop().close()


async def vllm(*urls: str, **kw: Any) -> VLLMTeacher:
    t = VLLMTeacher(HTTPTeacherConfig(urls=urls, **kw))
    _OPEN.append(t)
    await t.start()
    return t


def requests(vocab: int, k: int, first: list[int] | None = None, seed: int = 0) -> list[ScoreRequest]:
    rng = np.random.default_rng(seed)
    reqs = []
    for i, n in enumerate(LENGTHS):
        tok = rng.integers(0, vocab, n).astype(np.int32)
        if first is not None:
            tok[0] = first[i]
        reqs.append(ScoreRequest(tok, k))
    return reqs


def assert_same(model: Any, tokens: np.ndarray, a: ScoreResult, b: ScoreResult, k: int) -> None:
    """``a`` (over HTTP) equals ``b`` (HF): exactly k sorted entries per row, ids equal up to near-ties."""
    assert a.topk_ids.shape == b.topk_ids.shape == (b.sampled_logprobs.shape[0], k)
    assert_topk_matches(a.topk_ids, a.topk_logprobs, b.topk_logprobs, teacher_logprobs(model, tokens.tolist()), TOL)
    np.testing.assert_allclose(a.sampled_logprobs, b.sampled_logprobs, atol=TOL, rtol=0)
    assert (np.diff(a.topk_logprobs, axis=1) <= 0).all()


@pytest.mark.parametrize("always_extra", [False, True])
@pytest.mark.parametrize("k", [1, 5, 20])
async def test_vllm_parse_equals_hf(model: Any, hf: HFTeacher, k: int, always_extra: bool) -> None:
    stub = VLLMStub(model, always_extra=always_extra, seed=k)
    await stub.start()
    try:
        teacher = await vllm(stub.url, k=5)
        assert teacher.model == "tiny-teacher" and teacher.identity == "vllm:tiny-teacher"
        reqs = requests(hf.max_k, k)
        got, want = await teacher.score(reqs), await hf.score(reqs)
        for r, g, w in zip(reqs, got, want, strict=True):
            assert isinstance(g, ScoreResult) and isinstance(w, ScoreResult)
            assert_same(model, r.tokens, g, w, k)
    finally:
        await stub.close()


@pytest.mark.parametrize("in_message", [True, False])
async def test_cap_probe(model: Any, in_message: bool) -> None:
    stub = VLLMStub(model, cap=13, cap_in_message=in_message)
    await stub.start()
    try:
        teacher = await vllm(stub.url, k=4)
        assert teacher.max_k == 13
        with pytest.raises(TeacherConfigError, match="exceeds the server cap 13"):
            await vllm(stub.url, k=14)
    finally:
        await stub.close()


@pytest.mark.parametrize("rule", ["clamp", "drop"])
async def test_k_over_cap_per_group(stub: VLLMStub, hf: HFTeacher, rule: str) -> None:
    teacher = await vllm(stub.url, k=5)
    (over,) = await teacher.score([ScoreRequest(np.array([1, 2, 3], np.int32), 21)])
    assert isinstance(over, ScoreFailure) and over.reason.startswith("k_over_cap") and not over.retryable
    seen = len(stub.prompt_logprobs_seen)
    groups = [synthetic_rollout(2, [9, 14], vocab=hf.max_k, seed=3, group_overrides={"teacher_top_k": 50})]
    (s,) = await Scorer(teacher, ScoringConfig(default_k=5, k_over_cap=rule)).score_groups(groups)  # type: ignore[arg-type]
    if rule == "clamp":
        assert s.status is DistillStatus.OK and s.k == 20 and s.teacher is not None
        assert stub.prompt_logprobs_seen[seen:] == [20, 20]
        want = await hf.score([ScoreRequest(q.tokens.numpy().astype(np.int32), 20) for q in groups[0].sequences])
        for t, w in zip(s.teacher, want, strict=True):
            assert isinstance(w, ScoreResult)
            np.testing.assert_allclose(t.topk_logprobs.numpy().astype(np.float32), w.topk_logprobs, atol=TOL, rtol=0)
    else:
        assert s.status is DistillStatus.DROPPED and s.reason is not None and s.reason.startswith("k_over_cap")
        assert len(stub.prompt_logprobs_seen) == seen  # never sent


async def test_failures_are_classified(stub: VLLMStub) -> None:
    stub.errors[301] = -1
    stub.hangs.add(302)
    stub.short.add(303)
    teacher = await vllm(stub.url, k=3, timeout_s=0.5)
    reqs = requests(64, 3, first=[300, 301, 302, 303, 304])
    out = await teacher.score(reqs)
    assert isinstance(out[0], ScoreResult) and isinstance(out[4], ScoreResult)
    assert isinstance(out[1], ScoreFailure) and out[1].retryable and out[1].reason.startswith("http 500")
    assert isinstance(out[2], ScoreFailure) and out[2].retryable and out[2].reason.startswith("timeout")
    assert isinstance(out[3], ScoreFailure) and not out[3].retryable and out[3].reason.startswith("misaligned")


async def test_scorer_retries_over_http(stub: VLLMStub) -> None:
    stub.errors[7] = 2  # two 500s, then success
    stub.errors[8] = -1  # always 500
    teacher = await vllm(stub.url, k=4)
    groups = [synthetic_rollout(2, [10, 12], vocab=300, seed=s, group_id=f"g{s}") for s in range(3)]
    g_retry = _with_first(groups[0], 7)
    g_fail = _with_first(groups[1], 8)
    out = await Scorer(teacher, ScoringConfig(default_k=4, retries=3, backoff_base_s=0.01)).score_groups(
        [g_retry, g_fail, groups[2]]
    )
    assert [s.status for s in out] == [DistillStatus.OK, DistillStatus.DROPPED, DistillStatus.OK]
    assert out[1].reason is not None and out[1].reason.startswith("teacher_error: http 500")
    assert stub.errors[7] == 0  # both 500s were served, then the retry succeeded


def _with_first(g: Any, first: int) -> Any:
    from schemas.build import make_sequence

    seqs = []
    for s in g.sequences:
        tok = s.tokens.numpy().copy()
        tok[0] = first
        seqs.append(make_sequence(tok, s.loss_mask.numpy(), logprobs=s.logprobs.numpy()))
    return type(g)(group_id=g.group_id, sequences=seqs)


async def test_model_discovery_and_mismatch(stub: VLLMStub) -> None:
    teacher = await vllm(stub.url)
    assert teacher.model == "tiny-teacher"
    with pytest.raises(TeacherConfigError, match="does not serve model 'other'"):
        await vllm(stub.url, model="other")
    with pytest.raises(TeacherConfigError, match="unreachable"):
        await vllm("http://127.0.0.1:9", connect_timeout_s=0.5)
    # A server that goes away mid-run: retryable connection error.
    await stub.close()
    (out,) = await teacher.score(requests(64, 2)[:1])
    assert isinstance(out, ScoreFailure) and out.retryable and out.reason.startswith("connection error")


async def test_least_loaded_routing_and_concurrency_bound(model: Any) -> None:
    stubs = [VLLMStub(model), VLLMStub(model)]
    for s in stubs:
        await s.start()
    try:
        teacher = await vllm(*(s.url for s in stubs), k=2, max_concurrency=3)
        base = [s.requests for s in stubs]
        reqs = [ScoreRequest(np.arange(i % 7 + 2, dtype=np.int32), 2) for i in range(40)]
        out = await teacher.score(reqs)
        assert all(isinstance(o, ScoreResult) for o in out)
        served = [s.requests - b for s, b in zip(stubs, base, strict=True)]
        assert sum(served) == 40 and min(served) >= 15
        assert all(s.max_in_flight <= 3 for s in stubs) and max(s.max_in_flight for s in stubs) >= 2
        assert all(srv.in_flight == 0 for srv in teacher.pool.servers)
    finally:
        for s in stubs:
            await s.close()


def test_parse_rejects_missing_prompt_token() -> None:
    from pipeline.teacher.vllm_http import _Logprob

    tokens = np.array([5, 6, 7], np.int32)
    row = {"1": _Logprob(-0.5, 1), "2": _Logprob(-1.0, 2)}
    out = parse_prompt_logprobs([None, {**row, "6": _Logprob(-3.0, 9)}, row], tokens, 2)
    assert isinstance(out, ScoreFailure) and "lacks the prompt token 7" in out.reason
    out = parse_prompt_logprobs([None, row], tokens, 2)
    assert isinstance(out, ScoreFailure) and out.reason.startswith("misaligned: 2 prompt_logprobs entries")
    out = parse_prompt_logprobs([None, {"6": _Logprob(-3.0, 9)}, {"7": _Logprob(-1.0, 1)}], tokens, 2)
    assert isinstance(out, ScoreFailure) and "has 1 items" in out.reason


async def test_self_test_checksum_matches_hf(stub: VLLMStub, hf: HFTeacher) -> None:
    teacher = await vllm(stub.url)
    assert await self_test_checksum(teacher) == await self_test_checksum(hf)


async def test_sglang_parse_equals_hf(stub: VLLMStub, hf: HFTeacher, model: Any) -> None:
    stub.short.add(303)
    teacher = SGLangTeacher(HTTPTeacherConfig(urls=(stub.url,), k=6), max_k=32)
    _OPEN.append(teacher)
    await teacher.start()
    assert teacher.model == "tiny-teacher" and teacher.max_k == 32
    reqs = requests(hf.max_k, 6, first=[300, 1, 2, 303, 4])
    got, want = await teacher.score(reqs), await hf.score(reqs)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if i == 3:
            assert isinstance(g, ScoreFailure) and g.reason.startswith("misaligned")
            continue
        assert isinstance(g, ScoreResult) and isinstance(w, ScoreResult)
        assert_same(model, reqs[i].tokens, g, w, 6)


async def test_injected_client_not_closed(stub: VLLMStub) -> None:
    async with httpx.AsyncClient() as client:
        teacher = VLLMTeacher(HTTPTeacherConfig(urls=(stub.url,), k=2), client=client)
        await teacher.start()
        await teacher.close()
        assert not client.is_closed
