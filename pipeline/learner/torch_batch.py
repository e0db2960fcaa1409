"""Turn a ``TrainBatch`` into padded torch tensors aligned to next-token prediction.

Needs torch (the ``hf`` extra); nothing else in ``pipeline`` imports this module at import time.

Alignment: for sequence ``i`` with ``L_i`` tokens, index ``t`` of every ``[B, T-1]`` tensor is about
predicting token ``t + 1`` from ``tokens[:t + 1]``, i.e. it pairs with ``logits[:, t]`` of a causal LM
run on ``input_ids``. Per-token arrays are shifted by one (``x[1:]``); teacher arrays are already
logits-aligned (row ``r`` predicts token ``r + 1``) and map straight to index ``r``.

Teacher rows: a payload may hold only the trained rows (``TeacherPayload.rows``); its rows land at
their indices and the other rows stay empty (``distill_mask`` 0, top-k slots empty).

Padding: positions past a sequence's end have every mask 0, ``labels``/``input_ids`` ``pad_id`` and zeros
elsewhere. Top-k slots that carry no teacher entry (past the row's ``k``, a group without payload, or
padding) have id 0 and logprob ``PAD_LOGPROB`` (a large negative *finite* number, so that
``exp(PAD_LOGPROB) == 0`` and no ``0 * inf`` NaN arises); ``pipeline.learner.losses`` treats any logprob
``<= PAD_LOGPROB / 2`` as an empty slot.

Cross-tokenizer payloads (``TeacherPayload.topk_mapped``, a teacher of another tokenizer): their empty slots
(``topk_mapped`` 0) become id 0 and ``PAD_LOGPROB`` too, and a row with no mapped slot gets ``distill_mask`` 0, so
the top-k losses see the mapped teacher entries only (their unmapped mass is the tail of ``mode="tail"``). Their
``teacher_sampled_logprobs`` are chunk log-probabilities on the chunks' last positions (0 elsewhere); the
per-token signal is in ``advantages`` (``pipeline.stages.batching``).

``chunk_last`` (uint8 ``[B, T-1]``, laid out as ``teacher_sampled_logprobs``) says where the chunks end, so a learner
can sum the student's logprobs per chunk: a cross-tokenizer payload's own values at its rows (0 inside a chunk, 1 on
the last position of a chunk whose teacher log-probability is in ``teacher_sampled_logprobs``, 2 on the last position
of a chunk with no teacher signal); a payload of the student's tokenizer is one chunk per token, so 1 at every row it
holds. 0 where no payload holds the row (padding, a group without an OK payload, rows a payload does not hold:
untrained, so outside ``loss_mask``). ``pipeline.learner.crosstok.chunk_reverse_kl_advantages(torch.where(
chunk_last == 2, nan, teacher_sampled_logprobs), chunk_last, student_logprobs, loss_mask, coef)`` gives back the
batch's chunk advantages; ``chunk_ids(chunk_last)`` numbers the chunks for a loss of one's own.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import numpy.typing as npt
import torch

from pipeline.learner.losses import PAD_LOGPROB
from schemas.messages import DistillStatus, TeacherPayload, TrainBatch

__all__ = ["PAD_LOGPROB", "TorchBatch", "to_torch"]


@dataclass(frozen=True, slots=True)
class TorchBatch:
    """Padded tensors for one learner step. ``B`` sequences (groups flattened), ``T`` longest length,
    ``K`` largest teacher k in the batch (at least 1)."""

    input_ids: torch.Tensor  # [B, T] int64
    attention_mask: torch.Tensor  # [B, T] bool
    labels: torch.Tensor  # [B, T-1] int64, tokens[:, 1:]
    loss_mask: torch.Tensor  # [B, T-1] float32, loss_mask[:, 1:]
    student_logprobs: torch.Tensor  # [B, T-1] float32, logprobs[:, 1:] (zeros where absent)
    advantages: torch.Tensor  # [B, T-1] float32, batch.advantages[i][1:]
    teacher_topk_ids: torch.Tensor  # [B, T-1, K] int64 (or int32, see ``to_torch``)
    teacher_topk_logprobs: torch.Tensor  # [B, T-1, K] float32 (or bf16/fp16), PAD_LOGPROB in empty slots
    teacher_sampled_logprobs: torch.Tensor  # [B, T-1] float32
    chunk_last: torch.Tensor  # [B, T-1] uint8: 1/2 on a chunk's last position (same tokenizer: 1 per held row), else 0
    distill_mask: torch.Tensor  # [B, T-1] float32, loss_mask where the group has an OK teacher payload
    group_index: torch.Tensor  # [B] int64, index of the sequence's group in batch.groups
    seq_lengths: torch.Tensor  # [B] int64

    def to(self, device: str | torch.device, *, non_blocking: bool = False) -> TorchBatch:
        """A copy with every tensor moved to ``device``."""
        moved = {f.name: getattr(self, f.name).to(device, non_blocking=non_blocking) for f in fields(self)}
        return TorchBatch(**moved)

    @property
    def num_sequences(self) -> int:
        return int(self.input_ids.shape[0])


def to_torch(
    batch: TrainBatch,
    device: str | torch.device = "cpu",
    pad_id: int = 0,
    *,
    topk_dtype: torch.dtype = torch.float32,
    index_dtype: torch.dtype = torch.int64,
) -> TorchBatch:
    """Pad ``batch`` into a ``TorchBatch`` on ``device``.

    Each wire array is copied once into a padded buffer and moved to ``device`` in one transfer per field.
    Teacher payloads that hold only the trained rows (``TeacherPayload.rows``) are spread to their rows;
    ``distill_mask`` is 1 where the position trains and the payload holds its row.

    ``topk_dtype``: ``teacher_topk_logprobs`` in float32 (default) or ``torch.bfloat16`` (half the memory,
    8 bits of mantissa; float16 has no room for ``PAD_LOGPROB``, so it is not offered).
    ``index_dtype``: ``teacher_topk_ids`` as int64 (default, what ``torch.gather`` takes) or ``torch.int32``
    (half the memory; the losses widen the rows they use). At ``16 x 8192`` positions and ``k = 256`` the
    two top-k tensors take 384 MiB as int64 + float32 and 192 MiB as int32 + bfloat16.

    Raises ``ValueError`` if the batch is empty or its arrays disagree in length with the tokens.
    """
    if topk_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"topk_dtype must be float32 or bfloat16, got {topk_dtype}")
    if index_dtype not in (torch.int64, torch.int32):
        raise ValueError(f"index_dtype must be int64 or int32, got {index_dtype}")
    seqs = [(gi, s) for gi, g in enumerate(batch.groups) for s in g.group.sequences]
    if not seqs:
        raise ValueError("batch has no sequences")
    if len(batch.advantages) != len(seqs):
        raise ValueError(f"{len(batch.advantages)} advantage arrays for {len(seqs)} sequences")
    payloads = [
        g.teacher[j] if g.status is DistillStatus.OK and g.teacher is not None else None
        for g in batch.groups
        for j in range(len(g.group.sequences))
    ]
    b = len(seqs)
    t = max(s.length for _, s in seqs)
    k = max([p.k for p in payloads if p is not None] + [1])
    n = max(t - 1, 0)

    input_ids = np.full((b, t), pad_id, np.int64)
    attention = np.zeros((b, t), np.bool_)
    mask = np.zeros((b, n), np.float32)
    student = np.zeros((b, n), np.float32)
    adv = np.zeros((b, n), np.float32)
    # The top-k tensors are the big ones: filled in place in their final dtype, a sequence at a time.
    top_ids = torch.zeros((b, n, k), dtype=index_dtype)
    top_lps = torch.full((b, n, k), PAD_LOGPROB, dtype=topk_dtype)
    sampled = np.zeros((b, n), np.float32)
    chunk_last = np.zeros((b, n), np.uint8)
    distill = np.zeros((b, n), np.float32)
    lengths = np.zeros(b, np.int64)

    for i, ((_, seq), p, a) in enumerate(zip(seqs, payloads, batch.advantages, strict=True)):
        length = seq.length
        if length < 1:
            raise ValueError(f"sequence {i} is empty")
        m = length - 1
        lengths[i] = length
        input_ids[i, :length] = seq.tokens.numpy()
        attention[i, :length] = True
        mask[i, :m] = seq.loss_mask.numpy()[1:]
        if seq.logprobs is not None:
            student[i, :m] = seq.logprobs.numpy()[1:]
        av = a.numpy()
        if av.shape != (length,):
            raise ValueError(f"advantages[{i}] has shape {av.shape}, sequence has {length} tokens")
        adv[i, :m] = av[1:]
        if p is not None:
            _put_teacher(i, m, p, top_ids, top_lps, sampled, chunk_last, distill, mask)

    labels = input_ids[:, 1:].copy()
    group_index = np.array([gi for gi, _ in seqs], np.int64)

    def tt(x: npt.NDArray[np.generic]) -> torch.Tensor:
        return torch.from_numpy(x).to(device)

    return TorchBatch(
        input_ids=tt(input_ids),
        attention_mask=tt(attention),
        labels=tt(labels),
        loss_mask=tt(mask),
        student_logprobs=tt(student),
        advantages=tt(adv),
        teacher_topk_ids=top_ids.to(device),
        teacher_topk_logprobs=top_lps.to(device),
        teacher_sampled_logprobs=tt(sampled),
        chunk_last=tt(chunk_last),
        distill_mask=tt(distill),
        group_index=tt(group_index),
        seq_lengths=tt(lengths),
    )


def _put_teacher(
    i: int,
    m: int,
    p: TeacherPayload,
    top_ids: torch.Tensor,
    top_lps: torch.Tensor,
    sampled: npt.NDArray[np.float32],
    chunk_last: npt.NDArray[np.uint8],
    distill: npt.NDArray[np.float32],
    mask: npt.NDArray[np.float32],
) -> None:
    """Sequence ``i``'s payload (``m = L - 1`` rows) into row ``i`` of the padded teacher buffers."""
    ids = p.topk_ids.numpy()
    rows = p.row_index(m + 1)  # validated on decode: increasing, in range, every trained row held
    if ids.shape != (rows.shape[0], p.k):
        raise ValueError(f"teacher payload {i} has shape {ids.shape}, expected {(rows.shape[0], p.k)}")
    held: slice | npt.NDArray[np.int32] = slice(0, m) if p.rows is None else rows
    at: slice | torch.Tensor = held if isinstance(held, slice) else torch.tensor(held, dtype=torch.int64)
    sampled[i, :m] = p.dense_sampled(m + 1)
    chunk_last[i, held] = p.chunk_last.numpy() if p.chunk_last is not None else 1  # same tokenizer: a chunk per row
    distill[i, held] = mask[i, held]  # where the position trains and the payload holds its row
    lps = p.topk_logprobs.numpy()
    if p.topk_mapped is not None:  # cross-tokenizer: empty slots are padding, rows without a mapped slot no signal
        mapped = p.topk_mapped.numpy().astype(np.bool_)
        ids = np.where(mapped, ids, 0)
        lps = np.where(mapped, lps.astype(np.float32), np.float32(PAD_LOGPROB))
        distill[i, held] *= mapped.any(axis=1)
    top_ids[i, at, : p.k] = torch.tensor(ids).to(top_ids.dtype)  # copies: the wire arrays are read-only views
    top_lps[i, at, : p.k] = torch.tensor(lps).to(top_lps.dtype)
