"""The optimizer's state beside the published weights, so a learner restarted on them goes on where it was.

``DIR/optimizer.safetensors`` holds every per-parameter tensor of the optimizer's state (AdamW's moments
and step counts; safetensors, never pickle) with the weights' version and the learner step in its metadata.
It is written (atomic rename) before the weights it belongs to, and only used when its version matches the
weights': a learner stopped between the two writes starts that step's optimizer afresh rather than pairing
moments with other weights. The hyper-parameters (learning rate, betas) come from the restarted learner.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

OPTIMIZER_FILE = "optimizer.safetensors"


@dataclass(frozen=True)
class Restored:
    version: int
    step: int


def save_optimizer(opt: torch.optim.Optimizer, directory: str | Path, *, version: int, step: int) -> Path:
    """Atomically write ``opt``'s per-parameter state (tensors only) for weights ``version`` at ``step``."""
    from safetensors.torch import save_file

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for index, state in opt.state_dict()["state"].items():
        for name, value in state.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"optimizer state {name!r} is a {type(value).__name__}, not a tensor")
            tensors[f"{index}.{name}"] = value.detach().contiguous().cpu()
    tmp = d / f".{OPTIMIZER_FILE}.{os.getpid()}.tmp"
    save_file(tensors, str(tmp), metadata={"version": str(version), "step": str(step)})
    os.replace(tmp, d / OPTIMIZER_FILE)
    return d / OPTIMIZER_FILE


def load_optimizer(opt: torch.optim.Optimizer, directory: str | Path, *, version: int) -> Restored | None:
    """Load the state saved for weights ``version`` into ``opt``; None when there is none for that version."""
    from safetensors import safe_open

    path = Path(directory) / OPTIMIZER_FILE
    if not path.exists():
        return None
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        if int(meta.get("version", "-1")) != version:
            return None
        state: dict[int, dict[str, torch.Tensor]] = {}
        for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
            index, _, name = key.partition(".")
            state.setdefault(int(index), {})[name] = f.get_tensor(key)
    current = opt.state_dict()
    opt.load_state_dict({"state": state, "param_groups": current["param_groups"]})
    return Restored(version=version, step=int(meta.get("step", "0")))
