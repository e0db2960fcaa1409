"""``GET /batch`` right after groups were posted (atroposlib's own API tests do this): while groups being
scored would complete a batch, the server waits for them, at most ``batch_wait_s`` (``--batch-wait-s``,
``DISTILLQ_ATROPOS_BATCH_WAIT_S``); with nothing that could complete a batch it answers at once."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import redis

from pipeline.config import RedisSettings
from pipeline.serve.atropos.app import create_app
from pipeline.serve.atropos.packing import scoring_completes_batch
from pipeline.serve.atropos.startup import ServeConfig
from pipeline.transport.keys import Keys
from tests.integration.test_serve_atropos import (
    ENV,
    FAST,
    RECEIVED,
    REGISTRATION,
    TeacherThread,
    ThreadedServer,
    group,
    http,
)

pytestmark = pytest.mark.redis


def timed_batch(url: str) -> tuple[float, dict[str, object]]:
    t0 = time.monotonic()
    out = http("GET", url + "/batch").json()
    return time.monotonic() - t0, out


def serve(redis_url: str, keys: Keys, wait_s: float) -> ThreadedServer:
    cfg = ServeConfig(redis=RedisSettings(redis_url=redis_url, namespace=keys.namespace), streams=FAST,
                      batch_wait_s=wait_s)
    return ThreadedServer(create_app(cfg))


def test_batch_waits_for_groups_being_scored_and_no_longer_than_the_bound(redis_url: str, keys: Keys) -> None:
    r = redis.Redis.from_url(redis_url)
    with serve(redis_url, keys, 2.0) as server:
        url = server.url
        assert http("POST", url + "/register", json=REGISTRATION).status_code == 200  # batch_size 4
        took, out = timed_batch(url)
        assert out == {"batch": None} and took < 0.5  # nothing in flight: at once
        assert http("POST", url + "/register-env", json=ENV).json()["env_id"] == 0
        # no teacher yet: two groups in flight would complete a batch, but are never scored -> the bound
        for i in range(2):
            assert http("POST", url + "/scored_data", json=group(seed=i, env_id=0)).json() == RECEIVED
        took, out = timed_batch(url)
        assert out == {"batch": None} and 2.0 <= took < 3.5
        # the teacher starts: the same GET now waits until the two groups are scored and gets them
        with TeacherThread(redis_url, keys.namespace):
            took, out = timed_batch(url)
            batch = out["batch"]
            assert isinstance(batch, list) and [g["tokens"] for g in batch] == [group(seed=i)["tokens"]
                                                                               for i in range(2)]
            assert took < 2.0
            for i in range(2, 4):
                http("POST", url + "/scored_data", json=group(seed=i, env_id=0))
            took, out = timed_batch(url)  # at once after the posts, as atroposlib's tests do
            assert isinstance(out["batch"], list) and len(out["batch"]) == 2 and took < 2.0
            http("POST", url + "/scored_data", json=group(seed=9, env_id=0))  # 2 of the 4 sequences
            took, out = timed_batch(url)
            assert out == {"batch": None} and took < 0.5  # cannot complete a batch: no wait
    with serve(redis_url, keys, 0.0) as server:  # the wait off: the reference's answer, at once
        http("POST", server.url + "/scored_data", json=group(seed=10, env_id=0))
        took, out = timed_batch(server.url)
        assert out == {"batch": None} and took < 0.5
    r.close()


def test_scoring_completes_batch_counts_queued_and_in_flight_sequences() -> None:
    assert scoring_completes_batch([(0, 2)], [(0, 2)], 4, [])
    assert not scoring_completes_batch([(0, 2)], [], 4, [])
    assert not scoring_completes_batch([], [(0, 2)], 4, [])
    assert not scoring_completes_batch([(0, 3)], [(0, 3)], 4, [])  # 6 sequences, but no exact 4
    assert scoring_completes_batch([], [(0, 1), (1, 3)], 4, [])
    env = {"registered_id": 1, "connected": True, "min_batch_allocation": 0.5}
    assert not scoring_completes_batch([], [(0, 2), (0, 2)], 4, [env])  # env 1 must get half: none of it


def test_the_flag_and_its_variable() -> None:
    cmd = [sys.executable, "-m", "pipeline.cli.main", "serve", "atropos", "--batch-wait-s", "-1"]
    bad = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "distillq: --batch-wait-s must be a number of seconds from 0 to 60, got -1.0"]
    env = {**os.environ, "DISTILLQ_ATROPOS_BATCH_WAIT_S": "nan"}
    bad = subprocess.run(cmd[:-2], check=False, capture_output=True, text=True, timeout=60, env=env)
    assert bad.returncode == 2 and "--batch-wait-s must be a number of seconds from 0 to 60, got nan" in bad.stderr
