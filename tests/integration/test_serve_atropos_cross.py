"""``distillq serve atropos`` hands out a group scored by a teacher of another tokenizer in a batch beside a
same-tokenizer group: one answer with both, the cross group's entries per token only (``schemas.atropos``)."""

from __future__ import annotations

import asyncio

import pytest
import redis

from pipeline.config import RedisSettings
from pipeline.serve.atropos.app import create_app
from pipeline.serve.atropos.startup import ServeConfig
from pipeline.transport.connection import connect
from pipeline.transport.keys import Keys
from pipeline.transport.producer import StreamProducer
from schemas.atropos import ATROPOS_KEYS, CROSS_KEY
from schemas.build import synthetic_rollout, synthetic_scored
from tests.integration.test_serve_atropos import FAST, REGISTRATION, ThreadedServer, http, wait_for
from tests.unit.test_atropos_cross import WANT_IDS, WANT_LPS, cross_group

pytestmark = pytest.mark.redis


async def _send_scored(redis_url: str, keys: Keys) -> None:
    client = connect(RedisSettings(redis_url=redis_url, namespace=keys.namespace))
    try:
        producer = StreamProducer(client, keys, "scored")
        await producer.send(cross_group("cross"))
        await producer.send(synthetic_scored(synthetic_rollout(1, 8, group_id="same", seed=1), k=3, seed=1))
    finally:
        await client.aclose()


@pytest.mark.timeout(60)
def test_a_batch_with_a_cross_group_is_served_whole(redis_url: str, keys: Keys) -> None:
    cfg = ServeConfig(redis=RedisSettings(redis_url=redis_url, namespace=keys.namespace), streams=FAST)
    r = redis.Redis.from_url(redis_url)
    with ThreadedServer(create_app(cfg)) as server:
        assert http("POST", server.url + "/register", json={**REGISTRATION, "batch_size": 2}).status_code == 200
        assert http("GET", server.url + "/batch").json() == {"batch": None}
        asyncio.run(_send_scored(redis_url, keys))
        wait_for(lambda: r.xlen(keys.atropos("queue")) == 2, what="2 groups queued")
        resp = http("GET", server.url + "/batch")
        assert resp.status_code == 200
        cross, same = resp.json()["batch"]
        assert set(cross) == {*ATROPOS_KEYS, "teacher"}
        assert cross["teacher"][CROSS_KEY] is True and CROSS_KEY not in same["teacher"]
        assert cross["distill_token_ids"] == [WANT_IDS]
        assert cross["distill_logprobs"] == [[pytest.approx(e) for e in row] for row in [WANT_LPS]]
        assert all(len(e) in (3, 4) for e in same["distill_token_ids"][0][1:] if e)
        assert http("GET", server.url + "/status").json()["queue_size"] == 0
    assert r.xlen(keys.dlq) == 0
    r.close()
