"""What the learner client hands out: ``LearnerBatch`` (a batch, or a rank's part of one, and its stream entry)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from pipeline.transport.consumer import Delivery
from schemas import BatchManifest, TrainBatch


@dataclass(frozen=True)
class LearnerBatch:
    """One train batch (with ``world_size > 1``: this rank's part of it) and the stream entry it came from.

    ``delivery`` is the stream entry's ``Delivery`` record (entry id, fields, delivery count, whether it was
    reclaimed), not a count. ``batch.stats`` give the staleness at delivery (``staleness_<n>``).
    """

    entry_id: str
    batch: TrainBatch
    redelivered: bool
    delivery: Delivery
    payload_keys: tuple[str, ...] = ()  # the groups' payloads, deleted on ack
    rank: int = 0
    world_size: int = 1
    generation: int = 0  # learner ranks: the generation it was handed out in
    #: every group id the batch entry names (all ranks' parts): their ``batches`` dedupe markers record the ack
    entry_groups: tuple[str, ...] = ()

    @property
    def group_ids(self) -> list[str]:
        return [g.group_id for g in self.batch.groups]

    def sequences(self) -> Iterator[dict[str, npt.NDArray[np.generic] | None]]:
        """Per sequence, zero-copy numpy views: tokens, loss_mask, logprobs, advantages, teacher arrays.

        ``teacher_rows`` names the rows the teacher arrays hold (the trained rows; ``arange(L - 1)`` for a
        payload of every row): ``teacher_topk_ids[j]`` is row ``teacher_rows[j]``, predicting token
        ``teacher_rows[j] + 1``.
        """
        i = 0
        for g in self.batch.groups:
            for j, s in enumerate(g.group.sequences):
                t = g.teacher[j] if g.teacher is not None else None
                yield {
                    "tokens": s.tokens.numpy(), "loss_mask": s.loss_mask.numpy(),
                    "logprobs": s.logprobs.numpy() if s.logprobs is not None else None,
                    "advantages": self.batch.advantages[i].numpy(),
                    "teacher_topk_ids": t.topk_ids.numpy() if t else None,
                    "teacher_topk_logprobs": t.topk_logprobs.numpy() if t else None,
                    "teacher_sampled_logprobs": t.sampled_logprobs.numpy() if t else None,
                    "teacher_rows": t.row_index(s.length) if t else None,
                }
                i += 1


@dataclass(frozen=True)
class _Raw:
    """A batch entry read and decoded, with its groups' payloads fetched but not yet validated."""

    delivery: Delivery
    msg: BatchManifest | TrainBatch
    payloads: list[bytes | None]
    version: int | None = None  # learner ranks: the policy version the batch was made current with
    all_keys: tuple[str, ...] = ()  # learner ranks: every payload key of the whole batch
    generation: int = 0
    all_groups: tuple[str, ...] = ()  # learner ranks: every group id of the whole batch
