"""Distillation and policy-gradient losses over next-token-aligned tensors (see ``pipeline.learner.torch_batch``).

Needs torch (the ``hf`` extra); nothing else in ``pipeline`` imports this module at import time.

Shapes: ``B`` sequences, ``N = T - 1`` next-token positions, vocabulary ``V``, teacher top-k width ``K``.
``student_logits`` is ``[B, N, V]``: the causal LM's ``logits[:, :-1]``, position ``t`` predicting token
``t + 1``. Student logits are upcast to float32 inside every loss.

Masks are ``[B, N]`` 0/1 tensors (float or bool). Losses are computed per position and then reduced:
``"mean"`` (default) is ``sum(loss * mask) / max(sum(mask), 1)``, i.e. the mean over masked positions
(0 when the mask is empty); ``"sum"`` is ``sum(loss * mask)``; ``"none"`` returns ``[B, N]`` with
masked-out positions set to 0. Values at masked-out positions never leak NaN into the result.

Empty top-k slots hold logprob ``PAD_LOGPROB`` (finite, so ``exp`` is exactly 0 and no ``0 * inf`` arises);
any slot with logprob ``<= PAD_LOGPROB / 2`` is ignored on both the teacher and the student side.
"""

from __future__ import annotations

import math
from typing import Final, Literal

import torch

#: Logprob of an empty top-k slot (id 0). ``pipeline.learner.torch_batch`` pads with it.
PAD_LOGPROB: Final = -1e9
#: The policy-gradient loss's default PPO clip (``importance_sampled_pg_loss``; ``None``: unclipped).
DEFAULT_CLIP: Final = 0.2
#: Smallest tail-bucket probability: ``log(1 - sum(top-k probs))`` is clamped to ``log(TAIL_EPS)``.
TAIL_EPS: Final = 1e-6

Reduction = Literal["mean", "sum", "none"]
TopKMode = Literal["unnormalized", "renormalized", "tail"]
Direction = Literal["forward", "reverse"]


def reduce_masked(values: torch.Tensor, mask: torch.Tensor, reduction: Reduction = "mean") -> torch.Tensor:
    """Reduce a ``[B, N]`` per-position loss over ``mask`` (see the module docstring)."""
    m = mask.to(values.dtype)
    masked = torch.where(m > 0, values, torch.zeros_like(values)) * m
    if reduction == "none":
        return masked
    if reduction == "sum":
        return masked.sum()
    if reduction == "mean":
        return masked.sum() / m.sum().clamp_min(1.0)
    raise ValueError(f"unknown reduction {reduction!r}")


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``log softmax(logits)[labels]``: logits ``[B, N, V]``, labels ``[B, N]`` -> ``[B, N]`` float32."""
    lf = logits.float()
    picked = lf.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(lf, dim=-1)


def reverse_kl_advantages(
    teacher_sampled_logprobs: torch.Tensor,
    student_logprobs: torch.Tensor,
    mask: torch.Tensor,
    coef: float = 1.0,
) -> torch.Tensor:
    """Per-token advantage ``coef * (q - s)``, ``[B, N]``, 0 where ``mask`` is 0; carries no gradient.

    ``q``/``s``: teacher/student logprob of the sampled token. ``s - q`` is the single-sample estimate of
    the reverse KL, so a policy gradient with this advantage minimises ``coef * KL(student || teacher)``.
    """
    with torch.no_grad():
        adv = coef * (teacher_sampled_logprobs.float() - student_logprobs.float())
        return torch.where(mask > 0, adv, torch.zeros_like(adv))


def sampled_reverse_kl(
    teacher_sampled_logprobs: torch.Tensor, student_logprobs: torch.Tensor, mask: torch.Tensor
) -> float:
    """Mean of ``s - q`` over masked positions: the observed KL to feed a ``KLController``."""
    with torch.no_grad():
        diff = student_logprobs.float() - teacher_sampled_logprobs.float()
        return float(reduce_masked(diff, mask, "mean"))


def importance_sampled_pg_loss(
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip: float | None = DEFAULT_CLIP,
    *,
    reduction: Reduction = "mean",
) -> torch.Tensor:
    """Importance-sampled policy gradient, PPO-clipped by default.

    All inputs ``[B, N]``: ``new_logprobs`` (with gradient, e.g. ``token_logprobs``), ``old_logprobs`` (the
    sampler's, detached), ``advantages`` (detached); ``ratio = exp(new - old)``. With ``clip = eps`` (default
    ``DEFAULT_CLIP`` = 0.2) the loss is PPO's pessimistic form ``max(-ratio * adv, -clamp(ratio, 1 - eps, 1 + eps)
    * adv)``: a token whose ratio has already moved more than ``eps`` in the direction its advantage favours
    contributes no gradient, so the trained policy cannot run far from the (stale) policy that sampled the
    batch. ``clip=None`` is the plain ``-ratio * adv``, unbounded in the ratio: on batches sampled several
    policy versions back it drifts from the sampler without limit (tests/unit/test_pg_clip_staleness.py).
    """
    if clip is not None and not clip > 0:
        raise ValueError(f"clip must be > 0 or None, got {clip!r}")
    new = new_logprobs.float()
    log_ratio = torch.where(mask > 0, new - old_logprobs.detach().float(), torch.zeros_like(new))
    ratio = torch.exp(log_ratio)
    adv = advantages.detach().float()
    loss = -ratio * adv
    if clip is not None:
        loss = torch.maximum(loss, -ratio.clamp(1.0 - clip, 1.0 + clip) * adv)
    return reduce_masked(loss, mask, reduction)


def _topk_pair(
    student_logits: torch.Tensor, topk_ids: torch.Tensor, topk_logprobs: torch.Tensor
) -> torch.Tensor:
    """The student's logprobs on the teacher's top-k ids, ``[B, N, K]``."""
    if student_logits.shape[:-1] != topk_ids.shape[:-1] or topk_ids.shape != topk_logprobs.shape:
        raise ValueError(
            f"shape mismatch: student_logits {tuple(student_logits.shape)}, topk_ids {tuple(topk_ids.shape)},"
            f" topk_logprobs {tuple(topk_logprobs.shape)} (logits must be [B, N, V], top-k [B, N, K])"
        )
    lf = student_logits.float()
    return lf.gather(-1, topk_ids.long()) - torch.logsumexp(lf, dim=-1, keepdim=True)


def _valid_pair(
    student_topk_logprobs: torch.Tensor, topk_logprobs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Teacher and student logprobs with ``PAD_LOGPROB`` in the empty slots, and the valid-slot mask."""
    t = topk_logprobs.float()
    valid = t > PAD_LOGPROB / 2
    pad = torch.full_like(t, PAD_LOGPROB)
    return torch.where(valid, t, pad), torch.where(valid, student_topk_logprobs, pad), valid


def _log1mexp(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``log(max(1 - exp(x), eps))`` for ``x <= 0``, stable near 0 and at very negative ``x``."""
    xc = x.clamp(max=math.log1p(-eps))
    return torch.where(xc > -math.log(2.0), torch.log(-torch.expm1(xc)), torch.log1p(-torch.exp(xc)))


def _tail(logp: torch.Tensor, eps: float) -> torch.Tensor:
    """Log-probability of everything outside the (valid) top-k slots, ``[B, N, 1]``."""
    return _log1mexp(torch.logsumexp(logp, dim=-1, keepdim=True), eps)


def _kl(log_p: torch.Tensor, log_q: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``sum_j p_j (log p_j - log q_j)`` over valid slots of the last dim."""
    terms = torch.exp(log_p) * (log_p - log_q)
    return torch.where(valid, terms, torch.zeros_like(terms)).sum(-1)


def topk_forward_kl(
    student_logits: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_logprobs: torch.Tensor,
    mask: torch.Tensor,
    mode: TopKMode = "tail",
    *,
    reduction: Reduction = "mean",
    tail_eps: float = TAIL_EPS,
) -> torch.Tensor:
    """Forward KL ``KL(teacher || student)`` restricted to the teacher's top-k ids.

    ``student_logits [B, N, V]``, ``topk_ids [B, N, K]`` (int), ``topk_logprobs [B, N, K]``, ``mask [B, N]``.

    * ``"unnormalized"``: ``sum_k p_T(v) (log p_T(v) - log p_s(v))`` (verl GKD recipe).
    * ``"renormalized"``: both distributions renormalised over the top-k set (Axolotl ``kd_normalize_topk``).
    * ``"tail"``: adds one bucket for everything outside the top-k, ``log(1 - sum_k p)`` on both sides,
      clamped at ``log(tail_eps)`` (TRL's default; keeps ``k = 1`` from being trivially 0).

    With ``k = V`` all three equal the exact forward KL (up to ``tail_eps``-sized terms).
    """
    per = topk_forward_kl_from_logprobs(_topk_pair(student_logits, topk_ids, topk_logprobs), topk_logprobs, mode,
                                        tail_eps=tail_eps)
    return reduce_masked(per, mask, reduction)


def topk_forward_kl_from_logprobs(
    student_topk_logprobs: torch.Tensor,
    topk_logprobs: torch.Tensor,
    mode: TopKMode = "tail",
    *,
    tail_eps: float = TAIL_EPS,
) -> torch.Tensor:
    """Per-position top-k forward KL ``[...]`` from the student's logprobs on the top-k ids ``[..., K]``.

    What ``topk_forward_kl`` computes after its gather, before the reduction (``pipeline.learner.chunked``
    gathers without ``[B, N, V]`` and calls this); slots whose teacher logprob is ``<= PAD_LOGPROB / 2``
    are ignored.
    """
    t, s, valid = _valid_pair(student_topk_logprobs, topk_logprobs)
    if mode == "unnormalized":
        return _kl(t, s, valid)
    if mode == "renormalized":
        return _kl(t - torch.logsumexp(t, -1, keepdim=True), s - torch.logsumexp(s, -1, keepdim=True), valid)
    if mode == "tail":
        tail_t, tail_s = _tail(t, tail_eps), _tail(s, tail_eps)
        return _kl(t, s, valid) + (torch.exp(tail_t) * (tail_t - tail_s)).squeeze(-1)
    raise ValueError(f"unknown top-k KL mode {mode!r}")


def _gjsd(log_s: torch.Tensor, log_t: torch.Tensor, valid: torch.Tensor, beta: float) -> torch.Tensor:
    """TRL's generalised JSD over the last dim: 0 -> KL(T||S), 1 -> KL(S||T), else mixture form."""
    if beta == 0.0:
        return _kl(log_t, log_s, valid)
    if beta == 1.0:
        return _kl(log_s, log_t, valid)
    log_m = torch.logaddexp(log_s + math.log1p(-beta), log_t + math.log(beta))
    return beta * _kl(log_t, log_m, valid) + (1.0 - beta) * _kl(log_s, log_m, valid)


def generalized_jsd(
    student_logits: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_logprobs: torch.Tensor,
    mask: torch.Tensor,
    beta: float = 0.5,
    *,
    reduction: Reduction = "mean",
    tail: bool = True,
    tail_eps: float = TAIL_EPS,
) -> torch.Tensor:
    """Generalised Jensen-Shannon divergence (TRL GKDTrainer) on the teacher's top-k support.

    ``JSD_beta = beta KL(T || M) + (1 - beta) KL(S || M)`` with ``M = beta T + (1 - beta) S``; ``beta = 0``
    is exactly forward ``KL(T || S)`` and ``beta = 1`` reverse ``KL(S || T)``. The support is the top-k ids
    plus, with ``tail`` (default), one bucket for the rest (``log(1 - sum_k p)`` clamped at
    ``log(tail_eps)``); without ``tail`` both sides are renormalised over the top-k. Shapes as in
    ``topk_forward_kl``.
    """
    student = _topk_pair(student_logits, topk_ids, topk_logprobs)
    per = generalized_jsd_from_logprobs(student, topk_logprobs, beta, tail=tail, tail_eps=tail_eps)
    return reduce_masked(per, mask, reduction)


def generalized_jsd_from_logprobs(
    student_topk_logprobs: torch.Tensor,
    topk_logprobs: torch.Tensor,
    beta: float = 0.5,
    *,
    tail: bool = True,
    tail_eps: float = TAIL_EPS,
) -> torch.Tensor:
    """Per-position generalised JSD ``[...]`` from the student's logprobs on the top-k ids (no reduction)."""
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta!r}")
    t, s, valid = _valid_pair(student_topk_logprobs, topk_logprobs)
    if tail:
        t = torch.cat([t, _tail(t, tail_eps)], dim=-1)
        s = torch.cat([s, _tail(s, tail_eps)], dim=-1)
        valid = torch.cat([valid, torch.ones_like(valid[..., :1])], dim=-1)
    else:
        t = t - torch.logsumexp(t, -1, keepdim=True)
        s = s - torch.logsumexp(s, -1, keepdim=True)
    return _gjsd(s, t, valid, beta)


def full_vocab_kl(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor,
    direction: Direction = "forward",
    *,
    reduction: Reduction = "mean",
) -> torch.Tensor:
    """Exact KL over the whole vocabulary (reference; needs teacher logits ``[B, N, V]``).

    ``"forward"``: ``KL(teacher || student)``; ``"reverse"``: ``KL(student || teacher)``. Gradient flows to
    both inputs; detach the teacher's logits if it is not being trained.
    """
    if student_logits.shape != teacher_logits.shape:
        shapes = f"{tuple(student_logits.shape)} vs {tuple(teacher_logits.shape)}"
        raise ValueError(f"logit shapes differ: {shapes}")
    ls = torch.log_softmax(student_logits.float(), dim=-1)
    lt = torch.log_softmax(teacher_logits.float(), dim=-1)
    if direction == "forward":
        log_p, log_q = lt, ls
    elif direction == "reverse":
        log_p, log_q = ls, lt
    else:
        raise ValueError(f"unknown KL direction {direction!r}")
    return reduce_masked(_kl(log_p, log_q, log_p > -math.inf), mask, reduction)
