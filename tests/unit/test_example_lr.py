"""The example learner's learning-rate schedule: a function of the step alone (a restarted learner goes on
with the rate it would have had)."""

from __future__ import annotations

import pytest
import torch

from pipeline.demo.learner import LearnerConfig, main, set_lr


def _opt() -> torch.optim.Optimizer:
    return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1.0)


@pytest.mark.parametrize(("decay", "step", "want"), [
    ("none", 1, 2e-3), ("none", 100, 2e-3),
    ("linear", 1, 2e-3), ("linear", 51, 1e-3), ("linear", 100, 2e-5), ("linear", 101, 0.0), ("linear", 150, 0.0),
])
def test_rate_of_a_step(decay: str, step: int, want: float) -> None:
    opt = _opt()
    set_lr(opt, LearnerConfig(student="s", weights_dir="w", steps=100, lr=2e-3, lr_decay=decay), step)
    assert opt.param_groups[0]["lr"] == pytest.approx(want)


def test_unknown_decay_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--student", "s", "--weights-dir", "w", "--lr-decay", "cosine"])
    assert e.value.code == 2
    assert "argument --lr-decay: none or linear, got 'cosine'" in capsys.readouterr().err
