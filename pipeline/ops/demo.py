"""The end-to-end demo: tiny teacher and student, every stage as its own process, on one machine.

Steps: build the tiny models (cached), train the teacher briefly on the arithmetic task, enqueue
prompts, start a rollout worker (hf student, reloading the weights the learner publishes), a
teacher worker, the feeder and the example learner, show progress, then stop everything and report
groups/s per stage, drops by reason and reverse KL start -> end, with a PNG plot.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis as redis_sync
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from pipeline.config import RedisSettings
from pipeline.models.tinymodels import arithmetic_problem
from pipeline.ops.supervisor import ProcSpec, Supervisor, distillq_argv
from pipeline.transport.jobs import PromptJob, enqueue_prompts
from pipeline.transport.keys import Keys

STAGES = ("rollout", "teacher", "feeder")


@dataclass
class DemoConfig:
    redis_url: str
    out: Path
    namespace: str = "demo"
    steps: int = 150
    group_size: int = 4
    groups_per_batch: int = 4
    top_k: int = 8
    teacher_steps: int = 150
    rollout_workers: int = 1
    timeout_s: float = 240.0
    eval_every: int = 25
    student_backend: str = "hf"  # or "vllm": a vLLM server synced every step (pipeline.ops.demo_vllm)


@dataclass
class DemoResult:
    history: list[dict[str, float]] = field(default_factory=list)
    stages: dict[str, dict[str, Any]] = field(default_factory=dict)
    elapsed_s: float = 0.0
    exit_codes: dict[str, int | None] = field(default_factory=dict)

    def heldout(self) -> list[tuple[float, float]]:
        return [(r["step"], r["heldout_reverse_kl"]) for r in self.history if "heldout_reverse_kl" in r]


def process_specs(cfg: DemoConfig, student: Path, teacher: Path) -> list[ProcSpec]:
    weights = str((cfg.out / "weights").absolute())
    rest = ("--group-size", str(cfg.group_size), "--max-tokens", "6", "--reward", "math", "--max-jobs", "2")
    specs = [
        ProcSpec(f"rollout-{i}", distillq_argv(
            "worker", "rollout", "--backend", "hf", "--model", str(student), "--weights-dir", weights,
            *rest, "--consumer-name", f"rollout-{i}"))
        for i in range(cfg.rollout_workers)
    ]
    if cfg.student_backend == "vllm":
        from pipeline.ops import demo_vllm

        python, port = demo_vllm.vllm_python(), demo_vllm.free_port()
        assert python is not None, demo_vllm.missing_line()
        url = f"http://127.0.0.1:{port}"
        specs = [demo_vllm.server_spec(python, student, port)] + [
            ProcSpec(f"rollout-{i}", demo_vllm.rollout_argv(student, url, weights, *rest, "--consumer-name",
                                                            f"rollout-{i}"))
            for i in range(cfg.rollout_workers)
        ]
    specs += [
        ProcSpec("teacher", distillq_argv(
            "worker", "teacher", "--backend", "hf", "--model", str(teacher), "--student-tokenizer", str(student),
            "--top-k", str(cfg.top_k), "--consumer-name", "teacher-0")),
        ProcSpec("feeder", distillq_argv(
            "worker", "feeder", "--max-batch-groups", str(cfg.groups_per_batch), "--max-staleness", "3",
            "--max-wait", "0.5", "--kl-coef", "1.0", "--consumer-name", "feeder-0")),
        ProcSpec("learner", [*distillq_argv()[:2], "pipeline.learner.example", "--student", str(student),
                             "--weights-dir", weights, "--steps", str(cfg.steps), "--eval-teacher", str(teacher),
                             "--eval-every", str(cfg.eval_every), "--metrics-file", str(cfg.out / "metrics.jsonl"),
                             "--batch-timeout", "600" if cfg.student_backend == "vllm" else "60"], restart=False),
    ]
    return specs


def enqueue(cfg: DemoConfig) -> int:
    rng = random.Random(7)
    n = int(cfg.steps * cfg.groups_per_batch * 1.5) + 16
    jobs = []
    for i in range(n):
        q, a = arithmetic_problem(rng, "train")
        jobs.append(PromptJob(id=f"p{i}", messages=[{"role": "user", "content": q}], answer=a))
    rs = RedisSettings(redis_url=cfg.redis_url, namespace=cfg.namespace)
    new, _ = asyncio.run(enqueue_prompts(rs, Keys(cfg.namespace), jobs, epoch=0))
    return new


def read_heartbeats(r: redis_sync.Redis, keys: Keys) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for stage in STAGES:
        agg: dict[str, Any] = {"handled": 0, "workers": 0, "started": None, "drops": {}, "outcomes": {}}
        for k in r.scan_iter(match=keys.heartbeat_pattern(stage)):
            raw: Any = r.get(k)
            if raw is None:
                continue
            info = json.loads(raw)
            agg["workers"] += 1
            agg["handled"] += int(info.get("handled", 0))
            agg["started"] = min(x for x in (agg["started"], info.get("started")) if x is not None)
            for key in ("drops", "outcomes"):
                for reason, n in (info.get(key) or {}).items():
                    agg[key][reason] = agg[key].get(reason, 0) + n
        out[stage] = agg
    return out


def read_history(path: Path) -> list[dict[str, float]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_pipeline(cfg: DemoConfig, student: Path, teacher: Path, console: Console) -> DemoResult:
    cfg.out.mkdir(parents=True, exist_ok=True)
    (cfg.out / "metrics.jsonl").unlink(missing_ok=True)
    keys = Keys(cfg.namespace)
    r = redis_sync.Redis.from_url(cfg.redis_url)
    env = {"DISTILLQ_REDIS_URL": cfg.redis_url, "DISTILLQ_NAMESPACE": cfg.namespace, "DISTILLQ_MAX_BACKLOG": "8",
           "DISTILLQ_LOG_JSON": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false", "DISTILLQ_HEARTBEAT_INTERVAL_S": "1"}
    sup = Supervisor(process_specs(cfg, student, teacher), cfg.out / "logs", base_env=env)
    result = DemoResult()
    t0 = time.monotonic()
    sup.start()
    try:
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      TextColumn("{task.fields[info]}"), console=console, transient=False) as progress:
            task = progress.add_task("learner steps", total=cfg.steps, info="starting workers...")
            while time.monotonic() - t0 < cfg.timeout_s:
                codes = sup.poll()
                result.history = read_history(cfg.out / "metrics.jsonl")
                stages = read_heartbeats(r, keys)
                if any(s["workers"] for s in stages.values()):
                    result.stages = stages
                step = int(result.history[-1]["step"]) if result.history else 0
                kl = [x for _, x in result.heldout()]
                info = "  ".join(f"{s}:{v['handled']}" for s, v in stages.items())
                if kl:
                    info += f"  heldout rKL {kl[0]:.3f} -> {kl[-1]:.3f}"
                progress.update(task, completed=step, info=info)
                if codes.get("learner") is not None:
                    break
                time.sleep(0.5)
    finally:
        result.elapsed_s = time.monotonic() - t0
        sup.stop()
        result.exit_codes = {p.spec.name: p.exit_code if p.exit_code is not None else
                             (p.popen.returncode if p.popen else None) for p in sup.procs}
        r.close()
    result.history = read_history(cfg.out / "metrics.jsonl")
    return result


def report(result: DemoResult, console: Console) -> dict[str, Any]:
    table = Table(title="distillq demo")
    table.add_column("stage")
    table.add_column("groups", justify="right")
    table.add_column("groups/s", justify="right")
    table.add_column("notes")
    now = time.time()
    summary: dict[str, Any] = {"elapsed_s": round(result.elapsed_s, 1), "stages": {}}
    for stage, s in result.stages.items():
        rate = s["handled"] / max(1e-9, now - s["started"]) if s.get("started") else 0.0
        notes = ", ".join(f"{k}={v}" for k, v in sorted({**s["outcomes"], **s["drops"]}.items()))
        table.add_row(stage, str(s["handled"]), f"{rate:.1f}", notes)
        summary["stages"][stage] = {"groups": s["handled"], "groups_per_s": round(rate, 2),
                                    "outcomes": s["outcomes"], "drops_by_reason": s["drops"]}
    steps = [r for r in result.history if r.get("step", 0) > 0]
    table.add_row("learner", str(len(steps)), f"{len(steps) / max(result.elapsed_s, 1e-9):.1f}", "steps")
    console.print(table)
    held = result.heldout()
    if held:
        start, end = held[0][1], held[-1][1]
        console.print(f"held-out reverse KL(student || teacher): {start:.3f} -> {end:.3f} "
                      f"({100 * (1 - end / start):.0f}% lower) over {int(held[-1][0])} steps")
        summary.update(heldout_reverse_kl_start=start, heldout_reverse_kl_end=end)
    batch_kl = [r["batch_reverse_kl"] for r in steps if not math.isnan(r.get("batch_reverse_kl", math.nan))]
    if len(batch_kl) >= 10:
        summary["batch_reverse_kl_first10"] = sum(batch_kl[:10]) / 10
        summary["batch_reverse_kl_last10"] = sum(batch_kl[-10:]) / 10
    summary["exit_codes"] = result.exit_codes
    return summary


def plot(result: DemoResult, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    steps = [r for r in result.history if r.get("step", 0) > 0 and not math.isnan(r.get("batch_reverse_kl", math.nan))]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in steps], [r["batch_reverse_kl"] for r in steps], lw=1, alpha=0.6,
            label="batch (sampled-token estimate)")
    held = result.heldout()
    if held:
        ax.plot([s for s, _ in held], [k for _, k in held], "o-", lw=2, label="held-out prompts (exact)")
    ax.set_xlabel("learner step")
    ax.set_ylabel("reverse KL(student || teacher), nats/token")
    ax.set_title("distillq demo: on-policy distillation of a tiny student")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
