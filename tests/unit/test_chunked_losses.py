"""Chunked losses (``pipeline.learner.chunked``) against ``pipeline.learner.losses`` on full logits.

Values and gradients (hidden, weight, bias) at small shapes for every mode and reduction, empty masks, a
tiny transformers Llama, and (slow) the peak memory at the real vocabulary, measured in fresh subprocesses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from typing import get_args

import pytest

pytest.importorskip("torch")

import torch

from pipeline.learner import chunked as C
from pipeline.learner import losses as L

B, N, V, H, K = 3, 17, 1000, 32, 8
MODES = get_args(L.TopKMode)
REDUCTIONS: tuple[L.Reduction, ...] = get_args(L.Reduction)
# chunk size, with bias: 1, one that divides no mask's position count (asserted), one larger than everything
CASES = [(1, True), (7, False), (10_000, True)]
CASE_IDS = [f"chunk{c}-{'bias' if b else 'nobias'}" for c, b in CASES]
ATOL = RTOL = 1e-5


def _close(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL, msg=(lambda m: f"{what}: {m}") if what else None)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@dataclass
class Data:
    hidden: torch.Tensor  # [B, N, H], requires grad
    weight: torch.Tensor  # [V, H], requires grad
    bias: torch.Tensor | None  # [V], requires grad
    labels: torch.Tensor
    loss_mask: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    topk_ids: torch.Tensor
    topk_logprobs: torch.Tensor
    distill_mask: torch.Tensor
    out_weights: torch.Tensor  # [B, N] random weights to turn reduction="none" into a scalar

    def params(self) -> list[torch.Tensor]:
        return [self.hidden, self.weight] + ([] if self.bias is None else [self.bias])

    def logits(self) -> torch.Tensor:
        return torch.nn.functional.linear(self.hidden, self.weight, self.bias)


def _data(with_bias: bool, seed: int = 0) -> Data:
    g = _gen(seed)
    hidden = torch.randn(B, N, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.4
    bias = torch.randn(V, generator=g) * 0.5 if with_bias else None
    labels = torch.randint(0, V, (B, N), generator=g)
    loss_mask = (torch.rand(B, N, generator=g) > 0.3).float()
    loss_mask[0, 0] = 1.0
    loss_mask[1, -3:] = 0.0  # padding at the end of two sequences
    loss_mask[2, -6:] = 0.0
    with torch.no_grad():
        ref = L.token_logprobs(torch.nn.functional.linear(hidden, weight, bias), labels)
    # the sampler's logprobs: off by up to +-0.5 so that ratios fall on both sides of a 0.2 clip
    old = ref + (torch.rand(B, N, generator=g) - 0.5)
    advantages = torch.randn(B, N, generator=g)
    teacher = torch.randn(B, N, V, generator=g) * 4.0
    topk_logprobs, topk_ids = torch.log_softmax(teacher, -1).topk(K, dim=-1)
    topk_ids[0, ::2, 5:], topk_logprobs[0, ::2, 5:] = 0, L.PAD_LOGPROB  # rows with k = 5 < K
    topk_ids[2, 3, 1:], topk_logprobs[2, 3, 1:] = 0, L.PAD_LOGPROB  # a row with k = 1
    topk_ids[1], topk_logprobs[1] = 0, L.PAD_LOGPROB  # a sequence whose group has no teacher payload
    distill_mask = loss_mask.clone()
    distill_mask[1] = 0.0
    distill_mask[2, 5] = 1.0  # a trained position with no teacher entry at all
    topk_ids[2, 5], topk_logprobs[2, 5] = 0, L.PAD_LOGPROB
    return Data(
        hidden=hidden.requires_grad_(True),
        weight=weight.requires_grad_(True),
        bias=None if bias is None else bias.requires_grad_(True),
        labels=labels,
        loss_mask=loss_mask,
        old_logprobs=old,
        advantages=advantages,
        topk_ids=topk_ids,
        topk_logprobs=topk_logprobs,
        distill_mask=distill_mask,
        out_weights=torch.rand(B, N, generator=g) + 0.5,
    )


def _grads(out: torch.Tensor, d: Data) -> list[torch.Tensor]:
    scalar = out if out.dim() == 0 else (out * d.out_weights).sum()
    return list(torch.autograd.grad(scalar, d.params(), allow_unused=True, materialize_grads=True))


def _assert_same(
    chunked: Callable[[], torch.Tensor], reference: Callable[[], torch.Tensor], d: Data, nontrivial: bool = True
) -> None:
    got, ref = chunked(), reference()
    assert got.dtype == torch.float32 and got.shape == ref.shape
    _close(got, ref)
    got_g, ref_g = _grads(got, d), _grads(ref, d)
    for name, a, b in zip(["hidden", "weight", "bias"], got_g, ref_g, strict=False):
        assert torch.isfinite(a).all(), name
        _close(a, b, f"grad of {name}")
    if nontrivial:
        assert ref.abs().sum() > 1e-3 and all(g.abs().sum() > 1e-3 for g in ref_g)


@pytest.fixture(params=CASES, ids=CASE_IDS)
def case(request: pytest.FixtureRequest) -> tuple[int, Data]:
    chunk, with_bias = request.param
    d = _data(with_bias)
    if chunk == 7:
        assert int(d.loss_mask.sum()) % 7 and int(d.distill_mask.sum()) % 7  # the last chunk is partial
    return chunk, d


# --- equality with the full-logits losses ---------------------------------------------------------


def test_token_logprobs(case: tuple[int, Data]) -> None:
    chunk, d = case
    _assert_same(
        lambda: C.token_logprobs(d.hidden, d.weight, d.labels, bias=d.bias, chunk_size=chunk),
        lambda: L.token_logprobs(d.logits(), d.labels),
        d,
    )
    masked = C.token_logprobs(d.hidden, d.weight, d.labels, d.loss_mask, bias=d.bias, chunk_size=chunk)
    ref = L.token_logprobs(d.logits(), d.labels)
    on = d.loss_mask > 0
    _close(masked[on], ref[on])
    assert (masked[~on] == 0).all()


@pytest.mark.parametrize("clip", [None, 0.2])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_importance_sampled_pg_loss(case: tuple[int, Data], clip: float | None, reduction: L.Reduction) -> None:
    chunk, d = case
    old, adv, mask = d.old_logprobs, d.advantages, d.loss_mask
    with torch.no_grad():
        ratio = torch.exp(L.token_logprobs(d.logits(), d.labels) - d.old_logprobs)[d.loss_mask > 0]
    assert (ratio > 1.2).any() and (ratio < 0.8).any() and ((ratio - 1).abs() < 0.2).any()  # clip is exercised
    _assert_same(
        lambda: C.importance_sampled_pg_loss(
            d.hidden, d.weight, d.labels, old, adv, mask, clip, reduction=reduction, bias=d.bias, chunk_size=chunk
        ),
        lambda: L.importance_sampled_pg_loss(
            L.token_logprobs(d.logits(), d.labels), old, adv, mask, clip, reduction=reduction
        ),
        d,
    )


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_topk_forward_kl(case: tuple[int, Data], mode: L.TopKMode, reduction: L.Reduction) -> None:
    chunk, d = case
    ids, lps, mask = d.topk_ids, d.topk_logprobs, d.distill_mask
    _assert_same(
        lambda: C.topk_forward_kl(
            d.hidden, d.weight, ids, lps, mask, mode, reduction=reduction, bias=d.bias, chunk_size=chunk
        ),
        lambda: L.topk_forward_kl(d.logits(), ids, lps, mask, mode, reduction=reduction),
        d,
    )


@pytest.mark.parametrize(("beta", "tail"), [(0.0, True), (0.3, True), (1.0, True), (0.0, False), (0.7, False)])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_generalized_jsd(case: tuple[int, Data], beta: float, tail: bool, reduction: L.Reduction) -> None:
    chunk, d = case
    ids, lps, mask = d.topk_ids, d.topk_logprobs, d.distill_mask
    _assert_same(
        lambda: C.generalized_jsd(
            d.hidden, d.weight, ids, lps, mask, beta, reduction=reduction, tail=tail, bias=d.bias, chunk_size=chunk
        ),
        lambda: L.generalized_jsd(d.logits(), ids, lps, mask, beta, reduction=reduction, tail=tail),
        d,
    )


def test_tail_eps_is_passed_through() -> None:
    d = _data(False)
    ids, lps, mask = d.topk_ids, d.topk_logprobs.clone(), d.distill_mask
    lps[0, 0] = torch.log(torch.full((K,), (1 - 1e-5) / K))  # teacher tail 1e-5 sits between the two eps
    for eps in (1e-6, 1e-3):
        _assert_same(
            lambda eps=eps: C.topk_forward_kl(d.hidden, d.weight, ids, lps, mask, "tail", tail_eps=eps),  # type: ignore[misc]
            lambda eps=eps: L.topk_forward_kl(d.logits(), ids, lps, mask, "tail", tail_eps=eps),  # type: ignore[misc]
            d,
        )
    a = C.topk_forward_kl(d.hidden, d.weight, ids, lps, mask, "tail", tail_eps=1e-6)
    b = C.topk_forward_kl(d.hidden, d.weight, ids, lps, mask, "tail", tail_eps=1e-3)
    assert abs(a.item() - b.item()) > 1e-6


def test_one_shared_pass_for_labels_and_topk() -> None:
    """The recipe of the docs: one ``gather_logprobs`` for both losses, then the ``*_from_logprobs`` math."""
    d = _data(True)
    ids = torch.cat([d.labels[..., None], d.topk_ids], -1)
    union = torch.maximum(d.loss_mask, d.distill_mask)
    lp = C.gather_logprobs(d.hidden, d.weight, ids, union, bias=d.bias, chunk_size=6)
    pg = L.importance_sampled_pg_loss(lp[..., 0], d.old_logprobs, d.advantages, d.loss_mask, 0.2)
    kl = L.reduce_masked(C.topk_forward_kl_from_logprobs(lp[..., 1:], d.topk_logprobs), d.distill_mask)
    js = L.reduce_masked(C.generalized_jsd_from_logprobs(lp[..., 1:], d.topk_logprobs, 0.3), d.distill_mask)
    logits = d.logits()
    ref_pg = L.importance_sampled_pg_loss(
        L.token_logprobs(logits, d.labels), d.old_logprobs, d.advantages, d.loss_mask, 0.2
    )
    ref_kl = L.topk_forward_kl(logits, d.topk_ids, d.topk_logprobs, d.distill_mask)
    ref_js = L.generalized_jsd(logits, d.topk_ids, d.topk_logprobs, d.distill_mask, 0.3)
    _assert_same(lambda: pg + kl + js, lambda: ref_pg + ref_kl + ref_js, d)


# --- masks: nothing selected, garbage off the mask, frozen weights ---------------------------------


def _all_losses(d: Data, mask: torch.Tensor, reduction: L.Reduction, chunk: int) -> list[torch.Tensor]:
    h, w, r, bias = d.hidden, d.weight, reduction, d.bias
    ids, lps = d.topk_ids, d.topk_logprobs
    out = [
        C.importance_sampled_pg_loss(
            h, w, d.labels, d.old_logprobs, d.advantages, mask, 0.2, reduction=r, bias=bias, chunk_size=chunk
        ),
        *(C.topk_forward_kl(h, w, ids, lps, mask, m, reduction=r, bias=bias, chunk_size=chunk) for m in MODES),
        *(
            C.generalized_jsd(h, w, ids, lps, mask, beta, tail=tail, reduction=r, bias=bias, chunk_size=chunk)
            for beta, tail in [(0.0, True), (0.5, True), (1.0, True), (0.5, False)]
        ),
    ]
    if reduction == "none":
        out.append(C.token_logprobs(d.hidden, d.weight, d.labels, mask, bias=d.bias, chunk_size=chunk))
    return out


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("chunk", [1, 4])
def test_empty_mask_gives_zero_and_zero_gradients(reduction: L.Reduction, chunk: int) -> None:
    d = _data(True)
    empty = torch.zeros(B, N, dtype=torch.bool)
    for out in _all_losses(d, empty, reduction, chunk):
        assert out.shape == (() if reduction != "none" else (B, N))
        assert (out == 0).all()
        grads = _grads(out, d)
        assert len(grads) == 3
        for g in grads:
            assert torch.isfinite(g).all() and (g == 0).all()


def test_positions_off_the_mask_are_never_computed() -> None:
    d = _data(True)
    with torch.no_grad():
        d.hidden[d.distill_mask == 0] = float("nan")  # garbage wherever the mask is 0
    total = sum(o.sum() for o in _all_losses(d, d.distill_mask, "sum", 5))
    assert isinstance(total, torch.Tensor) and torch.isfinite(total) and total.item() != 0
    grads = torch.autograd.grad(total, d.params())
    assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)
    assert (grads[0][d.distill_mask == 0] == 0).all()  # no gradient reaches the unselected hidden states


def test_frozen_weight_and_detached_hidden() -> None:
    d = _data(True)
    w = d.weight.detach()
    ids, lps, mask = d.topk_ids, d.topk_logprobs, d.distill_mask
    out = C.topk_forward_kl(d.hidden, w, ids, lps, mask, bias=d.bias, chunk_size=3)
    (gh,) = torch.autograd.grad(out, [d.hidden])
    ref = L.topk_forward_kl(torch.nn.functional.linear(d.hidden, w, d.bias), ids, lps, mask)
    (rh,) = torch.autograd.grad(ref, [d.hidden])
    _close(gh, rh)
    h = d.hidden.detach()
    out = C.token_logprobs(h, d.weight, d.labels, chunk_size=4).sum()
    (gw,) = torch.autograd.grad(out, [d.weight])
    (rw,) = torch.autograd.grad(L.token_logprobs(h @ d.weight.T, d.labels).sum(), [d.weight])
    _close(gw, rw)


def test_bfloat16_weights_match_bfloat16_logits() -> None:
    d = _data(False)
    h = d.hidden.detach().bfloat16().requires_grad_(True)
    w = d.weight.detach().bfloat16().requires_grad_(True)
    ids, lps, mask = d.topk_ids, d.topk_logprobs, d.distill_mask
    got = C.topk_forward_kl(h, w, ids, lps, mask, "tail", chunk_size=5)
    ref = L.topk_forward_kl(h @ w.T, ids, lps, mask, "tail")
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    gh, gw = torch.autograd.grad(got, [h, w])
    rh, rw = torch.autograd.grad(ref, [h, w])
    assert gh.dtype == gw.dtype == torch.bfloat16
    torch.testing.assert_close(gh.float(), rh.float(), atol=2e-3, rtol=2e-2)
    torch.testing.assert_close(gw.float(), rw.float(), atol=2e-3, rtol=2e-2)


def test_bad_arguments_raise() -> None:
    d = _data(False)
    ids, lps, mask = d.topk_ids, d.topk_logprobs, d.distill_mask
    with pytest.raises(ValueError, match="shape mismatch"):
        C.topk_forward_kl(d.hidden[:, :-1], d.weight, ids, lps, mask)  # [B, N-1, H]
    with pytest.raises(ValueError, match="shape mismatch"):
        C.topk_forward_kl(d.hidden, d.weight.T, ids, lps, mask)  # [H, V]
    with pytest.raises(ValueError, match="shape mismatch"):
        C.generalized_jsd(d.hidden, d.weight, ids, lps, mask[:, :-1])
    with pytest.raises(ValueError, match="shape mismatch"):
        C.token_logprobs(d.hidden, d.weight, d.labels, bias=torch.zeros(V + 1))
    with pytest.raises(ValueError, match="unknown top-k KL mode"):
        C.topk_forward_kl(d.hidden, d.weight, ids, lps, mask, "bogus")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="beta"):
        C.generalized_jsd(d.hidden, d.weight, ids, lps, mask, 1.5)
    with pytest.raises(ValueError, match="clip"):
        C.importance_sampled_pg_loss(d.hidden, d.weight, d.labels, d.old_logprobs, d.advantages, mask, clip=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        C.token_logprobs(d.hidden, d.weight, d.labels, chunk_size=0)


# --- a tiny transformers Llama: where the hidden states and the head are --------------------------


def test_tiny_llama_hidden_states_and_lm_head() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=1000,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 1000, (2, 12), generator=_gen(1))
    attention = torch.ones_like(ids)
    attention[1, -3:] = 0  # right padding
    full = model(input_ids=ids, attention_mask=attention, output_hidden_states=True)
    hidden = model.model(input_ids=ids, attention_mask=attention).last_hidden_state
    assert hidden.shape == (2, 12, 32) and model.lm_head.bias is None
    _close(model.lm_head(hidden), full.logits)
    _close(full.hidden_states[-1], hidden)  # hidden_states[-1] is after the final norm

    labels, mask = ids[:, 1:], attention[:, 1:].float()
    ref = torch.log_softmax(full.logits[:, :-1].float(), -1).gather(-1, labels[..., None])[..., 0]
    got = C.token_logprobs(hidden[:, :-1], model.lm_head.weight, labels, chunk_size=5)
    _close(got, ref)

    teacher = torch.randn(2, 11, 1000, generator=_gen(2)) * 3
    lps, top = torch.log_softmax(teacher, -1).topk(8, dim=-1)
    params = [model.lm_head.weight, model.model.layers[0].mlp.up_proj.weight]
    loss = C.topk_forward_kl(hidden[:, :-1], model.lm_head.weight, top, lps, mask, "tail", chunk_size=4)
    grads = torch.autograd.grad(loss, params)
    ref_loss = L.topk_forward_kl(full.logits[:, :-1], top, lps, mask, "tail")
    ref_grads = torch.autograd.grad(ref_loss, params)
    _close(loss, ref_loss)
    for a, b in zip(grads, ref_grads, strict=True):
        assert b.abs().sum() > 0
        _close(a, b)


@pytest.mark.slow
def test_real_vocab_model_chunked_losses_equal_the_logits_losses() -> None:
    """The realistic-shape model (vocabulary 151,936): hidden states + lm_head through the chunked losses
    equal the losses on the model's own logits, value and lm_head gradient."""
    from pipeline.demo.tinymodels import ensure_real_vocab_model
    from pipeline.models.weights import load_causal_lm

    model = load_causal_lm(ensure_real_vocab_model())
    v = model.config.vocab_size
    assert v == 151_936
    ids = torch.randint(0, v, (2, 160), generator=_gen(3))
    attention = torch.ones_like(ids)
    attention[1, -40:] = 0
    hidden = model.model(input_ids=ids, attention_mask=attention).last_hidden_state
    logits = model(input_ids=ids, attention_mask=attention).logits
    labels, mask = ids[:, 1:], attention[:, 1:].float()
    mask[:, :50] = 0  # a prompt: untrained positions cost nothing in the chunked path
    top = torch.randint(0, v, (2, 159, 64), generator=_gen(4))
    lps = torch.log_softmax(torch.randn(2, 159, 64, generator=_gen(5)), -1) - 2.0
    w = model.lm_head.weight
    for chunked, ref in (
        (lambda: C.topk_forward_kl(hidden[:, :-1], w, top, lps, mask, "tail", chunk_size=64),
         lambda: L.topk_forward_kl(logits[:, :-1], top, lps, mask, "tail")),
        (lambda: C.generalized_jsd(hidden[:, :-1], w, top, lps, mask, 0.5, chunk_size=100),
         lambda: L.generalized_jsd(logits[:, :-1], top, lps, mask, 0.5)),
    ):
        got, want = chunked(), ref()
        (g_got,) = torch.autograd.grad(got, [w], retain_graph=True)
        (g_want,) = torch.autograd.grad(want, [w], retain_graph=True)
        _close(got, want)
        assert g_want.abs().sum() > 0
        _close(g_got, g_want)
    got_lp = C.token_logprobs(hidden[:, :-1], w, labels, mask, chunk_size=37)
    want_lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, labels[..., None])[..., 0] * mask
    _close(got_lp, want_lp)


# --- peak memory at the real vocabulary, in fresh subprocesses ------------------------------------

_CHILD = textwrap.dedent(
    """
    import json, sys, torch
    torch.set_num_threads(1)
    from pipeline.learner import chunked as C, losses as L

    def vm(key):
        with open("/proc/self/status") as f:
            return next(int(x.split()[1]) * 1024 for x in f if x.startswith(key + ":"))

    def setup(b, n, v, h, k):
        g = torch.Generator().manual_seed(0)
        hidden = torch.randn(b, n, h, generator=g).requires_grad_(True)
        weight = (torch.randn(v, h, generator=g) * 0.05).requires_grad_(True)
        ids = torch.randint(0, v, (b, n, k), generator=g)
        lps = torch.log_softmax(torch.randn(b, n, k, generator=g), -1) - 1.0
        mask = torch.ones(b, n)
        if sys.argv[1] == "chunked":
            return lambda: C.topk_forward_kl(hidden, weight, ids, lps, mask, "tail", chunk_size=int(sys.argv[7]))
        return lambda: L.topk_forward_kl(hidden @ weight.T, ids, lps, mask, "tail")

    b, n, v, h, k = (int(x) for x in sys.argv[2:7])
    setup(2, 8, 1000, h, k)().backward()  # warm-up: lazy allocations happen outside the measurement
    loss_fn = setup(b, n, v, h, k)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to VmRSS where allowed; otherwise the delta is an upper bound
    except OSError:
        pass
    before = vm("VmRSS")
    loss = loss_fn()
    loss.backward()
    print(json.dumps({"peak_delta": vm("VmHWM") - before, "loss": loss.item()}))
    """
)


def _peak(kind: str, b: int, n: int, v: int, h: int, k: int, chunk: int) -> dict[str, float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = [sys.executable, "-c", _CHILD, kind, *(str(x) for x in (b, n, v, h, k, chunk))]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=100, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out: dict[str, float] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


@pytest.mark.slow
def test_peak_memory_at_real_vocab_is_bounded_by_the_chunk() -> None:
    b, n, v, h, k, chunk = 2, 512, 151_936, 64, 8, 128
    full_logits = b * n * v * 4  # one float32 [B, N, V] tensor: 622 MB
    chunked = _peak("chunked", b, n, v, h, k, chunk)
    unchunked = _peak("unchunked", b, n, v, h, k, chunk)
    assert chunked["loss"] == pytest.approx(unchunked["loss"], rel=1e-5)
    assert unchunked["peak_delta"] > full_logits, unchunked  # the measurement sees the full-logits path
    # one chunk of float32 logits (78 MB) + the float32 weight gradient (39 MB) + slack
    assert chunked["peak_delta"] < 0.25 * full_logits, chunked
