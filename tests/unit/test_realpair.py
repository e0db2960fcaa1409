"""The real pair's pure parts: pruning, the packaged prompts, the task metric, tied-weight sync."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from pipeline.demo import realtasks
from pipeline.demo.realpair import RealPair, prune_record, student_name
from pipeline.learner.publish import publish_weights
from pipeline.models.prune import kept_layers
from pipeline.models.weights import load_weights


def test_kept_layers_every_other() -> None:
    assert kept_layers(30) == list(range(0, 30, 2))
    assert len(kept_layers(30)) == 15
    assert kept_layers(5, 2) == [0, 2, 4]


def test_packaged_prompts_are_the_generated_ones() -> None:
    rows = realtasks.load()
    assert rows == realtasks.generate()  # regenerate: python -m pipeline.demo.realtasks
    train, held = realtasks.load("train"), realtasks.load("heldout")
    assert len(held) >= 100  # one held-out prompt is at most 1% of the accuracy
    assert len(train) >= 350
    assert len(train) + len(held) == len(rows)
    assert 0.1 < len(held) / len(rows) < 0.3
    assert not {r["id"] for r in train} & {r["id"] for r in held}
    assert len({r["id"] for r in rows}) == len(rows)
    for r in rows:
        assert r["messages"][0]["role"] == "user" and r["messages"][0]["content"].strip()
        assert r["answer"] in r["accept"]


@pytest.mark.parametrize(("text", "accept", "ok"), [
    ("The capital of France is Paris.", ["Paris"], True),
    ("paris", ["Paris"], True),
    ("Parisian food", ["Paris"], False),
    ("The plural of mouse is mice.", ["mice"], True),
    ("It is Washington, D.C.", ["Washington", "Washington, D.C."], True),
    ("I don't know", ["cold"], False),
])
def test_is_correct_whole_words(text: str, accept: list[str], ok: bool) -> None:
    assert realtasks.is_correct(text, accept) is ok


def test_weight_sync_keeps_tied_embeddings(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=1, num_key_value_heads=1, tie_word_embeddings=True)
    torch.manual_seed(0)
    a, b = LlamaForCausalLM(cfg), LlamaForCausalLM(cfg)
    publish_weights(a, 3, tmp_path)
    assert load_weights(b, tmp_path) == 3
    assert torch.equal(a.get_input_embeddings().weight, b.get_input_embeddings().weight)
    assert b.get_output_embeddings().weight.data_ptr() == b.get_input_embeddings().weight.data_ptr()
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(a(ids).logits, b(ids).logits)


def test_report_figures_from_the_learner_records() -> None:
    from pipeline.demo.real import summary_lines, task_figures, throughput
    from pipeline.demo.tiny import DemoResult

    history = [
        {"step": 0.0, "heldout_reverse_kl": 7.0, "heldout_task_accuracy": 0.0, "teacher_task_accuracy": 0.6,
         "heldout_answer_logprob": -9.0, "teacher_answer_logprob": -1.5},
        {"step": 1.0, "tokens": 300.0, "step_s": 10.0},
        {"step": 2.0, "tokens": 500.0, "step_s": 10.0, "heldout_reverse_kl": 3.0, "heldout_task_accuracy": 0.25,
         "heldout_answer_logprob": -4.0},
    ]
    result = DemoResult(history=history, elapsed_s=40.0,
                        stages={"teacher": {"handled": 3, "started": 1.0, "tokens_scored": 900}})
    with_se = task_figures(result, 100)
    assert with_se["task_prompts"] == 100
    assert with_se["teacher_task_accuracy_se"] == pytest.approx(math.sqrt(0.6 * 0.4 / 100))
    assert with_se["heldout_task_accuracy_start_se"] == 0.0
    assert with_se["heldout_task_accuracy_end_se"] == pytest.approx(math.sqrt(0.25 * 0.75 / 100))
    lines = summary_lines(with_se)
    assert "heldout_task_accuracy_end: 0.250 ± 0.043 (standard error, 100 prompts)" in lines
    assert "heldout_answer_logprob_end: -4.000" in lines
    assert task_figures(result) == {"teacher_task_accuracy": 0.6, "heldout_task_accuracy_start": 0.0,
                                    "heldout_task_accuracy_end": 0.25, "heldout_task_accuracy_end_step": 2.0,
                                    "teacher_answer_logprob": -1.5, "heldout_answer_logprob_start": -9.0,
                                    "heldout_answer_logprob_end": -4.0, "heldout_answer_logprob_end_step": 2.0}
    t = throughput(result)
    assert t["learner"] == {"steps": 2, "tokens": 800, "optimiser_s": 20.0, "tokens_per_s_optimiser": 40.0,
                            "s_per_step_wall": 20.0}
    assert t["teacher"]["tokens"] == 900 and t["teacher"]["groups"] == 3


def test_standard_error_is_binomial() -> None:
    from pipeline.demo.real import standard_error

    assert standard_error(0.5, 100) == pytest.approx(0.05)
    assert standard_error(0.0, 50) == 0.0
    assert math.isnan(standard_error(0.3, 0))


def test_student_cache_name_follows_method_drop_and_prompts() -> None:
    digest = realtasks.train_prompts().sha256[:8]
    assert student_name("block-influence", 3) == f"student-block-influence-drop3-{digest}"
    assert student_name("block-influence", 5) != student_name("block-influence", 3)
    assert student_name("alternate", None) == "student-alternate"


def test_pair_describes_its_student_from_prune_json(tmp_path: Path) -> None:
    student = tmp_path / "student"
    student.mkdir()
    pair = RealPair(tmp_path, tmp_path / "teacher", student)
    assert prune_record(student) is None and pair.describe() == "student"
    (student / "prune.json").write_text(json.dumps({"method": "block-influence", "layers": 30, "drop": 3,
                                                    "dropped": [4, 13, 14], "kept": [i for i in range(30)
                                                                                     if i not in (4, 13, 14)]}))
    assert pair.describe() == "27 of 30 layers, 3 of lowest block influence dropped: 4, 13, 14"
    (student / "prune.json").write_text(json.dumps({"method": "alternate", "layers": 4, "drop": 2,
                                                    "dropped": [1, 3], "kept": [0, 2]}))
    assert pair.describe() == "2 of 4 layers, 2 (every other) dropped: 1, 3"


def test_train_prompts_are_the_packaged_train_split() -> None:
    prompts = realtasks.train_prompts()
    assert [p for p in prompts.items] == [r["messages"] for r in realtasks.load("train")]
    assert len(prompts.items) > 100 and prompts.source.endswith("(train split)")
