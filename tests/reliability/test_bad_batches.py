"""Bad input for the learner's decoder: 1,000 malformed train batches XADDed raw onto ``batches``,
interleaved with 100 good ones. The learner client dead-letters each bad one with the decoder's reason
and goes on; every good batch (and group) arrives once."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from typing import Any

import msgspec
import pytest

from pipeline.stages.batching import BatchingConfig, Pending, build_batch, materialize
from pipeline.transport.claimcheck import header_of
from pipeline.transport.keys import Keys
from schemas import SCHEMA_VERSION, BatchManifest, DecodeError, TrainBatch, decode, encode
from schemas.build import synthetic_rollout, synthetic_scored
from tests.redis_server import RedisServer
from tests.reliability import mutations as mut
from tests.reliability.harness import RecordingLearner, redis_client, report, wait_until

pytestmark = [pytest.mark.reliability, pytest.mark.slow, pytest.mark.redis, pytest.mark.timeout(120)]

BAD = 1000
GOOD = 100
Tree = dict[str, Any]


def good_batch(tag: str, i: int, groups: int = 3) -> TrainBatch:
    gs = [synthetic_scored(synthetic_rollout(2, 16, group_id=f"{tag}-{i:04d}-{j}", seed=7 * i + j), k=4, seed=j)
          for j in range(groups)]
    items = [Pending(f"0-{j}", header_of(g), f"k{j}") for j, g in enumerate(gs)]
    return materialize(build_batch(items, 1.0, 0, BatchingConfig()).batch, gs)  # by value: the learner takes both


def batch_tree(i: int) -> Tree:
    tree: Tree = msgspec.msgpack.decode(encode(good_batch("base", i)))
    return tree


def advantages_count(t: Tree, rng: random.Random) -> None:
    t["advantages"] = t["advantages"][:-1] if rng.random() < 0.5 else [*t["advantages"], t["advantages"][0]]


def advantages_length(t: Tree, rng: random.Random) -> None:
    a = t["advantages"][rng.randrange(len(t["advantages"]))]
    a[1], a[2] = [a[1][0] + 1], a[2] + b"\0\0\0\0"


def advantages_values(t: Tree, rng: random.Random) -> None:
    a = t["advantages"][rng.randrange(len(t["advantages"]))]
    if rng.random() < 0.5:
        a[0] = rng.choice(["<f2", "<i4", "<f8"])
    else:
        mut.put(a, rng.randrange(a[1][0]), "<f", rng.choice([float("nan"), float("inf")]))


def envelope(t: Tree, rng: random.Random) -> None:
    key, value = rng.choice([("schema", SCHEMA_VERSION + 1), ("schema", 0), ("t", "batches"), ("batch_id", 7),
                             ("groups", {}),
                             ("advantages", None), ("kl_coef", "high")])
    t[key] = value


#: Edits of one scored group inside the batch that are invalid whatever the envelope.
INNER = [m for m in mut.SCORED_GUARANTEED if hasattr(m, "edit") and m.__name__ not in (
    "schema_version_unknown", "tag_invalid")]


def make(i: int, rng: random.Random) -> tuple[str, bytes]:
    t = batch_tree(i % 32)
    kind = i % 8
    if kind == 0:
        return "truncated", encode(good_batch("trunc", i))[: rng.randrange(200)]
    if kind == 1:
        return "other_message_type", encode(synthetic_rollout(1, 8, group_id=f"r{i}"))
    if kind == 2:
        return "oversize", encode(good_batch("big", i, groups=40))
    if kind == 3:
        fn = rng.choice([advantages_count, advantages_length, advantages_values, envelope])
        fn(t, rng)
        return fn.__name__, mut.pack(t)
    m = INNER[i % len(INNER)]
    m.edit(t["groups"][rng.randrange(len(t["groups"]))], rng)
    return f"group_{m.__name__}", mut.pack(t)


async def test_learner_dead_letters_malformed_batches(private_redis: RedisServer, namespace: str) -> None:
    rng = random.Random(3)
    keys = Keys(namespace)
    r = redis_client(private_redis.url)
    entries: list[tuple[bytes, bytes]] = []
    reasons: dict[str, str] = {}
    categories: Counter[str] = Counter()
    accepted: list[str] = []
    for i in range(BAD):
        name, payload = make(i, rng)
        try:
            msg = decode(payload, mut.LIMITS)
            if not isinstance(msg, BatchManifest | TrainBatch):  # what the learner client accepts
                raise DecodeError("t", f"expected a BatchManifest or TrainBatch, got a {type(msg).__name__}")
            accepted.append(name)
            continue
        except DecodeError as e:
            reasons[f"bad-{i:04d}"] = f"decode_error: {e}"
        categories[name] += 1
        entries.append((f"bad-{i:04d}".encode(), payload))
    goods = {f"good-{i:04d}": good_batch("good", i) for i in range(GOOD)}
    entries += [(bid.encode(), encode(b)) for bid, b in goods.items()]
    rng.shuffle(entries)
    async with r.pipeline(transaction=False) as p:
        for gid, payload in entries:
            p.xadd(keys.stream("batches"), {b"t": b"batch", b"gid": gid, b"d": payload})
        await p.execute()

    learner = RecordingLearner(private_redis.url, namespace, limits=mut.LIMITS)
    stop = asyncio.Event()
    task = asyncio.create_task(learner.run(stop))
    want_groups = {g.group_id for b in goods.values() for g in b.groups}

    async def finished() -> bool:
        return want_groups <= set(learner.counts) and await r.xlen(keys.dlq) >= len(reasons)

    done = await wait_until(finished, 60, every_s=0.25)
    stop.set()
    await task
    await learner.aclose()
    letters = [f for _, f in await r.xrange(keys.dlq)]
    wrong = [f for f in letters if (f[b"stage"], f[b"source"], f[b"reason"].decode()) != (
        b"learner", b"batches", reasons.get(f[b"orig_gid"].decode(), "?")[:2000])]
    report("bad_batches", bad_sent=len(reasons), categories=len(categories), accepted_invalid=len(accepted),
           dead_lettered=len(letters), dead_letter_mismatches=len(wrong), good_batches=GOOD,
           good_groups_received=len(set(learner.counts) & want_groups), duplicated=learner.duplicates,
           unknown_received=len(set(learner.counts) - want_groups), batches_left=int(await r.xlen(keys.stream(
               "batches"))))
    await r.aclose()
    assert not accepted, Counter(accepted)
    assert done
    assert len(letters) == len(reasons) == BAD and not wrong, wrong[:3]
    assert set(learner.counts) == want_groups and learner.duplicates == 0
