"""``bench.learner_phases``'s side-by-side measurements run and report what they claim, on the tiny student: the
loss with one pass over the lm_head against two (the same loss value: both are the example learner's), and the
forward and backward alone against beside a checkpoint writer (a thread, then a process, each writing)."""

from __future__ import annotations

import pytest

from bench.learner_phases import _one_pass, _student_and_batch, head_passes, write_overlap

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def tiny_student() -> object:
    from pipeline.demo.tinymodels import ensure_tiny_models

    return ensure_tiny_models().student


def test_head_passes_times_both_and_their_ratio(tiny_student: object) -> None:
    out = head_passes(tiny_student, groups=1, reps=2)  # type: ignore[arg-type]
    assert out["reps"] == 2 and out["one_pass_s"] > 0 and out["two_passes_s"] > 0
    assert out["ratio"] == pytest.approx(out["one_pass_s"] / out["two_passes_s"], abs=2e-3)


def test_one_pass_trains_the_batch(tiny_student: object) -> None:
    student, tb = _student_and_batch(tiny_student, 1)  # type: ignore[arg-type]
    assert int(tb.distill_mask.sum()) == 4 * 36  # 4 completions of 60 tokens, 36 trained, every row scored
    _one_pass(student, tb)()
    grads = [p.grad for p in student.parameters() if p.grad is not None]
    assert grads and any(float(g.abs().sum()) > 0 for g in grads)


def test_write_overlap_measures_alone_and_beside_both_writers(tiny_student: object) -> None:
    out = write_overlap(tiny_student, groups=1, reps=2)  # type: ignore[arg-type]
    for k in ("alone_s", "beside_a_writer_thread_s", "beside_a_writer_process_s", "checkpoint_in_the_thread_s"):
        assert out[k] > 0, k
    assert out["beside_a_writer_thread_ratio"] == pytest.approx(out["beside_a_writer_thread_s"] / out["alone_s"],
                                                                abs=2e-3)
