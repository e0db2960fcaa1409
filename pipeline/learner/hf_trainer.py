"""A transformers ``Trainer`` that trains on the pipeline's batches (needs ``transformers`` and ``accelerate``).

    with Learner(url) as learner:
        dataset = LearnerDataset(learner, timeout_s=60)
        trainer = DistillTrainer(model=model, args=TrainingArguments(output_dir=..., max_steps=1000,
                                 per_device_train_batch_size=1), dataset=dataset)
        trainer.train()

Loss per batch: ``pg_weight`` x importance-sampled policy gradient on the feeder's per-token advantages
(reverse KL to the teacher as an advantage, PPO-clipped at ``clip``) + ``kd_weight`` x top-k forward KL with
a tail bucket, each averaged over its mask (``pipeline.learner.losses``). A batch is acknowledged by a
callback after the optimiser step that used it (``on_step_end``), so a crash redelivers what was not
stepped. With ``publish_dir``, the same callback then publishes the weights as the next policy version
(``Learner.publish_weights``: a checkpoint folder in ``publish_dir``, then the version), every
``publish_every`` optimiser steps: after the ack, in that order, whatever other callbacks the trainer has.
The loss runs on the model's full logits; at a large vocabulary, override ``compute_loss`` with the chunked
losses (``pipeline.learner.chunked``, as in ``pipeline.demo.learner``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader
from transformers import Trainer, TrainerCallback

from pipeline.learner.data import ENTRY, LearnerDataset
from pipeline.learner.losses import importance_sampled_pg_loss, token_logprobs, topk_forward_kl


class AckAfterStep(TrainerCallback):
    """Acknowledges the batches trained into an optimiser step once it has run; with ``publish_dir``, then
    publishes the weights as the next policy version every ``publish_every`` steps."""

    def __init__(self, dataset: LearnerDataset, publish_dir: str | Path | None = None, *, publish_every: int = 1,
                 publish_keep: int = 3, tokenizer_dir: str | Path | None = None) -> None:
        if publish_every < 1:
            raise ValueError("publish_every must be >= 1")
        self.dataset, self.publish_dir, self.publish_every = dataset, publish_dir, publish_every
        self.publish_keep, self.tokenizer_dir = publish_keep, tokenizer_dir
        self.version = 0  # the policy version published last

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.version = self.dataset.learner.policy_version()

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        self.dataset.ack_trained()
        if self.publish_dir is not None and model is not None and state.global_step % self.publish_every == 0:
            self.version += 1
            self.dataset.learner.publish_weights(model, self.version, self.publish_dir, keep=self.publish_keep,
                                                 tokenizer_dir=self.tokenizer_dir)


class DistillTrainer(Trainer):
    """``Trainer`` on a ``LearnerDataset``: one pipeline batch per step, acknowledged after the step.

    ``publish_dir``: after each ``publish_every``-th step's ack, publish the weights there as the next policy
    version (starting from the version published when training begins; ``publish_keep`` versions kept,
    the tokenizer files copied from ``tokenizer_dir`` or the model's own folder)."""

    def __init__(self, *args: Any, dataset: LearnerDataset, pg_weight: float = 1.0, kd_weight: float = 1.0,
                 clip: float | None = 0.2, publish_dir: str | Path | None = None, publish_every: int = 1,
                 publish_keep: int = 3, tokenizer_dir: str | Path | None = None, **kwargs: Any) -> None:
        kwargs["train_dataset"] = dataset
        super().__init__(*args, **kwargs)
        self.dataset = dataset
        self.pg_weight, self.kd_weight, self.clip = pg_weight, kd_weight, clip
        self.add_callback(AckAfterStep(dataset, publish_dir, publish_every=publish_every, publish_keep=publish_keep,
                                       tokenizer_dir=tokenizer_dir))

    def get_train_dataloader(self) -> DataLoader[Any]:
        """Each item is a whole batch already: no batching, no worker processes."""
        return DataLoader(self.dataset, batch_size=None, num_workers=0)

    def compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: torch.Tensor | int | None = None) -> Any:
        self.dataset.mark_trained(inputs)
        logits = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"].long()).logits[:, :-1]
        pg = importance_sampled_pg_loss(token_logprobs(logits, inputs["labels"]), inputs["student_logprobs"],
                                        inputs["advantages"], inputs["loss_mask"], clip=self.clip)
        kd = topk_forward_kl(logits, inputs["teacher_topk_ids"], inputs["teacher_topk_logprobs"],
                             inputs["distill_mask"], mode="tail")
        loss = self.pg_weight * pg + self.kd_weight * kd
        return (loss, {"logits": logits}) if return_outputs else loss


__all__ = ["ENTRY", "AckAfterStep", "DistillTrainer"]
