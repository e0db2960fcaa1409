"""The KEDA triggers ops/k8s renders watch what the workers read: for every trigger, its stream key, consumer group
and Redis address are those of the workers the manifests start (pipeline.transport.keys, CONSUMER_GROUPS, the env the
manifests set), and the figure KEDA would read (XINFO GROUPS lag for lagCount, XPENDING's count for
pendingEntriesCount, XLEN for streamLength: pkg/scalers/redis_streams_scaler.go) equals what `distillq stats --json`
reports for that pool and shard, before, during and after a burst of groups, on a real Redis with S = 2 shards
and two teacher pools. An autoscaler watching the wrong key would leave a pool's backlog unserved."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis

from pipeline.transport.keys import CONSUMER_GROUPS, Keys, pool_stream
from schemas.atropos import to_atropos
from schemas.build import synthetic_rollout
from tests.redis_server import RedisServer
from tests.unit.test_k8s_manifests import K8S, env_of, render

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.redis


def cli(args: list[str], env: dict[str, str], timeout: float = 60) -> str:
    p = subprocess.run([sys.executable, "-m", "pipeline.cli.main", *args], env=env, capture_output=True, text=True,
                       timeout=timeout, cwd=ROOT, check=False)
    assert p.returncode == 0, f"distillq {shlex.join(args)}: {p.stdout}{p.stderr}"
    return p.stdout


def keda_value(r: Any, meta: dict[str, str]) -> int:
    """What KEDA's redis-streams scaler reads for this trigger (its createEntriesCountFn)."""
    if "consumerGroup" not in meta:
        return int(r.xlen(meta["stream"]))
    if "lagCount" in meta:
        for g in r.xinfo_groups(meta["stream"]):
            if g["name"] == meta["consumerGroup"]:
                return int(g["lag"])
        raise AssertionError(f"KEDA fails: no group {meta['consumerGroup']} on {meta['stream']}")
    return int(r.xpending(meta["stream"], meta["consumerGroup"])["pending"])


def stats_value(snapshot: dict[str, Any], meta: dict[str, str]) -> int:
    """The same figure from `distillq stats --json`: the row of that stream key (a shard, or the unsharded stream)."""
    rows = [s for s in snapshot["streams"].values() if s["key"] == meta["stream"]]
    assert len(rows) == 1, f"stats shows no single row for {meta['stream']}: {sorted(snapshot['streams'])}"
    row = rows[0]
    if "consumerGroup" not in meta:
        return int(row["length"])
    group = next(g for g in row["groups"] if g["name"] == meta["consumerGroup"])
    assert not group["lag_estimated"]
    return int(group["lag"] if "lagCount" in meta else group["pending"])


def words_of(container: dict[str, Any]) -> list[str]:
    command = container.get("command", [])
    return shlex.split(command[2] if command[:2] == ["sh", "-c"] else shlex.join(command + container.get("args", [])))


def triggers_of(docs: list[dict[str, Any]]) -> tuple[list[tuple[str, dict[str, str]]], dict[str, str]]:
    """Every trigger as (its pool, or "rollout"; its metadata), each checked to name the Redis its scale target's
    worker reads (KEDA resolves addressFromEnv in that container's env); and that env."""
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    triggers: list[tuple[str, dict[str, str]]] = []
    worker_env: dict[str, str] = {}
    for s in (d for d in docs if d["kind"] == "ScaledObject"):
        target = deployments[s["spec"]["scaleTargetRef"]["name"]]
        worker = next(c for c in target["spec"]["template"]["spec"]["containers"]
                      if c["name"] == s["spec"]["scaleTargetRef"]["envSourceContainerName"])
        worker_env = env = env_of(docs, worker)
        url = urlsplit(env["DISTILLQ_REDIS_URL"])
        words = words_of(worker)
        stage = words[words.index("worker") + 1]
        pool = words[words.index("--pool") + 1] if "--pool" in words else "default"
        for t in s["spec"]["triggers"]:
            meta = t["metadata"]
            address = env[meta["addressFromEnv"]] if "addressFromEnv" in meta else meta["address"]
            assert address == f"{url.hostname}:{url.port}", (address, env["DISTILLQ_REDIS_URL"])
            assert int(meta.get("databaseIndex", "0")) == int(url.path.strip("/") or 0)
            triggers.append((pool if stage == "teacher" else "rollout", meta))
    return triggers, worker_env


@pytest.fixture(scope="module")
def docs() -> list[dict[str, Any]]:
    return render(K8S / "overlays" / "default")


@pytest.fixture
def server() -> Iterator[RedisServer]:
    s = RedisServer().start()
    yield s
    s.stop()


@pytest.mark.timeout(90)
def test_every_trigger_reads_the_backlog_the_workers_serve(  # noqa: C901, PLR0915 - one scenario, in phases
        docs: list[dict[str, Any]], server: RedisServer, tmp_path: Path) -> None:
    job = next(d for d in docs if d["kind"] == "Job" and d["metadata"]["name"] == "distillq-init")
    script = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "distillq-init")["data"]

    triggers, worker_env = triggers_of(docs)
    assert {p for p, _ in triggers} == {"default", "math", "rollout"}

    # 2. the init Job's command on a real Redis (the manifests' Redis address mapped onto this one)
    env = {**os.environ, **worker_env, "DISTILLQ_REDIS_URL": server.url, "DISTILLQ_LOG_JSON": "1",
           **{e["name"]: script[e["valueFrom"]["configMapKeyRef"]["key"]]
              for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}}
    (tmp_path / "create_groups.py").write_text(script["create_groups.py"])
    command = job["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[:2] == ["sh", "-c"]
    line = command[2].replace("distillq ", f"{sys.executable} -m pipeline.cli.main ").replace(
        "python /init/", f"{sys.executable} {tmp_path}/")
    subprocess.run(["sh", "-c", line], env=env, cwd=ROOT, check=True, timeout=60, capture_output=True)
    keys = Keys(env["DISTILLQ_NAMESPACE"])
    shards = int(cli(["shards"], env).strip())
    assert shards == int(worker_env["PIPELINE_SHARDS"]) == 2
    for pool, meta in triggers:
        if pool == "rollout":
            assert (meta["stream"], meta["consumerGroup"]) == (keys.stream("prompts"), CONSUMER_GROUPS["prompts"])
        else:
            assert meta["stream"] in keys.streams(pool_stream(pool), shards)
            assert meta["consumerGroup"] == CONSUMER_GROUPS["rollouts"]
    for pool in ("default", "math"):  # every shard of every pool is watched
        assert {m["stream"] for p, m in triggers if p == pool} == set(keys.streams(pool_stream(pool), shards))

    r: Any = redis.Redis.from_url(server.url, decode_responses=True)

    def compare(phase: str) -> dict[str, int]:
        # every pool stream by name: `stats` alone lists the pools groups were sent to (none yet before the burst)
        snapshot = json.loads(cli(["stats", "--json", "prompts", "rollouts", "rollouts.math"], env))
        seen = {}
        for pool, meta in triggers:
            want = stats_value(snapshot, meta)
            got = keda_value(r, meta)
            assert got == want, f"{phase}: {pool} {meta['stream']} {meta}: KEDA reads {got}, stats says {want}"
            seen[f"{pool}:{meta['stream']}:{'lag' if 'lagCount' in meta else 'pending'}"] = got
        for p in snapshot["pools"]:  # and the per-pool backlog is the sum over the pool's shards
            lag = sum(v for k, v in seen.items() if k.startswith(f"{p['name']}:") and k.endswith(":lag"))
            pending = sum(v for k, v in seen.items() if k.startswith(f"{p['name']}:") and k.endswith(":pending"))
            assert (lag, pending) == (p["lag"], p["pending"]) and lag + pending == p["backlog"], (phase, p)
        return seen

    before = compare("before")
    assert not any(before.values())

    # 3. a burst: 24 groups for pool default, 16 for pool math, 5 prompts
    groups = tmp_path / "groups.jsonl"
    with groups.open("w") as f:
        for i in range(40):
            g = to_atropos(synthetic_rollout(2, 8, prompt_len=3, group_id=f"g{i}"))
            if i >= 24:
                g["group_overrides"] = {"teacher": "math"}
            f.write(json.dumps(g) + "\n")
    cli(["push", str(groups)], env)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"{i}+1="}) + "\n" for i in range(5)))
    cli(["enqueue", str(prompts)], env)
    burst = compare("burst")
    lag = {p: sum(v for k, v in burst.items() if k.startswith(f"{p}:") and k.endswith(":lag"))
           for p in ("default", "math", "rollout")}
    assert lag == {"default": 24, "math": 16, "rollout": 5}
    assert all(v > 0 for k, v in burst.items() if k.endswith(":lag") and not k.startswith("rollout"))  # both shards

    # 4. during: one teacher worker per pool, as the manifests start it (its --pool), on the synthetic backend;
    # frozen (SIGSTOP) once it holds groups, so both readings see the same state
    procs = []
    for pool in ("default", "math"):
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "pipeline.cli.main", "worker", "teacher", "--pool", pool, "--backend", "synthetic",
             "--synthetic-latency", "0.3", "--read-count", "2", "--max-in-flight", "4"],
            env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            held = {pool: sum(int(r.xpending(m["stream"], m["consumerGroup"])["pending"])
                              for p, m in triggers if p == pool and "pendingEntriesCount" in m)
                    for pool in ("default", "math")}
            if all(held.values()):
                break
            time.sleep(0.05)
        for p in procs:
            p.send_signal(signal.SIGSTOP)
        during = compare("during")
        for pool in ("default", "math"):
            assert sum(v for k, v in during.items() if k.startswith(f"{pool}:") and k.endswith(":pending")) > 0
            assert sum(v for k, v in during.items() if k.startswith(f"{pool}:") and k.endswith(":lag")) > 0
        for p in procs:
            p.send_signal(signal.SIGCONT)

        # 5. after: drained
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline:
            if not any(int(r.xlen(m["stream"])) for p, m in triggers if p != "rollout"):
                break
            time.sleep(0.2)
        after = compare("after")
        assert not any(v for k, v in after.items() if not k.startswith("rollout")), after
        assert sum(v for k, v in after.items() if k.startswith("rollout:") and k.endswith(":lag")) == 5
    finally:
        for p in procs:
            p.send_signal(signal.SIGCONT)
            p.terminate()
        for p in procs:
            try:
                p.wait(40)
            except subprocess.TimeoutExpired:
                p.kill()
        r.close()
    assert all(p.returncode == 0 for p in procs), [p.returncode for p in procs]
    snapshot = json.loads(cli(["stats", "--json"], env))
    assert not snapshot["incidents"], snapshot["incidents"]  # the groups made before any worker are no data loss
