"""Faults planted in a running pipeline, diagnosed with distillq's own tools only (docs/deployment.md, Debugging).

Each test plants one fault (a short per-token array, the wrong namespace, a failing teacher backend, a stopped
feeder or learner, a configuration a worker refuses, ...) against a private redis-server and real worker
processes, and asserts what an operator sees: CLI output and exit status, ``stats`` rows, dead letters, log lines.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from pipeline.cli.supervisor import ProcSpec, Supervisor
from pipeline.stages.scoring import Scorer
from pipeline.teacher.synthetic import SyntheticTeacher
from pipeline.transport.consumer import StreamConsumer
from pipeline.transport.keys import Keys
from pipeline.transport.producer import StreamProducer
from pipeline.transport.sdk import AsyncGroupProducer
from schemas import DecodeError, DistillStatus, Limits
from schemas.atropos import to_atropos
from schemas.build import synthetic_rollout, synthetic_scored
from tests.redis_server import RedisServer
from tests.reliability.harness import (
    FAST_ENV,
    RecordingLearner,
    Workers,
    fast_settings,
    heartbeat_pid,
    redis_client,
    wait_until,
)
from tests.reliability.teacher_stub import MODEL, SwitchableTeacher

pytestmark = [pytest.mark.reliability, pytest.mark.redis, pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parents[2]


def dq(url: str, ns: str, *argv: str, env: dict[str, str] | None = None,
       timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``distillq ARGV --redis-url URL --namespace NS`` as an operator runs it: a process, output in a pipe."""
    base = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES") and not k.startswith("DISTILLQ_")}
    return subprocess.run([sys.executable, "-m", "pipeline.cli.main", *argv, "--redis-url", url,
                           "--namespace", ns], env={**base, **(env or {})}, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, check=False)


def stats_json(url: str, ns: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    p = dq(url, ns, "stats", "--json", env=env)
    assert p.returncode == 0, p.stderr
    return dict(json.loads(p.stdout))


def lines_file(path: Path, objs: list[dict[str, Any]]) -> str:
    path.write_text("".join(json.dumps(o) + "\n" for o in objs))
    return str(path)


def events(text: str, name: str) -> list[dict[str, Any]]:
    out = []
    for line in text.splitlines():
        if f'"{name}"' in line:
            try:
                out.append(json.loads(line[line.index("{"):]))
            except ValueError:
                continue
    return [e for e in out if e.get("event") == name]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- 1. a per-token array of another length ---------------------------------------------------------


async def test_1_short_inference_logprobs_are_refused_by_push_and_the_sdk(
    private_redis: RedisServer, namespace: str, tmp_path: Path
) -> None:
    obj = to_atropos(synthetic_rollout(1, 12, prompt_len=4, group_id="short"))
    obj["inference_logprobs"][0] = obj["inference_logprobs"][0][:-3]  # three entries short
    p = dq(private_redis.url, namespace, "push", lines_file(tmp_path / "g.jsonl", [obj]))
    assert p.returncode == 1 and p.stdout == ""
    assert "line 1: inference_logprobs[0]: 9 values for 12 tokens (one per token)" in p.stderr
    assert "nothing pushed: 1 bad line(s)" in p.stderr
    async with AsyncGroupProducer(private_redis.url, namespace=namespace) as sdk:
        with pytest.raises(DecodeError) as err:
            await sdk.push_atropos(obj)
    assert err.value.field == "inference_logprobs[0]" and "9 values for 12 tokens" in err.value.reason
    r = redis_client(private_redis.url)
    assert await r.xlen(Keys(namespace).stream("rollouts")) == 0


# --- 2. the wrong namespace -------------------------------------------------------------------------


@pytest.mark.slow  # every writing command, each a CLI process
async def test_2_every_writing_command_names_the_namespace_and_an_unused_one_is_flagged(
    private_redis: RedisServer, namespace: str, tmp_path: Path
) -> None:
    url, other = private_redis.url, f"{namespace}-typo"
    r = redis_client(url)
    keys = Keys(namespace)
    path = lines_file(tmp_path / "g.jsonl", [to_atropos(synthetic_rollout(1, 8, group_id=f"g{i}")) for i in range(2)])
    p = dq(url, namespace, "push", path)
    assert p.returncode == 0 and p.stdout == f"pushed 2 group(s) onto rollouts in namespace '{namespace}'\n"
    c = StreamConsumer(r, keys, "rollouts", "ops")
    await c.ensure_group()
    (d,) = await c.read(1, block_ms=100)
    await c.dead_letter(d, "test_reason: planted")

    p = dq(url, other, "dlq", "purge", "--yes")  # meant the other pipeline: nothing there, and it says so
    assert p.returncode == 0 and p.stdout == f"no dead letter(s) to delete of namespace '{other}' ({{{other}:dlq}})\n"
    assert f"note: namespace '{other}' has no keys in this Redis (namespaces here: {namespace};" in p.stderr
    p = dq(url, other, "namespaces")
    assert p.returncode == 0 and namespace in p.stdout and f"the chosen namespace '{other}' has no keys" in p.stderr
    p = dq(url, other, "namespaces", "--json")
    (row,) = [json.loads(line) for line in p.stdout.splitlines()]
    assert row["namespace"] == namespace and row["streams"] == {"rollouts": 1, "dlq": 1} and not row["chosen"]

    p = dq(url, namespace, "dlq", "replay", "--all")
    assert p.returncode == 0 and p.stdout.startswith(f"replaying dead letters of namespace '{namespace}'")
    await c.dead_letter((await c.read(1, block_ms=100))[0], "test_reason: planted again")
    p = dq(url, namespace, "dlq", "purge", "--yes")
    assert p.returncode == 0 and p.stdout == f"deleted 1 dead letter(s) of namespace '{namespace}' ({keys.dlq})\n"


# --- 3 and 10. stats shows what the heartbeats hold; where is group G ----------------------------------


@pytest.mark.slow  # worker processes
async def test_3_10_stale_drops_and_the_policy_version_show_in_stats_and_where_finds_the_group(
    workers: Workers, private_redis: RedisServer, namespace: str, tmp_path: Path
) -> None:
    url, keys = private_redis.url, Keys(namespace)
    r = redis_client(url)
    await r.set(keys.policy_version, 5)
    lines = []
    for i in range(4):
        obj = to_atropos(synthetic_scored(synthetic_rollout(2, 10, group_id=f"old{i}", seed=i), k=4))
        del obj["policy_version"]  # version from --policy-version
        lines.append(obj)
    path = lines_file(tmp_path / "scored.jsonl", lines)
    assert dq(url, namespace, "push", path, "--stream", "scored").returncode == 0  # policy version 0
    feeder = workers.add("f1", "feeder", "--max-staleness", "0", "--max-batch-groups", "2", "--max-wait", "0.2")
    assert await wait_until(lambda: _drained(r, keys.stream("scored")), 30), feeder.log_text()[-2000:]
    assert await wait_until(lambda: _stale_beat(r, keys), 10)

    snap = stats_json(url, namespace)
    assert snap["policy_version"] == 5
    (fw,) = [w for w in snap["workers"] if w["consumer"] == "f1"]
    assert fw["outcomes"] == {"stale": 4}
    p = dq(url, namespace, "stats")
    assert "policy version: 5" in p.stdout
    assert "feeder f1 dropped groups: stale 4 (group_not_batched in its log; distillq where GROUP_ID)" in p.stdout
    assert len(events(feeder.log_text(), "group_not_batched")) == 4

    # 10: where is old0, and why it cannot be pushed again; then push it again on purpose.
    p = dq(url, namespace, "where", "old0")
    assert p.returncode == 0 and '"reason": "stale"' in p.stdout and "dropped by the feeder (stale)" in p.stdout
    assert "distillq push --force" in p.stdout
    p = dq(url, namespace, "push", path, "--stream", "scored", "--policy-version", "5")
    assert p.returncode == 0 and "(4 already present, skipped)" in p.stdout
    assert "distillq where old0 shows what became of it; distillq push --force pushes them again" in p.stderr
    p = dq(url, namespace, "push", path, "--stream", "scored", "--policy-version", "5", "--force")
    assert p.returncode == 0 and p.stdout.startswith("pushed 4 group(s) onto scored")
    assert await wait_until(lambda: _length_at_least(r, keys.stream("batches"), 2), 20), feeder.log_text()[-2000:]
    p = dq(url, namespace, "tail", "batches", "--group-id", "old3", "--json")
    assert p.returncode == 0 and [b["group_ids"].count("old3") for b in map(json.loads, p.stdout.splitlines())] == [1]
    p = dq(url, namespace, "where", "old3")
    assert "batches   entry" in p.stdout and p.stdout.rstrip().endswith("in a batch the learner has not "
                                                                            "acknowledged yet")
    assert dq(url, namespace, "where", "never-pushed").returncode == 1


async def test_3_full_streams_orphaned_consumers_and_queued_jobs_show_in_stats(
    private_redis: RedisServer, namespace: str, tmp_path: Path
) -> None:
    url, keys = private_redis.url, Keys(namespace)
    r = redis_client(url)
    for i in range(3):
        await StreamProducer(r, keys, "rollouts").send(synthetic_rollout(1, 6, group_id=f"r{i}"))
    dead = StreamConsumer(r, keys, "rollouts", "teacher-gone", fast_settings())
    await dead.ensure_group()
    assert len(await dead.read(2, block_ms=100)) == 2  # read, never acked, no heartbeat: a killed worker
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"{i}+1="}) + "\n" for i in range(12)))
    p = dq(url, namespace, "enqueue", str(prompts))
    assert p.returncode == 0 and p.stdout.startswith("enqueued 12 prompt(s)")
    assert f"in namespace '{namespace}'" in p.stdout
    env = {"DISTILLQ_MAX_BACKLOG": "3", "DISTILLQ_CLAIM_IDLE_MS": "60000"}
    snap = stats_json(url, namespace, env)
    assert snap["rollout_jobs"] == 12 and snap["max_backlog"] == 3 and snap["streams"]["rollouts"]["full"]
    (orphan,) = [c for g in snap["streams"]["rollouts"]["groups"] for c in g["consumer_list"]]
    assert orphan["name"] == "teacher-gone" and orphan["heartbeat"] is False and 50 < orphan["reclaim_in_s"] <= 60
    p = dq(url, namespace, "stats", env=env)
    assert "prompts queued: 12" in p.stdout and "3 FULL" in p.stdout
    assert "rollouts is full (3 entries, cap 3 per stream key)" in p.stdout
    assert "rollouts: consumer teacher-gone holds 2 entries and has no live heartbeat; a live teacher worker " \
           "reclaims them in" in p.stdout


async def _drained(r: Any, key: str) -> bool:
    return int(await r.xlen(key)) == 0


async def _length_at_least(r: Any, key: str, n: int) -> bool:
    return int(await r.xlen(key)) >= n


async def _stale_beat(r: Any, keys: Keys) -> bool:
    raw = await r.get(keys.heartbeat("feeder", "f1"))
    return raw is not None and json.loads(raw).get("outcomes", {}).get("stale") == 4


# --- 4 and 5. a teacher whose backend fails; an unreachable teacher URL --------------------------------


@pytest.mark.slow  # worker processes
async def test_4_teacher_check_fails_while_its_backend_fails_and_drops_show_in_stats(
    workers: Workers, private_redis: RedisServer, namespace: str
) -> None:
    url, keys = private_redis.url, Keys(namespace)
    r = redis_client(url)
    stub = SwitchableTeacher()
    await stub.start()
    try:
        teacher = workers.add("t1", "teacher", "--backend", "vllm", "--url", stub.url, "--model", MODEL, "--top-k",
                              "4", "--timeout", "1", "--retries", "0")
        assert await wait_until(lambda: _is(heartbeat_pid(r, keys.heartbeat("teacher", "t1")), teacher.pid), 30)
        env = {"DISTILLQ_HEARTBEAT_INTERVAL_S": FAST_ENV["DISTILLQ_HEARTBEAT_INTERVAL_S"]}
        assert dq(url, namespace, "worker", "teacher", "--check", "--any-host", env=env).returncode == 0

        await stub.set_mode("refuse")  # every backend call fails from now on
        prod = StreamProducer(r, keys, "rollouts")
        for i in range(3):
            await prod.send(synthetic_rollout(1, 8, group_id=f"g{i}", seed=i))
        assert await wait_until(lambda: _length_at_least(r, keys.stream("scored"), 3), 30), teacher.log_text()[-2000:]
        await asyncio.sleep(1.5)  # a heartbeat after the failures
        p = dq(url, namespace, "worker", "teacher", "--check", "--any-host", env=env)
        assert p.returncode == 1, p.stdout + p.stderr
        assert "1 teacher worker(s) alive but unhealthy: t1: teacher backend failing: last " in p.stdout + p.stderr
        assert "call(s) failed, latest: connection error" in p.stdout + p.stderr
        snap = stats_json(url, namespace)
        (tw,) = [w for w in snap["workers"] if w["consumer"] == "t1"]
        assert tw["drops"] == {"teacher_error": 3} and tw["problem"].startswith("teacher backend failing")
        text = dq(url, namespace, "stats").stdout
        assert "teacher t1 dropped teacher payloads: teacher_error 3" in text and "t1: teacher backend failing" in text
        log = teacher.log_text()
        assert len(events(log, "teacher_backend_failing")) == 1 and len(events(log, "teacher_payload_dropped")) == 3

        await stub.set_mode("up")
        await prod.send(synthetic_rollout(1, 8, group_id="back", seed=9))
        assert await wait_until(lambda: _healthy(url, namespace, env), 30), teacher.log_text()[-2000:]
        assert len(events(teacher.log_text(), "teacher_backend_recovered")) == 1
    finally:
        await stub.close()


async def _is(value: Any, want: Any) -> bool:
    return bool(await value == want)


async def _healthy(url: str, ns: str, env: dict[str, str]) -> bool:
    return (await asyncio.to_thread(dq, url, ns, "worker", "teacher", "--check", "--any-host", env=env)).returncode == 0


@pytest.mark.slow  # worker processes
async def test_5_an_unreachable_teacher_url_is_reported_at_once(
    workers: Workers, private_redis: RedisServer, namespace: str
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    teacher = workers.add("t1", "teacher", "--backend", "vllm", "--url", dead, "--model", MODEL)
    assert await wait_until(lambda: _logged(teacher.log_text(), "teacher_unreachable"), 15), teacher.log_text()
    waited = time.monotonic() - t0
    (first,) = events(teacher.log_text(), "teacher_unreachable")
    assert first["url"] == dead and "ConnectError" in first["error"] and 0 <= first["retry_in"] <= 0.25
    assert 50 < first["gives_up_in_s"] <= 60 and first["level"] == "warning"
    assert teacher.alive and waited < 15
    teacher.kill()  # it would retry for a minute


async def _logged(text: str, event: str) -> bool:
    return bool(events(text, event))


# --- 6. push on a full stream ------------------------------------------------------------------------


async def test_6_push_into_a_full_stream_says_how_many_got_in(
    private_redis: RedisServer, namespace: str, tmp_path: Path
) -> None:
    objs = [to_atropos(synthetic_rollout(1, 6, group_id=f"g{i:02d}")) for i in range(30)]
    env = {"DISTILLQ_MAX_BACKLOG": "15", "DISTILLQ_BACKPRESSURE_TIMEOUT_S": "0.5"}
    p = dq(private_redis.url, namespace, "push", lines_file(tmp_path / "g.jsonl", objs), env=env)
    assert p.returncode == 1 and "Traceback" not in p.stderr and p.stdout == ""
    (line,) = [ln for ln in p.stderr.splitlines() if ln.startswith("distillq:")]
    assert line.startswith(f"distillq: pushed 15 of 30 group(s) onto rollouts in namespace '{namespace}', then it "
                           "stayed full:")
    assert "the other 15 were not pushed (push the file again once it drains" in line
    r = redis_client(private_redis.url)
    assert await r.xlen(Keys(namespace).stream("rollouts")) == 15


# --- 7. a top-k above DISTILLQ_MAX_K ------------------------------------------------------------------


async def test_7_top_k_above_the_readers_cap_is_refused_at_start_up(
    private_redis: RedisServer, namespace: str, tmp_path: Path
) -> None:
    from pipeline.demo.tinymodels import ensure_tiny_models

    model = str(ensure_tiny_models().teacher)
    p = dq(private_redis.url, namespace, "worker", "teacher", "--backend", "hf", "--model", model, "--top-k", "300")
    assert p.returncode == 2
    assert "distillq: --top-k 300 exceeds DISTILLQ_MAX_K=256, the largest k any reader accepts" in \
        p.stderr


async def test_7_a_group_override_above_the_readers_cap_is_clamped_to_it_not_to_the_vocabulary() -> None:
    backend = SyntheticTeacher(max_k=151_936)  # a local model: its cap is its vocabulary
    await backend.start()
    scorer = Scorer(backend, limits=Limits(max_k=256))
    (out,) = await scorer.score_groups([synthetic_rollout(1, 12, group_id="g", group_overrides={"teacher_top_k": 300})])
    assert out.status is DistillStatus.OK and out.k == 256, out.reason
    await backend.close()


# --- 8. a worker that refuses its configuration under distillq up -------------------------------------


async def test_8_up_reports_a_configuration_refusal_once_and_does_not_restart_it(
    private_redis: RedisServer, namespace: str, tmp_path: Path
) -> None:
    logs = tmp_path / "logs"
    t0 = time.monotonic()
    p = dq(private_redis.url, namespace, "up", "--teachers", "1", "--feeders", "0", "--teacher-args",
           "--backend vllm", "--log-dir", str(logs), "--duration", "60", env={"DISTILLQ_LOG_JSON": "1"}, timeout=90)
    took = time.monotonic() - t0
    assert p.returncode == 1 and took < 30  # ends once its only worker is done: no restarts
    (refusal,) = events(p.stderr, "process_refused_config")
    assert refusal["name"] == "teacher-0" and refusal["code"] == 2 and refusal["restarted"] is False
    assert refusal["reason"] == "distillq: --url is required for the vllm backend"
    assert not events(p.stderr, "process_died")
    assert (logs / "teacher-0.log").read_text().count("--url is required") == 1  # started once


def test_8_supervisor_gives_up_loudly_after_its_restarts(tmp_path: Path) -> None:
    crash = [sys.executable, "-c", "import sys; print('boom: planted'); sys.exit(1)"]
    sup = Supervisor([ProcSpec("crashy", crash)], tmp_path, max_restarts=1)
    try:
        sup.start()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and sup.poll()["crashy"] is None:
            time.sleep(0.1)
        assert sup.poll()["crashy"] == 1 and sup.procs[0].restarts == 1
        assert sup.last_line(sup.procs[0]) == "boom: planted"
    finally:
        sup.stop(grace_s=2)


# --- 9. a stopped feeder, a stopped learner: inputs kept, never dead-lettered ------------------------


@pytest.mark.slow  # worker processes
async def test_9_full_downstream_keeps_inputs_pending_and_logs_the_documented_events(
    workers: Workers, private_redis: RedisServer, namespace: str
) -> None:
    url, keys = private_redis.url, Keys(namespace)
    r = redis_client(url)
    env = {"DISTILLQ_MAX_BACKLOG": "2", "DISTILLQ_BACKPRESSURE_TIMEOUT_S": "1", "DISTILLQ_MAX_DELIVERIES": "2"}
    workers.env.update(env)
    teacher = workers.teacher("t1")
    prod = StreamProducer(r, keys, "rollouts", fast_settings(max_backlog=100))
    for i in range(6):
        await prod.send(synthetic_rollout(1, 8, group_id=f"g{i}", seed=i))
    assert await wait_until(lambda: _logged(teacher.log_text(), "downstream_full"), 20), teacher.log_text()[-2000:]
    await asyncio.sleep(3.0)  # several timeouts and reclaim intervals: still nothing dead-lettered
    assert teacher.alive and await r.xlen(keys.dlq) == 0
    assert await r.xlen(keys.stream("scored")) == 2
    snap = stats_json(url, namespace, env)
    assert snap["streams"]["scored"]["full"] and snap["dead_letters"] == 0

    feeder = workers.feeder("f1", "--max-batch-groups", "1")  # batches fill too: no learner yet
    assert await wait_until(lambda: _logged(feeder.log_text(), "learner_stalled"), 20), feeder.log_text()[-2000:]
    await asyncio.sleep(2.0)
    assert feeder.alive and teacher.alive and await r.xlen(keys.dlq) == 0

    learner = RecordingLearner(url, namespace)
    stop = asyncio.Event()
    task = asyncio.create_task(learner.run(stop))
    assert await wait_until(lambda: _true(len(learner.counts) == 6), 60), (feeder.log_text()[-2000:])
    stop.set()
    await task
    assert learner.duplicates == 0 and await r.xlen(keys.dlq) == 0
    assert feeder.alive and teacher.alive


async def _true(value: bool) -> bool:
    return value
