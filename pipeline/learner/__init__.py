"""The learner side: the client that reads batches (``Learner``, ``AsyncLearner``), ``to_torch``, the losses.

``to_torch`` and ``TorchBatch`` need torch; they are imported on first use, so the client itself runs without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pipeline.learner.client import AsyncLearner, Learner, LearnerBatch

if TYPE_CHECKING:
    from pipeline.learner.torch_batch import TorchBatch, to_torch

__all__ = ["AsyncLearner", "Learner", "LearnerBatch", "TorchBatch", "to_torch"]


def __getattr__(name: str) -> Any:
    if name in ("TorchBatch", "to_torch"):
        from pipeline.learner import torch_batch

        return getattr(torch_batch, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
