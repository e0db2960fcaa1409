"""HTTP teachers against a stub vLLM/SGLang server that serves real logprobs (the tiny teacher's, and the
real-vocabulary model's at k = 256); row subsets and server URLs with ``/v1``. The parser on raw response
bytes: tests/unit/test_vllm_parse.py."""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator
from typing import Any

import httpx
import numpy as np
import numpy.typing as npt
import pytest

from pipeline.demo.tinymodels import REAL_VOCAB_SIZE, ensure_real_vocab_model, ensure_tiny_models
from pipeline.models.weights import load_causal_lm
from pipeline.stages.scoring import Scorer, ScoringConfig
from pipeline.teacher.base import ScoreFailure, ScoreRequest, ScoreResult, TeacherConfigError, rows_sorted
from pipeline.teacher.hf import HFTeacher
from pipeline.teacher.sglang_http import SGLangTeacher
from pipeline.teacher.vllm_http import HTTPTeacher, HTTPTeacherConfig, VLLMTeacher
from pipeline.teacher.vllm_parse import SPARSE_BELOW
from pipeline.teacher.vocab import self_test_checksum
from schemas import DistillStatus
from schemas.build import synthetic_rollout, trained_rows
from tests.stubs.vllm_stub import VLLMStub, assert_topk_matches, running, teacher_logprobs
from workers.teacher import add_arguments, make_backend

TOL = 1e-5
LENGTHS = [2, 40, 7, 130, 18]


@pytest.fixture(scope="module")
def model() -> Any:
    return load_causal_lm(ensure_tiny_models().teacher)


@pytest.fixture(scope="module")
def real_model() -> Any:
    return load_causal_lm(ensure_real_vocab_model())


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
        seqs = groups[0].sequences
        want = await hf.score([ScoreRequest(q.tokens.numpy().astype(np.int32), 20, trained_rows(q)) for q in seqs])
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


# -- rows, URLs, real shapes ------------------------------------------------------------------------


def with_rows(req: ScoreRequest, rows: npt.ArrayLike) -> ScoreRequest:
    return ScoreRequest(req.tokens, req.k, np.asarray(rows, np.int32))


def row_patterns(n: int) -> list[npt.NDArray[np.int32]]:
    """Rows a learner trains on in a sequence of ``n`` tokens: the completion (last 75%: parsed from one
    typed decode), two assistant turns around a tool output and a single row (only the wanted positions
    decoded), and none."""
    r = n - 1
    suffix = np.arange(r // 4, r)
    turns = np.r_[np.arange(r // 5, 2 * r // 5), np.arange(3 * r // 5, 7 * r // 10)]
    assert suffix.size >= SPARSE_BELOW * r > turns.size  # both parser paths
    return [a.astype(np.int32) for a in (suffix, turns, np.array([r - 1]), np.array([], np.int32))]


def assert_rows_of(part: ScoreResult, full: ScoreResult, rows: npt.NDArray[np.int32]) -> None:
    """Equal values; the same ids in each row (exactly tied logprobs keep the server's item order, which
    the stub shuffles per request)."""
    np.testing.assert_array_equal(np.sort(part.topk_ids, axis=1), np.sort(full.topk_ids[rows], axis=1))
    np.testing.assert_array_equal(part.topk_logprobs, full.topk_logprobs[rows])
    np.testing.assert_array_equal(part.sampled_logprobs, full.sampled_logprobs[rows])


async def assert_rows_match(model: Any, teacher: HTTPTeacher, hf: HFTeacher, tokens: npt.NDArray[np.int32],
                            k: int) -> tuple[list[ScoreRequest], ScoreResult]:
    """Every row pattern equals the same rows of the full request and HF's answer for those rows; returns
    the requests and the full answer."""
    full_req = ScoreRequest(tokens, k)
    reqs = [full_req] + [with_rows(full_req, r) for r in row_patterns(int(tokens.shape[0]))]
    got, want = await teacher.score(reqs), await hf.score(reqs)
    full_lp = teacher_logprobs(model, tokens.tolist())
    full = got[0]
    assert isinstance(full, ScoreResult), full
    for r, g, w in zip(reqs, got, want, strict=True):
        assert isinstance(g, ScoreResult) and isinstance(w, ScoreResult), g
        assert g.topk_ids.shape == (r.n_rows, k)
        assert_rows_of(g, full, r.row_index())
        assert_topk_matches(g.topk_ids, g.topk_logprobs, w.topk_logprobs, full_lp[r.row_index()], TOL)
        np.testing.assert_allclose(g.sampled_logprobs, w.sampled_logprobs, atol=TOL, rtol=0)
        assert rows_sorted(g.topk_logprobs)
    return reqs, full


@pytest.mark.parametrize("always_extra", [False, True])
async def test_vllm_rows_equal_rows_of_full_request(model: Any, hf: HFTeacher, always_extra: bool) -> None:
    async with running(VLLMStub(model, always_extra=always_extra, seed=3)) as stub:
        teacher = await vllm(stub.url, k=8)
        tokens = np.random.default_rng(4).integers(0, hf.max_k, 161).astype(np.int32)
        reqs, _ = await assert_rows_match(model, teacher, hf, tokens, 8)
        assert stub.requests == 1 + sum(r.n_rows > 0 for r in reqs)  # the cap probe; no call for no rows


@pytest.mark.slow
async def test_vllm_k256_at_real_vocabulary(real_model: Any) -> None:
    """k = 256 over a 151,936-token vocabulary for 300 positions: the stub serves the real-vocabulary
    model's logprobs (up to 257 items a position, ids up to 151,935), equal to the HF teacher's."""
    hf = HFTeacher(model=real_model)
    await hf.start()
    try:
        async with running(VLLMStub(real_model, cap=256, seed=5)) as stub:
            teacher = await vllm(stub.url, k=256)
            tokens = np.random.default_rng(6).integers(0, REAL_VOCAB_SIZE, 300).astype(np.int32)
            _, full = await assert_rows_match(real_model, teacher, hf, tokens, 256)
            assert stub.prompt_logprobs_seen[-1] == 256 and int(full.topk_ids.max()) >= 1 << 16
    finally:
        await hf.close()


async def test_rows_misaligned_and_bad_rows(stub: VLLMStub) -> None:
    teacher = await vllm(stub.url, k=3)
    tokens = np.arange(303, 303 + 40, dtype=np.int32)
    stub.short.add(303)  # one entry missing: misaligned whichever rows are asked for
    for rows in row_patterns(40)[:3]:
        (out,) = await teacher.score([with_rows(ScoreRequest(tokens, 3), rows)])
        assert isinstance(out, ScoreFailure) and out.reason.startswith("misaligned: 39 prompt_logprobs entries")
    seen = stub.requests
    for bad in ([5, 5], [3, 1], [0, 39], [-1]):
        (out,) = await teacher.score([with_rows(ScoreRequest(tokens, 3), bad)])
        assert isinstance(out, ScoreFailure) and out.reason.startswith("bad request: rows") and not out.retryable
    assert stub.requests == seen  # never sent


@pytest.mark.parametrize("suffix", ["/", "/v1", "/v1/"])
async def test_openai_style_urls(stub: VLLMStub, suffix: str) -> None:
    """``distillq worker teacher --backend vllm --url http://h:p/v1`` (the OpenAI SDK's form) works."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    teacher = make_backend(parser.parse_args(["--backend", "vllm", "--url", stub.url + suffix, "--top-k", "3"]))
    assert isinstance(teacher, VLLMTeacher)
    _OPEN.append(teacher)
    await teacher.start()
    assert teacher.model == "tiny-teacher" and teacher.pool.servers[0].url == stub.url
    (out,) = await teacher.score(requests(64, 3)[1:2])
    assert isinstance(out, ScoreResult) and out.topk_ids.shape == (39, 3)
    with pytest.raises(TeacherConfigError, match="invalid server URL"):
        VLLMTeacher(HTTPTeacherConfig(urls=(stub.url.removeprefix("http://"),)))


async def test_sglang_rows_send_logprob_start_len(stub: VLLMStub, hf: HFTeacher, model: Any) -> None:
    teacher = SGLangTeacher(HTTPTeacherConfig(urls=(stub.url + "/v1",), k=6), max_k=32)
    _OPEN.append(teacher)
    await teacher.start()
    tokens = np.random.default_rng(8).integers(0, hf.max_k, 121).astype(np.int32)
    tokens[0] = 1
    reqs, _ = await assert_rows_match(model, teacher, hf, tokens, 6)
    # Each call starts at its first wanted row (the radix cache may reuse the prompt before it).
    assert sorted(stub.logprob_start_lens_seen) == sorted(r.first_row for r in reqs if r.n_rows)
    stub.short.add(303)  # one top-logprobs entry missing
    tokens[0] = 303
    (out,) = await teacher.score([with_rows(ScoreRequest(tokens, 6), row_patterns(121)[1])])
    assert isinstance(out, ScoreFailure) and out.reason.startswith("misaligned: input logprob lists of lengths")
