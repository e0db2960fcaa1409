"""Connections never wait forever: a read timeout, TCP keepalive probes, and Unix sockets that connect."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from redis.exceptions import TimeoutError as RedisTimeoutError

from pipeline.config import RedisSettings
from pipeline.connection import KEEPALIVE_IDLE_S, KEEPALIVE_PROBES, connect
from tests.redis_server import RedisServer

pytestmark = pytest.mark.redis


async def test_a_redis_that_never_answers_fails_the_command_instead_of_hanging() -> None:
    """A peer that accepted the connection and then went silent (a host frozen or cut off without a FIN):
    without a read timeout the command waits forever; with one it fails after its retries."""
    accepted: list[asyncio.StreamWriter] = []

    async def silent(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        accepted.append(w)  # read nothing, answer nothing, keep the connection open

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    r = connect(RedisSettings(redis_url=f"redis://127.0.0.1:{port}/0", socket_timeout=0.3))
    t0 = time.monotonic()
    try:
        with pytest.raises(RedisTimeoutError):
            await asyncio.wait_for(r.ping(), 20)
        elapsed = time.monotonic() - t0
        assert 0.3 <= elapsed < 10, elapsed  # 4 attempts (redis-py's 3 retries) of 0.3 s, plus backoff
        assert accepted  # it did connect: the timeout is on the read, not the connect
    finally:
        await r.aclose()
        server.close()
        for w in accepted:
            w.close()
        await server.wait_closed()


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


def test_worker_refuses_a_read_timeout_shorter_than_its_blocking_reads(redis_url: str) -> None:
    env = {**os.environ, "DISTILLQ_SOCKET_TIMEOUT": "1.5", "DISTILLQ_BLOCK_MS": "1000"}
    done = subprocess.run([sys.executable, "-m", "pipeline.cli.main", "worker", "feeder", "--redis-url", redis_url],
                          check=False, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "DISTILLQ_SOCKET_TIMEOUT=1.5 s must exceed" in done.stderr
