"""Enqueue 20 prompts, run 2 rollout workers, read 20 groups from the rollouts stream; a stopped worker's
graceful shutdown."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import numpy as np
import pytest
import redis.asyncio as aioredis
from structlog.testing import capture_logs

from pipeline.cli.main import build_parser, main
from pipeline.config import RedisSettings, StreamSettings
from pipeline.models.tinymodels import arithmetic_problem, ensure_tiny_models
from pipeline.stages.rollout_stage import RolloutStage, RolloutWorker
from pipeline.transport.jobs import PromptJob, enqueue_prompts
from pipeline.transport.keys import Keys
from schemas import RolloutGroup, decode
from schemas.build import synthetic_rollout
from workers import rollout

pytestmark = pytest.mark.redis
G = 3


def write_prompts(path: Path, n: int) -> None:
    rng = random.Random(1)
    lines = []
    for i in range(n):
        q, a = arithmetic_problem(rng)
        lines.append(json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": q}], "answer": a}))
    path.write_text("\n".join(lines) + "\n")


async def test_enqueue_and_two_rollout_workers(tmp_path: Path, redis_url: str, keys: Keys,
                                               r: aioredis.Redis) -> None:
    tiny = ensure_tiny_models()
    prompts = tmp_path / "prompts.jsonl"
    write_prompts(prompts, 20)
    common = ["--redis-url", redis_url, "--namespace", keys.namespace]
    assert await asyncio.to_thread(main, ["enqueue", str(prompts), "--epoch", "1", *common]) == 0
    assert await asyncio.to_thread(main, ["enqueue", str(prompts), "--epoch", "1", *common]) == 0  # no-op
    await r.set(keys.policy_version, 7)
    argv = ["worker", "rollout", "--backend", "hf", "--model", str(tiny.student), "--group-size", str(G),
            "--max-tokens", "6", "--reward", "math", "--max-jobs", "2", "--burst", *common]
    args = [build_parser().parse_args([*argv, "--consumer-name", f"w{i}"]) for i in range(2)]
    await asyncio.wait_for(asyncio.gather(*(rollout.serve(a, r, keys, asyncio.Event()) for a in args)), 120)
    entries = await r.xrange(keys.stream("rollouts"))
    groups = [decode(f[b"d"], expect=RolloutGroup) for _, f in entries]
    assert sorted(g.group_id for g in groups) == sorted(f"1:p{i}" for i in range(20))  # each once
    for g in groups:
        assert len(g.sequences) == G and g.policy_version == 7
        for s in g.sequences:
            mask = s.loss_mask.numpy()
            assert s.prompt_len >= 2 and not mask[: s.prompt_len].any()
            assert mask[s.prompt_len :].all() and s.length > s.prompt_len  # completion tokens are trainable
            lp = s.logprobs.numpy()  # type: ignore[union-attr]
            assert (lp[mask == 1] < 0).all() and (lp[mask == 0] == 0).all()
            assert s.score in (0.0, 1.0)
    # enqueueing again for a new epoch is not a no-op
    assert await asyncio.to_thread(main, ["enqueue", str(prompts), "--epoch", "2", *common]) == 0
    assert await r.zcard(keys.arq_queue) == 20
    assert np.isfinite([s.score for g in groups for s in g.sequences]).all()


def test_enqueue_rejects_bad_file_entirely(tmp_path: Path, redis_url: str, keys: Keys,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "bad.jsonl"
    f.write_text('{"id": "a", "prompt": "1+1="}\n{"id": "b"}\nnot json\n')
    assert main(["enqueue", str(f), "--redis-url", redis_url, "--namespace", keys.namespace]) == 1
    err = capsys.readouterr().err
    assert "line 2" in err and "line 3" in err and "nothing enqueued" in err


class Gated(RolloutStage):
    """A stage whose job ``quick`` finishes once stop is set and whose job ``stuck`` never does."""

    def __init__(self, stop: asyncio.Event) -> None:
        self.synced, self.stop = None, stop
        self.running: set[str] = set()
        self.both = asyncio.Event()
        self.cancelled: list[str] = []

    async def sample(self, job: PromptJob, epoch: int) -> RolloutGroup | None:
        self.running.add(job.id)
        if len(self.running) == 2:
            self.both.set()
        try:
            await (self.stop.wait() if job.id == "quick" else asyncio.Event().wait())
        except asyncio.CancelledError:
            self.cancelled.append(job.id)
            raise
        return synthetic_rollout(1, 8, group_id=f"{epoch}:{job.id}")


async def test_a_stopped_worker_finishes_jobs_within_the_grace_period_cancels_the_rest_and_clears_its_heartbeat(
    redis_url: str, keys: Keys, r: aioredis.Redis
) -> None:
    rs = RedisSettings(redis_url=redis_url, namespace=keys.namespace)
    await enqueue_prompts(rs, keys, [PromptJob(id="quick", prompt="1+1="), PromptJob(id="stuck", prompt="2+2=")])
    stop = asyncio.Event()
    stage = Gated(stop)
    worker = RolloutWorker(r, keys, stage, rs, StreamSettings(shutdown_grace_s=0.5), consumer_name="w", max_jobs=2)
    with capture_logs() as logs:
        run = asyncio.create_task(worker.run(stop))
        await asyncio.wait_for(stage.both.wait(), 30)
        beat = keys.heartbeat("rollout", "w")
        for _ in range(200):  # the heartbeat task's first write
            if await r.exists(beat):
                break
            await asyncio.sleep(0.02)
        assert json.loads(await r.get(beat))["pid"] > 0
        stop.set()
        stats = await asyncio.wait_for(run, 30)
    assert stage.cancelled == ["stuck"] and stats.handled == 1
    assert [f[b"gid"] for _, f in await r.xrange(keys.stream("rollouts"))] == [b"0:quick"]
    assert await r.exists(beat) == 0
    events = [e["event"] for e in logs]
    assert events.index("rollout_worker_draining") < events.index("rollout_worker_stopped")
