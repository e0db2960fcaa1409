"""The weights store's Redis away (a real redis-server, killed and started again): each store operation waits for
it with the one backoff policy and goes on; past ``RedisStore.deadline_s`` it fails with one line naming the store
(password masked), a ``WeightStoreUnavailable`` (``TransportError`` and redis-py's ``ConnectionError``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from pipeline.errors import TransportError
from pipeline.weightstore.stores import RedisStore, WeightStoreUnavailable
from tests.redis_server import RedisServer

pytestmark = [pytest.mark.redis, pytest.mark.timeout(60)]


@pytest.fixture
def server() -> Iterator[RedisServer]:
    s = RedisServer(password="s3cret").start()
    try:
        yield s
    finally:
        s.stop()


def test_an_outage_is_waited_out_and_a_long_one_is_one_line(server: RedisServer) -> None:
    url = f"redis://:s3cret@127.0.0.1:{server.port}/0?prefix=w"
    store = RedisStore(url)
    store.commit(1, b"{}")
    server.kill()
    back = threading.Timer(1.5, server.start)
    back.start()
    t0 = time.monotonic()
    store.put("v1/0", b"chunk")  # waits for the restart, then writes
    waited = time.monotonic() - t0
    back.join()
    assert 1.0 < waited < 20, waited
    assert store.get("v1/0") == b"chunk"
    server.kill()
    store.deadline_s = 1.0
    t0 = time.monotonic()
    with pytest.raises(WeightStoreUnavailable) as e:
        store.latest()
    assert time.monotonic() - t0 < 5
    text = str(e.value)
    assert text.startswith(f"weights store redis://:***@127.0.0.1:{server.port}/0?prefix=w: its Redis did not "
                           "answer for 1 s: ") and "\n" not in text and "s3cret" not in text, text
    assert isinstance(e.value, TransportError) and isinstance(e.value, RedisConnectionError)  # transient: exit 3
    store.close()
