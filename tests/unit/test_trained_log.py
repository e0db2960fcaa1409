"""The example learner's ``--trained-log``: what its weights hold across restarts (``kept_steps``,
``trained_groups``), and ``distillq models tiny --link``'s fixed paths."""

from __future__ import annotations

from pathlib import Path

from pipeline.cli.commands.models import link
from pipeline.demo.learner import kept_steps, trained_groups


def step(t: float, n: int, *groups: str) -> dict[str, object]:
    return {"t": t, "event": "step", "step": n, "batch_id": f"b{n}-{t}", "groups": list(groups)}


def test_steps_lost_with_a_crash_before_their_checkpoint_do_not_count() -> None:
    log = [
        {"t": 0, "event": "start", "step": 0},
        step(1, 1, "g1", "g2"),
        step(2, 2, "g3"),  # trained, then the process died before its checkpoint
        {"t": 3, "event": "start", "step": 1},  # restored step 1: step 2 is not in the weights
        step(4, 2, "g3"),  # trained again
        step(5, 3, "g4"),
        {"t": 6, "event": "start", "step": 3},  # a crash after step 3's checkpoint: nothing dropped
    ]
    assert [r["t"] for r in kept_steps(log)] == [1, 4, 5]
    assert trained_groups(log) == {"g1": 1, "g2": 1, "g3": 1, "g4": 1}


def test_a_batch_trained_twice_into_the_weights_counts_twice() -> None:
    log = [{"t": 0, "event": "start", "step": 0}, step(1, 1, "g1"), step(2, 2, "g1")]
    assert trained_groups(log)["g1"] == 2


def test_link_gives_fixed_paths_replaced_in_place(tmp_path: Path) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    for d in (first, second):
        d.mkdir()
    paths = {name: str(first) for name in ("student", "teacher", "tokenizer")}
    link(tmp_path / "models", paths)
    link(tmp_path / "models", {**paths, "teacher": str(second)})
    assert (tmp_path / "models" / "teacher").resolve() == second
    assert (tmp_path / "models" / "student").resolve() == first
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["student", "teacher", "tokenizer"]
