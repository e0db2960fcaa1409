"""The on-policy loop, closed, with the weights in Redis and no directory shared between the learner and the
rollout worker: an hf rollout worker, the HF teacher worker, the feeder (the tiny demo's) and a 1-rank learner
(tests/learner_loop.py) publishing every step to ``redis://.../1`` (a database apart from the streams'), each
its own process, against a real redis-server.

The learner stages its folders in a temporary folder of its own, the rollout worker mirrors the store into
another. Checked: every group's recorded student logprobs equal a transformers forward of the weights of the
version it is tagged with, rebuilt from the store; snapshots and deltas were both written and read; in the same
run, once the learner is done, a version whose manifest names a chunk that is missing (a torn upload) and one with
a corrupt chunk are refused by the rollout worker by name and never loaded.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from pipeline.cli.supervisor import Supervisor
from pipeline.demo.tiny import DemoConfig, enqueue, process_specs, worker_env
from pipeline.transport.keys import Keys
from pipeline.weightstore import manifest as mf
from pipeline.weightstore.mirror import Mirror
from pipeline.weightstore.stores import RedisStore
from tests.integration.test_closed_loop import log_events, logprob_gap, records
from tests.redis_server import free_port

STEPS = 8
TORN, CORRUPT = 90_001, 90_002
TOL = 1e-4
ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.redis, pytest.mark.slow, pytest.mark.timeout(900)]


def plant(store: RedisStore, version: int, fault: str) -> None:
    """A copy of the learner's newest version's manifest as ``version``: its first chunk missing (``torn``) or with
    a byte flipped (``corrupt``); committed, so it is the newest."""
    newest = max(v for v in store.versions() if v < TORN)  # the learner's newest (not a planted one)
    m = mf.decode(store.manifest(newest) or b"", newest)
    files = []
    for i, f in enumerate(m.files):
        chunks = []
        for k, c in enumerate(f.chunks):
            name = f"v{version:08d}/{i}.{k}"
            data = store.get(c.name) or b""
            if k == 0 and i == 0:
                if fault == "torn":
                    chunks.append(mf.ChunkRef(name, c.raw, c.stored, c.sha256))
                    continue
                data = bytes([data[0] ^ 0xFF]) + data[1:]
            store.put(name, data)
            chunks.append(mf.ChunkRef(name, c.raw, c.stored, c.sha256))
        files.append(mf.FileEntry(f.name, f.size, f.sha256, f.itemsize, f.mode, chunks))
    bad = mf.Manifest(version, m.kind, m.base, m.snapshot, m.depth, files, time.time())
    store.commit(version, mf.encode(bad))


def test_closed_loop_with_weights_in_redis(redis_url: str, keys: Keys, tmp_path: Path) -> None:
    from pipeline.demo.pretrain import train_teacher
    from pipeline.demo.tinymodels import ensure_tiny_models

    tiny = ensure_tiny_models()
    student, teacher = tiny.student.resolve(), train_teacher(tiny).resolve()
    weights_url = redis_url.rsplit("/", 1)[0] + f"/1?prefix={keys.namespace}-w&snapshot_every=4"
    cfg = DemoConfig(redis_url=redis_url, out=tmp_path, namespace=keys.namespace, steps=STEPS)
    enqueue(cfg)
    env = worker_env(cfg)
    specs = [s for s in process_specs(cfg, student, teacher) if s.name != "learner"]
    for s in specs:
        if "--weights-dir" in s.argv:
            s.argv[s.argv.index("--weights-dir") + 1] = weights_url
    learner_dir = tmp_path / "learner"  # the learner's own: its checkpoint; its staging is a temporary folder
    learner_dir.mkdir()
    rec = tmp_path / "rank0.jsonl"
    sup = Supervisor(specs, tmp_path / "logs", base_env=env)
    store = RedisStore(weights_url)
    with open(tmp_path / "rank0.log", "ab") as log:
        sup.start()
        learner = subprocess.Popen(
            [sys.executable, "-m", "tests.learner_loop", "--rank", "0", "--world-size", "1", "--port",
             str(free_port()), "--student", str(student), "--weights-dir", weights_url, "--checkpoint-dir",
             str(learner_dir / "checkpoint"), "--steps", str(STEPS), "--record", str(rec), "--lr", "8e-3"],
            env={**os.environ, **env, "PYTHONPATH": str(ROOT)}, cwd=learner_dir, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 600
            while learner.poll() is None:
                sup.poll()
                assert time.monotonic() < deadline, "the loop did not finish in 600 s"
                time.sleep(0.2)
            for version, fault in ((TORN, "torn"), (CORRUPT, "corrupt")):  # the rollout worker still follows
                plant(store, version, fault)
                until = time.monotonic() + 60
                while not refused(tmp_path, version):
                    sup.poll()
                    assert time.monotonic() < until, f"v{version} ({fault}) was not refused in 60 s"
                    time.sleep(0.2)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(learner.pid, 9)
            learner.wait(10)
            sup.stop()
    assert learner.returncode == 0, (tmp_path / "rank0.log").read_text()[-3000:]
    assert not (tmp_path / "weights").exists() and not any(learner_dir.glob("v0*"))  # nothing shared on disk

    groups = {g["group_id"]: g for r in records(rec) if r["event"] == "step" for g in r["groups"]}
    versions = sorted({g["version"] for g in groups.values()})
    assert TORN not in versions and CORRUPT not in versions and len(versions) >= 2, versions
    worst, tokens = check_logprobs(groups, versions, weights_url, tmp_path / "check")
    events = log_events(tmp_path / "logs" / "rollout-0.log")
    assert not any(e.get("event") == "weights_reloaded" and e.get("version") in (TORN, CORRUPT) for e in events)
    refusals = {e.get("version"): e.get("kind") for e in events if e.get("event") == "weights_version_refused"}
    assert refusals.get(TORN) == "incomplete" and refusals.get(CORRUPT) == "corrupt", refusals
    fetched = [e for e in events if e.get("event") == "weights_fetched"]
    assert any(e["from_snapshot"] for e in fetched) and any(not e["from_snapshot"] for e in fetched)
    print(f"\nweights via redis: {STEPS} steps, {len(groups)} groups ({tokens} tokens) of {len(versions)} versions, "
          f"max |logprob diff| {worst:.2e}", file=sys.stderr)


def refused(out: Path, version: int) -> bool:
    return any(e.get("event") == "weights_version_refused" and e.get("version") == version
               for e in log_events(out / "logs" / "rollout-0.log"))




def check_logprobs(groups: dict[str, dict[str, Any]], versions: list[int], url: str, check: Path) -> tuple[float, int]:
    """Every group's logprobs equal a forward of its version's weights, rebuilt from the store."""
    from pipeline.models.weights import load_causal_lm

    mirror = Mirror(RedisStore(url), check)
    worst, tokens = 0.0, 0
    for v in versions:
        assert mirror.sync(v) == v
        model = load_causal_lm(check / f"v{v:08d}").eval()
        gap, n = logprob_gap(model, (g for g in groups.values() if g["version"] == v))
        worst, tokens = max(worst, gap), tokens + n
    assert tokens > 0 and worst <= TOL, worst
    return worst, tokens
