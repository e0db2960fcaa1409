"""Enqueue 20 prompts, run 2 rollout workers, read 20 groups from the rollouts stream."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import numpy as np
import pytest
import redis.asyncio as aioredis

from pipeline.cli.main import build_parser, main
from pipeline.models.tinymodels import arithmetic_problem, ensure_tiny_models
from pipeline.transport.keys import Keys
from schemas import RolloutGroup, decode
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
