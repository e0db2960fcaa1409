"""Distillation losses against full-vocabulary and float64 references, gradients, and a tiny real model."""

from __future__ import annotations

import math
from typing import get_args

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import schemas  # noqa: E402
from pipeline.learner import losses as L  # noqa: E402
from pipeline.learner.torch_batch import TorchBatch, to_torch  # noqa: E402
from schemas.build import make_sequence, make_teacher  # noqa: E402
from schemas.validate import Limits  # noqa: E402

MODES = get_args(L.TopKMode)
BETAS = (0.0, 0.1, 0.5, 0.9, 1.0)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _logits(b: int, n: int, v: int, seed: int, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(b, n, v, generator=_gen(seed)) * scale


def _topk(teacher_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    vals, ids = torch.log_softmax(teacher_logits, -1).topk(k, dim=-1)
    return ids, vals


def _mask(b: int, n: int, seed: int) -> torch.Tensor:
    m = (torch.rand(b, n, generator=_gen(seed)) > 0.3).float()
    m[0, 0] = 1.0
    return m


def _np_log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _ref_topk(s_logits: torch.Tensor, ids: torch.Tensor, t_lps: torch.Tensor, mask: torch.Tensor, mode: str) -> float:
    """Straight float64 loops over positions, written independently of the library."""
    ls = _np_log_softmax(s_logits.double().numpy())
    total, count = 0.0, 0.0
    for b in range(ids.shape[0]):
        for n in range(ids.shape[1]):
            if not mask[b, n]:
                continue
            keep = t_lps[b, n].double().numpy() > L.PAD_LOGPROB / 2
            pt = np.exp(t_lps[b, n].double().numpy()[keep])
            ps = np.exp(ls[b, n, ids[b, n].numpy()[keep]])
            if mode == "renormalized":
                pt, ps = pt / pt.sum(), ps / ps.sum()
            elif mode == "tail":
                pt = np.append(pt, max(1 - pt.sum(), L.TAIL_EPS))
                ps = np.append(ps, max(1 - ps.sum(), L.TAIL_EPS))
            total += float((pt * (np.log(pt) - np.log(ps))).sum())
            count += 1
    return total / count


def _ref_gjsd(p_t: np.ndarray, p_s: np.ndarray, beta: float) -> float:
    """TRL's definition on probability vectors (float64), summed over the last axis, mean over rows."""

    def kl(p: np.ndarray, q: np.ndarray) -> np.ndarray:
        return np.where(p > 0, p * (np.log(np.maximum(p, 1e-300)) - np.log(q)), 0.0).sum(-1)

    if beta == 0:
        return float(kl(p_t, p_s).mean())
    if beta == 1:
        return float(kl(p_s, p_t).mean())
    m = beta * p_t + (1 - beta) * p_s
    return float((beta * kl(p_t, m) + (1 - beta) * kl(p_s, m)).mean())


# --- exactness against full-vocabulary references -------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_topk_with_k_equal_vocab_is_exact_forward_kl(mode: str) -> None:
    s, t = _logits(3, 7, 50, 1), _logits(3, 7, 50, 2)
    mask = _mask(3, 7, 3)
    ids, lps = _topk(t, 50)
    got = L.topk_forward_kl(s, ids, lps, mask, mode)  # type: ignore[arg-type]
    ref = L.full_vocab_kl(s, t, mask, "forward")
    assert ref.item() > 0.5
    assert got.item() == pytest.approx(ref.item(), abs=1e-5)


def test_full_vocab_kl_matches_float64() -> None:
    s, t = _logits(2, 4, 30, 4), _logits(2, 4, 30, 5)
    mask = torch.ones(2, 4)
    ls, lt = _np_log_softmax(s.double().numpy()), _np_log_softmax(t.double().numpy())
    fwd = (np.exp(lt) * (lt - ls)).sum(-1).mean()
    rev = (np.exp(ls) * (ls - lt)).sum(-1).mean()
    assert L.full_vocab_kl(s, t, mask, "forward").item() == pytest.approx(fwd, abs=1e-5)
    assert L.full_vocab_kl(s, t, mask, "reverse").item() == pytest.approx(rev, abs=1e-5)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("k", [1, 3, 10])
def test_topk_with_small_k_matches_float64_reference(mode: str, k: int) -> None:
    s, t = _logits(2, 6, 40, 6), _logits(2, 6, 40, 7, scale=3.0)
    mask = _mask(2, 6, 8)
    ids, lps = _topk(t, k)
    if k > 1:  # one row carries fewer entries (padded slots), as in a batch mixing k
        ids[1, 2, -1], lps[1, 2, -1] = 0, L.PAD_LOGPROB
        mask[1, 2] = 1.0
    got = L.topk_forward_kl(s, ids, lps, mask, mode)  # type: ignore[arg-type]
    assert got.item() == pytest.approx(_ref_topk(s, ids, lps, mask, mode), rel=1e-4, abs=1e-6)


def test_k1_tail_is_not_trivially_zero_but_renormalized_is() -> None:
    s, t = _logits(2, 5, 20, 9), _logits(2, 5, 20, 10)
    ids, lps = _topk(t, 1)
    mask = torch.ones(2, 5)
    assert L.topk_forward_kl(s, ids, lps, mask, "renormalized").item() == pytest.approx(0.0, abs=1e-7)
    assert L.topk_forward_kl(s, ids, lps, mask, "tail").item() > 0.05


@pytest.mark.parametrize("beta", BETAS)
def test_gjsd_with_k_equal_vocab_matches_full_vocab_jsd(beta: float) -> None:
    s, t = _logits(3, 5, 40, 11), _logits(3, 5, 40, 12)
    mask = torch.ones(3, 5)
    ids, lps = _topk(t, 40)
    p_s = np.exp(_np_log_softmax(s.double().numpy())).reshape(-1, 40)
    p_t = np.exp(_np_log_softmax(t.double().numpy())).reshape(-1, 40)
    ref = _ref_gjsd(p_t, p_s, beta)
    assert ref > 0.01
    assert L.generalized_jsd(s, ids, lps, mask, beta).item() == pytest.approx(ref, abs=1e-5)


def test_gjsd_endpoints_are_forward_and_reverse_kl() -> None:
    s, t = _logits(2, 4, 25, 13), _logits(2, 4, 25, 14)
    mask = _mask(2, 4, 15)
    ids, lps = _topk(t, 25)
    fwd, rev = L.full_vocab_kl(s, t, mask, "forward"), L.full_vocab_kl(s, t, mask, "reverse")
    assert L.generalized_jsd(s, ids, lps, mask, 0.0).item() == pytest.approx(fwd.item(), abs=1e-5)
    assert L.generalized_jsd(s, ids, lps, mask, 1.0).item() == pytest.approx(rev.item(), abs=1e-5)


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("tail", [True, False])
def test_gjsd_small_k_matches_reference_on_topk_support(beta: float, tail: bool) -> None:
    s, t = _logits(2, 3, 30, 16), _logits(2, 3, 30, 17)
    ids, lps = _topk(t, 4)
    mask = torch.ones(2, 3)
    ls = _np_log_softmax(s.double().numpy())
    p_t = np.exp(lps.double().numpy()).reshape(-1, 4)
    p_s = np.exp(np.take_along_axis(ls, ids.numpy(), -1)).reshape(-1, 4)
    if tail:
        p_t = np.concatenate([p_t, 1 - p_t.sum(-1, keepdims=True)], -1)
        p_s = np.concatenate([p_s, 1 - p_s.sum(-1, keepdims=True)], -1)
    else:
        p_t, p_s = p_t / p_t.sum(-1, keepdims=True), p_s / p_s.sum(-1, keepdims=True)
    got = L.generalized_jsd(s, ids, lps, mask, beta, tail=tail)
    assert got.item() == pytest.approx(_ref_gjsd(p_t, p_s, beta), rel=1e-4, abs=1e-6)


# --- masking, padding, reductions -------------------------------------------------------------------


def test_reductions_and_masked_garbage_never_leak() -> None:
    s, t = _logits(2, 4, 16, 18), _logits(2, 4, 16, 19)
    ids, lps = _topk(t, 5)
    mask = torch.tensor([[1.0, 0, 1, 0], [0, 0, 0, 1]])
    ids[0, 1], lps[0, 1] = 0, L.PAD_LOGPROB  # a position with no teacher entries at all (masked)
    s[1, 0] = float("nan")  # garbage logits where the mask is 0
    per = L.topk_forward_kl(s, ids, lps, mask, "tail", reduction="none")
    assert per.shape == (2, 4) and torch.isfinite(per).all()
    assert (per[mask == 0] == 0).all() and (per[mask == 1] > 0).all()
    assert L.topk_forward_kl(s, ids, lps, mask, "tail", reduction="sum").item() == pytest.approx(per.sum().item())
    mean = L.topk_forward_kl(s, ids, lps, mask, "tail")
    assert mean.item() == pytest.approx(per.sum().item() / 3)
    assert L.topk_forward_kl(s, ids, lps, torch.zeros(2, 4), "tail").item() == 0.0


def test_all_padded_slots_give_zero_loss_and_finite_gradients() -> None:
    s = _logits(1, 3, 12, 20).requires_grad_(True)
    ids = torch.zeros(1, 3, 4, dtype=torch.long)
    lps = torch.full((1, 3, 4), L.PAD_LOGPROB)
    mask = torch.ones(1, 3)
    total = sum(L.topk_forward_kl(s, ids, lps, mask, m) for m in MODES) + sum(
        L.generalized_jsd(s, ids, lps, mask, b) for b in BETAS
    )
    assert isinstance(total, torch.Tensor)
    total.backward()
    assert total.item() == pytest.approx(0.0, abs=1e-6)
    assert s.grad is not None and torch.isfinite(s.grad).all()


def test_shape_mismatch_and_bad_arguments_raise() -> None:
    s, t = _logits(1, 4, 10, 21), _logits(1, 4, 10, 22)
    ids, lps = _topk(t, 3)
    mask = torch.ones(1, 4)
    with pytest.raises(ValueError, match="shape mismatch"):
        L.topk_forward_kl(torch.cat([s, s[:, :1]], 1), ids, lps, mask)  # [B, T, V] instead of [B, T-1, V]
    with pytest.raises(ValueError):
        L.topk_forward_kl(s, ids, lps, mask, "bogus")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        L.generalized_jsd(s, ids, lps, mask, 1.5)
    with pytest.raises(ValueError):
        L.importance_sampled_pg_loss(lps[..., 0], lps[..., 0], lps[..., 0], mask, clip=0.0)


# --- gradients ------------------------------------------------------------------------------------


LOSSES = [(f"kl-{m}", {"kind": "kl", "mode": m}) for m in MODES] + [
    (f"gjsd-{b}", {"kind": "gjsd", "beta": b}) for b in (0.0, 0.5, 1.0)
]


def _loss(
    spec: dict[str, object], s: torch.Tensor, ids: torch.Tensor, lps: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    if spec["kind"] == "kl":
        return L.topk_forward_kl(s, ids, lps, mask, spec["mode"])  # type: ignore[arg-type]
    return L.generalized_jsd(s, ids, lps, mask, float(spec["beta"]))  # type: ignore[arg-type]


@pytest.mark.parametrize(("name", "spec"), LOSSES, ids=[n for n, _ in LOSSES])
def test_gradients_flow_and_sgd_reduces_loss(name: str, spec: dict[str, object]) -> None:
    t = _logits(2, 5, 24, 23)
    ids, lps = _topk(t, 6)
    mask = _mask(2, 5, 24)
    s = _logits(2, 5, 24, 25).requires_grad_(True)
    first = _loss(spec, s, ids, lps, mask)
    first.backward()
    assert s.grad is not None and torch.isfinite(s.grad).all()
    on = mask.bool()
    assert s.grad[on].abs().sum() > 0
    assert (s.grad[~on] == 0).all()
    opt = torch.optim.Adam([s], lr=0.1)
    for _ in range(30):
        opt.zero_grad()
        _loss(spec, s, ids, lps, mask).backward()
        opt.step()
    assert _loss(spec, s, ids, lps, mask).item() < 0.5 * first.item()


# --- sampled-token reverse KL as advantage + importance-sampled policy gradient ----------------------


def test_reverse_kl_advantages_values_and_no_grad() -> None:
    q = torch.tensor([[-1.0, -2.0, -0.5]])
    s = torch.tensor([[-2.0, -1.0, -0.5]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    adv = L.reverse_kl_advantages(q, s, mask, coef=0.5)
    assert adv.tolist() == [[0.5, -0.5, 0.0]]
    assert not adv.requires_grad
    assert L.sampled_reverse_kl(q, s, mask) == pytest.approx(0.0)


def test_is_pg_value_ratio_and_clip() -> None:
    new = torch.tensor([[math.log(2.0), 0.0, math.log(0.5)]], requires_grad=True)
    old = torch.zeros(1, 3)
    adv = torch.tensor([[1.0, -3.0, 2.0]])
    mask = torch.ones(1, 3)
    loss = L.importance_sampled_pg_loss(new, old, adv, mask, clip=None)
    assert loss.item() == pytest.approx(-(2.0 * 1 - 3.0 + 0.5 * 2) / 3)
    clipped = L.importance_sampled_pg_loss(new, old, adv, mask)  # the default: clip=0.2
    # ratio 2 with adv>0 is clipped to 1.2 (no gradient); ratio 0.5 with adv>0 keeps the unclipped term.
    assert clipped.item() == pytest.approx(-(1.2 * 1 - 3.0 + 0.5 * 2) / 3)
    clipped.backward()
    assert new.grad is not None
    assert new.grad[0, 0].item() == 0.0 and new.grad[0, 2].item() == pytest.approx(-0.5 * 2 / 3)


def test_is_pg_with_reverse_kl_advantage_moves_student_toward_teacher() -> None:
    b, n, v = 3, 8, 32
    s_logits = _logits(b, n, v, 26).requires_grad_(True)
    labels = torch.randint(0, v, (b, n), generator=_gen(27))
    mask = _mask(b, n, 28)
    old = L.token_logprobs(s_logits, labels).detach()
    # Teacher above the student at even positions, below at odd ones.
    sign = torch.where(torch.arange(n) % 2 == 0, 1.0, -1.0).expand(b, n)
    q = old + sign * 1.5
    adv = L.reverse_kl_advantages(q, old, mask, coef=1.0)
    loss = L.importance_sampled_pg_loss(L.token_logprobs(s_logits, labels), old, adv, mask)
    loss.backward()
    assert s_logits.grad is not None
    label_grad = s_logits.grad.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    on = mask.bool()
    # Descent raises the label logit where the teacher likes the token more, lowers it where less.
    assert (torch.sign(-label_grad[on]) == sign[on]).all()
    with torch.no_grad():
        s_logits -= 0.5 * s_logits.grad
    new = L.token_logprobs(s_logits, labels).detach()
    assert ((new - q).abs()[on] < (old - q).abs()[on]).all()
    assert torch.equal(new[~on], old[~on])


def test_token_logprobs_matches_log_softmax() -> None:
    x = _logits(2, 3, 11, 29).to(torch.bfloat16)
    labels = torch.randint(0, 11, (2, 3), generator=_gen(30))
    ref = torch.log_softmax(x.float(), -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    got = L.token_logprobs(x, labels)
    assert got.dtype == torch.float32 and torch.allclose(got, ref, atol=1e-6)


# --- a tiny real model end to end: TrainBatch -> wire -> TorchBatch -> losses -----------------------

VOCAB = 128
TinySetup = tuple["torch.nn.Module", TorchBatch, "torch.Tensor"]


def _tiny_llama(seed: int, sharpen: float = 1.0) -> torch.nn.Module:
    """A random LlamaForCausalLM (hidden 64, 2 layers); ``sharpen`` scales the output head."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model: torch.nn.Module = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpen)
    return model.eval()


def _scored_group(
    student: torch.nn.Module, teacher: torch.nn.Module, lengths: list[int], k: int, seed: int
) -> schemas.ScoredGroup:
    """One group scored exactly: student logprobs and teacher top-k/sampled logprobs from the models."""
    rng = np.random.default_rng(seed)
    seqs, payloads = [], []
    for n in lengths:
        tok = rng.integers(0, VOCAB, n)
        mask = (np.arange(n) >= 4).astype(np.uint8)
        x = torch.from_numpy(tok).long()[None]
        with torch.no_grad():
            ls = torch.log_softmax(student(input_ids=x).logits[0, :-1].float(), -1)
            lt = torch.log_softmax(teacher(input_ids=x).logits[0, :-1].float(), -1)
        nxt = x[0, 1:, None]
        s_lp = np.concatenate([[0.0], ls.gather(-1, nxt)[:, 0].numpy()])
        vals, ids = lt.topk(k, -1)
        seqs.append(make_sequence(tok, mask, logprobs=s_lp))
        payloads.append(make_teacher(ids.numpy(), vals.numpy(), lt.gather(-1, nxt)[:, 0].numpy()))
    group = schemas.RolloutGroup(group_id=f"g{seed}", sequences=seqs)
    return schemas.ScoredGroup(group=group, status=schemas.DistillStatus.OK, teacher=payloads, k=k)


@pytest.fixture(scope="module")
def tiny_setup() -> TinySetup:
    student, teacher = _tiny_llama(0), _tiny_llama(1, sharpen=20.0)
    groups = [
        _scored_group(student, teacher, [12, 9], VOCAB, 40),
        _scored_group(student, teacher, [15], VOCAB, 41),
    ]
    skipped = schemas.ScoredGroup(
        group=_scored_group(student, teacher, [10], 1, 42).group,
        status=schemas.DistillStatus.SKIPPED,
        reason="x",
    )
    groups.append(skipped)
    seqs = [s for g in groups for s in g.group.sequences]
    batch = schemas.TrainBatch(
        batch_id="b",
        groups=groups,
        advantages=[schemas.Array.from_numpy(np.zeros(s.length, np.float32)) for s in seqs],
    )
    decoded = schemas.decode(schemas.encode(batch), Limits(vocab_size=VOCAB), expect=schemas.TrainBatch)
    tb = to_torch(decoded)
    with torch.no_grad():
        teacher_logits = teacher(input_ids=tb.input_ids, attention_mask=tb.attention_mask).logits[:, :-1]
    return student, tb, teacher_logits


def test_tiny_model_alignment_of_batch_tensors(tiny_setup: TinySetup) -> None:
    student, tb, teacher_logits = tiny_setup
    with torch.no_grad():
        logits = student(input_ids=tb.input_ids, attention_mask=tb.attention_mask).logits[:, :-1]
    on = tb.loss_mask.bool()
    assert torch.allclose(L.token_logprobs(logits, tb.labels)[on], tb.student_logprobs[on], atol=1e-5)
    d = tb.distill_mask.bool()
    assert d.sum() > 0 and not d[3].any()  # the skipped group has no distillation positions
    assert torch.allclose(L.token_logprobs(teacher_logits, tb.labels)[d], tb.teacher_sampled_logprobs[d], atol=1e-5)


def test_tiny_model_topk_and_gjsd_equal_full_vocab(tiny_setup: TinySetup) -> None:
    student, tb, teacher_logits = tiny_setup
    with torch.no_grad():
        logits = student(input_ids=tb.input_ids, attention_mask=tb.attention_mask).logits[:, :-1]
    mask = tb.distill_mask
    ids, lps = tb.teacher_topk_ids, tb.teacher_topk_logprobs
    ref = L.full_vocab_kl(logits, teacher_logits, mask, "forward").item()
    assert ref > 0.01
    for mode in MODES:
        assert L.topk_forward_kl(logits, ids, lps, mask, mode).item() == pytest.approx(ref, abs=1e-5), mode
    d = mask.bool()
    p_s = np.exp(_np_log_softmax(logits[d].double().numpy()))
    p_t = np.exp(_np_log_softmax(teacher_logits[d].double().numpy()))
    for beta in BETAS:
        got = L.generalized_jsd(logits, ids, lps, mask, beta).item()
        assert got == pytest.approx(_ref_gjsd(p_t, p_s, beta), abs=1e-5), beta


def test_tiny_model_training_on_topk_loss_reduces_exact_kl(tiny_setup: TinySetup) -> None:
    _, tb, teacher_logits = tiny_setup
    model = _tiny_llama(0).train()  # a fresh copy: the fixture's student stays untouched
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)

    def exact() -> float:
        with torch.no_grad():
            out = model(input_ids=tb.input_ids, attention_mask=tb.attention_mask).logits[:, :-1]
        return L.full_vocab_kl(out, teacher_logits, tb.distill_mask).item()

    before = exact()
    for step in range(8):
        opt.zero_grad()
        logits = model(input_ids=tb.input_ids, attention_mask=tb.attention_mask).logits[:, :-1]
        loss = L.topk_forward_kl(
            logits, tb.teacher_topk_ids[..., :8], tb.teacher_topk_logprobs[..., :8], tb.distill_mask
        )
        loss.backward()
        if step == 0:
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            assert grads and all(torch.isfinite(g).all() for g in grads)
            assert sum(float(g.abs().sum()) for g in grads) > 0
        opt.step()
    assert exact() < 0.8 * before
