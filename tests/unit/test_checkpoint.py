"""Learner checkpoints: a restored model and optimizer continue exactly as if never stopped; a write that
fails half-way leaves the previous checkpoint in force; old ones are pruned."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from pipeline.learner import checkpoint as ck  # noqa: E402
from pipeline.learner.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402


class Tied(torch.nn.Module):
    """Embedding and head share one weight, as in many language models."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(50, 8)
        self.mid = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 50, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.emb(x))))  # type: ignore[no-any-return]


def make() -> tuple[Tied, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = Tied()
    return m, torch.optim.AdamW(m.parameters(), lr=1e-2, betas=(0.8, 0.95))


def step(m: Tied, opt: torch.optim.Optimizer, i: int) -> None:
    g = torch.Generator().manual_seed(i)
    x = torch.randint(0, 50, (4, 6), generator=g)
    loss = torch.nn.functional.cross_entropy(m(x[:, :-1]).reshape(-1, 50), x[:, 1:].reshape(-1))
    opt.zero_grad()
    loss.backward()  # type: ignore[no-untyped-call]
    opt.step()


def test_restored_model_and_optimizer_continue_exactly(tmp_path: Path) -> None:
    m, opt = make()
    for i in range(3):
        step(m, opt, i)
    path = save_checkpoint(tmp_path, m, opt, step=3, policy_version=7, batch_ids=["b1", "b2", "b3"],
                           extra={"lr": 1e-2})
    assert path.name == "step-000000003" and (tmp_path / "latest").read_text() == path.name
    for i in range(3, 6):
        step(m, opt, i)
    m2, opt2 = make()
    ckpt = load_checkpoint(tmp_path, m2, opt2)
    assert ckpt is not None and (ckpt.step, ckpt.policy_version, ckpt.extra) == (3, 7, {"lr": 1e-2})
    assert ckpt.trained("b3") and not ckpt.trained("b4")
    assert m2.head.weight is m2.emb.weight  # tied weights stay tied
    for i in range(3, 6):
        step(m2, opt2, i)
    for (n, a), (_, b) in zip(m.state_dict().items(), m2.state_dict().items(), strict=True):
        assert torch.equal(a, b), n  # bit for bit: the optimizer's moments and step count were restored


def test_a_failed_write_leaves_the_previous_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    m, opt = make()
    save_checkpoint(tmp_path, m, opt, step=1, policy_version=1, batch_ids=["b1"])
    step(m, opt, 1)

    def broken(*a: object, **k: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr("safetensors.torch.save_file", broken)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path, m, opt, step=2, policy_version=2, batch_ids=["b2"])
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000000001"]  # no partial folder
    m2, opt2 = make()
    ckpt = load_checkpoint(tmp_path, m2, opt2)
    assert ckpt is not None and ckpt.step == 1 and ckpt.batch_ids == ("b1",)


def test_old_checkpoints_are_pruned_and_batch_ids_carried(tmp_path: Path) -> None:
    m, opt = make()
    assert load_checkpoint(tmp_path, m, opt) is None
    for s in range(1, 6):
        save_checkpoint(tmp_path, m, opt, step=s, policy_version=s, batch_ids=[f"b{s}"], keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000000004", "step-000000005"]
    ckpt = load_checkpoint(tmp_path, m)
    assert ckpt is not None and ckpt.batch_ids == ("b1", "b2", "b3", "b4", "b5")
    assert ck.LATEST == "latest"
