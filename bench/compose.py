"""The compose stack on this machine's Docker engine (``bench.compose_stack``): image sizes, seconds from ``up`` to
the first trained batch, and groups per second with 1, 2 and 4 teacher replicas, through the whole stack and
through the teacher stage alone (a filled rollouts stream scored by the replicas, on a stack whose rollout workers
are unpaced: ``bench/compose.teacher.yml``), with the CPU share of each service meanwhile.

    python -m bench.compose [--groups 240] [--stage-groups 960] [--replicas 1,2,4] [--json OUT]

Each measurement enqueues its own prompts and times them from ``distillq enqueue`` to the last one trained (the
learner's ``--trained-log``); CPU shares are ``docker stats`` samples taken during that time (100% = one core).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from bench.compose_stack import FILES, Stack, build_images, engine_problem, image_sizes, prompt_lines
from bench.provenance import header, run_info
from pipeline.transport.keys import Keys


def cpu_shares(project: str) -> dict[str, float]:
    """Service -> the summed CPU percent of its running containers now (``docker stats --no-stream``)."""
    out = subprocess.run(["docker", "stats", "--no-stream", "--format", "{{.Name}} {{.CPUPerc}}"],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    shares: dict[str, float] = defaultdict(float)
    for line in out.splitlines():
        name, _, pct = line.partition(" ")
        if name.startswith(f"{project}-"):
            service = name.removeprefix(f"{project}-").rsplit("-", 1)[0]
            shares[service] += float(pct.rstrip("%") or 0)
    return dict(shares)


class CpuSampler:
    """``docker stats`` samples in a thread, averaged per service."""

    def __init__(self, project: str) -> None:
        self.project = project
        self.samples: list[dict[str, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(cpu_shares(self.project))

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def mean(self) -> dict[str, float]:
        keys = {k for s in self.samples for k in s}
        n = max(len(self.samples), 1)
        return {k: round(sum(s.get(k, 0.0) for s in self.samples) / n, 1) for k in sorted(keys)}


def through(stack: Stack, prefix: str, n: int, timeout: float) -> dict[str, Any]:
    """Enqueue ``n`` prompts; groups/s until all are trained, and the CPU share of each service meanwhile."""
    ids = [f"{prefix}{i}" for i in range(n)]
    groups = {f"0:{i}" for i in ids}
    with CpuSampler(stack.project) as cpu:
        t0 = time.monotonic()
        stack.enqueue(prompt_lines(ids, seed=hash(prefix) % 1000))
        stack.wait_trained(groups, timeout)
        elapsed = time.monotonic() - t0
    return {"groups": n, "seconds": round(elapsed, 1), "groups_per_s": round(n / elapsed, 3),
            "cpu_percent": cpu.mean()}


def teacher_stage(stack: Stack, replicas: int, n: int, timeout: float) -> dict[str, Any]:
    """The teacher replicas alone: with them paused (``docker pause``), ``n`` groups fill the rollouts stream;
    groups/s from ``docker unpause`` until the teacher group has none left to read or pending."""
    stack.scale(teacher_worker=replicas)
    teachers = [c["Name"] for c in stack.containers("teacher-worker") if c["State"] == "running"]
    r = stack.redis()
    stream = Keys(stack.namespace).stream("rollouts")

    def backlog() -> int:
        groups: list[dict[str, Any]] = r.xinfo_groups(stream)  # type: ignore[assignment]
        (g,) = [g for g in groups if g["name"] == b"teacher"]
        return int(g["lag"] or 0) + int(g["pending"])

    subprocess.run(["docker", "pause", *teachers], check=True, capture_output=True)
    try:
        ids = [f"s{replicas}-{i}" for i in range(n)]
        stack.enqueue(prompt_lines(ids, seed=replicas))
        stack.wait(f"{n} groups waiting for the teachers", lambda: backlog() >= n, timeout)
    finally:
        subprocess.run(["docker", "unpause", *teachers], check=True, capture_output=True)
    with CpuSampler(stack.project) as cpu:
        elapsed = stack.wait("the teachers' backlog scored", lambda: backlog() == 0, timeout, every=0.2)
    return {"groups": n, "seconds": round(elapsed, 1), "groups_per_s": round(n / elapsed, 3),
            "cpu_percent": cpu.mean()}


def run(groups: int, stage_groups: int, replicas: list[int]) -> dict[str, Any]:
    build_s = build_images()
    result: dict[str, Any] = {**run_info(), "build_s": round(build_s, 1),
                              "image_bytes": image_sizes(), "through": {}}
    stack = Stack(project=f"dqbench{os.getpid()}")
    try:
        t0 = time.monotonic()
        result["up_healthy_s"] = round(stack.up(), 1)
        first = {f"0:first{i}" for i in range(4)}
        stack.enqueue(prompt_lines([g.split(":")[1] for g in sorted(first)]))
        stack.wait("the first batch trained", lambda: bool(first & set(stack.trained())), 300, every=0.5)
        result["up_to_first_trained_s"] = round(time.monotonic() - t0, 1)
        for t in replicas:
            stack.scale(teacher_worker=t)
            result["through"][str(t)] = through(stack, f"t{t}-", groups, timeout=300)
            print(f"  {t} teacher replica(s): {result['through'][str(t)]}", flush=True)
    finally:
        stack.down(volumes=True)
    result["teacher_stage"] = {}
    stack = Stack(project=f"dqbenchteacher{os.getpid()}", files=(*FILES, "bench/compose.teacher.yml"))
    try:
        stack.up()
        for t in replicas:
            result["teacher_stage"][str(t)] = teacher_stage(stack, t, stage_groups, timeout=600)
            print(f"  teacher stage, {t} replica(s): {result['teacher_stage'][str(t)]}", flush=True)
    finally:
        stack.down(volumes=True)
    return result


def report(r: dict[str, Any]) -> str:
    lines = [header("compose stack", r), f"images built in {r['build_s']} s (cached layers count)"]
    for name, size in r["image_bytes"].items():
        lines.append(f"  {name:<28} {size / 1e6:8.0f} MB")
    lines.append(f"up to every service healthy: {r['up_healthy_s']} s; up to the first trained batch: "
                 f"{r['up_to_first_trained_s']} s")
    for title, key in (("through the stack (prompts to trained)", "through"),
                       ("the teacher stage alone (a filled rollouts stream to scored)", "teacher_stage")):
        lines.append(title + ":")
        base = r[key].get("1", {}).get("groups_per_s")
        for t, m in r[key].items():
            eff = f", {m['groups_per_s'] / base / int(t):.2f} of linear" if base else ""
            top = sorted(m["cpu_percent"].items(), key=lambda kv: -kv[1])[:4]
            lines.append(f"  {t} teacher replica(s): {m['groups_per_s']} groups/s ({m['groups']} in {m['seconds']} "
                         f"s{eff}); CPU % by service: " + ", ".join(f"{k} {v}" for k, v in top))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.compose", description=__doc__.split("\n")[0])
    p.add_argument("--groups", type=int, default=240, help="prompts per measurement through the stack")
    p.add_argument("--stage-groups", type=int, default=960,
                   help="groups per measurement of the teacher stage (at most the backlog cap, 1000)")
    p.add_argument("--replicas", default="1,2,4", help="teacher replica counts, comma-separated")
    p.add_argument("--json", type=Path, default=None, help="write the figures here too")
    a = p.parse_args(argv)
    problem = engine_problem()
    if problem is not None:
        print(f"bench.compose: {problem}")
        return 2
    r = run(a.groups, a.stage_groups, [int(x) for x in a.replicas.split(",")])
    print(report(r))
    if a.json is not None:
        a.json.write_text(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
