"""A ``torch.utils.data.IterableDataset`` over the learner client, for trainers that take a DataLoader.

    dataset = LearnerDataset(learner, timeout_s=60)
    for item in DataLoader(dataset, batch_size=None):        # each item is one whole batch already
        loss = step(item)                                     # item: to_torch's fields as a dict
        optimizer.step()
        dataset.ack(item)                                     # after the optimiser step

Each item is a dict of ``to_torch``'s tensors (``input_ids``, ``attention_mask``, ``labels``,
``loss_mask``, ``advantages``, ``teacher_topk_ids``, ...) plus ``"distillq_entry"``, the batch's stream
entry id (a string: the trainer's device move leaves it alone), by which ``ack`` finds the batch. A batch
is acknowledged only when ``ack`` (or ``ack_trained``) is called for it, so a DataLoader that reads ahead
never acknowledges a batch that was not trained. Use ``batch_size=None`` and no worker processes (the
client holds a Redis connection and a thread of its own).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import fields
from typing import Any

import torch

from pipeline.learner.client import Learner, LearnerBatch
from pipeline.learner.torch_batch import to_torch

ENTRY = "distillq_entry"


class LearnerDataset(torch.utils.data.IterableDataset[dict[str, Any]]):
    """Batches from a ``Learner`` as dicts of tensors; acknowledged through ``ack`` after the step."""

    def __init__(
        self, learner: Learner, *, timeout_s: float | None = 60.0, max_batches: int | None = None,
        pad_id: int = 0, topk_dtype: torch.dtype = torch.float32,
    ) -> None:
        """Iteration ends after ``timeout_s`` without a batch (``None``: never) or ``max_batches`` batches."""
        super().__init__()
        self.learner, self.timeout_s, self.max_batches = learner, timeout_s, max_batches
        self.pad_id, self.topk_dtype = pad_id, topk_dtype
        self._held: dict[str, LearnerBatch] = {}  # handed out, not acknowledged
        self._trained: list[str] = []

    def __iter__(self) -> Iterator[dict[str, Any]]:
        n = 0
        while self.max_batches is None or n < self.max_batches:
            lb = self.learner.next_batch(self.timeout_s)
            if lb is None:
                return
            n += 1
            self._held[lb.entry_id] = lb
            tb = to_torch(lb.batch, pad_id=self.pad_id, topk_dtype=self.topk_dtype)
            item: dict[str, Any] = {f.name: getattr(tb, f.name) for f in fields(tb)}
            item[ENTRY] = lb.entry_id
            yield item

    def batch_of(self, item: Mapping[str, Any]) -> LearnerBatch:
        """The ``LearnerBatch`` an item came from (stats, group ids, policy version)."""
        return self._held[str(item[ENTRY])]

    def mark_trained(self, item: Mapping[str, Any]) -> None:
        """Note that ``item`` went into the gradient of the coming optimiser step (see ``ack_trained``)."""
        self._trained.append(str(item[ENTRY]))

    def ack(self, item: Mapping[str, Any]) -> bool:
        """Acknowledge the batch of ``item`` (after the optimiser step that used it)."""
        lb = self._held.pop(str(item[ENTRY]))
        return self.learner.ack(lb)

    def ack_trained(self) -> int:
        """Acknowledge every batch marked trained since the last call (call it after the optimiser step);
        returns how many."""
        done, self._trained = self._trained, []
        for entry in done:
            self.learner.ack(self._held.pop(entry))
        return len(done)

    @property
    def held(self) -> int:
        """Batches handed out and not yet acknowledged."""
        return len(self._held)
