"""Bad input: 10,000 malformed messages XADDed raw onto ``rollouts`` and ``scored``, interleaved with 500
good ones, through a synthetic teacher process, a feeder process and the learner client. A ``scored`` entry is
claim-checked (``pipeline.transport.claimcheck``): a valid header, its payload in its own key, decoded first by
the learner client. Every bad one ends in the DLQ with the decoder's reason, from the stage that decodes it, no
worker dies, every good one reaches the learner once; oversized messages are rejected for their size before
any decoding. The inspection tools (tail, dlq list, dlq replay) read the same malformed entries without
failing."""

from __future__ import annotations

import asyncio
import functools
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest

from pipeline.cli.main import main as cli
from pipeline.transport.claimcheck import decode_header, encode_header
from pipeline.transport.keys import Keys
from pipeline.transport.producer import F_DATA, F_HEADER, F_REF
from schemas import DecodeError, GroupHeader, RolloutGroup, ScoredGroup, decode, encode
from schemas.build import synthetic_rollout, synthetic_scored
from tests.redis_server import RedisServer
from tests.reliability import mutations as mut
from tests.reliability.harness import RecordingLearner, Workers, redis_client, report, wait_until

pytestmark = [pytest.mark.reliability, pytest.mark.slow, pytest.mark.redis, pytest.mark.timeout(240)]

BAD_PER_STREAM = 5000
GOOD_PER_STREAM = 250
STAGE = {"rollouts": "teacher", "scored": "learner"}  # the stage that decodes a stream's payloads
#: A scored entry whose header names no payload key stops at the feeder, which reads headers only.
NO_PAYLOAD_KEY = "decode_error: p: claim-checked entry without a payload key"
EXPECT: dict[str, type[RolloutGroup] | type[ScoredGroup]] = {"rollouts": RolloutGroup, "scored": ScoredGroup}
MTYPE = {"rollouts": b"rollout", "scored": b"scored"}


@dataclass
class Corpus:
    """Entries to XADD (gid, fields) and what each bad one must become."""

    entries: dict[str, list[tuple[str, dict[bytes, bytes]]]] = field(default_factory=lambda: {"rollouts": [],
                                                                                             "scored": []})
    reason: dict[str, str] = field(default_factory=dict)  # bad gid -> expected DLQ reason
    category: dict[str, str] = field(default_factory=dict)
    stream: dict[str, str] = field(default_factory=dict)
    stage: dict[str, str] = field(default_factory=dict)  # bad gid -> the stage that dead-letters it
    good: set[str] = field(default_factory=set)
    accepted_invalid: list[str] = field(default_factory=list)  # guaranteed-bad messages the decoder took
    decoder_crashes: list[str] = field(default_factory=list)  # anything but DecodeError
    valid_by_chance: int = 0


def check(corpus: Corpus, stream: str, name: str, payload: bytes, guaranteed: bool) -> str | None:
    """The decoder's reason for rejecting ``payload`` (None if it accepted it)."""
    try:
        decode(payload, mut.LIMITS, expect=EXPECT[stream])
    except DecodeError as e:
        return f"decode_error: {e}"
    except Exception as e:  # a decoder must never raise anything else
        corpus.decoder_crashes.append(f"{stream}/{name}: {type(e).__name__}: {e}")
        return None
    if guaranteed:
        corpus.accepted_invalid.append(f"{stream}/{name}")
    else:
        corpus.valid_by_chance += 1
    return None


@functools.cache
def base_header() -> GroupHeader:
    return decode_header(encode_header(synthetic_scored(synthetic_rollout(2, 16, group_id="h", seed=0), k=4)))


def header(gid: str) -> bytes:
    """A valid scored header for group ``gid``: a bad payload behind it gets past the feeder to the learner."""
    return msgspec.msgpack.encode(msgspec.structs.replace(base_header(), group_id=gid))


def build(seed: int = 7) -> Corpus:
    rng = random.Random(seed)
    c = Corpus()
    for stream in ("rollouts", "scored"):
        guaranteed = mut.ROLLOUT_GUARANTEED if stream == "rollouts" else mut.SCORED_GUARANTEED
        cycle = [(m, True) for m in guaranteed] + [(m, False) for m in mut.FILTERED[stream]]
        out = c.entries[stream]
        for i in range(BAD_PER_STREAM):
            gid = f"bad-{stream}-{i:05d}"
            stage = STAGE[stream]
            if i % 100 == 99 and stream == "scored":  # a header without its payload key
                name, fields = "payload_key_missing", {b"t": MTYPE[stream], b"gid": gid.encode(), F_HEADER: header(gid)}
                reason, stage = NO_PAYLOAD_KEY, "feeder"
            elif i % 100 == 99:  # an entry without its payload field
                name, payload, fields = "payload_field_missing", b"", {b"t": MTYPE[stream], b"gid": gid.encode()}
                reason = check(c, stream, name, payload, True)
            else:
                cat, sure = (mut.OVERSIZE[(i // 50) % 2], True) if i % 50 == 0 else cycle[i % len(cycle)]
                for _ in range(50):  # filtered categories: retry until the mutation is actually invalid
                    payload = mut.make(stream, cat, i, rng)
                    reason = check(c, stream, cat.__name__, payload, sure)
                    if reason is not None or sure:
                        break
                name = cat.__name__
                mtype = MTYPE[stream] if rng.random() < 0.9 else rng.choice([b"", b"batch", b"\xff\xfe"])
                fields = {b"t": mtype, b"gid": gid.encode(), b"d": payload}
                if stream == "scored":
                    fields[F_HEADER] = header(gid)
            if reason is not None:
                c.reason[gid], c.category[gid], c.stream[gid], c.stage[gid] = reason, name, stream, stage
                out.append((gid, fields))
        for i in range(GOOD_PER_STREAM):
            g = synthetic_rollout(2, 16, group_id=f"good-{stream}-{i:04d}", seed=100_000 + i)
            if stream == "rollouts":
                good = {b"t": MTYPE[stream], b"gid": g.group_id.encode(), b"d": encode(g)}
            else:
                s = synthetic_scored(g, k=4, seed=i)
                good = {b"t": MTYPE[stream], b"gid": g.group_id.encode(), b"d": encode(s), F_HEADER: encode_header(s)}
            out.append((g.group_id, good))
            c.good.add(g.group_id)
        rng.shuffle(out)
    return c


async def xadd_all(r: Any, keys: Keys, corpus: Corpus) -> None:
    """XADD every entry; a claim-checked one (with a header) gets its payload (``d``) SET in a key of its own."""
    for stream, entries in corpus.entries.items():
        key = keys.stream(stream)
        for start in range(0, len(entries), 500):
            async with r.pipeline(transaction=False) as p:
                for gid, fields in entries[start : start + 500]:
                    entry: dict[bytes, bytes | str] = dict(fields)
                    if F_HEADER in fields and F_DATA in fields:
                        ref = keys.payload(key, gid, "0")
                        p.set(ref, entry.pop(F_DATA))
                        entry[F_REF] = ref
                    p.xadd(key, entry)
                await p.execute()


async def dead_letters(r: Any, keys: Keys) -> list[dict[bytes, bytes]]:
    out, start = [], "-"
    while page := await r.xrange(keys.dlq, min=start, max="+", count=1000):
        out += [f for _, f in page]
        start = "(" + page[-1][0].decode()
    return out


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[str]]:
    capsys.readouterr()
    code = cli(list(argv))
    return code, capsys.readouterr().out.splitlines()


def verify(corpus: Corpus, letters: list[dict[bytes, bytes]]) -> tuple[Counter[str], list[str], int]:
    """Dead letters per bad group id, the ones that differ from the decoder's verdict, and how many
    oversized messages were rejected for their size (not for being malformed)."""
    per_gid = Counter(f.get(b"orig_gid", b"").decode() for f in letters)
    wrong: list[str] = []
    size_first = 0
    for f in letters:
        gid = f.get(b"orig_gid", b"").decode()
        stream = corpus.stream.get(gid)
        if stream is None:
            wrong.append(f"unexpected dead letter {gid}: {f.get(b'reason')!r}")
            continue
        if (f[b"reason"].decode(), f[b"stage"].decode(), f[b"source"].decode()) != (
                corpus.reason[gid][:2000], corpus.stage[gid], stream):
            wrong.append(f"{gid} ({corpus.category[gid]}): {f[b'reason'][:200]!r} at {f[b'stage']!r}")
        if corpus.category[gid].startswith("oversize"):
            size_first += b"exceeds the cap" in f[b"reason"] and b"malformed" not in f[b"reason"]
    return per_gid, wrong, size_first


def check_replay(corpus: Corpus, replay: tuple[int, list[str]], n_bad: int) -> int:
    """``dlq replay --all`` of the bad messages: a valid scored group put on rollouts holds a valid rollout, which
    replay sends to be scored again; every other bad message stays in the DLQ, each with the reason it cannot go
    back. Returns how many stayed."""
    rescored = sorted(g for g, c in corpus.category.items()
                      if c == "other_message_type" and corpus.stream[g] == "rollouts")
    replayed = sorted(line.split("(group ", 1)[1].split(",", 1)[0] for line in replay[1] if " -> " in line)
    assert replayed == rescored and rescored, (len(replayed), len(rescored))
    kept = n_bad - len(rescored)
    assert replay[0] == 1 and replay[1][-1] == f"replayed {len(rescored)} of {n_bad}; {kept} kept in the DLQ"
    assert all("to be scored again" in line for line in replay[1] if " -> " in line)
    return kept


async def test_malformed_messages_go_to_the_dlq_and_good_ones_arrive(
    workers: Workers, private_redis: RedisServer, namespace: str, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    t0 = time.monotonic()
    corpus = build()
    built_s = time.monotonic() - t0
    keys = Keys(namespace)
    r = redis_client(private_redis.url)
    await xadd_all(r, keys, corpus)
    common = ("--redis-url", private_redis.url, "--namespace", namespace)
    tails = [await asyncio.to_thread(run_cli, capsys, "tail", s, "-n", "20000", "--json", *common)
             for s in ("rollouts", "scored")]
    assert [c for c, _ in tails] == [0, 0]
    assert [len(lines) for _, lines in tails] == [len(corpus.entries[s]) for s in ("rollouts", "scored")]

    workers.env.update(mut.ENV)
    t1 = time.monotonic()
    workers.teacher("t1", "--top-k", "4")
    workers.feeder("f1")
    learner = RecordingLearner(private_redis.url, namespace, limits=mut.LIMITS)
    stop = asyncio.Event()
    task = asyncio.create_task(learner.run(stop))
    n_bad = len(corpus.reason)

    async def finished() -> bool:
        return corpus.good <= set(learner.counts) and await r.xlen(keys.dlq) >= n_bad

    done = await wait_until(finished, 120, every_s=0.5)
    processing_s = time.monotonic() - t1
    await asyncio.sleep(1.0)
    stop.set()
    await task
    await learner.aclose()
    alive = workers.all_alive()

    letters = await dead_letters(r, keys)
    per_gid, wrong, size_first = verify(corpus, letters)
    dlq_list = await asyncio.to_thread(run_cli, capsys, "dlq", "list", "-n", "20000", "--json", *common)
    for k, v in mut.ENV.items():  # replay validates with the operator's limits
        monkeypatch.setenv(k, v)
    replay = await asyncio.to_thread(run_cli, capsys, "dlq", "replay", "--all", *common)
    after_replay = [await r.xlen(keys.stream(s)) for s in ("rollouts", "scored")] + [await r.xlen(keys.dlq)]
    figures: dict[str, Any] = dict(
        bad_sent=n_bad, bad_categories=len(set(corpus.category.values())), dead_lettered=len(letters),
        dead_letter_mismatches=len(wrong), duplicate_dead_letters=sum(n - 1 for n in per_gid.values() if n > 1),
        oversize=sum(1 for c in corpus.category.values() if c.startswith("oversize")),
        oversize_rejected_by_size=size_first,
        good_sent=len(corpus.good), good_received=len(set(learner.counts) & corpus.good),
        good_duplicated=learner.duplicates, unknown_received=len(set(learner.counts) - corpus.good),
        decoder_crashes=len(corpus.decoder_crashes), accepted_invalid=len(corpus.accepted_invalid),
        byte_flips_valid_by_chance=corpus.valid_by_chance, workers_alive=alive, build_s=built_s,
        processing_s=processing_s, dlq_list_lines=len(dlq_list[1]), replayed=replay[1][-1] if replay[1] else "",
    )
    report("bad_input", **figures)
    await r.aclose()
    assert not corpus.decoder_crashes, corpus.decoder_crashes[:5]
    assert not corpus.accepted_invalid, Counter(corpus.accepted_invalid).most_common(5)
    assert done and alive, figures
    assert n_bad == 2 * BAD_PER_STREAM
    assert len(letters) == n_bad and set(per_gid) == set(corpus.reason)
    assert not wrong, wrong[:5]
    assert size_first == figures["oversize"] > 0
    assert set(learner.counts) == corpus.good and learner.duplicates == 0
    assert all(s.group_id.startswith("good-") for s in learner.first.values())
    assert dlq_list[0] == 0 and len(dlq_list[1]) == n_bad
    kept = check_replay(corpus, replay, n_bad)
    assert after_replay[2] == kept  # (the replayed ones are on their way through the teacher, still running)
