"""A teacher that answers vLLM's -9999.0 (its logprob of -inf) for a while: a teacher worker process (``--backend
vllm``) drops those groups' payloads as ``invalid_logprobs`` and they flow on; no such value reaches any batch
the learner receives; the teacher's heartbeat and ``distillq stats`` count the drops. At start-up the same
answer is a one-line refusal with exit status 2 (a configuration error: ``distillq up`` does not restart it)."""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any

import numpy as np
import pytest

from pipeline.transport.keys import Keys
from pipeline.transport.producer import StreamProducer
from schemas import DistillStatus, Limits, RolloutGroup
from schemas.build import synthetic_rollout
from tests.redis_server import RedisServer
from tests.reliability.harness import (
    FAST_ENV,
    RecordingLearner,
    Workers,
    fast_settings,
    heartbeat_pid,
    redis_client,
    report,
    wait_until,
    worker_argv,
)
from tests.reliability.teacher_stub import MODEL, SENTINEL, SwitchableTeacher
from tests.reliability.test_debugging import stats_json

pytestmark = [pytest.mark.reliability, pytest.mark.slow, pytest.mark.redis, pytest.mark.timeout(150)]

K = 4
LIMITS = Limits()


def bad_values(groups: list[Any]) -> list[str]:
    """Every teacher value of ``groups`` that no logprob can have (NaN, +-inf, above 0, at/below the floor)."""
    out = []
    for g in groups:
        for i, t in enumerate(g.teacher or []):
            for field in ("topk_logprobs", "sampled_logprobs"):
                a = getattr(t, field).numpy().astype(np.float64)
                bad = a[~((a > LIMITS.logprob_floor) & (a <= LIMITS.logprob_tolerance))]
                out += [f"{g.group_id} teacher[{i}].{field}: {v}" for v in bad[:3]]
    return out


async def produce(r: Any, keys: Keys, sent: dict[str, RolloutGroup], n: int) -> None:
    prod = StreamProducer(r, keys, "rollouts", fast_settings())
    for i in range(n):
        g = synthetic_rollout(2, 12, group_id=f"g{i:03d}", seed=i, vocab=1000)
        await prod.send(g)
        sent[g.group_id] = g
        await asyncio.sleep(0.1)


async def _beat(r: Any, key: str) -> dict[str, Any]:
    raw = await r.get(key)
    return dict(json.loads(raw)) if raw else {}


async def test_sentinel_answers_drop_their_groups_and_never_reach_a_batch(
    workers: Workers, private_redis: RedisServer, namespace: str
) -> None:
    stub = SwitchableTeacher()
    await stub.start()
    keys = Keys(namespace)
    r = redis_client(private_redis.url)
    teacher = workers.add("t1", "teacher", "--backend", "vllm", "--url", stub.url, "--model", MODEL,
                          "--top-k", str(K), "--timeout", "5", "--retries", "2")
    workers.feeder("f1")
    hb = keys.heartbeat("teacher", "t1")
    assert await wait_until(lambda: _is(heartbeat_pid(r, hb), teacher.pid), 30), teacher.log_text()[-3000:]

    learner = RecordingLearner(private_redis.url, namespace)
    stop_learner = asyncio.Event()
    learning = asyncio.create_task(learner.run(stop_learner))
    sent: dict[str, RolloutGroup] = {}
    producing = asyncio.create_task(produce(r, keys, sent, 60))  # 6 s of groups
    await asyncio.sleep(1.5)
    await stub.set_mode("sentinel")  # 2.5 s of -9999.0 answers
    await asyncio.sleep(2.5)
    await stub.set_mode("up")
    await producing
    all_in = await wait_until(lambda: _true(set(sent) <= set(learner.counts)), 30)
    stop_learner.set()
    await learning
    await learner.aclose()
    beat = await _beat(r, hb)
    snap = stats_json(private_redis.url, namespace)
    dead_letters = int(await r.xlen(keys.stream("dlq")))
    alive = teacher.alive
    await stub.close()
    await r.aclose()

    got = {gid: learner.first[gid] for gid in sent if gid in learner.first}
    dropped = [s for s in got.values() if s.status is DistillStatus.DROPPED]
    invalid = [s for s in dropped if (s.reason or "").startswith("invalid_logprobs: ")]
    ok = [s for s in got.values() if s.status is DistillStatus.OK]
    report("teacher_invalid_logprobs", groups=len(sent), received=len(got), ok=len(ok), dropped=len(dropped),
           invalid_logprobs=len(invalid), sentinel_answers=stub.sentinel_answers, dead_letters=dead_letters,
           batches=learner.batches)
    assert all_in and alive, teacher.log_text()[-3000:]
    assert stub.sentinel_answers > 0 and invalid and ok  # both kinds flowed through
    assert len(invalid) == len(dropped), [s.reason for s in dropped if s not in invalid][:3]
    assert f"is {SENTINEL:g}: at or below the floor -1000" in (invalid[0].reason or "")
    assert "(sequence " in (invalid[0].reason or "")
    assert not bad_values(list(got.values()))  # the invariant: no sentinel, NaN or inf in any batch
    assert learner.duplicates == 0 and dead_letters == 0  # dropped by the teacher, not refused downstream
    assert beat["drops"] == {"invalid_logprobs": len(invalid)}
    assert beat["unhealthy"] is None and beat["slow"] is None  # a wrong answer is not a backend down
    (tw,) = [w for w in snap["workers"] if w["consumer"] == "t1"]
    assert tw["drops"] == {"invalid_logprobs": len(invalid)}
    assert teacher.log_text().count('"teacher_payload_dropped"') == len(invalid)


async def test_a_sentinel_answer_at_start_up_is_a_one_line_refusal(private_redis: RedisServer, namespace: str) -> None:
    stub = SwitchableTeacher()
    await stub.start()
    await stub.set_mode("sentinel")
    argv = worker_argv("teacher", private_redis.url, namespace, "--backend", "vllm", "--url", stub.url, "--model",
                       MODEL, "--top-k", str(K))
    t0 = time.monotonic()
    proc = await asyncio.create_subprocess_exec(*argv, env={**os.environ, **FAST_ENV}, stdin=asyncio.subprocess.DEVNULL,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    await stub.close()
    text = err.decode()
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith("{")]  # but the JSON log events
    assert proc.returncode == 2, (proc.returncode, text[-3000:], out.decode()[-2000:])
    assert len(lines) == 1 and "Traceback" not in text + out.decode(), text
    assert lines[0].startswith("distillq: teacher self-test answer refused: invalid_logprobs: ")
    assert f"is {SENTINEL:g}: at or below the floor -1000" in lines[0]
    assert time.monotonic() - t0 < 30
    assert stub.sentinel_answers >= 1


async def _is(coro: Any, want: int) -> bool:
    return bool(await coro == want)


async def _true(v: bool) -> bool:
    return v
