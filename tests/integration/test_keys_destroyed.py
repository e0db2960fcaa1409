"""Stage streams destroyed or trimmed by hand (real redis-server, in-process stages): the loss is an incident in
``distillq stats`` naming the stream and how many entries, ``where`` answers from the learner's acknowledgements
(never "reached training" for a group no learner acknowledged), ``push --force`` sends a lost group again, and in
the end every group is trained exactly once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from pipeline.learner.client import AsyncLearner
from pipeline.transport.audit import audit_streams
from pipeline.transport.keys import Keys
from pipeline.transport.producer import StreamProducer
from schemas.build import synthetic_rollout
from tests.integration.test_cli_ops import cli
from tests.integration.test_dlq_recovery import Pipeline, push_file
from tests.integration.test_feeder import fast
from tests.integration.test_learner_delivery import feed

pytestmark = [pytest.mark.redis, pytest.mark.timeout(90)]


async def stats(capsys: pytest.CaptureFixture[str], redis_url: str, keys: Keys) -> dict[str, object]:
    code, out, err = await cli(capsys, redis_url, keys, "stats", "--json")
    assert code == 0, err
    return dict(json.loads(out))


def incidents_of(snap: dict[str, object], kind: str) -> list[str]:
    return [str(i["text"]) for i in snap["incidents"] if i["kind"] == kind]  # type: ignore[attr-defined]


async def test_batches_stream_deleted_with_unacknowledged_batches(
    r: aioredis.Redis, keys: Keys, redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    groups = [synthetic_rollout(2, 12, group_id=f"g{i}") for i in range(6)]
    p = Pipeline(r, keys)
    for g in groups:
        await StreamProducer(r, keys, "rollouts", fast()).send(g)
    await p.teach()
    await feed(r, keys, max_batch_groups=2)  # 3 batches of 2 groups
    batches = await r.xlen(keys.stream("batches"))
    assert batches == 3
    async with AsyncLearner(redis=r, namespace=keys.namespace, settings=fast(), prefetch=False) as learner:
        first = await learner.next_batch(1)
        assert first is not None
        await learner.ack(first)  # one batch trained; the rest wait, unacknowledged
        held = await learner.next_batch(1)  # and one handed out, not acknowledged
        assert held is not None
    trained = set(first.group_ids)
    assert await stats(capsys, redis_url, keys)  # an audit: the stream's record
    assert await r.delete(keys.stream("batches")) == 1  # by hand
    snap = await stats(capsys, redis_url, keys)
    (text,) = incidents_of(snap, "stream_deleted")
    assert text.startswith(f"stream {keys.stream('batches')} was deleted (DEL, FLUSHDB or UNLINK by hand) holding "
                           f"{batches - 1} entries its learner consumers had not acknowledged")
    assert any("stream_deleted" in a for a in snap["attention"])  # type: ignore[attr-defined]
    lost = [g for g in groups if g.group_id not in trained]
    orphans = [k async for k in r.scan_iter(match=f"{keys.stream('scored')}:payload:*")]
    ttls = [await r.pttl(k) for k in orphans]
    assert len(orphans) == len(lost) and all(t > 0 for t in ttls)  # they expire (payload_ttl_s)
    for g in groups:
        code, out, _ = await cli(capsys, redis_url, keys, "where", g.group_id)
        summary = out.rstrip().splitlines()[-1]
        if g.group_id in trained:
            assert "acknowledged by the learner" in summary and summary.endswith("it reached training"), out
        else:
            assert "lost: batched into entry" in summary and "which no learner acknowledged" in summary, out
    code, out, err = await cli(capsys, redis_url, keys, "push", push_file(tmp_path, *lost), "--force")
    assert code == 0 and out.startswith(f"pushed {len(lost)} group(s)"), err
    await p.teach()
    await p.feed()
    got = await p.learn()
    assert sorted(got) == sorted(g.group_id for g in lost)  # each lost group once more, none trained twice
    code, out, err = await cli(capsys, redis_url, keys, "push", push_file(tmp_path, *groups[:1]), "--force")
    assert code == 1 and "it was trained already" in err


async def test_rollouts_trimmed_by_hand(
    r: aioredis.Redis, keys: Keys, redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    groups = [synthetic_rollout(2, 12, group_id=f"r{i}") for i in range(10)]
    for g in groups:
        await StreamProducer(r, keys, "rollouts", fast()).send(g)
    p = Pipeline(r, keys)
    assert await audit_streams(r, keys, "test") == []  # the record; nothing lost yet
    assert await r.xtrim(keys.stream("rollouts"), maxlen=4, approximate=False) == 6  # by hand
    snap = await stats(capsys, redis_url, keys)
    (text,) = incidents_of(snap, "stream_trimmed")
    assert text.startswith(f"6 entries of stream {keys.stream('rollouts')} were removed (XTRIM or XDEL by hand) "
                           "before its teacher consumers acknowledged them")
    assert incidents_of(await stats(capsys, redis_url, keys), "stream_trimmed") == [text]  # reported once
    code, out, _ = await cli(capsys, redis_url, keys, "where", "r0")
    assert "lost: written to rollouts" in out and "distillq push --force FILE sends it again" in out
    assert sorted(await p.run()) == [f"r{i}" for i in range(6, 10)]
    code, out, err = await cli(capsys, redis_url, keys, "push", push_file(tmp_path, *groups[:6]), "--force")
    assert code == 0, err
    assert sorted(await p.run()) == [f"r{i}" for i in range(6)]
    assert incidents_of(await stats(capsys, redis_url, keys), "stream_trimmed") == [text]  # normal flow: no loss


async def test_where_over_an_epoch_or_a_file_answers_was_anything_lost(
    r: aioredis.Redis, keys: Keys, redis_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from pipeline.transport.prompts import PromptJob, enqueue_prompts

    await enqueue_prompts(r, keys, [PromptJob(id=f"p{i}", prompt="1+1=") for i in range(3)], epoch=4)
    code, out, _ = await cli(capsys, redis_url, keys, "where", "--epoch", "4")
    assert code == 0 and out.splitlines()[0] == "epoch 4: 3 group(s): 3 in flight", out  # queued for a worker
    groups = [synthetic_rollout(2, 12, group_id=f"f{i}") for i in range(4)]
    for g in groups[:3]:
        await StreamProducer(r, keys, "rollouts", fast()).send(g)
    await Pipeline(r, keys).run()
    path = push_file(tmp_path, *groups)
    code, out, _ = await cli(capsys, redis_url, keys, "where", "--file", path)
    lines = out.splitlines()
    assert code == 1 and lines[0] == f"{path}: 4 group(s): 3 trained, 1 not found", out  # f3 was never pushed
    assert lines[1].startswith("  f3: not found")
    code, out, _ = await cli(capsys, redis_url, keys, "where", "--file", path, "--json")
    got = json.loads(out)
    assert got["fates"] == {"trained": 3, "not found": 1} and [x["group_id"] for x in got["not_trained"]] == ["f3"]
    code, _, err = await cli(capsys, redis_url, keys, "where", "f0", "--epoch", "4")
    assert code == 2 and "give one GROUP_ID, or --epoch N or --file FILE" in err


async def test_groups_of_enqueued_prompts_lost_to_a_trim_are_sampled_again(
    r: aioredis.Redis, keys: Keys, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Groups of enqueued prompts (``<epoch>:<id>``) trimmed from ``rollouts``: ``where`` names ``dlq resample``,
    which puts each prompt back on ``prompts`` as ``<epoch>:<id>@v<N>``, once; a trained group is refused."""
    from pipeline.transport.prompts import PromptJob, enqueue_prompts

    await enqueue_prompts(r, keys, [PromptJob(id=f"p{i}", prompt="1+1=") for i in range(4)], epoch=5)
    await r.delete(keys.stream("prompts"))  # sampled: the rollout worker acked (deleted) their entries
    await r.set(keys.policy_version, 3)
    groups = [synthetic_rollout(2, 12, group_id=f"5:p{i}") for i in range(4)]
    for g in groups:
        await StreamProducer(r, keys, "rollouts", fast()).send(g)
    p = Pipeline(r, keys)
    assert await audit_streams(r, keys, "test") == []
    assert await r.xtrim(keys.stream("rollouts"), maxlen=1, approximate=False) == 3  # 5:p0..5:p2, by hand
    assert sorted(await p.run()) == ["5:p3"]
    code, out, _ = await cli(capsys, redis_url, keys, "where", "5:p0")
    assert "lost: written to rollouts" in out and "distillq dlq resample 5:p0 samples its prompt again" in out, out
    code, out, err = await cli(capsys, redis_url, keys, "dlq", "resample", "5:p0", "5:p1", "5:p2", "5:p3")
    assert code == 1, err  # 5:p3 was trained
    lines = out.splitlines()
    assert [x.split()[:2] for x in lines] == [["resampled", f"5:p{i}"] for i in range(3)] + [["kept", "5:p3"]]
    assert "sampled again at policy version 3 as group 5:p0@v3" in lines[0]
    assert "neither stale nor lost: batched and acknowledged by the learner" in lines[3], lines[3]
    queued = [f[b"gid"].decode() for _, f in await r.xrange(keys.stream("prompts"))]
    assert queued == ["5:p0@v3", "5:p1@v3", "5:p2@v3"]
    code, out, _ = await cli(capsys, redis_url, keys, "dlq", "resample", "5:p0")
    assert code == 1 and "group 5:p0 was re-sampled already, as 5:p0@v3" in out, out
