"""Dead letters sent through the pipeline again, end to end against a real redis-server with in-process teacher,
feeder and learner: each replay path (a rollout scored again, a batch, a group whose payload is gone re-sent from
another copy, ``push --force`` of a group the learner dead-lettered) reaches the learner exactly once, and what
cannot be replayed says why and what to do instead (``dlq replay``, ``dlq show``, ``where``)."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from pipeline.cli.deadletters import BatchState
from pipeline.cli.recovery import batch_state
from pipeline.learner.client import AsyncLearner
from pipeline.stages.batching import BatchingConfig
from pipeline.stages.feeder import Feeder
from pipeline.stages.kl_control import ConstantKL
from pipeline.stages.runloop import StageRunner
from pipeline.stages.scoring import Scorer, ScoringConfig
from pipeline.stages.teacher_stage import TeacherStage
from pipeline.teacher.synthetic import SyntheticTeacher
from pipeline.transport.consumer import StreamConsumer
from pipeline.transport.keys import Keys
from pipeline.transport.producer import StreamProducer
from schemas import RolloutGroup
from schemas.atropos import to_atropos
from schemas.build import synthetic_rollout, synthetic_scored
from tests.integration.test_cli_ops import cli
from tests.integration.test_feeder import fast

pytestmark = [pytest.mark.redis, pytest.mark.timeout(90)]


class Pipeline:
    """Teacher, feeder and learner run in burst mode (each drains its input), recording every group the learner
    is handed (and acknowledges)."""

    def __init__(self, r: aioredis.Redis, keys: Keys) -> None:
        self.r, self.keys = r, keys
        self.trained: Counter[str] = Counter()

    async def teach(self) -> None:
        scorer = Scorer(SyntheticTeacher(vocab_size=1000), ScoringConfig(default_k=4))
        runner = StageRunner(self.r, self.keys, TeacherStage(scorer), RolloutGroup, "rollouts", "scored", fast(),
                             consumer_name="teacher-1")
        await asyncio.wait_for(runner.run(asyncio.Event(), burst=True), 20)

    async def feed(self, max_staleness: int | None = 4) -> None:
        cfg = BatchingConfig(max_wait_s=3600.0, max_staleness=max_staleness)
        await asyncio.wait_for(Feeder(self.r, self.keys, cfg, ConstantKL(0.1), fast()).run(asyncio.Event(),
                                                                                           burst=True), 20)

    async def learn(self) -> list[str]:
        """Every batch waiting, acknowledged after its 'step'; the group ids handed out."""
        got: list[str] = []
        async with AsyncLearner(redis=self.r, namespace=self.keys.namespace, settings=fast(),
                                prefetch=False) as learner:
            while (lb := await learner.next_batch(0.5)) is not None:
                got += lb.group_ids
                await learner.ack(lb)
        self.trained.update(got)
        return got

    async def run(self) -> list[str]:
        await self.teach()
        await self.feed()
        return await self.learn()


async def dead_letters(r: aioredis.Redis, keys: Keys) -> dict[str, dict[str, str]]:
    """entry id -> fields (text; the payload left out) of every dead letter."""
    return {eid.decode(): {k.decode(): v.decode("utf-8", "replace") for k, v in f.items() if k != b"orig_d"}
            for eid, f in await r.xrange(keys.dlq)}


def of(dl: dict[str, dict[str, str]], reason: str) -> list[str]:
    return [eid for eid, f in dl.items() if f["reason"].startswith(reason)]


def push_file(tmp_path: Path, *groups: RolloutGroup, drop_version: bool = False) -> str:
    lines = []
    for g in groups:
        obj = to_atropos(synthetic_scored(g, k=4))
        if drop_version:
            del obj["policy_version"]
        lines.append(json.dumps(obj))
    path = tmp_path / "groups.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


async def rollouts_dead_letter(r: aioredis.Redis, keys: Keys, g: RolloutGroup, reason: str) -> str:
    """``g`` on rollouts, read as the teacher group and dead-lettered with ``reason`` (as a teacher does)."""
    await StreamProducer(r, keys, "rollouts", fast()).send(g)
    c = StreamConsumer(r, keys, "rollouts", "teacher-0", fast(), stage="teacher")
    await c.ensure_group()
    (d,) = await c.read(1, block_ms=100)
    await c.dead_letter(d, reason)
    return str((await r.xrevrange(keys.dlq, count=1))[0][0].decode())


async def stale_at_delivery(r: aioredis.Redis, keys: Keys, p: Pipeline, gid: str) -> str:
    """A group batched at version 0 and dead-lettered by the learner as stale at version 9."""
    await StreamProducer(r, keys, "rollouts", fast()).send(synthetic_rollout(2, 12, group_id=gid))
    await p.teach()
    await p.feed()
    await r.set(keys.policy_version, 9)
    assert await p.learn() == []
    (eid,) = of(await dead_letters(r, keys), "stale:")
    return eid


# --- replay paths, each to the learner exactly once --------------------------------------------------------


async def test_a_teacher_dead_letter_is_scored_again_and_trained_once(
    r: aioredis.Redis, keys: Keys, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    p = Pipeline(r, keys)
    eid = await rollouts_dead_letter(r, keys, synthetic_rollout(2, 12, group_id="g1"),
                                     "teacher_dropped: teacher_error: connection refused")
    code, out, _ = await cli(capsys, redis_url, keys, "where", "g1")
    assert f"distillq dlq replay {eid} sends it back to rollouts to be scored again" in out
    code, out, _ = await cli(capsys, redis_url, keys, "dlq", "replay", eid)
    assert code == 0 and f"replayed {eid} -> rollouts" in out
    assert await p.run() == ["g1"]
    code, out, _ = await cli(capsys, redis_url, keys, "where", "g1")
    assert out.rstrip().endswith("): it reached training") and "acknowledged by the learner (batch entry" in out


async def test_a_batch_dead_lettered_after_max_deliveries_is_replayed_and_its_groups_trained_once(
    r: aioredis.Redis, keys: Keys, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    p = Pipeline(r, keys)
    prod = StreamProducer(r, keys, "rollouts", fast())
    for i in range(2):
        await prod.send(synthetic_rollout(2, 12, group_id=f"b{i}", seed=i))
    await p.teach()
    await p.feed()
    c = StreamConsumer(r, keys, "batches", "learner-0", fast(), stage="learner")
    await c.ensure_group()
    (d,) = await c.read(1, block_ms=100)
    await c.dead_letter(d, "max_deliveries: delivered 6 times without success")
    (eid,) = of(await dead_letters(r, keys), "max_deliveries")
    code, out, _ = await cli(capsys, redis_url, keys, "dlq", "replay", eid)
    assert code == 0 and f"replayed {eid} -> batches" in out
    assert sorted(await p.learn()) == ["b0", "b1"]
    assert await r.xlen(keys.dlq) == 0 and await p.learn() == []


async def test_a_payload_gone_at_the_learner_is_sent_again_from_another_copy_and_trained_once(
    r: aioredis.Redis, keys: Keys, redis_url: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The teacher dead-lettered g1 once (its rollout bytes stay in that dead letter); the operator pushed g1
    again; its scored payload was then lost before the learner read it."""
    p = Pipeline(r, keys)
    g = synthetic_rollout(2, 12, group_id="g1")
    first = await rollouts_dead_letter(r, keys, g, "teacher_dropped: teacher_error: timeout")
    code, out, err = await cli(capsys, redis_url, keys, "push", push_file(tmp_path, g), "--force")
    assert code == 0 and out.startswith("pushed 1 group(s) onto rollouts"), err
    await p.teach()
    await p.feed()
    for key in await r.keys(f"{{{keys.namespace}:scored}}:payload:*"):
        await r.delete(key)  # evicted, or deleted by hand
    assert await p.learn() == []
    (lost,) = of(await dead_letters(r, keys), "payload_missing")

    code, out, _ = await cli(capsys, redis_url, keys, "dlq", "show", lost)
    assert f"replay: distillq dlq replay {lost} sends it back to rollouts to be scored again (from dead letter " \
           f"{first})" in out
    code, out, _ = await cli(capsys, redis_url, keys, "dlq", "replay", lost)
    assert code == 0 and f"replayed {lost} -> rollouts" in out and f"from dead letter {first}" in out
    assert await p.run() == ["g1"]

    # g1 is trained now: neither its other dead letter nor a push brings it back.
    code, out, _ = await cli(capsys, redis_url, keys, "dlq", "replay", first)
    assert code == 1 and "it was trained already" in out
    code, out, err = await cli(capsys, redis_url, keys, "push", push_file(tmp_path, g), "--force")
    assert code == 1 and "not pushed again: g1: it was trained already" in err
    await p.run()
    assert p.trained == Counter({"g1": 1})
    code, out, _ = await cli(capsys, redis_url, keys, "where", "g1")
    assert "not replayable: it was trained already" in out  # each dead letter's advice
    summary = out.rstrip().splitlines()[-1]  # the summary says where it went, not "dead-lettered"
    assert "acknowledged by the learner (batch entry " in summary and "it reached training; 1 dead letter(s) of " \
        "it from before" in summary, out


async def test_push_force_of_a_group_dead_lettered_stale_by_the_learner_trains_it_once(
    r: aioredis.Redis, keys: Keys, redis_url: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    p = Pipeline(r, keys)
    stale = await stale_at_delivery(r, keys, p, "old")
    path = push_file(tmp_path, synthetic_rollout(2, 12, group_id="old"), drop_version=True)
    code, out, err = await cli(capsys, redis_url, keys, "push", path, "--policy-version", "9", "--force")
    assert code == 0 and out.startswith("pushed 1 group(s) onto rollouts"), err
    assert not await r.exists(keys.seen("batches", "old"))  # never trained: its batches marker went
    assert await p.run() == ["old"]
    code, out, err = await cli(capsys, redis_url, keys, "push", path, "--policy-version", "9", "--force")
    assert code == 1 and "not pushed again: old: it was trained already" in err
    code, out, _ = await cli(capsys, redis_url, keys, "dlq", "replay", stale)
    assert code == 1 and "a replay would be dropped as stale again" in out
    await p.run()
    assert p.trained == Counter({"old": 1})


# --- what cannot be replayed says why and what to do ------------------------------------------------------


async def test_a_stale_dead_letter_is_refused_with_what_to_do(
    r: aioredis.Redis, keys: Keys, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    p = Pipeline(r, keys)
    eid = await stale_at_delivery(r, keys, p, "0:p7")
    code, out, _ = await cli(capsys, redis_url, keys, "dlq", "replay", eid)
    assert code == 1
    (line,) = [ln for ln in out.splitlines() if ln.startswith("kept")]
    assert "a replay would be dropped as stale again; sample its prompt again at the current policy version" in line
    assert line.endswith(": distillq dlq resample 0:p7")
    code, out, _ = await cli(capsys, redis_url, keys, "where", "0:p7")
    assert "dead-lettered (stage learner: stale:" in out and "not replayable" in out
    assert "dlq replay sends it back" not in out and out.rstrip().endswith("distillq dlq resample 0:p7")
    assert await p.run() == []


async def test_a_payload_gone_without_another_copy_is_refused_with_what_to_do(
    r: aioredis.Redis, keys: Keys, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    p = Pipeline(r, keys)
    await StreamProducer(r, keys, "rollouts", fast()).send(synthetic_rollout(2, 12, group_id="lost"))
    await p.teach()
    await p.feed()
    for key in await r.keys(f"{{{keys.namespace}:scored}}:payload:*"):
        await r.delete(key)
    assert await p.learn() == []
    (eid,) = of(await dead_letters(r, keys), "payload_missing")
    code, out, _ = await cli(capsys, redis_url, keys, "dlq", "replay", eid)
    assert code == 1 and "its payload is gone (payload_missing: key" in out
    assert "no other copy of the group is left (the teacher deletes a rollout once it is scored)" in out
    assert "distillq push --force FILE" in out
    assert await r.xlen(keys.dlq) == 1


async def test_output_too_large_is_replayed_only_with_force(
    r: aioredis.Redis, keys: Keys, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    p = Pipeline(r, keys)
    eid = await rollouts_dead_letter(r, keys, synthetic_rollout(2, 12, group_id="big"),
                                     "output_too_large: scored big: 900 bytes exceeds max_message_bytes=800")
    code, out, _ = await cli(capsys, redis_url, keys, "dlq", "replay", eid)
    assert code == 1 and "output_too_large: a replay fails the same way" in out
    assert "DISTILLQ_MAX_MESSAGE_BYTES" in out and "distillq dlq replay --force ID" in out
    code, out, _ = await cli(capsys, redis_url, keys, "dlq", "replay", "--force", eid)
    assert code == 0 and f"replayed {eid} -> rollouts" in out
    assert await p.run() == ["big"]


async def test_push_force_of_a_group_in_a_batch_not_acknowledged_is_refused(
    r: aioredis.Redis, keys: Keys, redis_url: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    p = Pipeline(r, keys)
    g = synthetic_rollout(2, 12, group_id="busy")
    await StreamProducer(r, keys, "rollouts", fast()).send(g)
    await p.teach()
    await p.feed()
    code, _out, err = await cli(capsys, redis_url, keys, "push", push_file(tmp_path, g), "--force")
    assert code == 1 and "not pushed again: busy: it is in batch entry" in err
    assert "which the learner has not acknowledged yet; wait: distillq where busy" in err
    assert await p.run() == ["busy"] and p.trained == Counter({"busy": 1})


async def test_a_written_marker_is_tied_to_its_batch_by_its_write_time(r: aioredis.Redis, keys: Keys) -> None:
    """A batches marker from the two-step write holds ``written``: the learner's dead letter proves the group
    untrained only if its batch entry was written when the marker was."""
    s = fast()
    sec, us = await r.time()
    await r.set(keys.seen("batches", "w"), "written", px=s.dedupe_ttl_s * 1000)
    at = sec * 1000 + us // 1000

    def learner_dead_letter(batch_ms: int) -> list[tuple[str, dict[bytes, bytes]]]:
        return [("9-0", {b"stage": b"learner", b"reason": b"stale: x", b"batch_entry": f"{batch_ms}-0".encode()})]

    assert await batch_state(r, keys, "w", s, learner_dead_letter(at)) == BatchState("excluded", f"{at}-0")
    assert (await batch_state(r, keys, "w", s, learner_dead_letter(at - 10_000))).verdict == "unknown"
    assert (await batch_state(r, keys, "w", s, [])).verdict == "unknown"
    assert (await batch_state(r, keys, "never-batched", s, [])).verdict == "never"
