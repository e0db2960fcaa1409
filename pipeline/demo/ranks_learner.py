"""A learner on N ranks: torchrun, DDP or FSDP2, gloo on CPU and nccl on GPUs.

    torchrun --nproc-per-node 2 --max-restarts 3 --rdzv-backend c10d --rdzv-endpoint localhost:29411 \\
        -m pipeline.demo.ranks_learner --student DIR --weights-dir DIR --steps 100 [--shard fsdp]

Every rank runs this same loop (the rank rules of docs/learner.md, "Learners on N ranks"):

1. every rank builds the student, wraps it (``DistributedDataParallel``, or ``fully_shard`` per decoder layer
   and on the whole), makes its optimizer and calls ``load_checkpoint`` (the same checkpoint on every rank);
   then ``publish_weights`` on every rank (rank 0 writes): a crash between an ack and a publication is repaired;
2. every rank reads the batch (``Learner(rank=, world_size=)``: each gets its own part of the same batch);
   a batch the checkpoint already holds (its ``batch_id`` in ``Checkpoint.batch_ids``) is acknowledged on every
   rank without training: all ranks decide the same, since all get the same ``batch_id``;
3. the whole batch's token counts are summed over the ranks (``all_reduce``), each rank sums its per-token
   losses and divides by them times the world size, so the ranks' mean gradient is the whole batch's;
   a rank whose part is empty runs a forward of a dummy input through the wrapped model and a backward of
   ``0 *`` its output, so it joins the same collectives as the others;
4. optimiser step, then ``save_checkpoint`` on every rank (rank 0 writes; a barrier: no rank acks first),
   then ``ack`` on every rank, then ``publish_weights`` on every rank (rank 0 writes and announces the version;
   a barrier).

A rank killed mid-step makes torchrun stop and restart every rank (``--max-restarts``); the restarted ranks
restore the checkpoint, and the batch comes back to all of them, split the same way, and trains once.

``--record FILE`` appends one JSON line per event and rank (start, step, trained, acked, skipped), for tests;
``--hold RESTART:STEP:PHASE`` stops rank ``--hold-rank`` (1) in step STEP of its start number RESTART (0: the
first; torchrun's ``TORCHELASTIC_RESTART_COUNT``) at PHASE (``forward``: after the forward; ``checkpoint``:
after the checkpoint, before the ack) and sleeps there, to be killed.
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
from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]

from pipeline.demo.learner import step_losses
from pipeline.errors import ConfigurationError
from pipeline.learner.checkpoint import load_checkpoint, save_checkpoint
from pipeline.learner.client import Learner, LearnerBatch
from pipeline.learner.torch_batch import TorchBatch, to_torch
from pipeline.models.weights import load_causal_lm
from pipeline.stages.exits import run_command


class StepLoss(torch.nn.Module):
    """The student's loss on a part of a batch, as a module: the forward runs through DDP / FSDP."""

    def __init__(self, student: Any, clip: float = 0.2) -> None:
        super().__init__()
        self.student, self.clip = student, clip

    def forward(self, tb: TorchBatch | None, counts: torch.Tensor, world: int) -> torch.Tensor:
        if tb is None:  # an empty part: the same collectives as the other ranks, a zero gradient
            ids = torch.zeros((1, 2), dtype=torch.long, device=counts.device)
            zero: torch.Tensor = self.student(input_ids=ids).logits.sum() * 0.0
            return zero
        _, pg, kd = step_losses(self.student, tb, self.clip, reduction="sum")  # the example learner's losses
        return world * (pg / counts[0].clamp(min=1) + kd / counts[1].clamp(min=1))


def wrap(student: Any, shard: str, device: torch.device) -> torch.nn.Module:
    """The loss module, data parallel: DDP, or FSDP2 (``fully_shard`` on each decoder layer, then the root)."""
    module = StepLoss(student.to(device))
    if shard == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in student.get_decoder().layers:
            fully_shard(layer)
        fully_shard(module)
        return module
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(module, device_ids=[device.index] if device.type == "cuda" else None)


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="torchrun ... -m pipeline.demo.ranks_learner", description=__doc__.split("\n")[0])
    p.add_argument("--student", required=True, help="the student's model folder")
    p.add_argument("--weights-dir", required=True, help="where the versions are published")
    p.add_argument("--checkpoint-dir", help="default: WEIGHTS_DIR/checkpoint")
    p.add_argument("--steps", type=int, default=100, help="optimiser steps in all (counted across restarts)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--shard", choices=("ddp", "fsdp"), default="ddp")
    p.add_argument("--batch-timeout", type=float, default=60.0, help="stop after this many seconds without a batch")
    p.add_argument("--keep", type=int, default=3, help="published versions kept")
    p.add_argument("--redis-url")
    p.add_argument("--namespace")
    p.add_argument("--record", help="append one JSON line per event and rank")
    p.add_argument("--hold", action="append", default=[],
                   help="RESTART:STEP:PHASE (phase forward or checkpoint): sleep there, to be killed (repeatable)")
    p.add_argument("--hold-rank", type=int, default=1)
    return p.parse_args(argv)


class Recorder:
    def __init__(self, path: str | None, rank: int, restart: int) -> None:
        self.path, self.rank, self.restart = path, rank, restart

    def __call__(self, event: str, **fields: Any) -> None:
        if self.path is None:
            return
        line = json.dumps({"event": event, "rank": self.rank, "restart": self.restart, "pid": os.getpid(),
                           "t": time.time(), **fields})
        with open(self.path, "a") as f:
            f.write(line + "\n")

    def hold(self, holds: set[tuple[int, int, str]], step: int, phase: str, batch_id: str, rank: int) -> None:
        """Sleep here (to be killed) when ``--hold`` names this start, step and phase, on ``--hold-rank``."""
        if (self.restart, step, phase) in holds and self.rank == rank:
            self("hold", step=step, batch_id=batch_id, phase=phase)
            time.sleep(3600)


def optimise(model: torch.nn.Module, opt: torch.optim.Optimizer, loss: torch.Tensor) -> None:
    loss.backward()  # type: ignore[no-untyped-call]
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()


def main(argv: list[str]) -> int:
    """Through the one exit path (``run_command``): a configuration error is one line and exit status 2, Redis
    away one line and 3."""
    a = parse(argv)
    a.func = train_ranks
    return run_command(a)


def train_ranks(a: argparse.Namespace) -> int:
    if "RANK" not in os.environ or "MASTER_ADDR" not in os.environ:
        raise ConfigurationError("pipeline.demo.ranks_learner runs under torchrun (torchrun --standalone "
                                 "--nproc-per-node N -m pipeline.demo.ranks_learner ...): RANK, WORLD_SIZE and "
                                 "MASTER_ADDR are not set")
    device = rank_device()
    restart = init_ranks("nccl" if device.type == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    record = Recorder(a.record, rank, restart)
    holds = {(int(r), int(s), phase) for r, s, phase in (h.split(":") for h in a.hold)}
    ckpt_dir = Path(a.checkpoint_dir or Path(a.weights_dir) / "checkpoint")

    torch.manual_seed(0)
    student = load_causal_lm(a.student)
    model = wrap(student, a.shard, device)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0, fused=True)  # one kernel for every tensor
    ckpt = load_checkpoint(ckpt_dir, model, opt, device=str(device))  # every rank, the wrapped model
    trained = set(ckpt.batch_ids) if ckpt is not None else set()  # batches in these weights

    with Learner(a.redis_url, namespace=a.namespace, rank=rank, world_size=world) as learner:
        step = ckpt.step if ckpt is not None else 0
        version = ckpt.policy_version if ckpt is not None else learner.policy_version()
        learner.publish_weights(student, version, a.weights_dir, keep=a.keep, tokenizer_dir=a.student)  # every rank
        record("start", step=step, version=version, restored=ckpt is not None)
        while step < a.steps:
            lb = learner.next_batch(a.batch_timeout)
            if lb is None:
                break
            bid = lb.batch.batch_id
            if bid in trained:  # the checkpoint holds it (a crash between checkpoint and ack): ack, no step
                ok = learner.ack(lb)
                record("skipped", batch_id=bid, ok=ok)
                continue
            tb, counts = part(lb, device)
            if not counts.any():  # every group was left out at delivery (stale): nothing to train
                record("empty", batch_id=bid, ok=learner.ack(lb))
                continue
            record("step", step=step + 1, batch_id=bid, entry=lb.entry_id, groups=lb.group_ids,
                   redelivered=lb.redelivered, generation=lb.generation)
            loss = model(tb, counts, world)
            record.hold(holds, step + 1, "forward", bid, a.hold_rank)
            optimise(model, opt, loss)
            step, version = step + 1, version + 1
            save_checkpoint(ckpt_dir, model, opt, step=step, policy_version=version, batch_ids=[bid])  # every rank
            trained.add(bid)
            record("trained", step=step, batch_id=bid, groups=lb.group_ids, loss=float(loss.detach()))
            record.hold(holds, step, "checkpoint", bid, a.hold_rank)
            ok = learner.ack(lb)  # every rank: the batch is settled once all have acked it
            record("acked", step=step, batch_id=bid, ok=ok)
            learner.publish_weights(student, version, a.weights_dir, keep=a.keep, tokenizer_dir=a.student)
        record("end", step=step, version=version)
    dist.destroy_process_group()
    return 0


def rank_device() -> torch.device:
    """This rank's GPU (``LOCAL_RANK``) when there are GPUs, else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    return device


def init_ranks(backend: str, timeout_s: float = 600.0) -> int:
    """``init_process_group`` from torchrun's environment, on a store prefix of its own per start; returns the
    start number (``TORCHELASTIC_RESTART_COUNT``: 0 first, one more after each torchrun restart).

    torchrun keeps one rendezvous store for every start of a job, and the gloo process group of a restarted
    job found the previous start's addresses there (``Gloo connectFullMesh failed ... Connection refused``):
    the prefix keeps each start's keys apart."""
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    timeout = datetime.timedelta(seconds=timeout_s)
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun's agent hosts the store
    store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=rank == 0 and not agent_store, timeout=timeout, multi_tenant=True)
    prefixed = PrefixStore(f"distillq-start-{restart}", store)
    dist.init_process_group(backend, store=prefixed, rank=rank,
                            world_size=world, timeout=timeout)
    return restart


def part(lb: LearnerBatch, device: torch.device) -> tuple[TorchBatch | None, torch.Tensor]:
    """This rank's part as tensors (``None`` when empty) and the whole batch's trained and distilled token
    counts (an ``all_reduce`` over the ranks)."""
    tb = to_torch(lb.batch, device=str(device)) if lb.group_ids else None
    counts = (torch.stack([tb.loss_mask.sum(), tb.distill_mask.sum()]).double() if tb is not None
              else torch.zeros(2, dtype=torch.float64, device=device))
    dist.all_reduce(counts)
    return tb, counts


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
