"""Local HF teacher: batched, row-selected, chunked and prefix-shared scoring equals an independent
full-logits forward pass of each sequence to 1e-5, at the tiny vocabulary and at 151,936 tokens."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM

from pipeline.demo.tinymodels import REAL_VOCAB_SIZE, ensure_real_vocab_model, ensure_tiny_models
from pipeline.models.weights import load_causal_lm
from pipeline.stages.scoring import Scorer, ScoringConfig
from pipeline.teacher.base import ScoreFailure, ScoreRequest, ScoreResult, plan_chunks
from pipeline.teacher.hf import HFTeacher
from pipeline.teacher.hf_prefix import plan_prefix_groups, planned_tokens
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


def reference(
    model: Any, tokens: np.ndarray, k: int, rows: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One sequence alone, no padding, no mask, the full ``[L, V]`` logits: log-softmax, top-k, sampled-token
    logprob, at ``rows`` (all when None)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(tokens[None].astype(np.int64))).logits[0, :-1]
    r = torch.arange(len(tokens) - 1) if rows is None else torch.from_numpy(rows.astype(np.int64))
    lp = torch.log_softmax(logits[r].double(), dim=-1)
    top = torch.topk(lp, k, dim=-1)
    sampled = lp[torch.arange(len(r)), torch.from_numpy(tokens.astype(np.int64))[r + 1]]
    return top.indices.numpy(), top.values.numpy(), sampled.numpy()


def assert_matches(model: Any, tokens: np.ndarray, res: ScoreResult, k: int, rows: np.ndarray | None = None) -> None:
    ids, lps, sampled = reference(model, tokens, k, rows)
    n = len(tokens) - 1 if rows is None else len(rows)
    assert res.topk_ids.dtype == np.int32 and res.topk_logprobs.dtype == np.float32
    assert res.topk_ids.shape == (n, k) and res.sampled_logprobs.shape == (n,)
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
            rows = t.row_index(len(tok))
            np.testing.assert_array_equal(rows, np.flatnonzero(seq.loss_mask.numpy()[1:]))  # the trained rows only
            assert_matches(model, tok, res, s.k, rows)


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
        ScoreRequest(np.array([1, 2, 3], np.int32), 2, np.array([0, 2], np.int32)),  # row 2 needs a 4th token
        ScoreRequest(np.array([1, 2, 3, 4], np.int32), 2, np.array([1, 1], np.int32)),
        ScoreRequest(np.array([1, 2, 3, 4], np.int32), 2, np.array([-1, 1], np.int32)),
        ScoreRequest(np.array([1, 2, 3, 4], np.int32), 2, np.array([[0, 1]], np.int32)),
        ScoreRequest(np.array([1, 2, 3, 4], np.int32), 2, np.zeros(0, np.int32)),
        ScoreRequest(np.array([1, 2, 3, 4], np.int32), 2, np.array([2], np.int32)),
    ]
    out = await teacher.score(reqs)
    assert isinstance(out[0], ScoreFailure) and out[0].reason.startswith("k_over_cap") and not out[0].retryable
    assert isinstance(out[1], ScoreFailure) and "token id" in out[1].reason
    assert isinstance(out[2], ScoreResult) and out[2].topk_ids.shape == (0, 3)
    assert isinstance(out[3], ScoreFailure) and isinstance(out[4], ScoreFailure)
    assert isinstance(out[5], ScoreResult)  # full vocabulary: k = max_k works
    assert_matches(model, reqs[5].tokens, out[5], v)
    assert isinstance(out[6], ScoreFailure) and "outside" in out[6].reason
    assert isinstance(out[7], ScoreFailure) and "increasing" in out[7].reason
    assert isinstance(out[8], ScoreFailure) and "outside" in out[8].reason
    assert isinstance(out[9], ScoreFailure) and "1-D" in out[9].reason
    assert isinstance(out[10], ScoreResult) and out[10].topk_ids.shape == (0, 2)
    assert isinstance(out[11], ScoreResult)
    assert_matches(model, reqs[11].tokens, out[11], 2, np.array([2]))


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


# --- real vocabulary (151,936): chunked lm_head, row selection, prefix sharing, memory -------------------------

REAL_K = 16


@pytest.fixture(scope="module")
def real_model() -> Any:
    model = load_causal_lm(ensure_real_vocab_model())
    assert model.config.vocab_size == REAL_VOCAB_SIZE and model.config.max_position_embeddings == 32768
    assert model.config.hidden_size // model.config.num_attention_heads >= 32  # vLLM's CPU backend needs it
    return model


def full_logprobs(model: Any, tokens: np.ndarray) -> torch.Tensor:
    """``[L - 1, V]`` float64 log-softmax of the full model's logits (the unchunked computation)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(tokens[None].astype(np.int64))).logits[0, :-1]
    return torch.log_softmax(logits.double(), dim=-1)


def assert_rows_match(full: torch.Tensor, tokens: np.ndarray, rows: np.ndarray, res: ScoreResult, k: int) -> None:
    """``res`` holds ``rows`` of ``full``: top-k values, sampled logprobs, and ids (up to float ties: each id
    must carry its reported logprob in the reference, and no id may repeat)."""
    lp = full[torch.from_numpy(rows.astype(np.int64))]
    top = torch.topk(lp, k, dim=-1)
    assert res.topk_ids.shape == (len(rows), k) and res.sampled_logprobs.shape == (len(rows),)
    np.testing.assert_allclose(res.topk_logprobs, top.values.numpy(), atol=TOL, rtol=0)
    want_sampled = lp[torch.arange(len(rows)), torch.from_numpy(tokens[rows + 1].astype(np.int64))]
    np.testing.assert_allclose(res.sampled_logprobs, want_sampled.numpy(), atol=TOL, rtol=0)
    at_ids = lp.gather(1, torch.from_numpy(res.topk_ids.astype(np.int64))).numpy()
    np.testing.assert_allclose(at_ids, res.topk_logprobs, atol=TOL, rtol=0)
    assert all(len(set(r)) == k for r in res.topk_ids.tolist())
    assert (res.topk_ids == top.indices.numpy()).mean() > 0.99  # ties aside, the very same ids


@pytest.mark.slow
async def test_real_vocab_chunked_equals_full_logits(real_model: Any, started: Factory) -> None:
    """Chunk sizes 1, 7 (not dividing), 64, and one chunk for all rows; rows=None and a random subset."""
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, REAL_VOCAB_SIZE, 301).astype(np.int32)
    full = full_logprobs(real_model, tokens)
    subset = np.sort(rng.choice(300, 37, replace=False)).astype(np.int32)
    outs: dict[int, ScoreResult] = {}
    for chunk in (1, 7, 64, 1000):
        teacher = await started(model=real_model, chunk_positions=chunk)
        assert teacher.split_head and teacher.max_k == REAL_VOCAB_SIZE
        rows_before = teacher.rows_computed
        res, sub = await teacher.score([ScoreRequest(tokens, REAL_K), ScoreRequest(tokens, REAL_K, subset)])
        assert isinstance(res, ScoreResult) and isinstance(sub, ScoreResult)
        assert teacher.rows_computed - rows_before == 300 + 37
        assert_rows_match(full, tokens, np.arange(300), res, REAL_K)
        assert_rows_match(full, tokens, subset, sub, REAL_K)
        for a, b in (
            (sub.topk_logprobs, res.topk_logprobs[subset]),
            (sub.sampled_logprobs, res.sampled_logprobs[subset]),
        ):
            np.testing.assert_allclose(a, b, atol=TOL, rtol=0)  # the subset equals the same rows of the full result
        outs[chunk] = res
    for chunk in (1, 7, 64):
        np.testing.assert_allclose(outs[chunk].topk_logprobs, outs[1000].topk_logprobs, atol=TOL, rtol=0)


def group_with_prompt(
    rng: np.random.Generator, prompt: int, tails: list[int], diverge_at: int | None
) -> list[np.ndarray]:
    """Sequences sharing a ``prompt``-token prompt with tails of the given lengths; with ``diverge_at`` the last
    sequence's prompt differs from position ``diverge_at`` on."""
    shared = rng.integers(0, REAL_VOCAB_SIZE, prompt).astype(np.int32)
    seqs = [np.concatenate([shared, rng.integers(0, REAL_VOCAB_SIZE, n).astype(np.int32)]) for n in tails]
    if diverge_at is not None:
        seqs[-1][diverge_at:prompt] = rng.integers(0, REAL_VOCAB_SIZE, prompt - diverge_at)
    return seqs


@pytest.mark.slow
async def test_prefix_sharing_equals_no_sharing(real_model: Any, started: Factory) -> None:
    """A group whose tails differ in length and whose last sequence diverges inside the prompt, plus an unrelated
    sequence, in one call; continuations split over several forwards over the same prefix cache."""
    rng = np.random.default_rng(4)
    seqs = group_with_prompt(rng, 96, [40, 130, 7, 64, 50], diverge_at=50)
    seqs.append(rng.integers(0, 1000, 80).astype(np.int32))
    reqs = [ScoreRequest(s, REAL_K, np.arange(95, len(s) - 1, dtype=np.int32)) for s in seqs[:5]]  # completion rows
    reqs[1] = ScoreRequest(seqs[1], REAL_K)  # all rows: the prompt rows read the prefix's hidden states
    reqs.append(ScoreRequest(seqs[5], 3))
    shared = await started(model=real_model, max_batch_tokens=400, chunk_positions=50, min_shared_prefix=16)
    plain = await started(model=real_model, min_shared_prefix=0)
    assert shared.sharing and not plain.sharing
    t0, p0 = shared.tokens_computed, plain.tokens_computed
    got, want = await shared.score(reqs), await plain.score(reqs)
    for req, a, b in zip(reqs, got, want, strict=True):
        assert isinstance(a, ScoreResult) and isinstance(b, ScoreResult)
        np.testing.assert_allclose(a.topk_logprobs, b.topk_logprobs, atol=TOL, rtol=0)
        np.testing.assert_allclose(a.sampled_logprobs, b.sampled_logprobs, atol=TOL, rtol=0)
        assert (a.topk_ids == b.topk_ids).mean() > 0.99
        assert a.topk_ids.shape == (req.n_rows, req.k)
    full, all_rows = full_logprobs(real_model, seqs[1]), got[1]
    assert isinstance(all_rows, ScoreResult)
    assert_rows_match(full, seqs[1], np.arange(len(seqs[1]) - 1), all_rows, REAL_K)  # both equal the reference
    # Without sharing every sequence runs through its last wanted row: L - 1 tokens each.
    needed = [len(r.tokens) - 1 for r in reqs]
    assert plain.tokens_computed - p0 == sum(needed)
    # Sharing: the four agreeing sequences run the 96-token prompt once; the diverging one (it shares 50 tokens:
    # sharing them would recompute 46 tokens for each of the four) and the unrelated one run alone.
    assert shared.tokens_computed - t0 == sum(needed) - 3 * 96


def test_plan_prefix_groups_picks_the_cheapest_partition() -> None:
    rng = np.random.default_rng(5)
    prompt = rng.integers(0, 1000, 100).astype(np.int32)
    seqs = [np.concatenate([prompt, rng.integers(0, 1000, 50).astype(np.int32)]) for _ in range(8)]
    seqs[7][40:100] = rng.integers(1000, 2000, 60)  # diverges inside the prompt
    seqs.append(prompt[:30].copy())  # shares only 30 tokens
    groups = plan_prefix_groups(seqs, min_prefix=32)
    assert sorted(m for g in groups for m in g.members) == list(range(9))
    by_member = {m: g for g in groups for m in g.members}
    assert sorted(by_member[0].members) == list(range(7)) and by_member[0].prefix == 100
    assert by_member[8].prefix == 0 and by_member[7].prefix == 0  # 7 alone beats all 8 sharing 40 tokens
    assert planned_tokens(seqs, groups) == 7 * 150 - 6 * 100 + 150 + 30
    same = [prompt.copy() for _ in range(3)]  # identical: share all but the last token
    (g,) = plan_prefix_groups(same, min_prefix=8)
    assert g.prefix == 99 and sorted(g.members) == [0, 1, 2]
    assert all(g.prefix == 0 for g in plan_prefix_groups(same, min_prefix=100))


class SoftcapLlama(LlamaForCausalLM):  # type: ignore[no-untyped-call]
    """Logits are not lm_head(hidden): a tanh softcap after it (as Gemma 2 does)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = super().forward(*args, **kwargs)
        out.logits = 2.0 * torch.tanh(out.logits / 2.0)
        return out


async def test_fallback_when_logits_are_not_lm_head_of_hidden(model: Any, started: Factory) -> None:
    capped = SoftcapLlama(model.config)
    capped.load_state_dict(model.state_dict())
    capped.eval()  # type: ignore[no-untyped-call]
    teacher = await started(model=capped, max_batch_tokens=200)
    assert not teacher.split_head and not teacher.sharing
    rng = np.random.default_rng(6)
    prompt = rng.integers(0, teacher.max_k, 40).astype(np.int32)
    seqs = [np.concatenate([prompt, rng.integers(0, teacher.max_k, n).astype(np.int32)]) for n in (30, 9, 61)]
    reqs = [ScoreRequest(s, 5, np.arange(39, len(s) - 1, dtype=np.int32)) for s in seqs]
    for req, res in zip(reqs, await teacher.score(reqs), strict=True):
        assert isinstance(res, ScoreResult)
        assert_matches(capped, req.tokens, res, 5, req.rows)
    plain = await started(model=model)  # the same weights without the cap give other logprobs: the cap was applied
    (uncapped,), (again,) = await plain.score(reqs[:1]), await teacher.score(reqs[:1])
    assert isinstance(uncapped, ScoreResult) and isinstance(again, ScoreResult)
    assert np.abs(uncapped.topk_logprobs - again.topk_logprobs).max() > 1e-3


PEAK_SCRIPT = """
import json, sys
import numpy as np, torch
from pipeline.demo.tinymodels import ensure_real_vocab_model
from pipeline.models.weights import load_causal_lm
from pipeline.teacher.base import ScoreRequest, ScoreResult
from pipeline.teacher.hf import HFTeacher
import asyncio

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024

torch.set_num_threads(1)
model = load_causal_lm(ensure_real_vocab_model())
rng = np.random.default_rng(0)
reqs = [ScoreRequest(rng.integers(0, model.config.vocab_size, 2048).astype(np.int32), 64) for _ in range(4)]
teacher = HFTeacher(model=model)
asyncio.run(teacher.start())
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM := VmRSS
rss = status("VmRSS")
out = teacher.score_sync(reqs)
assert all(isinstance(o, ScoreResult) and o.topk_ids.shape == (2047, 64) for o in out)
print(json.dumps({"delta": status("VmHWM") - rss, "rows": teacher.rows_computed}))
"""


@pytest.mark.slow
def test_peak_memory_at_real_vocab_is_far_below_full_logits() -> None:
    """4 x 2048 tokens, k=64, V=151,936 in a fresh process: the peak RSS above the loaded model stays far below
    the ``[tokens, V]`` float32 logits (5 GB) the unchunked computation needs."""
    ensure_real_vocab_model()
    proc = subprocess.run([sys.executable, "-c", PEAK_SCRIPT], capture_output=True, text=True, timeout=110, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    full_logits = 4 * 2048 * REAL_VOCAB_SIZE * 4
    assert res["rows"] >= 4 * 2047
    assert res["delta"] < full_logits / 8, f"peak {res['delta'] / 2**20:.0f} MiB above the model"
