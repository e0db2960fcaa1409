"""``distillq stats`` ``attention:`` rules on built snapshots (pure), and heartbeat ages and clock skew."""

from __future__ import annotations

import json

import pytest

from pipeline.cli.attention import attention
from pipeline.cli.streamstats import (
    ConsumerStats,
    GroupStats,
    IncidentStats,
    RedisMemory,
    Snapshot,
    StreamStats,
    WorkerStats,
)
from pipeline.learner.health import RankBeat
from pipeline.stages.liveness import parse_beat, skew_note
from pipeline.transport.keys import Keys

NOW = 1_800_000_000.0


def stream(name: str, length: int, group: str | None = None, *consumers: ConsumerStats, pending: int = 0,
           **group_fields: object) -> StreamStats:
    s = StreamStats(name=name, key=f"{{distillq:{name}}}", exists=True, length=length)
    if group is not None:
        s.groups = [GroupStats(name=group, exists=True, pending=pending, consumers=len(consumers),
                               consumer_list=list(consumers), **group_fields)]  # type: ignore[arg-type]
    return s


def snap(*streams: StreamStats, workers: list[WorkerStats] | None = None, **fields: object) -> Snapshot:
    return Snapshot(namespace="distillq", time=NOW, streams={s.name: s for s in streams}, dead_letters=0,
                    workers=workers or [], max_backlog=1000, **fields)  # type: ignore[arg-type]


def worker(stage: str, consumer: str, **fields: object) -> WorkerStats:
    return WorkerStats(stage=stage, consumer=consumer, host="h", pid=1, age_s=0.5, **fields)  # type: ignore[arg-type]


def test_all_well_is_empty() -> None:
    s = snap(stream("rollouts", 0, "teacher"), stream("batches", 0, "learner"),
             workers=[worker("teacher", "t1")], memory=RedisMemory(used_bytes=10 << 20, max_bytes=1 << 30))
    assert attention(s) == []


@pytest.mark.parametrize(("name", "stage"), [("rollouts", "teacher"), ("scored", "feeder"), ("prompts", "rollout")])
def test_a_stage_stream_with_backlog_and_no_live_reader_is_named(name: str, stage: str) -> None:
    s = snap(stream(name, 7, stage), workers=[worker("other", "x")])
    assert f"stream {name} has 7 entries and no live {stage} worker: start one (distillq worker {stage})" \
        in attention(s)
    alive = snap(stream(name, 7, stage), workers=[worker(stage, "w1")])
    assert not any("no live" in line for line in attention(alive))


def test_a_reader_of_another_stage_name_that_is_a_consumer_of_the_group_counts_as_live() -> None:
    s = snap(stream("scored", 3, "feeder", ConsumerStats("atropos-server", 0, 0.1)),
             workers=[worker("atropos", "atropos-server")])
    assert not any("no live" in line for line in attention(s))


def test_batches_without_a_reading_learner() -> None:
    idle = snap(stream("batches", 4, "learner", ConsumerStats("learner-0", 0, 200.0)), claim_idle_s=60.0)
    (line,) = [x for x in attention(idle) if "no live" in x]
    assert line.startswith("stream batches has 4 entries and no live learner worker (its group's consumers last "
                           "read or renewed a lease 3.3 min ago")
    none = snap(stream("batches", 4, "learner"))
    assert "stream batches has 4 entries and no live learner worker (no consumer in its group)" in attention(none)
    reading = snap(stream("batches", 4, "learner", ConsumerStats("learner-0", 0, 0.8)), claim_idle_s=60.0)
    assert not any("no live" in x for x in attention(reading))


def test_retrying_and_failed_rollout_jobs() -> None:
    s = snap(stream("prompts", 5, "rollout", ConsumerStats("r1", 3, 1.0), pending=3, redelivered=2, max_deliveries=4),
             workers=[worker("rollout", "r1")], dead_letters_by_stage={"rollout": 6, "teacher": 1})
    s.dead_letters = 7
    lines = attention(s)
    assert ("rollout jobs retrying: prompts: 2 entries delivered more than once (up to 4 times): rollout work on "
            "them failed or its worker died holding them; after DISTILLQ_MAX_DELIVERIES they are dead-lettered"
            ) in lines
    assert ("rollout jobs failed: 6 prompt(s) dead-lettered by stage rollout, with the reason: distillq dlq list"
            in lines)
    assert "7 dead letter(s) (newest by stage: rollout 6, teacher 1): distillq dlq list" in lines


def test_batches_held_under_a_learner_name_no_live_process_has() -> None:
    def batches(age: float, idle: float) -> StreamStats:
        return stream("batches", 2, "learner", ConsumerStats("learner-0", 2, 1.0), pending=2,
                      oldest_pending_age_s=age, oldest_pending_idle_s=idle, oldest_pending_consumer="learner-0")
    held = [x for x in attention(snap(batches(20.0, 5.0), claim_idle_s=60.0)) if "holds" in x]
    assert held == ["learner learner-0 holds 2 batch(es) unacknowledged and no learner process of that name is alive "
                    "(no heartbeat): it stopped or failed (its log says why); a learner started as learner-0 is "
                    "handed them at once, one under another name once they are idle 60.0 s; the oldest was "
                    "written 20.0 s ago"]
    gone = [x for x in attention(snap(batches(420.0, 400.0), claim_idle_s=60.0)) if "holds" in x]
    assert gone[0].endswith("the oldest was written 7.0 min ago and its lease last renewed 6.7 min ago")
    alive = RankBeat("learner-0", 0, 1, "h", 1, 3, 2, 20.0, 1.0, None, 0, 0.5)
    assert not any("holds" in x for x in attention(snap(batches(20.0, 5.0), learners=[alive])))


def test_feeders_with_different_settings_are_named_by_setting() -> None:
    base = {"max_batch_tokens": 65536, "max_staleness": 4, "kl": "constant 0.0"}
    s = snap(workers=[worker("feeder", "f1", settings=base),
                      worker("feeder", "f2", settings={**base, "max_batch_tokens": 8192}),
                      worker("feeder", "f3", settings={**base, "max_staleness": 0})])
    lines = [x for x in attention(s) if x.startswith("feeders disagree")]
    assert lines == [
        "feeders disagree on max_batch_tokens: f1 65536, f2 8192, f3 65536 (one namespace batches by one setting: "
        "restart them with the same flags)",
        "feeders disagree on max_staleness: f1 4, f2 4, f3 0 (one namespace batches by one setting: restart them "
        "with the same flags)",
    ]
    same = snap(workers=[worker("feeder", "f1", settings=base), worker("feeder", "f2", settings=dict(base))])
    assert not any("disagree" in x for x in attention(same))


def test_clock_skew_over_five_seconds_is_named() -> None:
    s = snap(workers=[worker("teacher", "teacher-h-1", clock_skew_s=42.2), worker("feeder", "f1", clock_skew_s=-3.0),
                      worker("feeder", "f2", clock_skew_s=-9.0)])
    lines = [x for x in attention(s) if "clock" in x]
    assert len(lines) == 2
    assert lines[0].startswith("worker f2 (host h) clock is 9 s behind Redis")
    assert lines[1].startswith("worker teacher-h-1 (host h) clock is 42 s ahead of Redis (over 5 s")


def test_teacher_reports_clamped_k_slow_and_invalid_values() -> None:
    s = snap(workers=[worker("teacher", "t1", clamped_k=3, slow="backend calls take 31 s (timeout 10 s)",
                             drops={"invalid_logprobs": 2})])
    lines = attention(s)
    assert "teacher t1 clamped k for 3 groups (k asked above the cap)" in lines
    assert "teacher t1: backend calls take 31 s (timeout 10 s) (slow but alive, not unreachable)" in lines
    assert ("teacher t1 got invalid teacher values for 2 group(s) (NaN, infinity, above 0 or at the floor): their "
            "payloads were dropped (invalid_logprobs); check the teacher server") in lines
    assert not any("backend failing" in x for x in lines)  # slow is not a problem line


def test_incidents_newest_first_and_bounded() -> None:
    incidents = [IncidentStats(kind="stream_reset", text=f"stream rollouts was reset: {i} entries pending before "
                               "are gone", ts=NOW - i, writer=f"t{i}", age_s=float(i)) for i in range(7)]
    lines = attention(snap(incidents=incidents))
    assert lines[0] == "incident 0.0 s ago (stream_reset, t0): stream rollouts was reset: 0 entries pending before " \
                       "are gone"
    assert [x for x in lines if x.startswith("incident")][-1].startswith("incident 4.0 s ago")
    assert "2 older incident(s) of the last 24 h: distillq stats --json" in lines


def test_redis_memory_near_full_full_and_evicting() -> None:
    gib = 1 << 30
    near = attention(snap(memory=RedisMemory(used_bytes=int(0.95 * gib), max_bytes=gib)))
    assert near == ["Redis is nearly full (used 972.8 MiB of maxmemory 1.0 GiB, 95%): at maxmemory writes wait"]
    full = attention(snap(memory=RedisMemory(used_bytes=gib + 5, max_bytes=gib)))
    assert full == ["Redis is full: writes wait (used 1.0 GiB of maxmemory 1.0 GiB); drain the streams or raise "
                    "maxmemory"]
    at_98 = attention(snap(memory=RedisMemory(used_bytes=int(0.98 * gib), max_bytes=gib, oom_errors=3)))
    assert at_98 == ["Redis is full: writes wait (used 1003.5 MiB of maxmemory 1.0 GiB, 3 write(s) refused for memory "
                     "since Redis started); drain the streams or raise maxmemory"]  # one snapshot: refusals count
    calm = attention(snap(memory=RedisMemory(used_bytes=int(0.98 * gib), max_bytes=gib, oom_errors=3,
                                             oom_errors_new=0)))
    assert calm[0].startswith("Redis is nearly full")  # none since the last refresh
    refused = attention(snap(memory=RedisMemory(used_bytes=gib // 2, max_bytes=gib, oom_errors=9, oom_errors_new=4)))
    assert refused[0].startswith("Redis is full: writes wait (used 512.0 MiB of maxmemory 1.0 GiB, 4 write(s) refused")
    lru = attention(snap(memory=RedisMemory(used_bytes=1, max_bytes=gib, policy="allkeys-lru")))
    assert lru == ["Redis maxmemory-policy is allkeys-lru: it may evict stream entries and payloads; set "
                   "maxmemory-policy noeviction"]
    assert attention(snap(memory=RedisMemory(used_bytes=gib, max_bytes=0))) == []


# --- heartbeat ages on the Redis clock --------------------------------------------------------------------


def beat_value(ts: float, ttl_ms: int | None = 15000) -> bytes:
    info: dict[str, object] = {"pid": 1, "host": "h1", "ts": ts}
    if ttl_ms is not None:
        info["ttl_ms"] = ttl_ms
    return json.dumps(info).encode()


def test_heartbeat_age_comes_from_its_ttl_and_skew_from_its_ts() -> None:
    keys = Keys()
    # written 2 s ago by Redis's clock (15 s TTL, 13 s left) by a host whose clock is 42 s ahead
    b = parse_beat(keys, "distillq:health:teacher:t1", beat_value(NOW - 2 + 42), 13000, NOW)
    assert b is not None and (b.stage, b.consumer, b.age_s) == ("teacher", "t1", 2.0)
    assert b.skew_s == pytest.approx(42.0)
    assert skew_note(b.consumer, b.skew_s, "h1") == "worker t1 (host h1) clock is 42 s ahead of Redis"
    behind = parse_beat(keys, "distillq:health:teacher:t1", beat_value(NOW - 2 - 42), 13000, NOW)
    assert behind is not None and behind.age_s == 2.0 and skew_note("t1", behind.skew_s) == \
        "worker t1 clock is 42 s behind Redis"
    assert skew_note("t1", 4.9) is None


def test_a_heartbeat_without_ttl_ms_is_aged_by_its_ts() -> None:
    b = parse_beat(Keys(), "distillq:health:feeder:f1", beat_value(NOW - 3, ttl_ms=None), 12000, NOW)
    assert b is not None and b.age_s == 3.0 and b.skew_s is None
    assert parse_beat(Keys(), "distillq:health:feeder:f1", b"not json", 100, NOW) is None
    assert parse_beat(Keys(), "other:health:feeder:f1", beat_value(NOW), 100, NOW) is None
