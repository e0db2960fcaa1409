"""Learner losses for a teacher of another tokenizer (``pipeline.teacher.crosstok`` aligns the two).

Such a teacher ships, in student positions: per **aligned chunk** (a run of student tokens covering exactly the
bytes of a run of teacher tokens), the teacher's log-probability of the chunk's text on the chunk's last position;
and at positions whose token starts on a boundary both tokenizations share, the teacher's top-k mapped into student
ids (the unmapped mass goes to the tail bucket of ``losses.topk_forward_kl``, mode ``"tail"``).

* ``chunk_reverse_kl_advantages``: every token of chunk ``c`` gets ``coef * (q_c - s_c)``, with ``q_c`` the teacher's
  and ``s_c`` the sampler's log-probability of the chunk (the sum of its tokens' logprobs). The sum of ``s_c - q_c``
  over a sequence is the single-sample reverse KL of the whole completion, exactly; where every chunk is one token
  on both sides this is ``losses.reverse_kl_advantages``.
  The feeder computes the same in numpy for the batch advantages (``schemas.crosschunks``; the two are
  held equal by tests/unit/test_crossscore.py).
* The top-k forward KL is ``losses.topk_forward_kl`` on the mapped rows, as for a teacher of the same tokenizer.
"""

from __future__ import annotations

import torch


def chunk_ids(chunk_last: torch.Tensor) -> torch.Tensor:
    """The chunk index of every position, ``[B, N]`` int64, from ``chunk_last`` ``[B, N]`` (bool: the last position
    of a chunk): a chunk runs from the position after the previous chunk's last one to its own last position."""
    last = chunk_last.bool().long()
    return torch.cumsum(last, dim=-1) - last


def chunk_reverse_kl_advantages(
    teacher_chunk_logprobs: torch.Tensor,
    chunk_last: torch.Tensor,
    student_logprobs: torch.Tensor,
    mask: torch.Tensor,
    coef: float = 1.0,
) -> torch.Tensor:
    """Per-token advantage ``coef * (q_c - s_c)`` of each token's chunk ``c``, ``[B, N]``; no gradient.

    ``teacher_chunk_logprobs [B, N]``: the teacher's logprob of each chunk on its last position (read only where
    ``chunk_last``; ``nan`` there marks a chunk with no teacher signal, e.g. a special token the teacher has no
    counterpart for: its tokens get 0). ``student_logprobs [B, N]``: the sampler's. ``mask [B, N]``: trained
    positions; a chunk counts the student logprobs of its masked positions only, and positions outside ``mask``
    get 0."""
    if not (teacher_chunk_logprobs.shape == chunk_last.shape == student_logprobs.shape == mask.shape):
        raise ValueError(f"shape mismatch: {tuple(teacher_chunk_logprobs.shape)}, {tuple(chunk_last.shape)}, "
                         f"{tuple(student_logprobs.shape)}, {tuple(mask.shape)} (all must be [B, N])")
    with torch.no_grad():
        ids = chunk_ids(chunk_last)
        b, n = ids.shape
        m = mask > 0
        s = torch.where(m, student_logprobs.float(), torch.zeros_like(student_logprobs, dtype=torch.float32))
        s_c = torch.zeros(b, n, dtype=torch.float32, device=s.device).scatter_add_(1, ids, s)
        last = chunk_last.bool()
        q = torch.where(last, teacher_chunk_logprobs.float(), torch.zeros_like(s))
        q_c = torch.zeros(b, n, dtype=torch.float32, device=s.device).scatter_add_(1, ids, q)
        known = torch.zeros(b, n, dtype=torch.bool, device=s.device).scatter_(
            1, ids, last & ~torch.isnan(teacher_chunk_logprobs))
        adv_c = torch.where(known, coef * (torch.nan_to_num(q_c) - s_c), torch.zeros_like(s_c))
        adv = adv_c.gather(1, ids)
        return torch.where(m, adv, torch.zeros_like(adv))
