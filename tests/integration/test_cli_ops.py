"""Operator commands (stats, tail, dlq, push) against a real redis-server, through ``distillq`` main()."""

from __future__ import annotations

import asyncio
import io
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis.asyncio as aioredis
import structlog

from pipeline.cli.main import main
from pipeline.cli.streamstats import collect, with_rates
from pipeline.demo.tinymodels import ensure_tiny_models
from pipeline.transport.consumer import StreamConsumer
from pipeline.transport.keys import Keys
from pipeline.transport.producer import StreamProducer
from schemas import DecodeError, DistillStatus, RolloutGroup, ScoredGroup, decode
from schemas.atropos import content_group_id, to_atropos
from schemas.build import make_sequence, make_teacher, synthetic_rollout, synthetic_scored

pytestmark = pytest.mark.redis


@pytest.fixture(autouse=True)
def _reset_logging(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """main() configures structlog with the captured stderr; do not leak that into other tests."""
    monkeypatch.setenv("COLUMNS", "200")  # rich tables: no wrapping in captured output
    yield
    structlog.reset_defaults()


async def cli(capsys: pytest.CaptureFixture[str], url: str, keys: Keys, *argv: str) -> tuple[int, str, str]:
    """Run ``distillq ARGV --redis-url URL --namespace NS`` in a thread (it runs its own event loop)."""
    capsys.readouterr()
    code = await asyncio.to_thread(main, [*argv, "--redis-url", url, "--namespace", keys.namespace])
    out, err = capsys.readouterr()
    return code, out, err


JUNK = b"\x00junk"


def junk_error() -> DecodeError:
    with pytest.raises(DecodeError) as e:
        decode(JUNK)
    return e.value


def json_lines(out: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.splitlines() if line.strip()]


async def dead_letter_rollout(
    r: aioredis.Redis, keys: Keys, gid: str, reason: str, payload: bytes | None = None
) -> str:
    """Put a rollout on ``rollouts`` (raw bytes if given), read it as the teacher group, dead-letter it."""
    if payload is None:
        await StreamProducer(r, keys, "rollouts").send(synthetic_rollout(2, 12, group_id=gid))
    else:
        await r.xadd(keys.stream("rollouts"), {b"t": b"rollout", b"gid": gid.encode(), b"d": payload})
    c = StreamConsumer(r, keys, "rollouts", "ops-test")
    await c.ensure_group()
    (d,) = await c.read(1, block_ms=100)
    assert d.group_id == gid
    await c.dead_letter(d, reason)
    rows = await r.xrevrange(keys.dlq, count=1)
    return str(rows[0][0].decode())


# --- stats -------------------------------------------------------------------------------------------


async def test_stats_json_reports_lengths_groups_pending_and_workers(
    r: aioredis.Redis, keys: Keys, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    prod = StreamProducer(r, keys, "rollouts")
    for i in range(5):
        await prod.send(synthetic_rollout(1, 8, group_id=f"g{i}", seed=i))
    c = StreamConsumer(r, keys, "rollouts", "c1")
    await c.ensure_group()
    got = await c.read(3, block_ms=100)
    await c.dead_letter(got[0], "test_reason: rejected")  # acked and deleted from rollouts
    scored = StreamProducer(r, keys, "scored")
    for i in range(2):
        await scored.send(synthetic_scored(synthetic_rollout(1, 8, group_id=f"s{i}"), k=4))
    beat = {"pid": 4242, "host": "box", "handled": 7, "ts": time.time(), "started": time.time() - 10}
    await r.set(keys.heartbeat("teacher", "w1"), json.dumps(beat), px=30_000)

    code, out, _ = await cli(capsys, redis_url, keys, "stats", "--json")
    assert code == 0
    s = json.loads(out)
    ro = s["streams"]["rollouts"]
    assert ro["exists"] and ro["length"] == 4 and ro["entries_added"] == 5
    assert ro["memory_bytes"] > 0
    assert ro["added_in_window"] == 4  # ids of the last minute still in the stream
    (g,) = ro["groups"]
    assert (g["name"], g["pending"], g["lag"], g["consumers"], g["entries_read"]) == ("teacher", 2, 2, 1, 3)
    assert g["oldest_pending_id"] == got[1].entry_id
    assert 0 <= g["oldest_pending_age_s"] < 60
    assert [(x["name"], x["pending"]) for x in g["consumer_list"]] == [("c1", 2)]
    sc = s["streams"]["scored"]
    assert sc["length"] == 2
    assert [x["name"] for x in sc["groups"]] == ["feeder"]
    assert not sc["groups"][0]["exists"] and sc["groups"][0]["lag"] == 2  # no reader yet: all of it waits
    ba = s["streams"]["batches"]
    assert not ba["exists"] and ba["length"] == 0 and ba["groups"][0]["lag"] == 0
    assert s["streams"]["dlq"]["length"] == 1 and s["dead_letters"] == 1
    (w,) = s["workers"]
    assert (w["stage"], w["consumer"], w["pid"], w["host"], w["handled"]) == ("teacher", "w1", 4242, "box", 7)
    assert 0 <= w["age_s"] < 30


async def test_stats_fresh_namespace_shows_zeros(
    keys: Keys, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = await cli(capsys, redis_url, keys, "stats", "--json", "rollouts", "dlq")
    assert code == 0
    s = json.loads(out)
    assert list(s["streams"]) == ["rollouts", "dlq"]
    assert s["streams"]["rollouts"]["length"] == 0 and s["streams"]["rollouts"]["groups"][0]["pending"] == 0
    assert s["streams"]["dlq"]["groups"] == [] and s["dead_letters"] == 0 and s["workers"] == []


async def test_rates_come_from_counter_deltas(r: aioredis.Redis, keys: Keys) -> None:
    c = StreamConsumer(r, keys, "rollouts", "c1")
    await c.ensure_group()
    first = await collect(r, keys, ["rollouts"])
    prod = StreamProducer(r, keys, "rollouts")
    for i in range(3):
        await prod.send(synthetic_rollout(1, 8, group_id=f"g{i}"))
    await c.ack(await c.read(2, block_ms=100))  # acked entries are deleted: the window count cannot see them
    await asyncio.sleep(0.05)
    second = with_rates(first, await collect(r, keys, ["rollouts"]))
    dt = second.time - first.time
    s = second.streams["rollouts"]
    assert s.added_in_window == 1
    assert s.added_per_s == pytest.approx(3 / dt)
    assert s.groups[0].read_per_s == pytest.approx(2 / dt)


async def test_stats_watch_and_table(r: aioredis.Redis, keys: Keys, redis_url: str,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    await dead_letter_rollout(r, keys, "dead", "test_reason: x")
    code, out, _ = await cli(capsys, redis_url, keys, "stats", "rollouts", "--watch", "0.05", "--refreshes", "3",
                             "--json")
    assert code == 0
    snaps = json_lines(out)
    assert len(snaps) == 3
    assert snaps[0]["streams"]["rollouts"]["added_per_s"] is None  # no earlier snapshot
    assert snaps[2]["streams"]["rollouts"]["added_per_s"] == 0.0
    assert all(x["dead_letters"] == 1 for x in snaps)
    code, out, _ = await cli(capsys, redis_url, keys, "stats")
    assert code == 0
    assert "rollouts" in out and "teacher" in out and "ops-test" in out and "dead letters: 1" in out
    code, out, _ = await cli(capsys, redis_url, keys, "stats", "--watch", "0.05", "--refreshes", "2")
    assert code == 0 and "dead letters: 1" in out


# --- tail --------------------------------------------------------------------------------------------


async def test_tail_summary_json_atropos_and_filters(
    r: aioredis.Redis, keys: Keys, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    prod = StreamProducer(r, keys, "rollouts")
    for i in range(3):
        await prod.send(synthetic_rollout(2, 10, group_id=f"r{i}", seed=i))
    sp = StreamProducer(r, keys, "scored")
    ok = synthetic_scored(synthetic_rollout(2, 10, group_id="ok1", seed=5), k=3)
    await sp.send(ok)
    dropped = synthetic_rollout(1, 6, group_id="drop1")
    await sp.send(ScoredGroup(group=dropped, status=DistillStatus.DROPPED, reason="misaligned: test"))

    code, out, _ = await cli(capsys, redis_url, keys, "tail", "rollouts", "-n", "2")
    assert code == 0
    lines = out.splitlines()
    newest = [eid.decode() for eid, _ in await r.xrange(keys.stream("rollouts"))][1:]
    assert [ln.split()[:3] for ln in lines] == [[newest[0], "rollout", "group=r1"], [newest[1], "rollout", "group=r2"]]

    code, out, _ = await cli(capsys, redis_url, keys, "tail", "scored", "--json", "--status", "dropped")
    (only,) = json_lines(out)
    assert (only["group_id"], only["status"], only["reason"]) == ("drop1", "dropped", "misaligned: test")

    code, out, _ = await cli(capsys, redis_url, keys, "tail", "scored", "--format", "atropos", "--group-id", "ok1")
    (obj,) = json_lines(out)
    assert obj["group_id"] == "ok1"
    assert obj["tokens"] == [s.tokens.numpy().tolist() for s in ok.group.sequences]
    assert len(obj["distill_token_ids"][0]) == 10  # entry p for token p (entry 0 empty)

    code, out, _ = await cli(capsys, redis_url, keys, "tail", "rollouts", "--group-id", "nope")
    assert code == 0 and out == ""


def _decode_fixture() -> tuple[Any, ScoredGroup]:
    """A real-text sequence and a teacher whose top-1 at row r is tokens[r + 1] (except row 6: second)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(ensure_tiny_models().tokenizer))
    prompt = tok.encode("<|user|>3+4=<|assistant|>")
    completion = tok.encode("7</s>")
    ids = np.array(prompt + completion, np.int32)
    mask = np.r_[np.zeros(len(prompt)), np.ones(len(completion))]
    seq = make_sequence(ids, mask, logprobs=np.linspace(-1.0, -0.1, len(ids)))
    rows, k = len(ids) - 1, 3
    others = [i for i in range(10, 40) if i not in set(ids.tolist())]
    top_ids = np.array([[ids[r + 1], others[r], others[r + 1]] for r in range(rows)], np.int32)
    top_lps = np.tile(np.array([-0.2, -1.5, -2.5], np.float32), (rows, 1))
    last = rows - 1
    top_ids[last, :2] = top_ids[last, [1, 0]]  # the sampled token is second in the last row
    sampled = np.full(rows, -0.2, np.float32)
    sampled[last] = -1.5
    teacher = make_teacher(top_ids, top_lps, sampled)
    group = RolloutGroup(group_id="dec", sequences=[seq])
    return tok, ScoredGroup(group=group, status=DistillStatus.OK, teacher=[teacher], k=k)


async def test_tail_decode_shows_text_and_teacher_rows(
    r: aioredis.Redis, keys: Keys, redis_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    tok, scored = _decode_fixture()
    await StreamProducer(r, keys, "scored").send(scored)
    tok_path = str(ensure_tiny_models().tokenizer)
    monkeypatch.setenv("DISTILLQ_TOKENIZER", tok_path)
    code, out, _ = await cli(capsys, redis_url, keys, "tail", "scored", "--decode", "--json", "--top", "2")
    assert code == 0
    (obj,) = json_lines(out)
    d = obj["decoded"]
    assert d["prompt"] == "<|user|>3+4=<|assistant|>"
    assert d["completion"] == "⟦7</s>⟧"
    seq = scored.group.sequences[0]
    ids = seq.tokens.numpy().tolist()
    p0 = seq.prompt_len
    assert [row["pos"] for row in d["positions"]] == [p0, p0 + 1]  # trainable positions only
    first, second = d["positions"]
    assert (first["token"], second["token"]) == ("7", "</s>")
    assert first["topk"][0] == {"id": ids[p0], "token": "7", "logprob": -0.2}  # row p-1 is about token p
    assert second["teacher_logprob"] == -1.5 and second["topk"][1]["token"] == "</s>"
    assert len(first["topk"]) == 2
    assert first["student_logprob"] == pytest.approx(float(seq.logprobs.numpy()[p0]), abs=1e-4)  # type: ignore[union-attr]

    code, out, _ = await cli(capsys, redis_url, keys, "tail", "scored", "--decode", "--tokenizer", tok_path,
                             "--all-positions")
    assert code == 0
    assert '"<|user|>3+4=<|assistant|>"' in out and "⟦7</s>⟧" in out
    table = [ln.split() for ln in out.splitlines() if ln.strip().split(" ")[0].isdigit()]
    assert [int(row[0]) for row in table] == list(range(1, len(ids)))  # every position, masked ones too
    assert [row[2] for row in table if row[2] == "*"] == ["*", "*"]

    code, out, _ = await cli(capsys, redis_url, keys, "tail", "scored", "--decode", "--seq", "3")
    assert code == 0 and "no sequence 3 (message has 1)" in out
    assert tok.decode(ids) == "<|user|>3+4=<|assistant|>7</s>"


async def test_tail_decode_needs_a_local_tokenizer(
    keys: Keys, redis_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DISTILLQ_TOKENIZER", raising=False)
    code, _, err = await cli(capsys, redis_url, keys, "tail", "scored", "--decode")
    assert code == 2 and "--tokenizer" in err
    code, _, err = await cli(capsys, redis_url, keys, "tail", "scored", "--decode", "--tokenizer", "org/some-model")
    assert code == 2 and "local paths only" in err


# --- dlq ---------------------------------------------------------------------------------------------


async def test_dlq_list_and_show(r: aioredis.Redis, keys: Keys, redis_url: str,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    good = await dead_letter_rollout(r, keys, "good", "test_reason: teacher refused")
    bad = await dead_letter_rollout(r, keys, "bad", "decode_error: junk", payload=JUNK)

    code, out, _ = await cli(capsys, redis_url, keys, "dlq", "list", "--json")
    assert code == 0
    rows = json_lines(out)
    assert [(x["entry_id"], x["group_id"], x["source"]) for x in rows] == [
        (good, "good", "rollouts"), (bad, "bad", "rollouts")
    ]
    code, out, _ = await cli(capsys, redis_url, keys, "dlq", "list", "-n", "1")
    assert out.count("\n") == 1 and "group=bad" in out

    code, out, _ = await cli(capsys, redis_url, keys, "dlq", "show", good, "--json")
    info = json.loads(out)
    assert info["fields"]["stage"] == "teacher" and info["fields"]["reason"] == "test_reason: teacher refused"
    assert info["fields"]["orig_gid"] == "good" and info["fields"]["orig_d"].endswith("bytes>")
    assert info["payload"]["valid"] and info["payload"]["type"] == "rollout"
    assert info["payload"]["group_id"] == "good" and info["payload"]["sequences"] == 2

    code, out, _ = await cli(capsys, redis_url, keys, "dlq", "show", bad)
    e = junk_error()
    assert code == 0 and f"payload: INVALID at {e.field}: {e.reason}" in out and "source_id" in out

    code, _, err = await cli(capsys, redis_url, keys, "dlq", "show", "1-0")
    assert code == 1 and "no dead letter 1-0" in err


async def test_dlq_replay_valid_returns_invalid_stays(
    r: aioredis.Redis, keys: Keys, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    good = await dead_letter_rollout(r, keys, "good", "test_reason: transient")
    bad = await dead_letter_rollout(r, keys, "bad", "decode_error: junk", payload=JUNK)
    assert await r.exists(keys.seen("rollouts", "good"))  # a plain send would be skipped as a duplicate
    assert await r.xlen(keys.stream("rollouts")) == 0

    code, out, _ = await cli(capsys, redis_url, keys, "dlq", "replay", good, bad)
    assert code == 1
    assert f"replayed {good} -> rollouts" in out
    assert f"kept     {bad} still invalid: {junk_error()}" in out
    assert "replayed 1 of 2; 1 kept in the DLQ" in out
    assert [eid.decode() for eid, _ in await r.xrange(keys.dlq)] == [bad]
    c = StreamConsumer(r, keys, "rollouts", "after")
    (d,) = await c.read(1, block_ms=100)  # the group reads the replayed entry as new work
    assert d.group_id == "good" and decode(d.payload, expect=RolloutGroup).group_id == "good"

    code, out, _ = await cli(capsys, redis_url, keys, "dlq", "replay", "--all")
    assert code == 1 and "replayed 0 of 1" in out
    assert await r.xlen(keys.dlq) == 1

    code, _, err = await cli(capsys, redis_url, keys, "dlq", "replay")
    assert code == 2 and "--all" in err


async def test_dlq_replay_checks_the_target_type(
    r: aioredis.Redis, keys: Keys, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    eid = await dead_letter_rollout(r, keys, "g", "test_reason: x")
    code, out, _ = await cli(capsys, redis_url, keys, "dlq", "replay", eid, "--to", "scored")
    assert code == 1 and "expected a ScoredGroup, got a RolloutGroup" in out
    assert await r.xlen(keys.stream("scored")) == 0 and await r.xlen(keys.dlq) == 1


async def _old_and_new_dead_letters(r: aioredis.Redis, keys: Keys) -> list[str]:
    sec, _ = await r.time()
    ids = []
    for age_s in (7200, 3600):
        fields = {b"stage": b"teacher", b"reason": b"test_reason: old", b"source": b"rollouts"}
        ids.append((await r.xadd(keys.dlq, fields, id=f"{(int(sec) - age_s) * 1000}-0")).decode())
    ids.append(await dead_letter_rollout(r, keys, "new", "test_reason: new"))
    return ids


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


async def test_dlq_purge_confirms_and_respects_age(
    r: aioredis.Redis, keys: Keys, redis_url: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = await _old_and_new_dead_letters(r, keys)
    monkeypatch.setattr("sys.stdin", io.StringIO("y\n"))  # not a terminal
    code, _, err = await cli(capsys, redis_url, keys, "dlq", "purge", "--older-than", "600")
    assert code == 2 and "pass --yes" in err and await r.xlen(keys.dlq) == 3

    monkeypatch.setattr("sys.stdin", FakeTTY("n\n"))
    code, out, _ = await cli(capsys, redis_url, keys, "dlq", "purge", "--older-than", "600")
    assert code == 1 and "Delete 2 dead letter(s)" in out and await r.xlen(keys.dlq) == 3

    monkeypatch.setattr("sys.stdin", FakeTTY("y\n"))
    code, out, _ = await cli(capsys, redis_url, keys, "dlq", "purge", "--older-than", "600")
    assert code == 0 and "deleted 2 dead letter(s) older than 600 s" in out
    assert [eid.decode() for eid, _ in await r.xrange(keys.dlq)] == ids[2:]

    code, out, _ = await cli(capsys, redis_url, keys, "dlq", "purge", "--older-than", "600", "--yes")
    assert code == 0 and "no dead letter(s) older than 600 s to delete" in out
    code, out, _ = await cli(capsys, redis_url, keys, "dlq", "purge", "--yes")
    assert code == 0 and "deleted 1 dead letter(s)" in out and await r.xlen(keys.dlq) == 0


# --- push --------------------------------------------------------------------------------------------


async def test_push_to_a_new_namespace_beside_a_foreign_key_of_a_stream_name(
    r: aioredis.Redis, keys: Keys, redis_url: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Another namespace's key named like a stream but of another type (WRONGTYPE for XLEN) never fails a push."""
    other = Keys(f"{keys.namespace}x")
    await r.set(other.stream("rollouts"), "not a stream")
    try:
        path = tmp_path / "groups.jsonl"
        path.write_text(json.dumps(to_atropos(synthetic_rollout(2, 9, prompt_len=3, group_id="g0", seed=0))) + "\n")
        code, out, err = await cli(capsys, redis_url, keys, "push", str(path))
        assert code == 0 and out == f"pushed 1 group(s) onto rollouts in namespace '{keys.namespace}'\n"
        assert "namespaces here: " in err and other.namespace in err
    finally:
        await r.delete(other.stream("rollouts"))


async def test_push_good_file_lands_on_the_stream(
    r: aioredis.Redis, keys: Keys, redis_url: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    groups = [synthetic_rollout(2, 9, prompt_len=3, group_id=f"p{i}", seed=i) for i in range(3)]
    path = tmp_path / "groups.jsonl"
    path.write_text("\n".join(json.dumps(to_atropos(g)) for g in groups) + "\n\n")
    code, out, err = await cli(capsys, redis_url, keys, "push", str(path))
    assert code == 0 and out == f"pushed 3 group(s) onto rollouts in namespace '{keys.namespace}'\n"  # stdout
    assert err.startswith(f"note: namespace '{keys.namespace}' has no keys in this Redis")  # the first push
    rows = await r.xrange(keys.stream("rollouts"))
    back = [decode(f[b"d"], expect=RolloutGroup) for _, f in rows]
    assert [g.group_id for g in back] == ["p0", "p1", "p2"]
    assert back[1].sequences[1].tokens.numpy().tolist() == groups[1].sequences[1].tokens.numpy().tolist()
    code, out, _ = await cli(capsys, redis_url, keys, "push", str(path))
    assert code == 0 and "3 already present, skipped" in out and await r.xlen(keys.stream("rollouts")) == 3


async def test_push_bad_line_pushes_nothing(
    r: aioredis.Redis, keys: Keys, redis_url: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    good = json.dumps(to_atropos(synthetic_rollout(1, 6, prompt_len=2, group_id="ok")))
    short = to_atropos(synthetic_rollout(1, 6, prompt_len=2, group_id="short"))
    short["masks"][0] = short["masks"][0][:-1]  # masks shorter than tokens
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join([good, "{not json", good.replace('"ok"', '"ok2"'), json.dumps(short)]) + "\n")
    code, _, err = await cli(capsys, redis_url, keys, "push", str(path))
    assert code == 1
    assert "line 2: invalid JSON" in err and "line 4: masks[0]" in err and "line 1" not in err
    assert "nothing pushed: 2 bad line(s)" in err
    assert await r.xlen(keys.stream("rollouts")) == 0


def _without_group_id(group: RolloutGroup) -> dict[str, Any]:
    obj = to_atropos(group)
    del obj["group_id"]
    return obj


async def test_push_lines_without_group_id_get_a_content_id_and_repush_is_deduplicated(
    r: aioredis.Redis, keys: Keys, redis_url: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    a, b = (_without_group_id(synthetic_rollout(2, 8, prompt_len=3, seed=s)) for s in (1, 2))
    path = tmp_path / "nogid.jsonl"
    path.write_text(f"{json.dumps(a)}\n{json.dumps(b)}\n")
    code, out, _ = await cli(capsys, redis_url, keys, "push", str(path))
    assert code == 0 and out == f"pushed 2 group(s) onto rollouts in namespace '{keys.namespace}'\n"
    ids = [decode(f[b"d"], expect=RolloutGroup).group_id for _, f in await r.xrange(keys.stream("rollouts"))]
    assert len(set(ids)) == 2 and all(i.startswith("sha256-") and len(i) == len("sha256-") + 32 for i in ids)
    assert ids == [content_group_id(a), content_group_id(b)]  # the function the server and the SDK use too

    # The same content again, keys in another order and spaced differently: the same ids, nothing added.
    reordered = tmp_path / "again.jsonl"
    reordered.write_text("\n".join(json.dumps(dict(reversed(list(o.items()))), indent=None, separators=(", ", ": "))
                                   for o in (b, a)) + "\n")
    code, out, _ = await cli(capsys, redis_url, keys, "push", str(reordered))
    assert code == 0
    assert out == f"pushed 0 group(s) onto rollouts in namespace '{keys.namespace}' (2 already present, skipped)\n"
    assert await r.xlen(keys.stream("rollouts")) == 2

    changed = dict(a, scores=[s + 1.0 for s in a["scores"]])  # other content: another id
    path.write_text(json.dumps(changed) + "\n")
    code, out, _ = await cli(capsys, redis_url, keys, "push", str(path))
    assert code == 0 and out == f"pushed 1 group(s) onto rollouts in namespace '{keys.namespace}'\n"
    assert await r.xlen(keys.stream("rollouts")) == 3


async def test_push_empty_file_says_so_and_fails(
    r: aioredis.Redis, keys: Keys, redis_url: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "empty.jsonl"
    for text in ("", "\n  \n"):
        path.write_text(text)
        code, out, err = await cli(capsys, redis_url, keys, "push", str(path))
        assert (code, out, err) == (1, "", f"distillq: no groups in {path}; nothing pushed\n")
    assert not await r.exists(keys.stream("rollouts"))


@pytest.mark.parametrize("stream", ["batches", "dlq"])
async def test_push_onto_a_stream_that_takes_no_groups_is_a_usage_error(
    keys: Keys, redis_url: str, capsys: pytest.CaptureFixture[str], tmp_path: Path, stream: str
) -> None:
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps(to_atropos(synthetic_rollout(1, 6, prompt_len=2, group_id="g"))) + "\n")
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["push", str(path), "--stream", stream, "--redis-url", redis_url, "--namespace", keys.namespace])
    err = " ".join(capsys.readouterr().err.split())
    assert e.value.code == 2
    assert f"argument --stream: cannot push onto '{stream}': it is written by the" in err
    assert "push groups onto rollouts or scored" in err and "bad line" not in err


async def test_tail_of_an_empty_stream_says_so_on_stderr(
    r: aioredis.Redis, keys: Keys, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = await cli(capsys, redis_url, keys, "tail", "scored")
    assert (code, out, err) == (0, "", "(stream scored is empty)\n")
    code, out, err = await cli(capsys, redis_url, keys, "tail", "dlq", "--json")
    assert (code, out, err) == (0, "", "(stream dlq is empty)\n")
    await StreamProducer(r, keys, "rollouts").send(synthetic_rollout(1, 6, group_id="only"))
    code, out, err = await cli(capsys, redis_url, keys, "tail", "rollouts", "--group-id", "other")
    assert (code, out) == (0, "") and err == "(none of the newest 1 entries of stream rollouts match)\n"
    code, out, err = await cli(capsys, redis_url, keys, "tail", "rollouts")
    assert code == 0 and "group=only" in out and err == ""
