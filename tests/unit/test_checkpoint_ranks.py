"""Checkpoint pieces used by learner ranks: an FSDP full optimizer state (keyed by parameter names) survives the
safetensors + JSON split, and without torch.distributed ``save_checkpoint`` writes in this process alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from pipeline.learner.checkpoint import _join_optimizer, _split_optimizer, load_checkpoint, save_checkpoint


def test_an_optimizer_state_keyed_by_parameter_names_round_trips() -> None:
    layer = {"exp_avg": torch.ones(2, 3), "step": torch.tensor(4.0)}
    head = {"exp_avg": torch.zeros(3), "step": torch.tensor(4.0), "flag": True}
    state: dict[str, Any] = {"state": {"model.layers.0.mlp.weight": layer, "lm_head.weight": head},
                             "param_groups": [{"params": ["model.layers.0.mlp.weight", "lm_head.weight"], "lr": 0.1}]}
    tensors, rest = _split_optimizer(state)
    back = _join_optimizer(tensors, rest)
    assert back["param_groups"] == state["param_groups"]
    assert back["state"].keys() == state["state"].keys()
    for name, entries in state["state"].items():
        for k, v in entries.items():
            got = back["state"][name][k]
            assert torch.equal(got, v) if isinstance(v, torch.Tensor) else got == v


def test_index_keyed_state_keeps_int_keys_and_single_process_writes(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    path = save_checkpoint(tmp_path, model, opt, step=1, policy_version=1, batch_ids=["b1"])
    assert path is not None and path.name == "step-000000001"
    fresh = torch.nn.Linear(3, 2)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    ckpt = load_checkpoint(tmp_path, fresh, fresh_opt)
    assert ckpt is not None and ckpt.trained("b1") and not ckpt.trained("b2")
    assert sorted(fresh_opt.state_dict()["state"]) == [0, 1]
    assert torch.equal(fresh.weight, model.weight)
