"""The transformers teacher packs sequences without padding (position ids restarting per sequence, no
mask): equal to the padded computation within 1e-5 in float32 at the tiny and the real vocabulary, no
padded token computed, the shared-prefix path unchanged; half-precision weights keep a float32
log-softmax; chunk sizes from free memory; the worker flags reach the backend."""

from __future__ import annotations

import argparse
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.demo.tinymodels import REAL_VOCAB_SIZE, ensure_real_vocab_model, ensure_tiny_models
from pipeline.models.weights import load_causal_lm
from pipeline.teacher.base import ScoreRequest, ScoreResult, TeacherConfigError
from pipeline.teacher.hf import HFTeacher, resolve_dtype
from pipeline.teacher.hf_forward import auto_chunk_positions
from pipeline.teacher.hf_pack import pack, plan_packed_chunks, plan_rows

TOL = 1e-5
Factory = Callable[..., Awaitable[HFTeacher]]


@pytest.fixture(scope="module")
def model() -> Any:
    return load_causal_lm(ensure_tiny_models().teacher)


@pytest.fixture(scope="module")
def real_model() -> Any:
    return load_causal_lm(ensure_real_vocab_model())


@pytest.fixture
async def started() -> AsyncIterator[Factory]:
    made: list[HFTeacher] = []

    async def make(**kw: Any) -> HFTeacher:
        t = HFTeacher(**kw)
        made.append(t)
        await t.start()
        return t

    yield make
    for t in made:
        await t.close()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=1, max_size=20), st.booleans())
def test_pack_places_every_token_once(lengths: list[int], varlen: bool) -> None:
    seqs = [np.arange(n, dtype=np.int32) + 100 * i for i, n in enumerate(lengths)]
    pk = pack(seqs, varlen)
    width = pk.ids.shape[1]
    assert width == (sum(lengths) if varlen else max(lengths))
    used = np.zeros(pk.ids.shape, bool)
    for s, (r, c) in zip(seqs, pk.where, strict=True):
        n = s.shape[0]
        assert not used[r, c : c + n].any()
        used[r, c : c + n] = True
        np.testing.assert_array_equal(pk.ids[r, c : c + n], s)
        np.testing.assert_array_equal(pk.positions[r, c : c + n], np.arange(n))
    # first-fit decreasing never needs more rows than twice the lower bound (and one row when varlen)
    assert pk.ids.shape[0] <= (1 if varlen else max(1, 2 * -(-sum(lengths) // width)))
    chunks = plan_packed_chunks(lengths, 64)
    assert sorted(i for c in chunks for i in c) == list(range(len(lengths)))
    assert all(len(c) == 1 or sum(lengths[i] for i in c) <= 64 for c in chunks)


def test_plan_rows_first_fit_decreasing() -> None:
    assert plan_rows([10, 3, 7, 5, 5], 10) == [[0], [2, 1], [3, 4]]


def _reqs(vocab: int, lengths: list[int], k: int, seed: int) -> list[ScoreRequest]:
    rng = np.random.default_rng(seed)
    out = []
    for j, n in enumerate(lengths):
        tokens = rng.integers(0, vocab, n).astype(np.int32)
        rows = None if j % 3 else np.sort(rng.choice(n - 1, max(1, (n - 1) // 2), replace=False)).astype(np.int32)
        out.append(ScoreRequest(tokens, k, rows))
    return out


def assert_same(a: list[Any], b: list[Any]) -> None:
    for x, y in zip(a, b, strict=True):
        assert isinstance(x, ScoreResult) and isinstance(y, ScoreResult)
        assert x.topk_ids.shape == y.topk_ids.shape
        np.testing.assert_allclose(x.topk_logprobs, y.topk_logprobs, atol=TOL, rtol=0)
        np.testing.assert_allclose(x.sampled_logprobs, y.sampled_logprobs, atol=TOL, rtol=0)
        assert (x.topk_ids == y.topk_ids).mean() > 0.99  # float ties aside, the same ids


async def test_packed_equals_padded_tiny(model: Any, started: Factory) -> None:
    lengths = [2, 300, 17, 64, 5, 129, 33, 250, 3, 90, 700]
    reqs = _reqs(model.config.vocab_size, lengths, 7, 0)
    packed = await started(model=model, max_batch_tokens=800, min_shared_prefix=0)
    padded = await started(model=model, max_batch_tokens=800, min_shared_prefix=0, pack=False)
    assert packed.packing and not padded.packing
    t0, p0 = packed.tokens_computed, padded.tokens_computed
    got, want = await packed.score(reqs), await padded.score(reqs)
    assert_same(got, want)
    needed = sum(int(r.row_index()[-1]) + 1 for r in reqs)  # through the last wanted row, nothing more
    assert packed.tokens_computed - t0 == needed == padded.tokens_computed - p0
    assert packed._fw is not None and packed._fw.counters.forward_calls >= 3  # the budget split the work


@pytest.mark.slow
async def test_packed_equals_padded_real_vocab(real_model: Any, started: Factory) -> None:
    """Real vocabulary, 4,000 tokens of unequal sequences, k=64: packed rows equal the padded batches."""
    lengths = [1024, 700, 1500, 300, 476]
    reqs = _reqs(REAL_VOCAB_SIZE, lengths, 64, 1)
    packed = await started(model=real_model, max_batch_tokens=2048, min_shared_prefix=0)
    padded = await started(model=real_model, max_batch_tokens=2048, min_shared_prefix=0, pack=False)
    assert packed.packing
    assert_same(await packed.score(reqs), await padded.score(reqs))


@pytest.mark.slow
async def test_shared_prefix_kept_with_packing(real_model: Any, started: Factory) -> None:
    rng = np.random.default_rng(5)
    prompt = rng.integers(0, REAL_VOCAB_SIZE, 80).astype(np.int32)
    seqs = [np.concatenate([prompt, rng.integers(0, REAL_VOCAB_SIZE, n).astype(np.int32)]) for n in (30, 60, 10)]
    seqs.append(rng.integers(0, REAL_VOCAB_SIZE, 90).astype(np.int32))
    seqs.append(rng.integers(0, REAL_VOCAB_SIZE, 40).astype(np.int32))
    reqs = [ScoreRequest(s, 20) for s in seqs]
    both = await started(model=real_model, min_shared_prefix=16)
    neither = await started(model=real_model, min_shared_prefix=0, pack=False)
    assert both.sharing and both.packing
    before = both.tokens_computed
    assert_same(await both.score(reqs), await neither.score(reqs))
    assert both.tokens_computed - before == sum(len(s) - 1 for s in seqs) - 2 * 80  # the prompt ran once


@pytest.mark.slow
async def test_half_precision_weights_float32_logsoftmax(real_model: Any, started: Factory) -> None:
    """bfloat16 weights: float32 logprobs that normalise, close to the float32 model's."""
    import copy

    half = copy.deepcopy(real_model).to(torch.bfloat16)
    reqs = _reqs(REAL_VOCAB_SIZE, [200, 90], 20, 2)
    t16 = await started(model=half, min_shared_prefix=0)
    t32 = await started(model=real_model, min_shared_prefix=0)
    assert t16.packing
    for a, b in zip(await t16.score(reqs), await t32.score(reqs), strict=True):
        assert isinstance(a, ScoreResult) and isinstance(b, ScoreResult)
        assert a.topk_logprobs.dtype == np.float32 and a.sampled_logprobs.dtype == np.float32
        assert np.isfinite(a.topk_logprobs).all() and (a.topk_logprobs <= 0).all()
        np.testing.assert_allclose(a.sampled_logprobs, b.sampled_logprobs, atol=0.1, rtol=0)


async def test_chunk_positions_from_free_memory(model: Any, started: Factory) -> None:
    n = auto_chunk_positions("cpu", REAL_VOCAB_SIZE, 4)
    assert 16 <= n <= 8192 and n * REAL_VOCAB_SIZE * 8 <= 1 << 30
    assert auto_chunk_positions("cpu", 10, 4) == 8192
    auto = await started(model=model, chunk_positions=None)
    fixed = await started(model=model, chunk_positions=7)
    reqs = _reqs(model.config.vocab_size, [50, 80], 5, 3)
    assert_same(await auto.score(reqs), await fixed.score(reqs))


def test_resolve_dtype() -> None:
    assert resolve_dtype("auto", "cpu") == "float32"
    assert resolve_dtype("auto", "cuda:1") == "bfloat16"
    assert resolve_dtype("float16", "cpu") == "float16"


def _args(*argv: str) -> argparse.Namespace:
    from workers.teacher import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_worker_flags_reach_the_backends() -> None:
    from pipeline.teacher.vllm_engine import VLLMEngineTeacher
    from workers.teacher import make_backend

    hf = make_backend(_args("--backend", "hf", "--model", "m", "--device", "cuda:1", "--dtype", "float16",
                            "--hf-chunk-positions", "auto"))  # fmt: skip
    assert isinstance(hf, HFTeacher) and hf.chunk_positions is None
    assert (hf._device, hf._dtype) == ("cuda:1", "float16")
    eng = make_backend(_args("--backend", "vllm-engine", "--model", "/m", "--top-k", "64", "--vllm-python", "/py",
                             "--tensor-parallel-size", "4", "--gpu-memory-utilization", "0.5",
                             "--vllm-max-logprobs", "300", "--vllm-enforce-eager"))  # fmt: skip
    assert isinstance(eng, VLLMEngineTeacher)
    c = eng.config
    assert (c.python, c.k, c.max_logprobs, c.tensor_parallel_size, c.gpu_memory_utilization) == ("/py", 64, 300, 4, 0.5)
    argv = c.argv()
    assert argv[:3] == ["/py", "-m", "pipeline.teacher.vllm_engine_proc"]
    assert argv[argv.index("--tensor-parallel-size") + 1] == "4" and "--enforce-eager" in argv
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.5"
    with pytest.raises(TeacherConfigError, match="not in"):
        make_backend(_args("--backend", "vllm-engine", "--model", "/m", "--gpu-memory-utilization", "1.5"))
