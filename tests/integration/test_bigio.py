"""Connections sized for multi-MB entries: bytes on the wire unchanged, large chunks never joined."""

from __future__ import annotations

import os
from typing import Any

import pytest
import redis.asyncio as aioredis

from pipeline.config import RedisSettings
from pipeline.transport import bigio
from pipeline.transport.connection import connect

pytestmark = pytest.mark.redis


class Recorder:
    def __init__(self) -> None:
        self.writes: list[bytes | memoryview] = []

    def write(self, data: bytes | memoryview) -> None:
        self.writes.append(data)


def test_small_commands_are_joined_into_one_write() -> None:
    w = Recorder()
    bigio.write_chunks(w, [b"*3\r\n", b"$3\r\nSET\r\n", b"x" * 100])  # type: ignore[arg-type]
    assert w.writes == [b"*3\r\n$3\r\nSET\r\n" + b"x" * 100]


def test_large_chunks_are_written_as_they_are() -> None:
    w = Recorder()
    payload = memoryview(os.urandom(bigio.JOIN_BELOW + 1))
    parts: list[bytes | memoryview] = [b"*3\r\n", b"$3\r\nSET\r\n$1\r\nk\r\n", payload, b"\r\n"]
    bigio.write_chunks(w, parts)  # type: ignore[arg-type]
    assert len(w.writes) == 3 and w.writes[1] is payload  # the payload itself, not a copy
    assert b"".join(w.writes) == b"".join(parts)


async def test_multi_megabyte_values_round_trip(redis_url: str) -> None:
    r: aioredis.Redis = connect(RedisSettings(redis_url=redis_url))
    try:
        pool = r.connection_pool
        assert pool.connection_class is bigio.BigIOConnection
        assert pool.connection_kwargs["socket_read_size"] == bigio.READ_SIZE
        blobs = [os.urandom(n) for n in (1, 70_000, 6_000_000)]
        key = f"bigio:{os.getpid()}"
        async with r.pipeline(transaction=True) as p:
            for i, b in enumerate(blobs):
                p.set(f"{key}:{i}", memoryview(b))
            await p.execute()
        assert await r.mget([f"{key}:{i}" for i in range(3)]) == blobs
        await r.delete(*[f"{key}:{i}" for i in range(3)])
        conn: Any = pool._available_connections[0]  # the one that carried them
        assert conn._writer.writelines.func is bigio.write_chunks
        assert conn._reader._limit == bigio.STREAM_LIMIT
    finally:
        await r.aclose()


def test_connection_class_follows_the_url_scheme() -> None:
    assert bigio.connection_class("redis://h:1/0") is bigio.BigIOConnection
    assert bigio.connection_class("rediss://h:1/0") is bigio.BigIOSSLConnection
    assert bigio.connection_class("unix:///tmp/r.sock") is bigio.BigIOUnixConnection


# --- the redis-py internals bigio relies on: an upgrade that moves one fails here, naming it -------------


def test_redis_py_version_is_in_the_verified_range() -> None:
    import redis

    version = tuple(int(x) for x in redis.__version__.split(".")[:3])
    low, high = bigio.VERIFIED
    assert low <= version < high, (
        f"redis-py {redis.__version__} is outside the range pipeline/transport/bigio.py was verified on "
        f"({low} to {high}): re-check the internals below and the gain in bench.transport, then widen VERIFIED"
    )


def test_the_patched_internals_are_where_bigio_expects_them() -> None:
    import inspect

    from redis.asyncio import connection as rc

    send = inspect.getsource(rc.AbstractConnection.send_packed_command)
    assert "self._writer.writelines(" in send, "redis-py no longer writes commands with _writer.writelines"
    connect_src = inspect.getsource(rc.Connection._connect)
    assert "asyncio.open_connection(" in connect_src and "**self._connection_arguments()" in connect_src, (
        "redis-py's Connection._connect no longer passes _connection_arguments() to asyncio.open_connection"
    )
    ssl_args = inspect.getsource(rc.SSLConnection._connection_arguments)
    assert "super()._connection_arguments()" in ssl_args, "SSLConnection._connection_arguments changed shape"
    init = inspect.signature(rc.AbstractConnection.__init__)
    assert "socket_read_size" in init.parameters, "redis-py connections no longer take socket_read_size"
    parser = inspect.getsource(rc.AbstractConnection)
    assert "parser_class(socket_read_size=self._socket_read_size)" in parser, (
        "redis-py no longer hands socket_read_size to its parser"
    )
    for cls in (rc.Connection, rc.UnixDomainSocketConnection):  # _BigIO wraps their _connect, then patches _writer
        body = inspect.getsource(cls._connect)
        assert inspect.iscoroutinefunction(cls._connect) and "self._writer = writer" in body, (
            f"{cls.__name__}._connect no longer sets self._writer from the stream it opens"
        )
