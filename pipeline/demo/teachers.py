"""``distillq demo --teachers 2``: one student distilled from two tiny teachers at once, each a teacher pool.

Teacher ``add`` is pretrained on ``a+b=`` (the demo's arithmetic task), teacher ``sub`` on ``a-b=`` (a >= b), both
from the same random tiny model in seconds (``pretrain.train_teacher``, cached). Prompts of both tasks are
enqueued with their teacher (``PromptJob.teacher``); one teacher worker per pool scores its task's groups; one
student learns from both. Held-out problems of each task are never sampled in rollouts; on them the demo
measures the student's exact reverse KL to each teacher on its own task, at the start (the initial student)
and the end (the last weights the learner published), for ``report.json`` and the plot.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.cli.supervisor import ProcSpec, distillq_argv
from pipeline.demo.plots import new_axes, save
from pipeline.demo.tinymodels import TinyModels, arithmetic_problem, is_heldout
from pipeline.transport.prompts import PromptJob

#: The pools, in order: the task each teacher knows.
POOLS = ("add", "sub")
#: Held-out prompts per task for the start and end reverse KL.
HELDOUT_PROMPTS = 48


def subtraction_problem(rng: random.Random, split: str = "any") -> tuple[str, str]:
    """One ``a-b=`` problem with ``a >= b`` (``split`` as in ``arithmetic_problem``)."""
    while True:
        a, b = rng.randint(0, 49), rng.randint(0, 49)
        if a < b:
            a, b = b, a
        if split == "any" or (split == "heldout") == is_heldout(a, b):
            return f"{a}-{b}=", f"{a - b}"


def all_subtractions() -> list[tuple[str, str]]:
    return [(f"{a}-{b}=", f"{a - b}") for a in range(50) for b in range(a + 1)]


def problem(pool: str, rng: random.Random, split: str) -> tuple[str, str]:
    return arithmetic_problem(rng, split) if pool == "add" else subtraction_problem(rng, split)


def train_teachers(tiny: TinyModels, progress: Callable[[str, int, float], None] | None = None) -> dict[str, Path]:
    """Each pool's pretrained teacher (cached): ``add`` is the demo's usual teacher."""
    from pipeline.demo.pretrain import train_teacher  # torch: only where a model is trained

    out: dict[str, Path] = {}
    for pool in POOLS:
        def step(s: int, loss: float, pool: str = pool) -> None:
            if progress is not None:
                progress(pool, s, loss)

        out[pool] = (train_teacher(tiny, progress=step) if pool == "add" else
                     train_teacher(tiny, progress=step, problems=all_subtractions(), name="teacher-sub"))
    return out


def jobs(n: int, seed: int = 7) -> list[PromptJob]:
    """``n`` training prompts, the two tasks in turn, each naming its teacher pool."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        pool = POOLS[i % len(POOLS)]
        q, a = problem(pool, rng, "train")
        out.append(PromptJob(id=f"p{i}", messages=[{"role": "user", "content": q}], answer=a, teacher=pool))
    return out


def teacher_specs(teachers: dict[str, Path], student: Path, top_k: int) -> list[ProcSpec]:
    """One teacher worker per pool."""
    return [ProcSpec(f"teacher-{pool}", distillq_argv(
        "worker", "teacher", "--pool", pool, "--backend", "hf", "--model", str(path), "--student-tokenizer",
        str(student), "--top-k", str(top_k), "--consumer-name", f"teacher-{pool}-0"))
        for pool, path in teachers.items()]


def heldout_prompts(tokenizer: Any, pool: str, n: int = HELDOUT_PROMPTS, seed: int = 12345) -> list[list[int]]:
    from pipeline.demo.pretrain import chat_ids

    rng = random.Random(seed)
    return [chat_ids(tokenizer, problem(pool, rng, "heldout")[0]) for _ in range(n)]


def heldout_kl(student: Path, teachers: dict[str, Path], *, max_new: int = 8, seed: int = 0) -> dict[str, float]:
    """The exact reverse KL(student || teacher) of ``student`` to each pool's teacher on its own task's held-out
    prompts (the same sampling seed each time: start and end are compared on common random numbers)."""
    from transformers import AutoTokenizer

    from pipeline.models.evaluation import reverse_kl_on_prompts
    from pipeline.models.weights import load_causal_lm

    tok = AutoTokenizer.from_pretrained(str(student))
    model = load_causal_lm(student).eval()
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else [2]
    out = {}
    for pool, path in teachers.items():
        teacher = load_causal_lm(path).eval()
        out[pool] = reverse_kl_on_prompts(model, teacher, heldout_prompts(tok, pool), max_new=max_new, eos_ids=eos,
                                          seed=seed)
    return out


def summary(start: dict[str, float], end: dict[str, float]) -> dict[str, dict[str, Any]]:
    """``report.json``'s ``teachers``: per pool its task and the held-out reverse KL at start and end."""
    return {pool: {"task": "a+b=" if pool == "add" else "a-b=", "heldout_reverse_kl_start": round(start[pool], 5),
                   "heldout_reverse_kl_end": round(end[pool], 5),
                   "end_over_start": round(end[pool] / start[pool], 4) if start[pool] > 0 else float("nan")}
            for pool in start}


def plot(teachers: dict[str, dict[str, Any]], path: Path) -> Path | None:
    """Each teacher's held-out reverse KL, start and end, on its own task."""
    axes = new_axes()
    if axes is None:
        return None
    fig, ax = axes
    for pool, row in teachers.items():
        ax.plot([0, 1], [row["heldout_reverse_kl_start"], row["heldout_reverse_kl_end"]], "o-", lw=2,
                label=f"teacher {pool} on {row['task']} ({row['heldout_reverse_kl_start']:.3f} -> "
                      f"{row['heldout_reverse_kl_end']:.3f})")
    ax.set_xticks([0, 1], ["start", "end"])
    ax.set_ylabel("held-out reverse KL(student || teacher), nats/token")
    ax.set_title("distillq demo --teachers 2: one student, two teachers")
    return save(fig, ax, path)


__all__ = ["POOLS", "all_subtractions", "heldout_kl", "jobs", "plot", "subtraction_problem", "summary",
           "teacher_specs", "train_teachers"]
