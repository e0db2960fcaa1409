"""Every code block of docs/learner.md runs as written. Each block follows a ``<!-- test: NAME -->`` line naming
how it is run here; a block without one, or a name without a runner, fails ``test_every_block_is_run``.

- ``single``: the single-process learner, as a script against batches of the real feeder;
- ``restart``: the restart line around that script, with the script killed (SIGKILL) between its first
  checkpoint and its ack: the batch the checkpoint holds is acknowledged without a second step;
- ``ranks``: the torchrun line of the multi-rank example;
- ``pacing``: the paced workers, two rollout workers, against a learner slower than sampling;
- ``trainer``: the transformers Trainer path with ``publish_dir``;
- ``asyncio``: the asyncio client;
- ``fragment``: fragments run in order in one namespace holding ``lb`` (a batch), ``model`` (the tiny student),
  ``DEVICE``, ``to_torch``;
- ``excerpt PATH``: a verbatim excerpt of PATH (a file another test runs: pipeline/demo/ranks_learner.py runs in
  tests/integration/test_ranks_learner.py and in ``ranks`` here).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from pipeline.transport.keys import Keys
from tests.integration.test_ranks_learner import state, tiny_batches

pytestmark = [pytest.mark.redis]
ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "learner.md"
RUNNERS = {"single", "restart", "ranks", "pacing", "trainer", "asyncio", "fragment", "excerpt"}


@dataclass(frozen=True)
class Block:
    runner: str
    arg: str
    lang: str
    code: str


def blocks() -> list[Block]:
    text = DOC.read_text(encoding="utf-8")
    out = []
    for m in re.finditer(r"<!-- test: (\S+)(?: (\S+))? -->\n```(\w*)\n(.*?)\n```", text, re.DOTALL):
        out.append(Block(m.group(1), m.group(2) or "", m.group(3), m.group(4) + "\n"))
    return out


def the(runner: str) -> Block:
    found = [b for b in blocks() if b.runner == runner]
    assert len(found) == 1, f"docs/learner.md has {len(found)} blocks run as {runner!r}"
    return found[0]


def test_every_block_is_run() -> None:
    text = DOC.read_text(encoding="utf-8")
    fences = len(re.findall(r"^```", text, re.MULTILINE))
    found = blocks()
    assert fences == 2 * len(found), "a code block in docs/learner.md without a <!-- test: NAME --> line before it"
    assert {b.runner for b in found} == RUNNERS, "a block whose runner is unknown, or a runner with no block"


def test_excerpts_are_verbatim() -> None:
    excerpts = [b for b in blocks() if b.runner == "excerpt"]
    assert excerpts
    for b in excerpts:
        assert b.code in (ROOT / b.arg).read_text(encoding="utf-8"), f"not an excerpt of {b.arg}:\n{b.code}"


def env_for(redis_url: str, keys: Keys, tmp_path: Path, **extra: str) -> dict[str, str]:
    from pipeline.demo.tinymodels import ensure_tiny_models

    return {**os.environ, "PYTHONPATH": str(ROOT), "DISTILLQ_REDIS_URL": redis_url,
            "DISTILLQ_NAMESPACE": keys.namespace, "STUDENT": str(ensure_tiny_models().student.absolute()),
            "WEIGHTS": str(tmp_path / "weights"), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
            **extra}


def run(argv: list[str], env: dict[str, str], cwd: Path, timeout: float) -> str:
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, timeout=timeout, check=False)
    out = (proc.stdout + proc.stderr).decode(errors="replace")
    assert proc.returncode == 0, out[-4000:]
    return out


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_the_asyncio_block_reads_and_acks_every_batch(
    r: aioredis.Redis, keys: Keys, redis_url: str, tmp_path: Path
) -> None:
    batches = await tiny_batches(r, keys, 4, 2)
    script = tmp_path / "client.py"
    script.write_text(the("asyncio").code)
    out = await asyncio.to_thread(run, [sys.executable, str(script)], env_for(redis_url, keys, tmp_path),
                                  tmp_path, 60)
    assert [line.split()[0] for line in out.splitlines() if line.endswith("groups")] == [m.batch_id for m in batches]
    assert await state(r, keys) == (0, 0, 0, 0)


async def test_the_fragments_run_on_a_batch(r: aioredis.Redis, keys: Keys, redis_url: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from pipeline.demo.tinymodels import ensure_tiny_models
    from pipeline.learner.client import AsyncLearner
    from pipeline.learner.torch_batch import to_torch

    await tiny_batches(r, keys, 2, 2)
    learner = AsyncLearner(redis_url, namespace=keys.namespace)
    try:
        lb = await learner.next_batch(10)
    finally:
        await learner.aclose()
    assert lb is not None
    fragments = [b for b in blocks() if b.runner == "fragment"]
    assert len(fragments) == 3
    model = AutoModelForCausalLM.from_pretrained(ensure_tiny_models().student)
    ns: dict[str, Any] = {"lb": lb, "DEVICE": "cpu", "to_torch": to_torch, "model": model}
    for b in fragments:
        model.zero_grad(set_to_none=True)
        exec(compile(b.code, "docs/learner.md", "exec"), ns)
        assert torch.isfinite(ns["pg"]) and torch.isfinite(ns["kd"])
        if "backward" in b.code:
            assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def published(weights: Path) -> list[int]:
    from pipeline.models.weights import published_versions

    return published_versions(weights)


def checkpoint_state(weights: Path) -> dict[str, Any]:
    from pipeline.learner.checkpoint import _read_state

    got = _read_state(weights / "checkpoint")
    assert got is not None
    return got


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_the_single_process_learner_trains_each_batch_once(
    r: aioredis.Redis, keys: Keys, redis_url: str, tmp_path: Path
) -> None:
    batches = await tiny_batches(r, keys, 6, 2)
    script = tmp_path / "learner.py"
    script.write_text(the("single").code)
    await asyncio.to_thread(run, [sys.executable, str(script)], env_for(redis_url, keys, tmp_path), tmp_path, 240)
    assert await state(r, keys) == (0, 0, 0, 0)
    ckpt = checkpoint_state(tmp_path / "weights")
    assert ckpt["step"] == 3 and ckpt["batch_ids"] == [m.batch_id for m in batches]
    assert int(await r.get(keys.policy_version)) == 3 and published(tmp_path / "weights") == [1, 2, 3]


SITE = '''
import os, signal
if os.environ.get("KILL_AT_FIRST_ACK"):
    import pipeline.learner.client as client
    real = client.Learner.ack
    def ack(self, lb):
        marker = os.environ["KILL_AT_FIRST_ACK"]
        if not os.path.exists(marker):  # the first ack of the first run: after its checkpoint
            with open(marker, "w") as f:
                f.write(lb.batch.batch_id)
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, lb)
    client.Learner.ack = ack
'''


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_the_restart_line_skips_the_batch_the_checkpoint_holds(
    r: aioredis.Redis, keys: Keys, redis_url: str, tmp_path: Path
) -> None:
    batches = await tiny_batches(r, keys, 6, 2)
    (tmp_path / "learner.py").write_text(the("single").code)
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(SITE)
    marker = tmp_path / "killed"
    env = env_for(redis_url, keys, tmp_path, KILL_AT_FIRST_ACK=str(marker))
    env["PYTHONPATH"] = f"{inject}:{ROOT}"
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"  # ``python`` is this interpreter
    await asyncio.to_thread(run, ["bash", "-c", the("restart").code], env, tmp_path, 280)
    assert marker.read_text() == batches[0].batch_id  # killed between checkpoint 1 and its ack
    ckpt = checkpoint_state(tmp_path / "weights")
    # Batch 1 was not trained again after the restart: 3 steps for 3 batches, each batch in the checkpoint once.
    assert ckpt["step"] == 3 and ckpt["batch_ids"] == [m.batch_id for m in batches]
    assert await state(r, keys) == (0, 0, 0, 0)
    assert int(await r.get(keys.policy_version)) == 3


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_the_trainer_block_publishes_after_each_step(
    r: aioredis.Redis, keys: Keys, redis_url: str, tmp_path: Path
) -> None:
    await tiny_batches(r, keys, 6, 2)
    script = tmp_path / "trainer.py"
    script.write_text(the("trainer").code)
    await asyncio.to_thread(run, [sys.executable, str(script)], env_for(redis_url, keys, tmp_path), tmp_path, 240)
    assert await state(r, keys) == (0, 0, 0, 0)
    assert int(await r.get(keys.policy_version)) == 3 and published(tmp_path / "weights") == [1, 2, 3]


@pytest.mark.slow
@pytest.mark.timeout(400)
async def test_the_torchrun_line_trains_every_batch_on_two_ranks(
    r: aioredis.Redis, keys: Keys, redis_url: str, tmp_path: Path
) -> None:
    batches = await tiny_batches(r, keys, 7, 3)  # the last batch holds one group: one rank's part is empty
    env = env_for(redis_url, keys, tmp_path)
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    await asyncio.to_thread(run, ["bash", "-c", the("ranks").code], env, tmp_path, 360)
    assert await state(r, keys) == (0, 0, 0, 0)
    ckpt = checkpoint_state(tmp_path / "weights")
    assert ckpt["step"] == 3 and ckpt["batch_ids"] == [m.batch_id for m in batches]
    assert int(await r.get(keys.policy_version)) == 3


STEPS, PROMPTS, STEP_S = 12, 60, 1.0


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_the_paced_workers_keep_two_rollout_workers_within_the_bound(
    r: aioredis.Redis, keys: Keys, redis_url: str, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    from pipeline.learner.client import Learner

    env = env_for(redis_url, keys, tmp_path)
    distillq = str(Path(sys.executable).parent / "distillq")
    prompts = tmp_path / "prompts.jsonl"
    await asyncio.to_thread(run, [distillq, "models", "tiny", "--prompts", str(prompts), "--count", str(PROMPTS)],
                            env, tmp_path, 120)
    await asyncio.to_thread(run, [distillq, "enqueue", str(prompts)], env, tmp_path, 60)
    assert await r.xlen(keys.stream("prompts")) == PROMPTS
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    log = tmp_path / "workers.log"
    with log.open("wb") as out:
        workers = subprocess.Popen(["bash", "-c", the("pacing").code], cwd=tmp_path, env=env, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    model = AutoModelForCausalLM.from_pretrained(env["STUDENT"])
    lags: list[int] = []
    ahead: list[int] = []  # per step: prompts the workers took beyond the groups handed to the learner
    sync = redis.Redis.from_url(redis_url)
    try:
        def learn() -> int:
            delivered = 0
            with Learner(redis_url, namespace=keys.namespace) as learner:
                version = learner.policy_version()
                for _ in range(STEPS):
                    lb = learner.next_batch(180)
                    assert lb is not None, log.read_text()[-4000:]
                    lags.extend(version - g.group.policy_version for g in lb.batch.groups)
                    delivered += len(lb.batch.groups) + int((lb.batch.stats or {}).get("stale_dropped", 0))
                    # Prompts the workers took: sent on (entry deleted) or in their hands (pending).
                    prompts = keys.stream("prompts")
                    pending = int(sync.xpending(prompts, "rollout")["pending"])  # type: ignore[index]
                    taken = PROMPTS - int(sync.xlen(prompts)) + pending  # type: ignore[arg-type]
                    ahead.append(taken - delivered)
                    time.sleep(STEP_S)  # a learner slower than the samplers
                    learner.ack(lb)
                    version += 1
                    learner.publish_weights(model, version, env["WEIGHTS"])
            return version

        assert await asyncio.to_thread(learn) == STEPS
        left = await r.xlen(keys.stream("prompts"))
    finally:
        sync.close()
        os.killpg(workers.pid, signal.SIGTERM)
        try:
            workers.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(workers.pid, signal.SIGKILL)
            workers.wait(10)
    reasons = [f[b"reason"].decode() for _, f in await r.xrange(keys.dlq)]
    print(f"pacing: {STEPS} steps, {len(lags)} groups trained, staleness at training max {max(lags)} "
          f"(values {sorted(set(lags))}), taken ahead of the learner per step {ahead} (max {max(ahead)}), "
          f"prompts sampled {PROMPTS - left} of {PROMPTS}, dropped {reasons}")
    # --max-ahead 1, --groups-per-step 2: (1 + N) x G = 4 groups started beyond those trained, plus the W x J = 2
    # prompts the workers hold while they wait; staleness N = 1, plus a version for an overtaken group and one
    # for a worker still on the weights it had when the learner published.
    assert max(ahead) <= 6, ahead
    assert reasons == [] and max(lags) <= 3, (reasons, lags)
