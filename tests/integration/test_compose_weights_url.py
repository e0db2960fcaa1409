"""The CPU compose stack with its weights through Redis instead of the shared volume: the learner publishes to
``redis://redis-weights:6379/0`` (profile weights-redis), the rollout workers mirror each version into the
``weights-mirror`` volume and sample with it. Skipped, saying why, where no Docker engine answers."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from bench.compose_stack import Stack, build_images, engine_problem, prompt_lines

pytestmark = [pytest.mark.slow]
WEIGHTS = "redis://redis-weights:6379/0"


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    problem = engine_problem()
    if problem is not None:
        pytest.skip(f"no Docker engine to run the compose stack on: {problem}")
    build_images()
    s = Stack(project=f"dqurl{os.getpid()}", profiles=("weights-redis",), extra_env={"WEIGHTS_LOCATION": WEIGHTS})
    try:
        yield s
    finally:
        s.down(volumes=True)


@pytest.mark.timeout(900)
def test_weights_reach_the_rollout_workers_through_redis(stack: Stack) -> None:
    stack.up()
    assert {c["Service"] for c in stack.containers() if c["State"] == "running"} >= {"redis-weights", "learner"}
    ids = [f"u{i}" for i in range(48)]  # 12 steps: versions 1 to 3 (one every 4 steps)
    out = stack.enqueue(prompt_lines(ids))
    assert "enqueued 48 prompt(s)" in out, out
    groups = {f"0:{i}" for i in ids}
    counts = stack.wait_trained(groups, timeout=300)
    assert set(counts) == groups and max(counts.values()) == 1

    # The rollout worker loaded versions from the store and sampled with them ...
    rollout_log = stack.logs("rollout-worker")
    assert max(r["version"] for r in rollout_log if r.get("event") == "weights_reloaded") >= 1
    assert max(r["policy_version"] for r in rollout_log if r.get("event") == "group_pushed") >= 1
    mirror = stack.exec("rollout-worker", "ls", "/weights-mirror")
    assert "v0000" in mirror, mirror
    # ... and no version went through the shared volume (it holds the learner's checkpoint and logs only).
    listing = stack.exec("learner", "ls", "/weights").split()
    assert "LATEST" not in listing and not [n for n in listing if n.startswith("v0")], listing
    keys = int(stack.exec("redis-weights", "redis-cli", "dbsize").strip())
    assert keys > 0, "nothing in the weights Redis"
