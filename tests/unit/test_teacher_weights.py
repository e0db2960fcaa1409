"""``--teacher-weight``: each teacher pool's share of the learner's loss, by mask rows."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from msgspec.structs import replace

from pipeline.learner import losses
from pipeline.learner.teacher_weights import parse_teacher_weights, weigh
from pipeline.learner.torch_batch import to_torch
from schemas import TrainBatch
from schemas.arrays import Array
from schemas.build import synthetic_rollout, synthetic_scored


def test_parse_names_the_bad_part() -> None:
    assert parse_teacher_weights("math=1, code=0.5") == {"math": 1.0, "code": 0.5}
    assert parse_teacher_weights(None) == {} == parse_teacher_weights("")
    for text, why in [("math", "POOL=WEIGHT"), ("Math=1", "invalid pool name"), ("math=x", "not a number"),
                      ("math=-1", ">= 0"), ("math=nan", ">= 0"), ("math=1,math=2", "named twice")]:
        with pytest.raises(ValueError, match=why):
            parse_teacher_weights(text)


def _batch() -> TrainBatch:
    groups = [replace(synthetic_scored(synthetic_rollout(2, 10, vocab=50, seed=i, group_id=f"g{i}"), 4, vocab=50,
                                       seed=i), pool=pool)
              for i, pool in enumerate(["math", "code", "default"])]
    adv = [Array.from_numpy(np.full(s.length, 0.5, np.float32)) for g in groups for s in g.group.sequences]
    return TrainBatch(batch_id="b", groups=groups, advantages=adv)


def test_weights_scale_each_teachers_rows_and_zero_leaves_them_out() -> None:
    batch = _batch()
    tb = to_torch(batch)
    assert weigh(tb, batch, {}) is tb
    w = weigh(tb, batch, parse_teacher_weights("math=0,code=0.5"))
    expect = torch.tensor([0.0, 0.0, 0.5, 0.5, 1.0, 1.0])[:, None]  # 2 sequences per group, groups in order
    torch.testing.assert_close(w.loss_mask, tb.loss_mask * expect)
    torch.testing.assert_close(w.distill_mask, tb.distill_mask * expect)
    values = torch.randn_like(tb.loss_mask)
    without_math = losses.reduce_masked(values[2:], tb.loss_mask[2:] * expect[2:])
    torch.testing.assert_close(losses.reduce_masked(values, w.loss_mask), without_math)  # math's rows: no share


def test_the_example_learner_refuses_a_bad_weight_with_one_line(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from pipeline.demo.learner import main

    (tmp_path / "config.json").write_text("{}")
    code = main(["--student", str(tmp_path), "--weights-dir", str(tmp_path / "w"), "--teacher-weight", "math=-2"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "--teacher-weight: math: weight '-2' must be" in err
