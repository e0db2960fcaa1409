"""distillq's pipeline against TRL's on-policy ``DistillationTrainer`` on the real pair, at equal samples.

    python -m bench.vs_trl [--steps 30] [--samples-per-step 8] [--quick] [--out bench-out/vs-trl]

Both sides train the real pair's student (``pipeline.demo.realpair``: SmolLM2-135M-Instruct without its 3 layers
of lowest block influence) towards its teacher on the same train prompts (``pipeline.demo.realtasks``, in the same
order), under the same chat template (the student tokenizer's), sampling the same way (temperature 1, no top-p or
top-k, at most 24 new tokens), ``--samples-per-step`` completions a step (groups of 4 completions of a prompt), with
AdamW (betas 0.9/0.999, no weight decay), the learning rate 2e-4 decaying linearly to 0 at the last step and the
gradient norm clipped at 1:

- **distillq**: the real demo's machinery (``pipeline.demo.real.run_pipeline``, an embedded Redis): an hf rollout
  worker, the hf teacher worker at k = 64, the feeder (staleness bound 3), the example learner on the top-64
  forward KL with a tail bucket, weights published every step; the learner evaluates nothing.
- **TRL**: ``trl.DistillationTrainer`` (TRL 1.16; the on-policy distillation of Agarwal et al., GKD with every
  sample the student's own) in this process, with ``beta`` = ``--trl-beta`` (0: forward KL, the direction distillq
  trains; over the full vocabulary, the teacher in the same process).

Each side's weights are evaluated afterwards in this process by distillq's own evaluation code
(``pipeline.demo.learner.Evaluator``: ``pipeline.models.evaluation`` and ``pipeline.demo.taskeval``): the exact
held-out reverse KL on the first 24 held-out prompts, the task accuracy (greedy, 12 new tokens) on all 103 with
its binomial standard error, and the answer log-likelihood; the student before training and the teacher once.
The report (``OUT/report.json``, printed) adds the wall-clock time of each side (from start to its last step,
model loading included), its seconds per step (median of the steps' intervals), and for distillq the mean
seconds of each learner phase. ``--quick``: 2 steps of 4 samples, 6 task and 3 KL prompts, a smoke test.

Needs the ``real`` extra and TRL (the ``bench`` extra: ``pip install -c constraints.txt -e '.[real,bench]'``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.provenance import header, run_info
from pipeline.demo.real import RealDemoConfig

GROUP_SIZE = 4


@dataclass
class Setup:
    steps: int = 30
    samples_per_step: int = 8
    max_new: int = 24  # new tokens a sample
    temperature: float = 1.0
    lr: float = 2e-4  # decaying linearly to 0 at the last step
    task_prompts: int | None = None  # held-out prompts for the task metrics (None: all 103)
    kl_prompts: int = 24  # the exact reverse KL on the first N of them
    eval_max_new: int = 12
    trl_beta: float = 0.0  # TRL's generalised JSD: 0 is the forward KL
    # distillq's side, one knob at a time (the real demo's defaults): the teacher's k, the feeder's staleness bound,
    # the policy-gradient weight beside the top-k forward KL, and how often the learner checkpoints
    top_k: int = 64
    max_staleness: int = 3
    max_ahead: int | None = None  # rollout pacing (versions ahead); --on-policy sets 0 with a staleness bound of 0
    pg_weight: float = 0.0
    checkpoint_every: int = RealDemoConfig.checkpoint_every  # the real demo's
    learner_threads: int | None = None  # distillq's learner's torch threads (None: 1, as its other processes)
    trl_threads: int = 2
    timeout_s: float = 3600.0
    seed: int = 0
    sides: tuple[str, ...] = ("distillq", "trl")

    @property
    def groups_per_step(self) -> int:
        return self.samples_per_step // GROUP_SIZE


QUICK: dict[str, Any] = dict(steps=2, samples_per_step=4, task_prompts=6, kl_prompts=3)


@dataclass
class Side:
    name: str
    steps: int = 0
    samples: int = 0
    wall_s: float = 0.0
    s_per_step: float = math.nan
    figures: dict[str, float] = field(default_factory=dict)  # the evaluation at the end
    extra: dict[str, Any] = field(default_factory=dict)


def median_interval(times: list[float]) -> float:
    """The median of the intervals between consecutive times (NaN with fewer than two)."""
    gaps = [b - a for a, b in itertools.pairwise(times)]
    return statistics.median(gaps) if gaps else math.nan


class Evaluation:
    """distillq's evaluation (the example learner's ``Evaluator``) of any model against the teacher."""

    def __init__(self, setup: Setup, student_dir: Path, teacher_dir: Path, out: Path) -> None:
        from transformers import AutoTokenizer

        from pipeline.demo.learner import Evaluator, LearnerConfig
        from pipeline.demo.realtasks import load

        rows = load("heldout")
        rows = rows if setup.task_prompts is None else rows[: setup.task_prompts]
        out.mkdir(parents=True, exist_ok=True)
        heldout = out / "heldout.jsonl"
        heldout.write_text("".join(json.dumps(r) + "\n" for r in rows))
        self.n = len(rows)
        cfg = LearnerConfig(student=str(student_dir), weights_dir=str(out), eval_teacher=str(teacher_dir),
                            eval_prompts=len(rows), eval_kl_prompts=setup.kl_prompts, heldout_file=str(heldout),
                            eval_max_new=setup.eval_max_new, seed=setup.seed)
        self.tokenizer = AutoTokenizer.from_pretrained(str(student_dir))
        self.evaluator = Evaluator(cfg, None, self.tokenizer)

    def figures(self, model: Any, *, teacher: bool = False) -> dict[str, float]:
        """Reverse KL, task accuracy (with its standard error) and answer log-likelihood of ``model``; with
        ``teacher``, the teacher's task figures too."""
        ev = self.evaluator
        ev.student = model
        rec: dict[str, float] = {}
        ev.record(rec, 0, first=teacher, last=True)
        model.train(False)
        out = {"heldout_reverse_kl": rec["heldout_reverse_kl"], "task_accuracy": rec["heldout_task_accuracy"],
               "answer_logprob": rec["heldout_answer_logprob"]}
        out["task_accuracy_se"] = se(out["task_accuracy"], self.n)
        if teacher:
            out["teacher_task_accuracy"] = rec["teacher_task_accuracy"]
            out["teacher_task_accuracy_se"] = se(rec["teacher_task_accuracy"], self.n)
            out["teacher_answer_logprob"] = rec["teacher_answer_logprob"]
        return out


def se(p: float, n: int) -> float:
    from pipeline.demo.real import standard_error

    return standard_error(p, n)


def run_distillq(setup: Setup, student: Path, teacher: Path, out: Path) -> tuple[Side, Any]:
    """The real demo's pipeline for ``setup.steps`` learner steps; the side and its published weights (loaded)."""
    from rich.console import Console

    from pipeline.cli.embedded import EmbeddedRedis
    from pipeline.demo.real import enqueue, run_pipeline
    from pipeline.models.weights import load_causal_lm, load_weights

    console = Console(stderr=True)
    embedded = EmbeddedRedis().start()
    try:
        cfg = RealDemoConfig(redis_url=embedded.url, out=out, namespace="vs-trl", steps=setup.steps,
                             group_size=GROUP_SIZE, groups_per_batch=setup.groups_per_step, max_tokens=setup.max_new,
                             lr=setup.lr, timeout_s=setup.timeout_s, evaluate=False, top_k=setup.top_k,
                             max_staleness=setup.max_staleness, max_ahead=setup.max_ahead, pg_weight=setup.pg_weight,
                             checkpoint_every=setup.checkpoint_every, learner_threads=setup.learner_threads)
        enqueue(cfg)
        t0 = time.perf_counter()
        result = run_pipeline(cfg, student, teacher, console)
        wall = time.perf_counter() - t0
    finally:
        embedded.stop()
    steps = [r for r in result.history if r.get("step", 0) > 0]
    side = Side("distillq", steps=len(steps), samples=int(sum(r.get("groups", 0.0) for r in steps)) * GROUP_SIZE,
                wall_s=wall, s_per_step=median_interval([r["wall_s"] for r in steps]))
    phases = ("wait_s", "forward_backward_s", "optimizer_s", "checkpoint_s", "publish_s")
    side.extra = {"learner_phase_mean_s": {p: round(statistics.fmean(r.get(p, 0.0) for r in steps), 3)
                                           for p in phases} if steps else {},
                  "staleness_max": max((r.get("staleness_max", 0.0) for r in steps), default=0.0),
                  "exit_codes": result.exit_codes, "batch_reverse_kl_first_last": [
                      steps[0].get("batch_reverse_kl") if steps else None,
                      steps[-1].get("batch_reverse_kl") if steps else None]}
    model = load_causal_lm(student)
    side.extra["policy_version"] = load_weights(model, out / "weights")
    return side, model


def trl_dataset(setup: Setup) -> Any:
    """The train prompts in the order distillq enqueues them, each ``GROUP_SIZE`` times in a row (a group)."""
    from datasets import Dataset  # type: ignore[import-untyped]

    from pipeline.demo.realtasks import load

    train = load("train")
    prompts = [train[i % len(train)]["messages"] for i in range(setup.steps * setup.groups_per_step)]
    return Dataset.from_list([{"prompt": p} for p in prompts for _ in range(GROUP_SIZE)])


def run_trl(setup: Setup, student: Path, teacher: Path, out: Path) -> tuple[Side, Any]:
    """``trl.DistillationTrainer`` for ``setup.steps`` steps of ``setup.samples_per_step`` completions."""
    import torch
    from transformers import AutoTokenizer, TrainerCallback
    from trl.trainer.distillation_config import DistillationConfig
    from trl.trainer.distillation_trainer import DistillationTrainer

    from pipeline.models.weights import load_causal_lm

    torch.set_num_threads(setup.trl_threads)
    t0 = time.perf_counter()
    times: list[float] = []

    class StepTimes(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            times.append(time.perf_counter())

    tokenizer = AutoTokenizer.from_pretrained(str(student), padding_side="left")
    args = DistillationConfig(
        output_dir=str(out), max_steps=setup.steps, per_device_train_batch_size=setup.samples_per_step,
        gradient_accumulation_steps=1, learning_rate=setup.lr, lr_scheduler_type="linear", warmup_steps=0,
        weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, max_grad_norm=1.0, optim="adamw_torch", bf16=False,
        fp16=False, gradient_checkpointing=False, use_cpu=True, temperature=setup.temperature, top_p=1.0, top_k=0,
        max_completion_length=setup.max_new, beta=setup.trl_beta, logging_steps=1, save_strategy="no",
        report_to=[], seed=setup.seed, shuffle_dataset=False, dataloader_num_workers=0,
    )
    trainer = DistillationTrainer(model=load_causal_lm(student), teacher_model=load_causal_lm(teacher), args=args,
                                  train_dataset=trl_dataset(setup), processing_class=tokenizer,
                                  callbacks=[StepTimes()])
    trainer.train()
    wall = time.perf_counter() - t0
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    side = Side("trl", steps=int(trainer.state.global_step), samples=int(trainer.state.global_step)
                * setup.samples_per_step, wall_s=wall, s_per_step=median_interval(times))
    import trl

    side.extra = {"trl": trl.__version__, "loss_first_last": [losses[0], losses[-1]] if losses else None,
                  "beta": setup.trl_beta, "threads": setup.trl_threads}
    model: Any = trainer.model
    model.train(False)
    return side, model


def run(setup: Setup, out: Path) -> dict[str, Any]:
    import torch

    from pipeline.demo.realpair import ensure_real_pair
    from pipeline.models.weights import load_causal_lm

    info = run_info()
    print(header("bench.vs_trl", info), file=sys.stderr, flush=True)
    pair = ensure_real_pair(progress=lambda m: print(m, file=sys.stderr, flush=True))
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"provenance": info, "setup": asdict(setup),
                              "pair": {"teacher": str(pair.teacher), "student": pair.describe()}}
    torch.set_num_threads(setup.trl_threads)
    evaluation = Evaluation(setup, pair.student, pair.teacher, out / "eval")
    start = evaluation.figures(load_causal_lm(pair.student), teacher=True)
    report["teacher"] = {k.removeprefix("teacher_"): v for k, v in start.items() if k.startswith("teacher_")}
    report["start"] = {k: v for k, v in start.items() if not k.startswith("teacher_")}
    report["task_prompts"], report["kl_prompts"] = evaluation.n, min(setup.kl_prompts, evaluation.n)
    for name in setup.sides:
        print(f"{name}: {setup.steps} steps of {setup.samples_per_step} samples", file=sys.stderr, flush=True)
        runner = run_distillq if name == "distillq" else run_trl
        side, model = runner(setup, pair.student, pair.teacher, out / name)
        torch.set_num_threads(setup.trl_threads)
        side.figures = evaluation.figures(model)
        report[name] = asdict(side)
        (out / "report.json").write_text(json.dumps(report, indent=2))
    for line in summary(report):
        print(line)
    return report


def summary(report: dict[str, Any]) -> list[str]:
    """The report as a table: one row a measure, a column a side."""
    sides = [s for s in ("distillq", "trl") if s in report]
    n = report.get("task_prompts", 0)
    t = report["teacher"]
    lines = [f"teacher: task accuracy {t['task_accuracy']:.3f} ± {t['task_accuracy_se']:.3f} ({n} prompts), "
             f"answer log-likelihood {t['answer_logprob']:.3f}",
             "| | start | " + " | ".join(sides) + " |", "|---|---|" + "---|" * len(sides)]

    def row(label: str, key: str, fmt: str, se_key: str | None = None) -> str:
        def cell(fig: dict[str, Any]) -> str:
            v = fig.get(key, math.nan)
            return format(v, fmt) + (f" ± {fig[se_key]:.3f}" if se_key and se_key in fig else "")
        return f"| {label} | {cell(report['start'])} | " + " | ".join(cell(report[s]["figures"]) for s in sides) + " |"

    lines += [row("held-out reverse KL", "heldout_reverse_kl", ".3f"),
              row("task accuracy", "task_accuracy", ".3f", "task_accuracy_se"),
              row("answer log-likelihood", "answer_logprob", ".3f")]
    lines.append("| steps (samples) | | " + " | ".join(f"{report[s]['steps']} ({report[s]['samples']})"
                                                    for s in sides) + " |")
    lines.append("| wall-clock s | | " + " | ".join(f"{report[s]['wall_s']:.0f}" for s in sides) + " |")
    lines.append("| s per step | | " + " | ".join(f"{report[s]['s_per_step']:.2f}" for s in sides) + " |")
    return lines


def parse(argv: list[str] | None) -> tuple[Setup, Path]:
    p = argparse.ArgumentParser(prog="python -m bench.vs_trl", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, help="optimizer steps of each side (30; --quick: 2)")
    p.add_argument("--samples-per-step", type=int,
                   help=f"completions a step, a multiple of {GROUP_SIZE} (8; --quick: 4)")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test of a few minutes")
    p.add_argument("--trl-beta", type=float, default=Setup.trl_beta,
                   help="TRL's generalised-JSD beta (0: forward KL, as distillq trains; 1: reverse KL)")
    p.add_argument("--task-prompts", type=int, help="held-out prompts for the task metrics (all 103; --quick: 6)")
    p.add_argument("--kl-prompts", type=int, help="the exact reverse KL on the first N of them (24; --quick: 3)")
    p.add_argument("--only", choices=("distillq", "trl"), help="run one side only")
    p.add_argument("--top-k", type=int, default=Setup.top_k, help="distillq: the teacher's k (64)")
    p.add_argument("--max-staleness", type=int, default=Setup.max_staleness,
                   help="distillq: the feeder's staleness bound in versions (3; 0: on-policy batches only)")
    p.add_argument("--on-policy", action="store_true",
                   help="distillq: every batch sampled by the weights it trains (rollout pacing 0 versions ahead, "
                        "staleness bound 0)")
    p.add_argument("--pg-weight", type=float, default=Setup.pg_weight,
                   help="distillq: the policy-gradient term's weight beside the top-k forward KL (0)")
    p.add_argument("--max-ahead", type=int, help="distillq: rollout pacing, versions ahead of the learner (none)")
    p.add_argument("--learner-threads", type=int, help="distillq: the learner's torch threads (1)")
    p.add_argument("--checkpoint-every", type=int, default=Setup.checkpoint_every,
                   help="distillq: the learner checkpoints every N steps (the real demo's, 5)")
    p.add_argument("--timeout", type=float, default=Setup.timeout_s, help="distillq's time budget, seconds")
    p.add_argument("--out", type=Path, default=Path("bench-out/vs-trl"))
    a = p.parse_args(argv)
    setup = Setup(**(QUICK if a.quick else {}))
    if a.steps is not None:
        setup.steps = a.steps
    if a.samples_per_step is not None:
        setup.samples_per_step = a.samples_per_step
    if setup.steps < 1 or setup.samples_per_step < GROUP_SIZE or setup.samples_per_step % GROUP_SIZE:
        p.error(f"--steps must be at least 1 and --samples-per-step a positive multiple of {GROUP_SIZE}")
    setup.trl_beta, setup.timeout_s = a.trl_beta, a.timeout
    setup.top_k, setup.max_staleness, setup.pg_weight = a.top_k, a.max_staleness, a.pg_weight
    setup.checkpoint_every = a.checkpoint_every
    setup.learner_threads = a.learner_threads
    if a.max_ahead is not None:
        setup.max_ahead = a.max_ahead
    if a.on_policy:
        setup.max_staleness, setup.max_ahead = 0, 0
    if a.task_prompts is not None:
        setup.task_prompts = a.task_prompts
    if a.kl_prompts is not None:
        setup.kl_prompts = a.kl_prompts
    if a.only:
        setup.sides = (a.only,)
    return setup, a.out


def main(argv: list[str] | None = None) -> int:
    setup, out = parse(argv)
    run(setup, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
