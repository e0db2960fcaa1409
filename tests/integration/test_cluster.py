"""The pipeline on a real 3-master Redis Cluster with sharded stage streams."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis.exceptions import ResponseError

from pipeline.cli.main import main
from pipeline.config import RedisSettings, StreamSettings
from pipeline.learner.client import AsyncLearner
from pipeline.stages.batching import BatchingConfig
from pipeline.stages.feeder import Feeder
from pipeline.stages.kl_control import ConstantKL
from pipeline.transport.connection import TRANSIENT, connect, retry_transient
from pipeline.transport.keys import Keys, shard_of
from pipeline.transport.producer import StreamProducer
from pipeline.transport.sharding import get_shards, set_shards
from schemas.build import synthetic_rollout
from tests import streams
from tests.cluster import LocalCluster

pytestmark = [pytest.mark.redis, pytest.mark.slow]
S = 3


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    c = LocalCluster().start()
    yield c
    c.stop()


def fast() -> StreamSettings:
    """The in-test side's settings, matching the worker processes' (``teacher_proc``'s environment)."""
    return streams.fast(claim_idle_ms=1000, claim_interval_ms=200, heartbeat_interval_s=0.5, shutdown_grace_s=2,
                        backpressure_timeout_s=60)


LOGS = Path(tempfile.mkdtemp(prefix="distillq-cluster-logs-"))


def teacher_proc(url: str, ns: str, name: str, latency: float = 0.0) -> subprocess.Popen[bytes]:
    env = {**os.environ, "DISTILLQ_CLAIM_IDLE_MS": "1000", "DISTILLQ_CLAIM_INTERVAL_MS": "200",
           "DISTILLQ_BLOCK_MS": "100", "DISTILLQ_LOG_JSON": "1"}
    with (LOGS / f"{ns}-{name}.log").open("ab") as log:  # the child keeps its own copy of the descriptor
        return subprocess.Popen([sys.executable, "-m", "pipeline.cli.main", "worker", "teacher", "--backend",
                                 "synthetic", "--synthetic-latency", str(latency), "--top-k", "4", "--read-count", "4",
                                 "--redis-url", url, "--namespace", ns, "--consumer-name", name],
                                env=env, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)


async def pending_of(url: str, keys: Keys, consumer: str) -> int:
    """Entries of ``rollouts`` (all shards) pending for ``consumer``."""
    r = connect(RedisSettings(redis_url=url))
    total = 0
    for key in keys.streams("rollouts", S):
        try:
            consumers = await r.xinfo_consumers(key, "teacher")
        except ResponseError:  # no group yet
            continue
        total += sum(int(c["pending"]) for c in consumers if c["name"] in (consumer, consumer.encode()))
    await r.aclose()
    return total


async def drain(url: str, keys: Keys, n_groups: int, timeout: float = 90) -> list[str]:
    """Feeder (all shards) + learner until ``n_groups`` groups arrived; returns group ids in arrival order."""
    r = connect(RedisSettings(redis_url=url))
    feeder = Feeder(r, keys, BatchingConfig(max_batch_groups=8, max_wait_s=0.2, max_staleness=None), ConstantKL(0.1),
                    fast(), consumer_name="feeder-0", shards=await get_shards(r, keys))
    stop = asyncio.Event()
    task = asyncio.create_task(feeder.run(stop))
    learner = AsyncLearner(redis=r, namespace=keys.namespace, settings=fast())
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        while len(seen) < n_groups and time.monotonic() < deadline:
            b = await learner.next_batch(timeout_s=1)
            if b is not None:
                seen += b.group_ids
                await learner.ack(b)
    finally:
        stop.set()
        await task
        await r.aclose()
    return seen


def test_shards_spread_over_masters_and_end_to_end_with_a_worker_killed(cluster: LocalCluster) -> None:
    keys = Keys("e2e")
    url = cluster.url
    assert main(["shards", "set", str(S), "--redis-url", url, "--namespace", keys.namespace]) == 0
    owners = {cluster.node_for_key(k).port for k in keys.streams("rollouts", S)}
    assert len(owners) == S  # each shard of rollouts on its own master

    async def produce() -> None:
        r = connect(RedisSettings(redis_url=url))
        p = StreamProducer(r, keys, "rollouts", fast(), shards=await get_shards(r, keys))
        for i in range(120):
            await p.send(synthetic_rollout(2, 16, group_id=f"g{i:03d}", seed=i))
        counts = [await r.xlen(k) for k in keys.streams("rollouts", S)]
        assert sum(counts) == 120 and min(counts) > 20  # spread by group-id hash
        await r.aclose()

    asyncio.run(produce())
    victim = teacher_proc(url, keys.namespace, "t0", latency=0.25)
    survivor = teacher_proc(url, keys.namespace, "t1", latency=0.25)
    try:
        held = 0
        deadline = time.monotonic() + 30
        while held == 0 and time.monotonic() < deadline:  # wait until the victim holds entries
            time.sleep(0.2)
            held = asyncio.run(pending_of(url, keys, "t0"))
        os.killpg(victim.pid, signal.SIGKILL)  # dies holding pending entries
        victim.wait(10)
        held = asyncio.run(pending_of(url, keys, "t0"))
        t0 = time.monotonic()
        seen = asyncio.run(drain(url, keys, 120))
        print(f"cluster e2e: {len(seen)} groups to the learner, {len(set(seen))} distinct; victim killed holding "
              f"{held} entries, drained {time.monotonic() - t0:.1f} s after")
    finally:
        os.killpg(survivor.pid, signal.SIGTERM)
        survivor.wait(20)
    assert held > 0
    assert sorted(seen) == [f"g{i:03d}" for i in range(120)]  # every group exactly once


def test_master_restart_mid_run(cluster: LocalCluster) -> None:
    keys = Keys("restart")
    url = cluster.url

    async def setup_and_produce(lo: int, hi: int) -> None:
        r = connect(RedisSettings(redis_url=url))
        if lo == 0:
            await set_shards(r, keys, S)
        p = StreamProducer(r, keys, "rollouts", fast(), shards=S)
        for i in range(lo, hi):
            await p.send(synthetic_rollout(2, 16, group_id=f"r{i:03d}", seed=i))
        await r.aclose()

    asyncio.run(setup_and_produce(0, 60))
    worker = teacher_proc(url, keys.namespace, "t0")
    try:
        time.sleep(2)
        gid = "r059"
        node = cluster.node_for_key(keys.stream("rollouts", shard_of(gid, S), S))
        node.kill()  # SIGKILL a master (AOF appendfsync always)
        time.sleep(2)
        node.start()
        cluster.wait_ok()
        asyncio.run(setup_and_produce(60, 90))
        seen = asyncio.run(drain(url, keys, 90))
        print(f"master restart: {len(seen)} groups arrived of 90, {len(set(seen))} distinct")
        assert worker.poll() is None, (LOGS / f"{keys.namespace}-t0.log").read_text()[-3000:]  # rode it out
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGTERM)
            worker.wait(20)
    assert sorted(seen) == [f"r{i:03d}" for i in range(90)]


def test_client_comes_back_after_a_master_restart_under_concurrent_readers(cluster: LocalCluster) -> None:
    """redis-py drops a node from its startup list on each connection error and closes every node's connections:
    with readers on every master, one master killed used to leave the client with no node to ask, for good."""
    url = cluster.url

    async def run() -> tuple[set[str], list[str], int]:
        r = connect(RedisSettings(redis_url=url))
        keys: dict[int, str] = {}
        for i in range(64):
            keys.setdefault(cluster.node_for_key(f"rd{i}").port, f"rd{i}")
        assert len(keys) == 3
        for k in keys.values():
            await r.xadd(k, {"v": 0})
        errors: set[str] = set()
        stop = asyncio.Event()

        async def reader(key: str) -> None:
            while not stop.is_set():
                try:
                    await r.xread({key: "$"}, block=100)
                except TRANSIENT as e:
                    errors.add(type(e).__name__)
                    await asyncio.sleep(0.05)

        tasks = [asyncio.create_task(reader(k)) for k in keys.values()]
        await asyncio.sleep(0.5)
        victim = cluster.node_for_key(next(iter(keys.values())))
        victim.kill()
        await asyncio.sleep(1.5)
        emptied = len(r.nodes_manager.startup_nodes)  # type: ignore[attr-defined]
        victim.start()
        await asyncio.to_thread(cluster.wait_ok)
        written: list[str] = []
        for k in keys.values():  # every master takes writes again through the same client
            written.append((await retry_transient(lambda k=k: r.xadd(k, {"v": 1}), deadline_s=20)).decode())
        stop.set()
        await asyncio.gather(*tasks)
        await r.aclose()
        return errors, written, emptied

    errors, written, emptied = asyncio.run(run())
    print(f"master restart under readers: errors seen {sorted(errors)}; startup nodes left while it was down: "
          f"{emptied}; {len(written)} of 3 masters written after")
    assert len(written) == 3
    assert "ConnectionError" in errors or "ClusterUnreachableError" in errors  # the outage was seen, as transient


def test_stats_show_per_shard_figures(cluster: LocalCluster, capsys: pytest.CaptureFixture[str]) -> None:
    keys = Keys("stats")

    async def fill() -> None:
        r = connect(RedisSettings(redis_url=cluster.url))
        await set_shards(r, keys, S)
        p = StreamProducer(r, keys, "rollouts", fast(), shards=S)
        for i in range(30):
            await p.send(synthetic_rollout(1, 8, group_id=f"s{i}"))
        await r.aclose()

    async def read_every_shard() -> None:
        """A teacher t0 and a feeder f0 reading every shard of their stream, as workers do."""
        r = connect(RedisSettings(redis_url=cluster.url))
        for i, key in enumerate(keys.streams("scored", S)):
            for n in range(i + 1):
                await r.xadd(key, {"n": str(n)})
        for stream, group, consumer in (("rollouts", "teacher", "t0"), ("scored", "feeder", "f0")):
            for key in keys.streams(stream, S):
                await r.xgroup_create(key, group, id="0")
                await r.xreadgroup(group, consumer, {key: ">"}, count=2)
        await r.aclose()

    asyncio.run(fill())
    asyncio.run(read_every_shard())
    assert main(["stats", "--json", "--redis-url", cluster.url, "--namespace", keys.namespace]) == 0
    snap = json.loads(capsys.readouterr().out)
    streams = snap["streams"]
    per_shard = [streams[f"rollouts:{i}"]["length"] for i in range(S)]
    assert streams["rollouts"]["length"] == sum(per_shard) == 30
    for stream, consumer, pending in (("rollouts", "t0", 2 * S), ("scored", "f0", 1 + 2 + 2)):
        shard_rows = [streams[f"{stream}:{i}"]["groups"][0]["consumer_list"] for i in range(S)]
        assert [[c["name"] for c in rows] for rows in shard_rows] == [[consumer]] * S
        total = streams[stream]["groups"][0]
        assert [(c["name"], c["pending"]) for c in total["consumer_list"]] == [(consumer, pending)]  # once, summed
        assert total["consumers"] == 1
    assert main(["stats", "--redis-url", cluster.url, "--namespace", keys.namespace]) == 0
    table = capsys.readouterr().out
    for stream, group, consumer in (("rollouts", "teacher", "t0"), ("scored", "feeder", "f0")):
        rows = re.findall(rf"│ {stream}\s+│ {group}\s+│ {consumer}\s+│", table)
        assert len(rows) == 1, table  # the stream's total row lists its consumer once (and each shard once)
        assert len(re.findall(rf"│ {stream}:\d\s+│ {group}\s+│ {consumer}\s+│", table)) == S
    assert main(["tail", "rollouts", "--count", "5", "--json", "--redis-url", cluster.url,
                 "--namespace", keys.namespace]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 5
    assert main(["shards", "set", "1", "--redis-url", cluster.url, "--namespace", keys.namespace]) == 1  # not drained


def demo_on_cluster(url: str, out: Path, *extra: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k != "DISTILLQ_REDIS_URL"}
    return subprocess.run([sys.executable, "-m", "pipeline.cli.main", "demo", "--redis-url", url, "--namespace",
                           "democluster", "--out", str(out), *extra], env={**base, **env}, capture_output=True,
                          text=True, timeout=400, check=False)


@pytest.mark.timeout(900)
def test_demo_on_the_cluster(cluster: LocalCluster, tmp_path: Path) -> None:
    out = tmp_path / "demo"
    first = demo_on_cluster(cluster.url, out, "--steps", "30")  # prompts and every stream on the cluster
    assert first.returncode == 0, first.stderr[-3000:]
    second = demo_on_cluster(cluster.url, out, "--steps", "30")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "keys an earlier demo run left in namespace democluster" in second.stderr  # on the cluster, deleted
    assert "replacing the earlier run in" in second.stderr
    for proc in (first, second):
        assert "Traceback" not in proc.stderr
        line = next(x for x in proc.stderr.splitlines() if x.startswith("held-out reverse KL"))
        print(f"demo on the cluster: {line}")
        assert "lower" in line
    report = json.loads((out / "report.json").read_text())
    assert report["exit_codes"]["learner"] == 0 and report["last_step"] == 30
    assert report["heldout_reverse_kl_end"] < report["heldout_reverse_kl_start"]
    for stage in ("rollout", "teacher", "feeder"):
        assert report["stages"][stage]["groups"] > 0
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout
    assert str(out) not in ps  # every process of both runs stopped


def test_prompts_enqueued_and_sampled_on_the_cluster(cluster: LocalCluster, tmp_path: Path) -> None:
    from pipeline.stages.rollout_worker import RolloutWorker
    from tests.integration.test_rollout_worker import Scripted

    keys = Keys("promptscluster")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"{i}+1="}) + "\n" for i in range(6)))
    common = ["--redis-url", cluster.url, "--namespace", keys.namespace]
    assert main(["enqueue", str(prompts), *common]) == 0
    assert main(["enqueue", str(prompts), *common]) == 0  # idempotent there too

    async def sample() -> list[str]:
        r = connect(RedisSettings(redis_url=cluster.url))
        try:
            worker = RolloutWorker(r, keys, Scripted(fail=frozenset({"p5"})), fast().model_copy(
                update={"max_deliveries": 2, "claim_idle_ms": 300, "claim_interval_ms": 50}), burst=True)
            await asyncio.wait_for(worker.run(asyncio.Event()), 60)
            assert await r.xlen(keys.dlq) == 1
            return [f[b"gid"].decode() for _, f in await r.xrange(keys.stream("rollouts"))]
        finally:
            await r.aclose()

    assert sorted(asyncio.run(sample())) == [f"0:p{i}" for i in range(5)]
    assert main(["where", "0:p5", *common]) == 0
