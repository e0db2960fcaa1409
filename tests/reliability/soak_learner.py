"""The chaos soak's learner, a process of its own (``tests.reliability.chaos`` SIGKILLs and SIGSTOPs it):

    python -m tests.reliability.soak_learner --redis-url URL --namespace NS --student DIR --weights-dir DIR
        --record OUT.jsonl [--publish-every N] [--lr LR]

A user's learner as the docs show it: ``distillq.Learner`` (no error handling of its own: a client error ends
the process, and the soak counts that exit), one AdamW step of the top-k forward KL per batch on the tiny
student, a checkpoint after each step (``save_checkpoint`` with the batch id), the ack, and
``publish_weights`` every ``--publish-every`` steps. A restart restores the checkpoint and acks, untrained, a
batch its weights already hold (the checkpoint's batch ids and this process's own).

Each step is recorded (JSON lines, flushed) *before* it trains: ``start`` (the step restored), ``step`` (step,
version, batch id, and per group its id and what is wrong with its teacher values, if anything),
``acked_trained``, ``acked``. A ``step`` line whose step is above the ``step`` of a later ``start`` line was
not in the weights that restart restored: it does not count as trained (``chaos.learner_record``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from distillq import Learner, LearnerBatch
from pipeline.learner.checkpoint import load_checkpoint, save_checkpoint
from pipeline.learner.chunked import topk_forward_kl
from pipeline.learner.torch_batch import to_torch
from pipeline.models.weights import load_causal_lm
from pipeline.stages.exits import EXIT_USAGE
from pipeline.transport.identity import NameHeld

#: A teacher logprob at or below this is not a value (vLLM's -inf sentinel is -9999.0).
FLOOR = -1000.0


def teacher_faults(lb: LearnerBatch) -> dict[str, str]:
    """Group id -> what is wrong with its teacher arrays (non-finite, above 0, at or below ``FLOOR``)."""
    bad: dict[str, str] = {}
    for g in lb.batch.groups:
        for i, t in enumerate(g.teacher or ()):
            for name, arr in (("topk_logprobs", t.topk_logprobs.numpy()),
                              ("sampled_logprobs", t.sampled_logprobs.numpy())):
                a = np.asarray(arr, dtype=np.float64)
                if not np.isfinite(a).all():
                    bad[g.group_id] = f"sequence {i}: {name} not finite"
                elif a.size and (a.max() > 1e-3 or a.min() <= FLOOR):
                    bad[g.group_id] = f"sequence {i}: {name} in [{a.min():g}, {a.max():g}]"
    return bad


class Step:
    """The tiny student, its optimizer and one step of the top-k forward KL."""

    def __init__(self, student: str, lr: float) -> None:
        torch.manual_seed(0)
        self.model = load_causal_lm(student)
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=0.0)

    def train(self, lb: LearnerBatch) -> float:
        tb = to_torch(lb.batch)
        if not tb.distill_mask.any():
            return 0.0
        head = self.model.get_output_embeddings()
        hidden = self.model.get_decoder()(input_ids=tb.input_ids, attention_mask=tb.attention_mask.long())
        loss = topk_forward_kl(hidden.last_hidden_state[:, :-1], head.weight, tb.teacher_topk_ids,
                               tb.teacher_topk_logprobs, tb.distill_mask, mode="tail", bias=head.bias)
        self.opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        return float(loss.detach())


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tests.reliability.soak_learner")
    for name in ("redis-url", "namespace", "student", "weights-dir", "record"):
        p.add_argument(f"--{name}", required=True)
    p.add_argument("--publish-every", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-3)
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    a = parse(argv)
    step_fn = Step(a.student, a.lr)
    ckpt_dir = Path(a.weights_dir) / "checkpoint"
    ckpt = load_checkpoint(ckpt_dir, step_fn.model, step_fn.opt)
    step = ckpt.step if ckpt is not None else 0
    version = ckpt.policy_version if ckpt is not None else 0
    trained = set(ckpt.batch_ids if ckpt is not None else ())  # and those of this process's steps
    with open(a.record, "a") as out, Learner(a.redis_url, namespace=a.namespace) as learner:
        def emit(rec: dict[str, Any]) -> None:
            out.write(json.dumps({"t": time.time(), **rec}) + "\n")
            out.flush()

        learner.publish_weights(step_fn.model, version, a.weights_dir, tokenizer_dir=a.student)
        emit({"event": "start", "step": step, "version": version, "restored": ckpt is not None})
        while True:
            lb = learner.next_batch(1.0)
            if lb is None:
                continue
            if lb.batch.batch_id in trained:
                learner.ack(lb)
                emit({"event": "acked_trained", "batch_id": lb.batch.batch_id, "groups": lb.group_ids})
                continue
            step += 1
            emit({"event": "step", "step": step, "version": version, "batch_id": lb.batch.batch_id,
                  "redelivered": lb.redelivered, "groups": lb.group_ids, "bad_teacher": teacher_faults(lb)})
            loss = step_fn.train(lb)
            trained.add(lb.batch.batch_id)
            version += 1
            save_checkpoint(ckpt_dir, step_fn.model, step_fn.opt, step=step, policy_version=version,
                            batch_ids=[lb.batch.batch_id])
            emit({"event": "acked", "step": step, "ok": learner.ack(lb), "loss": loss})
            if step % a.publish_every == 0:
                learner.publish_weights(step_fn.model, version, a.weights_dir, tokenizer_dir=a.student)


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except NameHeld as e:  # a second learner under the name of a live one: one line, exit 2, as distillq's
        print(f"distillq: {e}", file=sys.stderr, flush=True)
        sys.exit(EXIT_USAGE)
