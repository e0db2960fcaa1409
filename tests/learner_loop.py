"""One rank of a 2-rank torch DDP (gloo, CPU) learner for the closed loop (tests/integration/test_closed_loop.py).

    python -m tests.learner_loop --rank R --world-size N --port P --student DIR --weights-dir DIR --steps S
        --record OUT.jsonl [--eval-teacher DIR] [--hold-at-step K] [--lr LR] [--checkpoint-dir DIR]

The example learner (``pipeline.demo.learner``) on N ranks: each rank reads its part of the same batch
(``Learner(rank=, world_size=)``), the loss is the ranked example learner's (``pipeline.demo.ranks_learner.
StepLoss``: the example learner's ``step_losses`` summed and divided by the whole batch's token counts,
``all_reduce``), so that DDP's mean of the ranks' gradients is the gradient of the whole batch (shown to 1e-6 by
tests/integration/test_learner_ranks.py); AdamW with the learning rate decaying linearly from ``--lr`` to 0 at
``--steps``. After each step: rank 0 writes the
checkpoint, every rank acks, then ``publish_weights`` (rank 0 writes the version folder, all wait for it).
A restarted group restores the checkpoint on every rank and acks, untrained, a batch it already holds.

Each rank writes JSON lines to ``--record``: ``start``; ``step`` (the learner's version when it trains, the
batch id, redelivery, and each group of its part with its version, tokens, loss mask and student logprobs);
``acked``; on rank 0 ``eval`` (held-out reverse KL). ``--hold-at-step K``: stop in the middle of step K
(after the forward) and sleep, to be killed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from pipeline.demo.ranks_learner import StepLoss
from pipeline.learner.checkpoint import load_checkpoint, save_checkpoint
from pipeline.learner.client import Learner, LearnerBatch
from pipeline.learner.torch_batch import TorchBatch, to_torch
from pipeline.models.weights import load_causal_lm

KEEP_ALL = 1 << 20  # every published version stays: the test checks each group against its version's weights


def part_record(lb: LearnerBatch) -> list[dict[str, Any]]:
    out = []
    for g in lb.batch.groups:
        seqs = [{"tokens": s.tokens.numpy().tolist(), "loss_mask": s.loss_mask.numpy().tolist(),
                 "logprobs": s.logprobs.numpy().tolist() if s.logprobs is not None else None}
                for s in g.group.sequences]
        out.append({"group_id": g.group.group_id, "version": g.group.policy_version, "sequences": seqs})
    return out


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tests.learner_loop")
    for name in ("rank", "world-size", "steps"):
        p.add_argument(f"--{name}", type=int, required=True)
    for name in ("port", "student", "weights-dir", "record"):
        p.add_argument(f"--{name}", required=True)
    p.add_argument("--eval-teacher")
    p.add_argument("--checkpoint-dir")  # default: WEIGHTS_DIR/checkpoint (required when --weights-dir is a URL)
    p.add_argument("--hold-at-step", type=int, default=0)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--batch-timeout", type=float, default=300.0)
    return p.parse_args(argv)


class Rank:
    """One rank: the student under DDP, its optimizer, the held-out evaluation (rank 0) and the record."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.a, self.rank, self.world = a, a.rank, a.world_size
        torch.manual_seed(0)
        self.student = load_causal_lm(a.student)
        self.opt = torch.optim.AdamW(self.student.parameters(), lr=a.lr, weight_decay=0.0)
        self.ckpt_dir = Path(a.checkpoint_dir) if a.checkpoint_dir else Path(a.weights_dir) / "checkpoint"
        self.ckpt = load_checkpoint(self.ckpt_dir, self.student, self.opt)  # every rank restores the same state
        self.model = DistributedDataParallel(StepLoss(self.student))
        self.teacher: Any = None
        self.prompts: list[list[int]] = []
        if a.eval_teacher and self.rank == 0:
            from transformers import AutoTokenizer

            from pipeline.demo.learner import heldout_prompts

            self.teacher = load_causal_lm(a.eval_teacher)
            self.prompts = heldout_prompts(AutoTokenizer.from_pretrained(a.student), 48)
        self.out = open(a.record, "a")  # noqa: SIM115

    def emit(self, rec: dict[str, Any]) -> None:
        self.out.write(json.dumps({"rank": self.rank, "t": time.time(), **rec}) + "\n")
        self.out.flush()

    def evaluate(self, step: int) -> None:
        if self.teacher is None:
            return
        from pipeline.models.evaluation import reverse_kl_on_prompts

        self.student.eval()
        kl = reverse_kl_on_prompts(self.student, self.teacher, self.prompts, seed=0)
        self.student.train()
        self.emit({"event": "eval", "step": step, "heldout_reverse_kl": kl})

    def counts(self, lb: LearnerBatch) -> tuple[TorchBatch | None, torch.Tensor]:
        """This rank's part as tensors, and the whole batch's trained and distilled tokens (``all_reduce``)."""
        tb = to_torch(lb.batch) if lb.batch.groups else None
        local = (torch.stack([tb.loss_mask.sum(), tb.distill_mask.sum()]).double() if tb is not None
                 else torch.zeros(2, dtype=torch.float64))
        dist.all_reduce(local)
        return tb, local

    def train_step(self, tb: TorchBatch | None, counts: torch.Tensor, step: int, batch_id: str) -> None:
        loss = self.model(tb, counts, self.world)
        if step == self.a.hold_at_step:
            self.emit({"event": "hold", "step": step, "batch_id": batch_id})
            time.sleep(3600)  # to be killed
        for group in self.opt.param_groups:  # linear decay to 0 at --steps; a function of the step, so a
            group["lr"] = self.a.lr * (1 - (step - 1) / self.a.steps)  # restarted group goes on the same
        self.opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.student.parameters(), 1.0)
        self.opt.step()

    def run(self, learner: Learner) -> None:
        a, ckpt = self.a, self.ckpt
        version = ckpt.policy_version if ckpt is not None else max(learner.policy_version(), 0)
        step = ckpt.step if ckpt is not None else 0
        learner.publish_weights(self.student, version, a.weights_dir, keep=KEEP_ALL, tokenizer_dir=a.student)
        self.emit({"event": "start", "step": step, "version": version, "restored": ckpt is not None})
        if step == 0:
            self.evaluate(0)
        self.student.train()
        while step < a.steps:
            lb = learner.next_batch(a.batch_timeout)
            if lb is None:
                self.emit({"event": "no_batch", "step": step})
                return
            if ckpt is not None and ckpt.trained(lb.batch.batch_id):
                learner.ack(lb)  # already in the restored weights
                self.emit({"event": "acked_trained", "batch_id": lb.batch.batch_id})
                continue
            tb, counts = self.counts(lb)
            if not counts.any():  # every group of it was dead-lettered as stale at delivery: nothing to train
                learner.ack(lb)
                self.emit({"event": "acked_empty", "batch_id": lb.batch.batch_id})
                continue
            step += 1
            self.emit({"event": "step", "step": step, "version": version, "batch_id": lb.batch.batch_id,
                       "entry": lb.entry_id, "redelivered": lb.redelivered, "generation": lb.generation,
                       "groups": part_record(lb)})
            self.train_step(tb, counts, step, lb.batch.batch_id)
            version += 1
            # Every rank: rank 0 writes, and all return after a barrier, so no rank acks before it is written.
            save_checkpoint(self.ckpt_dir, self.student, self.opt, step=step, policy_version=version,
                            batch_ids=[lb.batch.batch_id])
            ok = learner.ack(lb)
            self.emit({"event": "acked", "step": step, "batch_id": lb.batch.batch_id, "ok": ok})
            learner.publish_weights(self.student, version, a.weights_dir, keep=KEEP_ALL, tokenizer_dir=a.student)
            if step == a.steps:
                self.evaluate(step)


def main(argv: list[str]) -> int:
    a = parse(argv)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=a.port)
    dist.init_process_group("gloo", rank=a.rank, world_size=a.world_size, timeout=datetime.timedelta(seconds=120))
    rank = Rank(a)
    with Learner(None, rank=a.rank, world_size=a.world_size) as learner:
        rank.run(learner)
    rank.out.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
