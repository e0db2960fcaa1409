"""One rank of a torch DDP (gloo, CPU) learner, for tests: one step on its part of one batch, gradients saved.

    python -m tests.learner_ddp URL NAMESPACE RANK WORLD PORT OUT.safetensors

Each rank reads its part (``Learner(rank=, world_size=)``), sums its per-token losses and divides by the
global count of trained tokens (``all_reduce`` of the local counts) times the world size, so that DDP's mean
of the ranks' gradients is the gradient of the whole batch's mean loss. Acks after the step.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.nn.parallel import DistributedDataParallel

from pipeline.learner.client import Learner
from pipeline.learner.losses import importance_sampled_pg_loss, token_logprobs, topk_forward_kl
from pipeline.learner.torch_batch import TorchBatch, to_torch

VOCAB = 1000


def tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(VOCAB, 16), torch.nn.Tanh(), torch.nn.Linear(16, VOCAB))


def loss_sums(model: torch.nn.Module, tb: TorchBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Sums over the batch of the policy-gradient and top-k forward-KL per-token losses."""
    logits = model(tb.input_ids)[:, :-1]
    pg = importance_sampled_pg_loss(token_logprobs(logits, tb.labels), tb.student_logprobs, tb.advantages,
                                    tb.loss_mask, clip=0.2, reduction="sum")
    kd = topk_forward_kl(logits, tb.teacher_topk_ids, tb.teacher_topk_logprobs, tb.distill_mask, mode="tail",
                         reduction="sum")
    return pg, kd


def main(argv: list[str]) -> int:
    url, ns, rank, world, port, out = argv[0], argv[1], int(argv[2]), int(argv[3]), argv[4], argv[5]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = DistributedDataParallel(tiny_model())
    with Learner(url, namespace=ns, rank=rank, world_size=world) as learner:
        lb = learner.next_batch(30)
        assert lb is not None
        tb = to_torch(lb.batch)
        counts = torch.stack([tb.loss_mask.sum(), tb.distill_mask.sum()]).double()
        dist.all_reduce(counts)  # the whole batch's trained and distilled tokens
        pg, kd = loss_sums(model, tb)
        loss = world * (pg / counts[0].clamp(min=1) + kd / counts[1].clamp(min=1))
        loss.backward()  # type: ignore[no-untyped-call]
        grads = {n: p.grad.detach().clone() for n, p in model.module.named_parameters() if p.grad is not None}
        save_file(grads, out, metadata={"groups": ",".join(lb.group_ids)})
        learner.ack(lb)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
