"""A learner process that follows the documented order (step, checkpoint, ack, publish), for tests.

    python -m tests.learner_resume URL NAMESPACE CKPT_DIR OUT [--crash-at N --crash-point P]

``--crash-point``: where to kill itself with SIGKILL at step N: ``after_step`` (before the checkpoint),
``after_checkpoint`` (before the ack) or ``after_ack`` (before the version is published). Ends when no
batch comes for 3 s, writing the model's weights to ``OUT`` (safetensors) with the policy version.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import torch
from safetensors.torch import save_file

from pipeline.learner.checkpoint import load_checkpoint, save_checkpoint
from pipeline.learner.client import Learner
from pipeline.learner.torch_batch import to_torch
from tests.learner_ddp import loss_sums, tiny_model


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    for name in ("url", "namespace", "ckpt", "out"):
        p.add_argument(name)
    p.add_argument("--crash-at", type=int, default=0)
    p.add_argument("--crash-point", default="")
    a = p.parse_args(argv)

    def crash(point: str, step: int) -> None:
        if step == a.crash_at and point == a.crash_point:
            os.kill(os.getpid(), signal.SIGKILL)

    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with Learner(a.url, namespace=a.namespace) as learner:
        ckpt = load_checkpoint(a.ckpt, model, opt)
        version = ckpt.policy_version if ckpt else 0
        step = ckpt.step if ckpt else 0
        learner.publish_policy_version(version)  # (again) the checkpoint's version
        for lb in learner.batches(timeout_s=3):
            if ckpt is not None and ckpt.trained(lb.batch.batch_id):
                learner.ack(lb)
                continue
            step += 1
            tb = to_torch(lb.batch)
            pg, kd = loss_sums(model, tb)
            opt.zero_grad()
            (pg / tb.loss_mask.sum() + kd / tb.distill_mask.sum()).backward()  # type: ignore[no-untyped-call]
            opt.step()
            crash("after_step", step)
            version += 1
            save_checkpoint(a.ckpt, model, opt, step=step, policy_version=version, batch_ids=[lb.batch.batch_id])
            crash("after_checkpoint", step)
            learner.ack(lb)
            crash("after_ack", step)
            learner.publish_policy_version(version)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, a.out,
              metadata={"version": str(version), "step": str(step)})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
