"""Teacher pools against a real Redis: each group goes to its pool's rollouts stream, a teacher worker of pool P
scores only P's groups and records its pool on them; bad pool names are refused where they enter."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis
import structlog

from pipeline.cli.main import main
from pipeline.learner.client import Learner
from pipeline.transport.keys import Keys, pool_stream
from pipeline.transport.pools import PoolProducer
from pipeline.transport.prompts import PromptJob
from pipeline.transport.sdk import GroupProducer
from schemas import DistillStatus, ScoredGroup, decode
from schemas.atropos import to_atropos
from schemas.build import synthetic_rollout
from tests.integration.test_stats_attention import beat, stats

pytestmark = pytest.mark.redis


@pytest.fixture(autouse=True)
def _plain_logs() -> None:
    structlog.reset_defaults()


def _line(gid: str, overrides: dict[str, object] | None) -> str:
    return json.dumps(to_atropos(synthetic_rollout(2, 8, vocab=100, prompt_len=3, group_id=gid,
                                                   group_overrides=overrides)))


def _scored(r: redis.Redis, keys: Keys) -> dict[str, ScoredGroup]:
    out = {}
    entries: list[tuple[bytes, dict[bytes, bytes]]] = r.xrange(keys.stream("scored"))  # type: ignore[assignment]
    for _, fields in entries:
        payload: bytes | None = r.get(fields[b"p"])  # type: ignore[assignment]
        s = decode(payload or b"", expect=ScoredGroup)
        out[s.group_id] = s
    return out


def test_each_pool_scores_only_its_groups(tmp_path: Path, redis_url: str, keys: Keys) -> None:
    f = tmp_path / "groups.jsonl"
    f.write_text("\n".join([_line("d1", None), _line("d2", {"teacher": "default"}),
                            _line("m1", {"teacher": "math"}), _line("m2", {"teacher": "math", "teacher_top_k": 3})])
                 + "\n")
    common = ["--redis-url", redis_url, "--namespace", keys.namespace]
    assert main(["push", str(f), *common]) == 0
    r = redis.Redis.from_url(redis_url)
    assert r.xlen(keys.stream("rollouts")) == 2 and r.xlen(keys.stream(pool_stream("math"))) == 2
    assert {m.decode() for m in r.smembers(keys.pools)} == {"default", "math"}  # type: ignore[union-attr]

    teacher = ["worker", "teacher", "--backend", "synthetic", "--top-k", "5", "--burst", *common]
    assert main(teacher) == 0  # the pool default: its groups only; math's wait
    assert set(_scored(r, keys)) == {"d1", "d2"}
    assert r.xlen(keys.stream(pool_stream("math"))) == 2

    assert main([*teacher, "--pool", "math"]) == 0
    out = _scored(r, keys)
    assert set(out) == {"d1", "d2", "m1", "m2"}
    assert r.xlen(keys.stream(pool_stream("math"))) == 0
    assert [out[g].pool for g in ("d1", "d2", "m1", "m2")] == ["default", "default", "math", "math"]
    assert all(s.status is DistillStatus.OK for s in out.values())
    assert (out["m1"].k, out["m2"].k) == (5, 3)  # the pool's k, and the group's teacher_top_k composed with it
    assert out["m1"].teacher_id.startswith("synthetic")


def test_bad_pool_names_are_refused(tmp_path: Path, redis_url: str, keys: Keys,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    common = ["--redis-url", redis_url, "--namespace", keys.namespace]
    f = tmp_path / "groups.jsonl"
    f.write_text(_line("ok", None) + "\n" + _line("bad", {"teacher": "Math Pool"}) + "\n")
    capsys.readouterr()
    assert main(["push", str(f), *common]) != 0
    err = capsys.readouterr().err
    assert "line 2" in err and "group_overrides.teacher" in err and "'Math Pool'" in err
    r = redis.Redis.from_url(redis_url)
    assert r.xlen(keys.stream("rollouts")) == 0  # nothing pushed from a file with a bad line

    code = main(["worker", "teacher", "--backend", "synthetic", "--pool", "no/such", "--burst", *common])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "--pool" in err and "'no/such'" in err

    with pytest.raises(ValueError, match="teacher"):
        PromptJob(id="p", prompt="1+1=", teacher="UPPER")


def test_group_producer_and_prompts_route_by_pool(redis_url: str, keys: Keys) -> None:
    with GroupProducer(redis_url, namespace=keys.namespace) as p:
        p.push(synthetic_rollout(1, 8, vocab=100, group_id="a", group_overrides={"teacher": "code"}))
        p.push(synthetic_rollout(1, 8, vocab=100, group_id="b"))
        p.push_atropos(to_atropos(synthetic_rollout(1, 8, vocab=100, group_id="c",
                                                    group_overrides={"teacher": "code"})))
    r = redis.Redis.from_url(redis_url)
    assert r.xlen(keys.stream("rollouts.code")) == 2 and r.xlen(keys.stream("rollouts")) == 1
    # a prompt's pool: group_overrides.teacher, else its teacher, else the worker's --teacher
    job = PromptJob(id="p", prompt="x", teacher="math")
    assert job.overrides("code") == {"teacher": "math"}
    assert PromptJob(id="p", prompt="x").overrides("code") == {"teacher": "code"}
    assert PromptJob(id="p", prompt="x").overrides() is None
    assert PromptJob(id="p", prompt="x", teacher="math", group_overrides={"teacher": "chem", "teacher_top_k": 2}
                     ).overrides("code") == {"teacher": "chem", "teacher_top_k": 2}


def test_a_pool_dead_letter_replays_onto_its_pool(tmp_path: Path, redis_url: str, keys: Keys) -> None:
    f = tmp_path / "groups.jsonl"
    f.write_text(_line("big", {"teacher": "math", "teacher_top_k": 500}) + "\n")
    common = ["--redis-url", redis_url, "--namespace", keys.namespace]
    assert main(["push", str(f), *common]) == 0
    assert main(["worker", "teacher", "--backend", "synthetic", "--pool", "math", "--k-over-cap", "drop",
                 "--on-drop", "dlq", "--burst", *common]) == 0
    r = redis.Redis.from_url(redis_url)
    assert r.xlen(keys.dlq) == 1 and r.xlen(keys.stream("rollouts.math")) == 0
    assert main(["dlq", "replay", "--all", "--force", *common]) == 0
    assert r.xlen(keys.stream("rollouts.math")) == 1 and r.xlen(keys.stream("rollouts")) == 0


def test_the_teacher_record_reaches_tail_and_the_batches(tmp_path: Path, redis_url: str, keys: Keys,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "groups.jsonl"
    f.write_text("\n".join([_line("d1", None), _line("m1", {"teacher": "math"}), _line("m2", {"teacher": "math"})])
                 + "\n")
    common = ["--redis-url", redis_url, "--namespace", keys.namespace]
    assert main(["push", str(f), *common]) == 0
    capsys.readouterr()
    assert main(["tail", "rollouts.math", "--json", *common]) == 0
    waiting = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert sorted(w["group_id"] for w in waiting) == ["m1", "m2"]
    for pool, k in (("default", 4), ("math", 6)):
        assert main(["worker", "teacher", "--backend", "synthetic", "--pool", pool, "--top-k", str(k), "--burst",
                     *common]) == 0
    capsys.readouterr()
    assert main(["tail", "scored", "--json", *common]) == 0
    records = {s["group_id"]: s["teacher"] for s in map(json.loads, capsys.readouterr().out.splitlines())}
    assert {g: (t["pool"], t["k"]) for g, t in records.items()} == {"d1": ("default", 4), "m1": ("math", 6),
                                                                   "m2": ("math", 6)}
    assert main(["worker", "feeder", "--burst", *common]) == 0
    r = redis.Redis.from_url(redis_url)
    entries: list[tuple[bytes, dict[bytes, bytes]]] = r.xrange(keys.stream("batches"))  # type: ignore[assignment]
    stats: dict[str, float] = {}
    for _, fields in entries:
        for name, value in (decode(fields[b"d"]).stats or {}).items():  # type: ignore[union-attr]
            stats[name] = stats.get(name, 0.0) + value
    assert (stats["teacher.default.groups"], stats["teacher.math.groups"]) == (1, 2)
    assert stats["teacher.math.tokens"] == 2 * 16 and "teacher.math.reverse_kl" in stats
    with Learner(redis_url, namespace=keys.namespace) as learner:  # the learner's batch: each group's teacher
        seen = {}
        for lb in learner.batches(timeout_s=2.0):
            seen.update({g.group_id: (g.pool, g.k) for g in lb.batch.groups})
            learner.ack(lb)
    assert seen == {"d1": ("default", 4), "m1": ("math", 6), "m2": ("math", 6)}


async def test_stats_shows_each_pool_and_names_one_without_a_worker(
    r: aioredis.Redis, keys: Keys, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    producer = PoolProducer(r, keys)
    for i in range(3):
        await producer.send(synthetic_rollout(1, 6, group_id=f"m{i}", group_overrides={"teacher": "math"}))
    await producer.send(synthetic_rollout(1, 6, group_id="d0"))
    await beat(r, keys, "teacher", "t-default", pool="default")  # the pool default has a worker, math none
    snap = await stats(capsys, redis_url, keys)
    pools = {p["name"]: p for p in snap["pools"]}
    assert {n: (p["backlog"], p["lag"], p["workers"]) for n, p in pools.items()} == {
        "default": (1, 1, 1), "math": (3, 3, 0)}
    assert snap["streams"]["rollouts.math"]["length"] == 3
    assert ("teacher pool math: stream rollouts.math has 3 group(s) and no live teacher worker of the pool: start "
            "one (distillq worker teacher --pool math)") in snap["attention"]
    assert not any("stream rollouts has" in line for line in snap["attention"])
    await beat(r, keys, "teacher", "t-math", pool="math")
    snap = await stats(capsys, redis_url, keys)
    assert [p["workers"] for p in snap["pools"]] == [1, 1]
    assert not any("no live" in line for line in snap["attention"]), snap["attention"]
    capsys.readouterr()
    assert await asyncio.to_thread(main, ["stats", "--redis-url", redis_url, "--namespace", keys.namespace]) == 0
    out = capsys.readouterr().out
    assert "teacher pools: 2" in out and "teacher (math)" in out


def test_where_finds_a_group_waiting_for_its_pool(tmp_path: Path, redis_url: str, keys: Keys,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "groups.jsonl"
    f.write_text(_line("m1", {"teacher": "math"}) + "\n")
    common = ["--redis-url", redis_url, "--namespace", keys.namespace]
    assert main(["push", str(f), *common]) == 0
    capsys.readouterr()
    assert main(["where", "m1", *common]) == 0
    out = capsys.readouterr().out
    assert "rollouts.math" in out and "waiting for a teacher worker of pool math" in out


async def test_resharding_refuses_while_a_pool_stream_holds_groups(r: aioredis.Redis, keys: Keys) -> None:
    from pipeline.transport.sharding import ShardConfigError, set_shards

    await PoolProducer(r, keys).send(synthetic_rollout(1, 6, group_id="m0", group_overrides={"teacher": "math"}))
    with pytest.raises(ShardConfigError, match=r"rollouts\.math"):
        await set_shards(r, keys, 4)


def test_serve_atropos_routes_each_posted_group_to_its_pool(redis_url: str, keys: Keys) -> None:
    from pipeline.config import RedisSettings
    from pipeline.serve.atropos.app import create_app
    from pipeline.serve.atropos.startup import ServeConfig
    from tests.integration.test_serve_atropos import REGISTRATION, ThreadedServer, group, http
    from tests.streams import fast

    cfg = ServeConfig(redis=RedisSettings(redis_url=redis_url, namespace=keys.namespace), streams=fast())
    with ThreadedServer(create_app(cfg)) as server:
        assert http("POST", server.url + "/register", json=REGISTRATION).status_code == 200
        for body in (group(seed=1, group_overrides={"teacher": "math"}), group(seed=2)):
            assert http("POST", server.url + "/scored_data", json=body).json()["status"] == "received"
        bad = http("POST", server.url + "/scored_data", json=group(seed=3, group_overrides={"teacher": "No!"}))
        assert bad.status_code >= 400 and "group_overrides.teacher" in bad.text
    r = redis.Redis.from_url(redis_url)
    assert r.xlen(keys.stream("rollouts.math")) == 1 and r.xlen(keys.stream("rollouts")) == 1
