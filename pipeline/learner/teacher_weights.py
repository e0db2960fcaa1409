"""A weight per teacher pool in the learner's loss (``--teacher-weight math=1,code=0.5``).

Each sequence's rows of ``loss_mask`` and ``distill_mask`` are multiplied by the weight of the pool that scored
its group (``ScoredGroup.pool``; a pool not named keeps weight 1). The losses average over their mask
(``losses.reduce_masked``: ``sum(loss * mask) / sum(mask)``), so a weight is a teacher's share of the loss
relative to the others in the batch, and a weight of 0 leaves that teacher's groups out of both terms.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from pipeline.learner.torch_batch import TorchBatch
from schemas import TrainBatch
from schemas.pools import pool_problem

__all__ = ["parse_teacher_weights", "row_weights", "weigh"]


def parse_teacher_weights(text: str | None) -> dict[str, float]:
    """``"math=1,code=0.5"`` -> ``{"math": 1.0, "code": 0.5}``; ``ValueError`` naming the bad part (a pool name
    that is not one, a weight that is not a finite number >= 0, a pool named twice)."""
    out: dict[str, float] = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep:
            raise ValueError(f"{part.strip()!r}: expected POOL=WEIGHT")
        if (problem := pool_problem(name)) is not None:
            raise ValueError(problem)
        try:
            w = float(value)
        except ValueError:
            raise ValueError(f"{name}: weight {value.strip()!r} is not a number") from None
        if not math.isfinite(w) or w < 0:
            raise ValueError(f"{name}: weight {value.strip()!r} must be a finite number >= 0")
        if name in out:
            raise ValueError(f"{name}: named twice")
        out[name] = w
    return out


def row_weights(batch: TrainBatch, group_index: torch.Tensor, weights: dict[str, float]) -> torch.Tensor:
    """``[B]`` float32: each row's teacher weight (``group_index``: the row's group in ``batch.groups``)."""
    per_group = torch.tensor([weights.get(g.pool, 1.0) for g in batch.groups], dtype=torch.float32)
    return per_group[group_index.cpu()]


def weigh(tb: TorchBatch, batch: TrainBatch, weights: dict[str, float]) -> TorchBatch:
    """``tb`` with its ``loss_mask`` and ``distill_mask`` rows multiplied by their teacher's weight (``tb``
    itself when ``weights`` is empty)."""
    if not weights:
        return tb
    w = row_weights(batch, tb.group_index, weights).to(tb.loss_mask.device)[:, None]
    return dataclasses.replace(tb, loss_mask=tb.loss_mask * w, distill_mask=tb.distill_mask * w)
