"""``demo --teachers 2``'s tasks and prompts: two tasks, held-out problems never enqueued, each prompt naming its
teacher pool."""

from __future__ import annotations

import random

from pipeline.demo.teachers import POOLS, all_subtractions, jobs, subtraction_problem, summary
from pipeline.demo.tinymodels import is_heldout


def test_subtraction_splits_like_addition() -> None:
    rng = random.Random(0)
    for _ in range(300):
        q, a = subtraction_problem(rng, "train")
        x, y = (int(v) for v in q[:-1].split("-"))
        assert x >= y and int(a) == x - y and not is_heldout(x, y)
        q, _ = subtraction_problem(rng, "heldout")
        assert is_heldout(*(int(v) for v in q[:-1].split("-")))
    assert len(all_subtractions()) == 50 * 51 // 2


def test_prompts_alternate_tasks_and_name_their_pool() -> None:
    js = jobs(10)
    assert [j.teacher for j in js] == [POOLS[i % 2] for i in range(10)]
    for j in js:
        content = (j.messages or [{}])[0]["content"]
        assert ("+" in content) == (j.teacher == "add") and ("-" in content) == (j.teacher == "sub")
        assert j.overrides() == {"teacher": j.teacher}


def test_summary_gives_each_teacher_start_end_and_ratio() -> None:
    rows = summary({"add": 2.0, "sub": 4.0}, {"add": 0.5, "sub": 3.0})
    assert rows["add"]["end_over_start"] == 0.25 and rows["sub"]["end_over_start"] == 0.75
    assert rows["sub"]["task"] == "a-b=" and rows["add"]["heldout_reverse_kl_start"] == 2.0
