"""Learner checkpoints: model, optimizer, step, policy version and the batches trained into them, atomic.

    from pipeline.learner.checkpoint import load_checkpoint, save_checkpoint

    ckpt = load_checkpoint(DIR, model, optimizer)          # None on the first start
    ...
    loss.backward(); optimizer.step()
    save_checkpoint(DIR, model, optimizer, step=s, policy_version=v, batch_ids=[lb.batch.batch_id])
    learner.ack(lb)                                        # only after the checkpoint: see docs/learner.md

Layout: ``DIR/step-<step>/`` holds ``model.safetensors`` (``safetensors.torch.save_model``: tied weights
kept once), ``optimizer.safetensors`` (the optimizer state's tensors) and ``state.json`` (step, version,
batch ids, the optimizer's other values, ``extra``); ``DIR/latest`` names the newest folder. A folder is
written under a temporary name, synced and renamed, and only then is ``latest`` replaced (write to a
temporary file, rename), so a crash at any point leaves the previous checkpoint in force. Never pickle.
The ``keep`` newest folders stay; older ones are deleted after ``latest`` moved on.

Learner ranks (``torch.distributed`` initialised, more than one rank): call both functions on every rank,
with the wrapped model. ``save_checkpoint`` takes rank 0's replica under DDP, or gathers the full model and
optimizer state under FSDP (``fully_shard`` or ``FullyShardedDataParallel``: a collective), has rank 0 write
it, and returns on every rank after a barrier, so no rank acknowledges a batch before the checkpoint that
holds it is on disk (the other ranks get ``None``). ``load_checkpoint`` restores the same checkpoint on every
rank (under FSDP each rank keeps its shard of it).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.models.weights import fsync_dir

LATEST = "latest"
FORMAT = 1


@dataclass(frozen=True)
class Checkpoint:
    """What ``load_checkpoint`` restored."""

    path: Path
    step: int
    policy_version: int
    batch_ids: tuple[str, ...] = ()  # the batches trained into these weights (the last few)
    extra: dict[str, Any] = field(default_factory=dict)

    def trained(self, batch_id: str) -> bool:
        """Whether the batch ``batch_id`` is already in these weights (a crash came between the checkpoint
        and its ack: acknowledge it again without training)."""
        return batch_id in self.batch_ids


def _distributed() -> tuple[bool, int]:
    """(whether more than one torch.distributed rank runs, this process's rank)."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch without distributed
        return False, 0
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return True, dist.get_rank()
    return False, 0


def _barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


def _unwrap(model: Any) -> Any:
    """The model under DDP / ``torch.compile`` wrappers."""
    while (inner := getattr(model, "module", None) or getattr(model, "_orig_mod", None)) is not None:
        model = inner
    return model


def _is_sharded(model: Any) -> bool:
    """FSDP: ``FullyShardedDataParallel``, or ``fully_shard`` (its parameters are DTensors)."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return isinstance(model, FullyShardedDataParallel) or any(isinstance(p, DTensor) for p in model.parameters())


def _full_state(model: Any, optimizer: Any | None) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The full model and optimizer state dicts of a sharded model, on CPU (a collective: every rank)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd, osd = get_state_dict(model, optimizer if optimizer is not None else [], options=opts)
    seen: set[int] = set()
    out: dict[str, Any] = {}
    for k, v in dict[str, Any](msd).items():  # safetensors refuses shared storage (tied weights): copy a repeat
        out[k] = v.clone() if v.data_ptr() in seen else v
        seen.add(v.data_ptr())
    return out, (dict(osd) if optimizer is not None else None)


def _split_optimizer(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """An optimizer ``state_dict`` as (tensors by flat name, the JSON rest)."""
    import torch

    tensors: dict[str, Any] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for pid, entries in state["state"].items():
        for name, v in entries.items():
            if isinstance(v, torch.Tensor):
                tensors[f"{pid}/{name}"] = v.detach().contiguous().cpu()
            else:
                scalars.setdefault(str(pid), {})[name] = v
    return tensors, {"scalars": scalars, "param_groups": state["param_groups"]}


def _join_optimizer(tensors: dict[str, Any], rest: dict[str, Any]) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    for key, v in tensors.items():
        pid, name = key.split("/", 1)
        state.setdefault(_param_key(pid), {})[name] = v
    for pid, entries in rest["scalars"].items():
        state.setdefault(_param_key(pid), {}).update(entries)
    return {"state": state, "param_groups": rest["param_groups"]}


def _param_key(pid: str) -> Any:
    """An optimizer state key: a parameter's index, or its name (a sharded model's full state dict)."""
    return int(pid) if pid.isdigit() else pid


def save_checkpoint(
    directory: str | Path,
    model: Any,
    optimizer: Any | None = None,
    *,
    step: int,
    policy_version: int,
    batch_ids: Iterable[str] = (),
    extra: dict[str, Any] | None = None,
    keep: int = 2,
) -> Path | None:
    """Write a checkpoint atomically and make it the latest; returns its folder. ``batch_ids``: the batches
    trained since the previous checkpoint (kept with the last 64 before them).

    Learner ranks: call it on every rank; rank 0 writes, every rank returns after a barrier (``None`` on
    the others). Under FSDP the full state is gathered first (a collective)."""
    if keep < 1:
        raise ValueError("keep must be >= 1")
    distributed, rank = _distributed()
    if not distributed:
        return _write(directory, model, optimizer, None, None, step, policy_version, batch_ids, extra, keep)
    msd: dict[str, Any] | None = None
    osd: dict[str, Any] | None = None
    if _is_sharded(model):
        msd, osd = _full_state(model, optimizer)
    path = None
    try:
        if rank == 0:
            path = _write(directory, _unwrap(model), optimizer, msd, osd, step, policy_version, batch_ids, extra,
                          keep)
    finally:
        _barrier()  # no rank goes on (acks) before the checkpoint is on disk; a failed write fails rank 0 alone
    return path


def _write(
    directory: str | Path, model: Any, optimizer: Any | None, msd: dict[str, Any] | None,
    osd: dict[str, Any] | None, step: int, policy_version: int, batch_ids: Iterable[str],
    extra: dict[str, Any] | None, keep: int,
) -> Path:
    from safetensors.torch import save_file, save_model

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    prev = _read_state(d)
    ids = [*((prev or {}).get("batch_ids", [])), *batch_ids][-64:]
    tmp = d / f".tmp-{uuid.uuid4().hex}"
    tmp.mkdir()
    try:
        if msd is None:
            save_model(model, str(tmp / "model.safetensors"))
        else:
            save_file(msd, str(tmp / "model.safetensors"), metadata={"distillq": "full_state_dict"})
        state: dict[str, Any] = {"format": FORMAT, "step": int(step), "policy_version": int(policy_version),
                                 "batch_ids": ids, "extra": extra or {}}
        if optimizer is not None:
            tensors, rest = _split_optimizer(osd if osd is not None else optimizer.state_dict())
            save_file(tensors, str(tmp / "optimizer.safetensors"))
            state["optimizer"] = rest
        (tmp / "state.json").write_text(json.dumps(state))
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        fsync_dir(tmp)
        final = d / f"step-{int(step):09d}"
        if final.exists():  # the same step written again (a retried step): replace it
            shutil.rmtree(final)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    latest_tmp = d / f".{LATEST}.{uuid.uuid4().hex}"
    latest_tmp.write_text(final.name)
    os.replace(latest_tmp, d / LATEST)
    fsync_dir(d)
    for old in sorted(p for p in d.glob("step-*") if p.is_dir())[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _latest(d: Path) -> Path | None:
    try:
        name = (d / LATEST).read_text().strip()
    except FileNotFoundError:
        return None
    return d / name if name else None


def _read_state(d: Path) -> dict[str, Any] | None:
    path = _latest(d)
    if path is None:
        return None
    state: dict[str, Any] = json.loads((path / "state.json").read_text())
    return state


def load_checkpoint(
    directory: str | Path, model: Any, optimizer: Any | None = None, *, device: str = "cpu"
) -> Checkpoint | None:
    """Restore the latest checkpoint into ``model`` (and ``optimizer``); ``None`` if there is none yet.

    Learner ranks: call it on every rank, with the wrapped model (DDP, FSDP) and its optimizer, before the
    first batch."""
    from safetensors.torch import load_file, load_model

    d = Path(directory)
    path = _latest(d)
    if path is None:
        return None
    state = json.loads((path / "state.json").read_text())
    if state.get("format") != FORMAT:
        raise ValueError(f"{path}: checkpoint format {state.get('format')!r}, expected {FORMAT}")
    if optimizer is not None and "optimizer" not in state:
        raise ValueError(f"{path}: the checkpoint holds no optimizer state")
    if _is_sharded(model):  # every rank reads the full state and keeps its shard of it
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        osd = (None if optimizer is None else
               _join_optimizer(load_file(str(path / "optimizer.safetensors")), state["optimizer"]))
        set_state_dict(model, optimizer if optimizer is not None else [],
                       model_state_dict=dict[str, Any](load_file(str(path / "model.safetensors"))),
                       optim_state_dict=osd or {}, options=StateDictOptions(full_state_dict=True))
    else:
        load_model(_unwrap(model), str(path / "model.safetensors"), strict=True, device=device)
        if optimizer is not None:
            optimizer.load_state_dict(_join_optimizer(load_file(str(path / "optimizer.safetensors"), device=device),
                                                      state["optimizer"]))
    return Checkpoint(path, int(state["step"]), int(state["policy_version"]), tuple(state.get("batch_ids", ())),
                      dict(state.get("extra", {})))
