"""The end-to-end demo: tiny teacher and student, every stage as its own process, on one machine.

Steps: build the tiny models (cached), train the teacher briefly on the arithmetic task, enqueue
prompts, start a rollout worker (hf student, reloading the weights the learner publishes), a
teacher worker, the feeder and the example learner, show progress, then stop everything and report
groups/s per stage, drops by reason and reverse KL start -> end, with a PNG plot.

Each run starts clean: the outputs of an earlier run in the output directory are replaced (the learner
would otherwise go on from the weights it published), and on a Redis of the user's the namespace's keys
are deleted first. ``resume`` keeps them, and the learner goes on from its checkpoint instead (weights,
optimizer state, policy version and step; ``pipeline.learner.checkpoint``).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from pipeline.cli.supervisor import ProcSpec, Supervisor, distillq_argv
from pipeline.config import RedisSettings
from pipeline.demo.plots import new_axes, save
from pipeline.demo.tinymodels import arithmetic_problem
from pipeline.learner.checkpoint import LATEST
from pipeline.models.weights import latest as latest_published
from pipeline.transport.connection import connect
from pipeline.transport.keys import Keys
from pipeline.transport.prompts import Added, PromptJob, enqueue_prompts

STAGES = ("rollout", "teacher", "feeder")
#: What a run writes under its output directory; a new run replaces these (and nothing else there).
OUTPUTS = ("weights", "metrics.jsonl", "report.json", "reverse_kl.png", "logs")


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
    resume: bool = False  # go on from the learner's checkpoint in out/weights instead of starting clean
    student_backend: str = "hf"  # or "vllm": a vLLM server synced every step (pipeline.demo.vllm_student)
    pools: dict[str, Path] = field(default_factory=dict)  # teacher pool -> its teacher (``demo --teachers 2``)
    cross_tokenizer: bool = False  # the teacher has a tokenizer of its own (``demo --cross-tokenizer``)

    def settings(self) -> RedisSettings:
        return RedisSettings(redis_url=self.redis_url, namespace=self.namespace)


@dataclass
class DemoResult:
    history: list[dict[str, float]] = field(default_factory=list)  # this run's learner records
    earlier: list[dict[str, float]] = field(default_factory=list)  # the runs it resumed
    stages: dict[str, dict[str, Any]] = field(default_factory=dict)
    elapsed_s: float = 0.0
    exit_codes: dict[str, int | None] = field(default_factory=dict)

    @property
    def first_step(self) -> int:
        """The learner step this run started from (0, or where a resumed run went on)."""
        return int(self.history[0]["step"]) if self.history else 0

    def heldout(self) -> list[tuple[float, float]]:
        return [(r["step"], r["heldout_reverse_kl"]) for r in self.history if "heldout_reverse_kl" in r]


def clear_outputs(out: Path) -> list[str]:
    """Delete an earlier run's outputs under ``out`` (only ``OUTPUTS``); returns the names deleted."""
    gone = []
    for name in OUTPUTS:
        path = out / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
        else:
            continue
        gone.append(name)
    return gone


def can_resume(out: Path) -> bool:
    """Whether ``out`` holds a learner checkpoint to go on from (model, optimizer, step and version) and the
    weights it published."""
    weights = out / "weights"
    return latest_published(weights) is not None and (weights / "checkpoint" / LATEST).exists()


async def live_workers(settings: RedisSettings, keys: Keys) -> int:
    """Heartbeats under ``keys``' namespace: workers of a pipeline running there now."""
    r = connect(settings)
    try:
        return len([k async for k in r.scan_iter(match=keys.heartbeat_pattern(), count=500)])
    finally:
        await r.aclose()


async def namespace_state(settings: RedisSettings, keys: Keys) -> tuple[int, bool]:
    """How many keys ``keys``' namespace holds, and whether ``distillq demo`` made it (``Keys.demo_owned``)."""
    r = connect(settings)
    try:
        found = await _namespace_keys(r, keys)
        return len(found - {keys.demo_owned.encode()}), keys.demo_owned.encode() in found
    finally:
        await r.aclose()


async def _namespace_keys(r: aioredis.Redis, keys: Keys) -> set[bytes]:
    ns = keys.namespace
    return {k for pattern in (f"{{{ns}:*", f"{ns}:*") async for k in r.scan_iter(match=pattern, count=1000)}


async def clear_namespace(settings: RedisSettings, keys: Keys) -> int:
    """Delete the keys an earlier demo run left under ``keys``' namespace on ``settings.redis_url``, then mark the
    namespace as the demo's (``Keys.demo_owned``). Returns how many were deleted. The caller checked that the demo
    made it (``namespace_state``)."""
    deleted = 0
    r = connect(settings)
    try:
        for k in await _namespace_keys(r, keys) - {keys.demo_owned.encode()}:  # one by one: a Cluster's span slots
            deleted += int(await r.unlink(k))
        await r.set(keys.demo_owned, "distillq demo")
    finally:
        await r.aclose()
    return deleted


def process_specs(cfg: DemoConfig, student: Path, teacher: Path, first_step: int = 0) -> list[ProcSpec]:
    """The demo's processes; ``first_step``: the learner step a resumed run goes on from (its ``--steps`` is the
    total to reach, so ``cfg.steps`` more)."""
    weights = str((cfg.out / "weights").absolute())
    # Paced to the learner (it publishes every step): no group starts more than 2 versions ahead, so none reaches
    # the feeder's bound of 3 however slowly the processes start (the same commands run by hand, `--commands`).
    rest = ("--group-size", str(cfg.group_size), "--max-tokens", "6", "--reward", "math", "--max-jobs", "2",
            "--max-ahead", "2", "--groups-per-step", str(cfg.groups_per_batch))
    specs = [
        ProcSpec(f"rollout-{i}", distillq_argv(
            "worker", "rollout", "--backend", "hf", "--model", str(student), "--weights-dir", weights,
            *rest, "--consumer-name", f"rollout-{i}"))
        for i in range(cfg.rollout_workers)
    ]
    if cfg.student_backend == "vllm":
        from pipeline.demo import vllm_student as demo_vllm

        python, port = demo_vllm.vllm_python(), demo_vllm.free_port()
        assert python is not None, demo_vllm.missing_line()
        url = f"http://127.0.0.1:{port}"
        specs = [demo_vllm.server_spec(python, student, port)] + [
            ProcSpec(f"rollout-{i}", demo_vllm.rollout_argv(student, url, weights, *rest, "--consumer-name",
                                                            f"rollout-{i}"))
            for i in range(cfg.rollout_workers)
        ]
    if cfg.pools:  # one teacher worker per pool; the demo measures each teacher's held-out KL itself
        from pipeline.demo.teachers import teacher_specs

        specs += teacher_specs(cfg.pools, student, cfg.top_k)
    elif cfg.cross_tokenizer:  # the learner's evaluator assumes the student's tokenizer: the demo measures on text
        from pipeline.demo.crosstok_demo import teacher_spec

        specs.append(teacher_spec(teacher, student, cfg.top_k))
    else:
        specs.append(ProcSpec("teacher", distillq_argv(
            "worker", "teacher", "--backend", "hf", "--model", str(teacher), "--student-tokenizer", str(student),
            "--top-k", str(cfg.top_k), "--consumer-name", "teacher-0")))
    evaluation = [] if cfg.pools or cfg.cross_tokenizer else [
        "--eval-teacher", str(teacher), "--eval-every", str(cfg.eval_every)]
    specs += [
        ProcSpec("feeder", distillq_argv(
            "worker", "feeder", "--max-batch-groups", str(cfg.groups_per_batch), "--max-staleness", "3",
            "--max-ready-batches", "2",  # a learner publishing every step: ready batches stay within the bound
            "--max-wait", "0.5", "--kl-coef", "1.0", "--consumer-name", "feeder-0")),
        ProcSpec("learner", [*distillq_argv()[:2], "pipeline.demo.learner", "--student", str(student),
                             "--weights-dir", weights, "--steps", str(first_step + cfg.steps), *evaluation,
                             "--metrics-file", str(cfg.out / "metrics.jsonl"),
                             "--batch-timeout", "600" if cfg.student_backend == "vllm" else "60"], restart=False),
    ]
    return specs


def enqueue(cfg: DemoConfig) -> int:
    rng = random.Random(7)
    n = int(cfg.steps * cfg.groups_per_batch * 1.5) + 16
    if cfg.pools:  # both tasks in turn, each prompt naming its teacher
        from pipeline.demo.teachers import jobs as pool_jobs

        return asyncio.run(enqueue_new(cfg.settings(), Keys(cfg.namespace), pool_jobs(n), 0))
    jobs = []
    for i in range(n):
        q, a = arithmetic_problem(rng, "train")
        jobs.append(PromptJob(id=f"p{i}", messages=[{"role": "user", "content": q}], answer=a))
    return asyncio.run(enqueue_new(cfg.settings(), Keys(cfg.namespace), jobs, 0))


async def enqueue_new(settings: RedisSettings, keys: Keys, jobs: list[PromptJob], epoch: int) -> int:
    """Enqueue ``jobs`` for ``epoch``; how many were new."""
    r = connect(settings)
    try:
        return (await enqueue_prompts(r, keys, jobs, epoch=epoch))[Added.ADDED]
    finally:
        await r.aclose()


async def read_heartbeats(r: aioredis.Redis, keys: Keys) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for stage in STAGES:
        agg: dict[str, Any] = {"handled": 0, "workers": 0, "started": None, "drops": {}, "outcomes": {},
                               "tokens_scored": 0}
        async for k in r.scan_iter(match=keys.heartbeat_pattern(stage)):  # every master of a Cluster
            raw: Any = await r.get(k)
            if raw is None:
                continue
            info = json.loads(raw)
            agg["workers"] += 1
            agg["handled"] += int(info.get("handled", 0))
            agg["tokens_scored"] += int(info.get("tokens_scored", 0))  # teacher workers
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


def worker_env(cfg: DemoConfig) -> dict[str, str]:
    """The environment of the demo's processes (Redis, namespace, JSON logs, one thread each)."""
    env = {"DISTILLQ_REDIS_URL": cfg.redis_url, "DISTILLQ_NAMESPACE": cfg.namespace, "DISTILLQ_MAX_BACKLOG": "8",
           "DISTILLQ_LOG_JSON": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "TOKENIZERS_PARALLELISM": "false", "DISTILLQ_HEARTBEAT_INTERVAL_S": "1"}
    return env


def run_pipeline(cfg: DemoConfig, student: Path, teacher: Path, console: Console) -> DemoResult:
    cfg.out.mkdir(parents=True, exist_ok=True)
    if not cfg.resume:
        (cfg.out / "metrics.jsonl").unlink(missing_ok=True)
    env = worker_env(cfg)
    earlier = read_history(cfg.out / "metrics.jsonl")
    first_step = int(max((r.get("step", 0) for r in earlier), default=0))
    sup = Supervisor(process_specs(cfg, student, teacher, first_step), cfg.out / "logs", base_env=env)
    result = DemoResult(earlier=earlier)
    watch(sup, result, cfg.settings(), cfg.out / "metrics.jsonl", total=cfg.steps, timeout_s=cfg.timeout_s,
          console=console)
    return result


def watch(sup: Supervisor, result: DemoResult, settings: RedisSettings, metrics: Path, *, total: int,
          timeout_s: float, console: Console, waiting: str = "starting workers...", poll_s: float = 0.5) -> None:
    """Start ``sup``'s processes and follow them with a progress bar of learner steps until the learner exits
    or ``timeout_s`` passes; then stop every process. Fills ``result``: this run's learner records (those of
    ``metrics`` after ``result.earlier``), the stages' heartbeat figures, the elapsed time and exit codes."""
    keys = Keys(settings.namespace)
    runner = asyncio.Runner()  # one loop for the monitoring client (a Cluster client too) for the whole run
    r = connect(settings)
    skip = len(result.earlier)
    t0 = time.monotonic()
    sup.start()
    try:
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      TextColumn("{task.fields[info]}"), console=console, transient=False) as progress:
            task = progress.add_task("learner steps", total=total, info=waiting)
            while time.monotonic() - t0 < timeout_s:
                codes = sup.poll()
                result.history = read_history(metrics)[skip:]
                stages = runner.run(read_heartbeats(r, keys))
                if any(s["workers"] for s in stages.values()):
                    result.stages = stages
                step = int(result.history[-1]["step"]) - result.first_step if result.history else 0
                kl = [x for _, x in result.heldout()]
                info = "  ".join(f"{s}:{v['handled']}" for s, v in stages.items())
                if kl:
                    info += f"  heldout rKL {kl[0]:.3f} -> {kl[-1]:.3f}"
                progress.update(task, completed=step, info=info)
                if codes.get("learner") is not None:
                    break
                time.sleep(poll_s)
    finally:
        result.elapsed_s = time.monotonic() - t0
        sup.stop()
        result.exit_codes = {p.spec.name: p.exit_code if p.exit_code is not None else
                             (p.popen.returncode if p.popen else None) for p in sup.procs}
        runner.run(r.aclose())
        runner.close()
    result.history = read_history(metrics)[skip:]


def change(start: float, end: float) -> str:
    """``79% lower``, ``45% higher`` or ``unchanged``: which way a figure went, in words that say it."""
    if end == start:
        return "unchanged"
    if start <= 0:
        return "higher" if end > start else "lower"
    pct = 100 * abs(end - start) / start
    return f"{pct:.0f}% {'lower' if end < start else 'higher'}"


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
    steps = [r for r in result.history if r.get("step", 0) > result.first_step]
    table.add_row("learner", str(len(steps)), f"{len(steps) / max(result.elapsed_s, 1e-9):.1f}", "steps")
    console.print(table)
    held = result.heldout()
    if held:
        start, end = held[0][1], held[-1][1]
        first, last = int(held[0][0]), int(held[-1][0])
        span = f"over {last - first} steps" + (f" (steps {first}-{last}, resumed)" if first else "")
        console.print(f"held-out reverse KL(student || teacher): {start:.3f} -> {end:.3f} "
                      f"({change(start, end)}) {span}")
        summary.update(heldout_reverse_kl_start=start, heldout_reverse_kl_end=end, first_step=first, last_step=last)
    batch_kl = [r["batch_reverse_kl"] for r in steps if not math.isnan(r.get("batch_reverse_kl", math.nan))]
    if len(batch_kl) >= 10:
        summary["batch_reverse_kl_first10"] = sum(batch_kl[:10]) / 10
        summary["batch_reverse_kl_last10"] = sum(batch_kl[-10:]) / 10
    summary["exit_codes"] = result.exit_codes
    return summary


def plot(result: DemoResult, path: Path) -> Path | None:
    axes = new_axes()
    if axes is None:
        return None
    records = result.earlier + result.history  # a resumed run's curve goes on from the runs before it
    steps = [r for r in records if r.get("step", 0) > 0 and not math.isnan(r.get("batch_reverse_kl", math.nan))]
    fig, ax = axes
    ax.plot([r["step"] for r in steps], [r["batch_reverse_kl"] for r in steps], lw=1, alpha=0.6,
            label="batch (sampled-token estimate)")
    held = [(r["step"], r["heldout_reverse_kl"]) for r in records if "heldout_reverse_kl" in r]
    if held:
        ax.plot([s for s, _ in held], [k for _, k in held], "o-", lw=2, label="held-out prompts (exact)")
    ax.set_xlabel("learner step")
    ax.set_ylabel("reverse KL(student || teacher), nats/token")
    ax.set_title("distillq demo: on-policy distillation of a tiny student")
    return save(fig, ax, path)
