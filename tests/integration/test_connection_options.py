"""Connections: cancellable blocking reads, TCP keepalive probes, and Unix sockets that connect."""

from __future__ import annotations

import asyncio
import random
import socket
from pathlib import Path

import pytest

from pipeline.config import RedisSettings, StreamSettings
from pipeline.transport.connection import KEEPALIVE_IDLE_S, KEEPALIVE_PROBES, connect
from pipeline.transport.consumer import StreamConsumer
from pipeline.transport.keys import Keys
from tests.redis_server import RedisServer

pytestmark = pytest.mark.redis


async def test_cancelling_a_blocked_read_always_cancels_it(redis_url: str, keys: Keys) -> None:
    """Every stop path (worker shutdown, the learner client's close, ``wait_for`` around a read) cancels a
    task blocked in XREADGROUP. With a ``socket_timeout`` set, redis-py 5.3 on Python 3.11 reads under
    ``asyncio.timeout``, and a cancel that lands as the reply arrives is lost: the task reads on (203 of
    2,000 here). ``connect`` therefore sets none; this fails if one comes back."""
    r = connect(RedisSettings(redis_url=redis_url))
    c = StreamConsumer(r, keys, "batches", "c", StreamSettings(block_ms=2, claim_interval_ms=10**9))
    await c.ensure_group()
    c._own_cursor = None

    async def reading() -> None:
        while True:
            await c.read(1, block_ms=2)

    lost = 0
    try:
        for _ in range(300):
            task = asyncio.ensure_future(reading())
            await asyncio.sleep(random.uniform(0, 0.006))
            task.cancel()
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if not done:
                lost += 1
                task.cancel()
                await asyncio.wait({task}, timeout=1)
    finally:
        await r.aclose()
    assert lost == 0, f"{lost} of 300 cancellations were swallowed"


async def test_tcp_connections_probe_an_idle_peer(redis_url: str) -> None:
    r = connect(RedisSettings(redis_url=redis_url))
    try:
        await r.ping()
        conn = r.connection_pool.make_connection()  # a fresh one, made as the pool makes them
        await conn.connect()
        try:
            sock = conn._writer.get_extra_info("socket")  # type: ignore[attr-defined]
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            if hasattr(socket, "TCP_KEEPIDLE"):
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == KEEPALIVE_IDLE_S
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == KEEPALIVE_PROBES
        finally:
            await conn.disconnect()
    finally:
        await r.aclose()


async def test_unix_socket_urls_connect(tmp_path: Path) -> None:
    """redis-py's Unix connections reject TCP options: passing them made every unix:// client fail."""
    path = tmp_path / "redis.sock"
    server = RedisServer(extra_args=["--unixsocket", str(path), "--unixsocketperm", "700"]).start()
    try:
        r = connect(RedisSettings(redis_url=f"unix://{path}"))
        try:
            await r.xadd("s", {b"d": b"x" * 100_000})
            rows = await r.xrange("s")
            assert len(rows) == 1 and rows[0][1][b"d"] == b"x" * 100_000
        finally:
            await r.aclose()
    finally:
        server.stop()
