"""The losses of ``pipeline.learner.losses`` from hidden states and the lm_head, never materialising ``[B, N, V]``.

At a real vocabulary (``V = 151,936``) the student's float32 logits for ``B x N = 8 x 4096`` positions take
20 GB, before ``log_softmax`` and the backward pass add copies of the same size. Every loss here takes the
student's final hidden states ``hidden [B, N, H]`` and the lm_head ``weight [V, H]`` (plus an optional
``bias [V]``) instead of ``student_logits``, with the other arguments of its namesake in
``pipeline.learner.losses``, and computes the same value and gradients as that loss applied to
``logits = hidden @ weight.T + bias``.

Method. Only the positions that count are computed: the rows of the flattened ``[B*N, H]`` hidden states
where the loss's mask is ``> 0`` are selected first. One ``torch.autograd.Function`` (behind
``gather_logprobs``) then walks them ``chunk_size`` positions at a time: it computes the chunk's logits
``[chunk, V]`` in the weight's dtype, upcasts them to float32, gathers the student logprobs of the ids the
loss needs (the labels, or the teacher's top-k ids) and the log-partition ``logsumexp``, and moves on,
reusing one ``[chunk, V]`` buffer. Only the selected hidden rows, the ids and ``logsumexp`` (one float per
position) are saved for backward, which recomputes each chunk's logits, forms
``d logits = onehot(ids) @ g - softmax * sum(g)`` in place and accumulates the gradients of ``hidden``,
``weight`` (in float32) and ``bias``. Memory is therefore ``O(chunk_size x V)`` in forward and backward,
plus ``O(V x H)`` for the weight's gradient; compute is one extra lm_head matmul (the recomputation).
Everything after the gather (top-k pairing, tail bucket, JSD, reductions) runs on ``[M, K]`` tensors with
the building blocks of ``pipeline.learner.losses``. Double backward is not supported.

Hidden states from a transformers model. For ``LlamaForCausalLM`` (and most decoder-only models) the hidden
states that the lm_head reads are ``model.model(input_ids, attention_mask=...).last_hidden_state``
(``[B, T, H]``, after the final norm), and the head is ``model.lm_head`` (``model.get_output_embeddings()``
generically; ``bias`` is ``model.lm_head.bias``, ``None`` for Llama). ``model(input_ids,
output_hidden_states=True).hidden_states[-1]`` is the same tensor in current transformers (it is after the
final norm), but ``model(...)`` also computes the full ``[B, T, V]`` logits, which is what this module
avoids; call the base model. Models that rescale or soft-cap their logits (Gemma 2's
``final_logit_softcapping``, Cohere's ``logit_scale``) are not plain ``hidden @ weight.T`` and are not
covered. Alignment is that of the logits: the losses take ``hidden[:, :-1]``, paired with
``labels = input_ids[:, 1:]`` exactly as ``logits[:, :-1]`` is::

    hidden = model.model(input_ids=tb.input_ids, attention_mask=tb.attention_mask.long()).last_hidden_state
    h, w = hidden[:, :-1], model.lm_head.weight
    pg = importance_sampled_pg_loss(h, w, tb.labels, tb.student_logprobs, tb.advantages, tb.loss_mask)  # clip 0.2
    kd = topk_forward_kl(h, w, tb.teacher_topk_ids, tb.teacher_topk_logprobs, tb.distill_mask, mode="tail")

Each call makes its own pass over the lm_head; to share one pass between the labels and the top-k ids, call
``gather_logprobs`` once with ``torch.cat([labels[..., None], topk_ids], -1)`` and use the ``*_from_logprobs``
building blocks (``pipeline.learner.losses``, re-exported here). ``nonzero`` on the mask synchronises with
the device once per call.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import once_differentiable

from pipeline.learner import losses as L
from pipeline.learner.losses import (
    DEFAULT_CLIP,
    TAIL_EPS,
    Reduction,
    TopKMode,
    generalized_jsd_from_logprobs,
    reduce_masked,
    topk_forward_kl_from_logprobs,
)

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "DEFAULT_CLIP",
    "Reduction",
    "TopKMode",
    "gather_logprobs",
    "generalized_jsd",
    "generalized_jsd_from_logprobs",
    "importance_sampled_pg_loss",
    "token_logprobs",
    "topk_forward_kl",
    "topk_forward_kl_from_logprobs",
]

#: Positions per chunk: the chunk's float32 logits take ``chunk_size * V * 4`` bytes (622 MB at V = 151,936).
DEFAULT_CHUNK_SIZE = 1024


class _ChunkLogits:
    """One chunk's logits ``[c, V]``: computed in the weight's dtype (as the lm_head would), upcast to float32.

    The ``[chunk, V]`` buffers (one if the weight is float32) are allocated once per pass and reused by every
    chunk: a fresh allocation per chunk would be mapped and page-faulted in again each time.
    """

    def __init__(self, rows: int, weight: torch.Tensor) -> None:
        self.f32 = torch.empty(rows, weight.shape[0], dtype=torch.float32, device=weight.device)
        self.same = weight.dtype == torch.float32
        self.wd = self.f32 if self.same else torch.empty(self.f32.shape, dtype=weight.dtype, device=weight.device)

    def __call__(self, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        zw = self.wd[: h.shape[0]]
        if bias is None:
            torch.mm(h, weight.t(), out=zw)  # what F.linear computes
        else:
            torch.addmm(bias, h, weight.t(), out=zw)
        return zw if self.same else self.f32[: h.shape[0]].copy_(zw)

    def to_weight_dtype(self, z: torch.Tensor) -> torch.Tensor:
        return z if self.same else self.wd[: z.shape[0]].copy_(z)


class _GatheredLogSoftmax(torch.autograd.Function):
    """``log_softmax(h @ weight.T + bias)`` at ``ids`` for rows ``h [M, H]``, ids ``[M, J]`` -> ``[M, J]`` float32."""

    @staticmethod
    def forward(
        ctx: Any, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, ids: torch.Tensor, chunk: int
    ) -> torch.Tensor:
        m = h.shape[0]
        out = torch.empty(ids.shape, dtype=torch.float32, device=h.device)
        lse = torch.empty(m, dtype=torch.float32, device=h.device)
        logits = _ChunkLogits(min(chunk, m), weight)
        for lo in range(0, m, chunk):
            hi = min(lo + chunk, m)
            z = logits(h[lo:hi], weight, bias)
            picked = z.gather(1, ids[lo:hi])
            top = z.amax(1, keepdim=True)
            log_z = z.sub_(top).exp_().sum(1).log_().add_(top.squeeze(1))  # logsumexp, in place in z
            out[lo:hi] = picked - log_z[:, None]
            lse[lo:hi] = log_z
        del logits
        ctx.save_for_backward(h, weight, bias, ids, lse)
        ctx.chunk = chunk
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        h, weight, bias, ids, lse = ctx.saved_tensors
        chunk: int = ctx.chunk
        m = h.shape[0]
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(h) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_b else None
        partial_w = None if grad_w is None or weight.dtype == torch.float32 else torch.empty_like(weight)
        g = grad_out.float()
        logits = _ChunkLogits(min(chunk, m), weight)
        for lo in range(0, m, chunk):
            hi = min(lo + chunk, m)
            gc = g[lo:hi]
            dz = logits(h[lo:hi], weight, bias)
            # d logits = scatter(g) - softmax * sum(g), built in place in the recomputed logits.
            dz.sub_(lse[lo:hi, None]).exp_().mul_(-gc.sum(1, keepdim=True)).scatter_add_(1, ids[lo:hi], gc)
            dzw = logits.to_weight_dtype(dz)
            if grad_h is not None:
                torch.mm(dzw, weight, out=grad_h[lo:hi])
            if grad_w is not None:
                if partial_w is None:
                    grad_w.addmm_(dzw.t(), h[lo:hi])
                else:
                    grad_w.add_(torch.mm(dzw.t(), h[lo:hi], out=partial_w))
            if grad_b is not None:
                grad_b.add_(dzw.sum(0))
        del logits
        gw = None if grad_w is None else grad_w.to(weight.dtype)
        gb = None if grad_b is None else grad_b.to(bias.dtype)
        return grad_h, gw, gb, None, None


def _gathered(
    h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, ids: torch.Tensor, chunk: int
) -> torch.Tensor:
    out: torch.Tensor = _GatheredLogSoftmax.apply(h, weight, bias, ids, chunk)  # type: ignore[no-untyped-call]
    return out


def _check(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, chunk_size: int) -> None:
    if hidden.dim() != 3 or weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"shape mismatch: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)} (need [B, N, H], [V, H])"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"shape mismatch: bias {tuple(bias.shape)}, weight {tuple(weight.shape)} (need [V])")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size!r}")


def gather_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    ids: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    bias: torch.Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> torch.Tensor:
    """``log_softmax(hidden @ weight.T + bias)`` gathered at ``ids [B, N, J]`` -> ``[B, N, J]`` float32.

    Only positions with ``mask > 0`` (all if ``mask`` is ``None``) are computed; the others are 0 and carry no
    gradient. Gradients flow to ``hidden``, ``weight`` and ``bias``; memory is ``O(chunk_size x V)``.
    """
    _check(hidden, weight, bias, chunk_size)
    b, n, h = hidden.shape
    if ids.dim() != 3 or tuple(ids.shape[:2]) != (b, n) or (mask is not None and tuple(mask.shape) != (b, n)):
        mask_shape = None if mask is None else tuple(mask.shape)
        raise ValueError(
            f"shape mismatch: hidden {tuple(hidden.shape)}, ids {tuple(ids.shape)}, mask {mask_shape}"
            " (need [B, N, H], [B, N, J], [B, N])"
        )
    flat_h, flat_ids = hidden.reshape(b * n, h), ids.reshape(b * n, -1).long()
    if mask is None:
        rows = torch.arange(b * n, device=hidden.device)
    else:
        rows = (mask.reshape(b * n) > 0).nonzero().squeeze(1)
    picked = _gathered(flat_h[rows], weight, bias, flat_ids[rows], chunk_size)
    out = torch.zeros(flat_ids.shape, dtype=torch.float32, device=hidden.device).index_copy(0, rows, picked)
    return out.reshape(ids.shape)


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    bias: torch.Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> torch.Tensor:
    """``losses.token_logprobs(hidden @ weight.T + bias, labels)``: ``[B, N]`` float32.

    With ``mask`` only positions where it is ``> 0`` are computed; the rest are 0 (without a mask, all are).
    """
    return gather_logprobs(hidden, weight, labels.unsqueeze(-1), mask, bias=bias, chunk_size=chunk_size)[..., 0]


def importance_sampled_pg_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip: float | None = DEFAULT_CLIP,
    *,
    reduction: Reduction = "mean",
    bias: torch.Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> torch.Tensor:
    """``losses.importance_sampled_pg_loss(token_logprobs(logits, labels), old_logprobs, advantages, mask, clip)``.

    The student's logprobs of ``labels`` are computed from ``hidden``/``weight`` at the positions of ``mask``
    only (the loss ignores the others); ``clip`` (PPO, ``DEFAULT_CLIP`` = 0.2 by default; ``None``: unclipped) and
    ``reduction`` are those of the original.
    """
    if clip is not None and not clip > 0:
        raise ValueError(f"clip must be > 0 or None, got {clip!r}")
    new = token_logprobs(hidden, weight, labels, mask, bias=bias, chunk_size=chunk_size)
    return L.importance_sampled_pg_loss(new, old_logprobs, advantages, mask, clip, reduction=reduction)


def _topk_args(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_logprobs: torch.Tensor) -> None:
    if hidden.shape[:-1] != topk_ids.shape[:-1] or topk_ids.shape != topk_logprobs.shape:
        raise ValueError(
            f"shape mismatch: hidden {tuple(hidden.shape)}, topk_ids {tuple(topk_ids.shape)},"
            f" topk_logprobs {tuple(topk_logprobs.shape)} (hidden must be [B, N, H], top-k [B, N, K])"
        )


def _per_position(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    topk_ids: torch.Tensor,
    topk_logprobs: torch.Tensor,
    mask: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Selected rows, the student's logprobs on their top-k ids ``[M, K]`` and their teacher logprobs."""
    _topk_args(hidden, topk_ids, topk_logprobs)
    _check(hidden, weight, bias, chunk_size)
    b, n, h = hidden.shape
    if tuple(mask.shape) != (b, n):
        raise ValueError(f"shape mismatch: mask {tuple(mask.shape)}, hidden {tuple(hidden.shape)} (need [B, N])")
    k = topk_ids.shape[-1]
    rows = (mask.reshape(b * n) > 0).nonzero().squeeze(1)
    ids = topk_ids.reshape(b * n, k)[rows].long()
    s = _gathered(hidden.reshape(b * n, h)[rows], weight, bias, ids, chunk_size)
    return rows, s, topk_logprobs.reshape(b * n, k)[rows]


def _scatter_reduce(rows: torch.Tensor, per: torch.Tensor, mask: torch.Tensor, reduction: Reduction) -> torch.Tensor:
    full = torch.zeros(mask.numel(), dtype=torch.float32, device=per.device).index_copy(0, rows, per.float())
    return reduce_masked(full.reshape(mask.shape), mask, reduction)


def topk_forward_kl(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_logprobs: torch.Tensor,
    mask: torch.Tensor,
    mode: TopKMode = "tail",
    *,
    reduction: Reduction = "mean",
    tail_eps: float = TAIL_EPS,
    bias: torch.Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> torch.Tensor:
    """``losses.topk_forward_kl(hidden @ weight.T + bias, topk_ids, topk_logprobs, mask, mode)``.

    Modes ``"unnormalized"``, ``"renormalized"`` and ``"tail"`` and the reductions are those of the original.
    """
    if mode not in ("unnormalized", "renormalized", "tail"):
        raise ValueError(f"unknown top-k KL mode {mode!r}")
    rows, s, t = _per_position(hidden, weight, bias, topk_ids, topk_logprobs, mask, chunk_size)
    per = topk_forward_kl_from_logprobs(s, t, mode, tail_eps=tail_eps)
    return _scatter_reduce(rows, per, mask, reduction)


def generalized_jsd(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_logprobs: torch.Tensor,
    mask: torch.Tensor,
    beta: float = 0.5,
    *,
    reduction: Reduction = "mean",
    tail: bool = True,
    tail_eps: float = TAIL_EPS,
    bias: torch.Tensor | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> torch.Tensor:
    """``losses.generalized_jsd(hidden @ weight.T + bias, topk_ids, topk_logprobs, mask, beta, tail=tail)``."""
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta!r}")
    rows, s, t = _per_position(hidden, weight, bias, topk_ids, topk_logprobs, mask, chunk_size)
    per = generalized_jsd_from_logprobs(s, t, beta, tail=tail, tail_eps=tail_eps)
    return _scatter_reduce(rows, per, mask, reduction)
