"""The demo's report says which way the held-out KL went: a rise is a rise."""

from __future__ import annotations

import pytest
from rich.console import Console

from pipeline.demo.tiny import DemoResult, change, report


@pytest.mark.parametrize(("start", "end", "words"), [
    (5.96, 0.85, "86% lower"), (0.846, 1.227, "45% higher"), (1.0, 1.0, "unchanged"), (0.0, 0.2, "higher"),
])
def test_change_words(start: float, end: float, words: str) -> None:
    assert change(start, end) == words


def test_a_rising_kl_is_reported_as_higher() -> None:
    history = [{"step": 0.0, "heldout_reverse_kl": 0.846}]
    history += [{"step": float(s), "batch_reverse_kl": 1.0} for s in range(1, 150)]
    history += [{"step": 150.0, "batch_reverse_kl": 1.0, "heldout_reverse_kl": 1.227}]
    console = Console(record=True, width=200)
    summary = report(DemoResult(history=history, elapsed_s=10.0), console)
    text = console.export_text()
    assert "0.846 -> 1.227 (45% higher) over 150 steps" in text
    assert "lower" not in text
    assert (summary["first_step"], summary["last_step"]) == (0, 150)


def test_a_resumed_run_reports_its_own_steps() -> None:
    history = [{"step": 150.0, "heldout_reverse_kl": 0.85}]
    history += [{"step": float(s), "batch_reverse_kl": 0.8} for s in range(151, 200)]
    history += [{"step": 200.0, "batch_reverse_kl": 0.8, "heldout_reverse_kl": 0.70}]
    console = Console(record=True, width=200)
    summary = report(DemoResult(history=history, elapsed_s=10.0), console)
    text = console.export_text()
    assert "0.850 -> 0.700 (18% lower) over 50 steps (steps 150-200, resumed)" in text
    assert summary["first_step"] == 150
    assert "│ learner │     50 │" in text  # this run's steps, not the step-150 record it started from
