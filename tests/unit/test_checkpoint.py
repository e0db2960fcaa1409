"""The optimizer's state saved beside the weights: a learner stopped and started again takes the same steps."""

from __future__ import annotations

from pathlib import Path

import torch

from pipeline.learner.checkpoint import OPTIMIZER_FILE, load_optimizer, save_optimizer
from pipeline.models.weights import load_weights, save_weights


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(5, 8, generator=g), torch.randn(5, 4, generator=g)
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()  # type: ignore[no-untyped-call]
    opt.step()


def test_a_restart_on_the_saved_state_takes_the_same_steps(tmp_path: Path) -> None:
    straight = _model()
    opt = torch.optim.AdamW(straight.parameters(), lr=1e-2)
    for i in range(6):
        _step(straight, opt, i)

    first = _model()
    opt1 = torch.optim.AdamW(first.parameters(), lr=1e-2)
    for i in range(3):
        _step(first, opt1, i)
    save_optimizer(opt1, tmp_path, version=3, step=3)
    save_weights(first, tmp_path, 3)

    again = _model()  # the initial weights again, as a restarted process has them
    opt2 = torch.optim.AdamW(again.parameters(), lr=1e-2)
    assert load_weights(again, tmp_path) == 3
    restored = load_optimizer(opt2, tmp_path, version=3)
    assert restored is not None and (restored.version, restored.step) == (3, 3)
    for i in range(3, 6):
        _step(again, opt2, i)
    for a, b in zip(straight.parameters(), again.parameters(), strict=True):
        assert torch.equal(a, b)

    fresh = _model()  # without the moments the same steps land elsewhere: the state is what makes them equal
    opt3 = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    load_weights(fresh, tmp_path)
    for i in range(3, 6):
        _step(fresh, opt3, i)
    assert any(not torch.equal(a, b) for a, b in zip(straight.parameters(), fresh.parameters(), strict=True))


def test_state_of_other_weights_is_not_used(tmp_path: Path) -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    assert load_optimizer(opt, tmp_path, version=0) is None  # nothing saved
    _step(model, opt, 0)
    save_optimizer(opt, tmp_path, version=4, step=4)
    assert (tmp_path / OPTIMIZER_FILE).stat().st_size > 0
    other = torch.optim.AdamW(_model().parameters(), lr=1e-2)
    assert load_optimizer(other, tmp_path, version=5) is None  # saved for version 4, not the weights' 5
    assert other.state_dict()["state"] == {}
