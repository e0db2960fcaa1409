"""redis-py connections sized for multi-MB stream entries (a scored group is 1-70 MB at the benchmarked shapes).

Three costs of redis-py 5 + asyncio (Python 3.11) on such entries, measured in ``bench.transport``:

* **Writes:** ``StreamWriter.writelines`` joins the packed command (``b"".join``), a copy of the whole
  payload before the socket copies it again. Here commands of at least ``JOIN_BELOW`` bytes are written
  chunk by chunk: small chunks (command headers) still joined, every large chunk (the payload's
  memoryview, as redis-py packs it) handed to the transport as is.
* **Reads:** the hiredis parser reads ``socket_read_size`` bytes per call (64 KiB by default): a 1.3 MB
  reply took ~20 reads, each slicing the stream buffer. ``READ_SIZE`` takes what has arrived in one go.
* **Flow control:** asyncio's ``StreamReader`` pauses the socket whenever more than twice its ``limit``
  (64 KiB by default) is buffered; ``STREAM_LIMIT`` lets a whole entry arrive without pausing.

TCP and TLS connections get all three, Unix-socket connections the first two; Redis Cluster nodes keep
redis-py's defaults (their connections are made by its cluster client).

Measured gain (``bench.transport``, 2026-11-23, 2-core VM, commit 2014b00): 4.45 -> 4.15 ms of process CPU
per 8 x 1024 group through distillq's stages, 2.4 -> 2.15 ms for the raw-bytes stub. Verified on redis-py
5.3.1 (``VERIFIED``, the range pyproject.toml pins); tests/integration/test_bigio.py checks every internal
used here and fails naming the one that moved.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Iterable
from typing import Any, Final

from redis.asyncio.connection import AbstractConnection, Connection, SSLConnection, UnixDomainSocketConnection

#: redis-py versions whose connection internals this module was verified against (``[low, high)``).
VERIFIED: Final = ((5, 3, 1), (5, 4))
#: Commands smaller than this are joined and written at once (as redis-py does).
JOIN_BELOW: Final = 64 * 1024
#: Chunks at least this large are written without joining them to their neighbours.
BIG_CHUNK: Final = 16 * 1024
#: ``socket_read_size`` for the parser: bytes taken from the stream buffer per read.
READ_SIZE: Final = 1 << 20
#: ``StreamReader`` limit: the socket is paused when twice this much is buffered and unread.
STREAM_LIMIT: Final = 4 << 20


def write_chunks(writer: asyncio.StreamWriter, chunks: Iterable[bytes | memoryview]) -> None:
    """``writer.writelines(chunks)`` without copying large chunks into one joined buffer first."""
    parts = list(chunks)
    if sum(len(p) for p in parts) < JOIN_BELOW:
        writer.write(b"".join(parts))
        return
    small: list[bytes | memoryview] = []
    for p in parts:
        if len(p) < BIG_CHUNK:
            small.append(p)
            continue
        if small:
            writer.write(b"".join(small))
            small.clear()
        writer.write(p)
    if small:
        writer.write(b"".join(small))


class _BigIO(AbstractConnection):
    async def _connect(self) -> None:
        await super()._connect()  # type: ignore[safe-super,no-untyped-call]
        # The instance's writelines, so that every write path of redis-py (commands, pipelines) uses it.
        writer: Any = self._writer
        writer.writelines = functools.partial(write_chunks, writer)


class BigIOConnection(_BigIO, Connection):
    def _connection_arguments(self) -> dict[str, Any]:
        return {**super()._connection_arguments(), "limit": STREAM_LIMIT}


class BigIOSSLConnection(_BigIO, SSLConnection):
    def _connection_arguments(self) -> dict[str, Any]:
        return {**super()._connection_arguments(), "limit": STREAM_LIMIT}


class BigIOUnixConnection(_BigIO, UnixDomainSocketConnection):
    pass


def connection_class(url: str) -> type[AbstractConnection]:
    """The connection class for a (non-cluster) Redis URL, as redis-py would pick it, sized for big entries."""
    if url.startswith("rediss://"):
        return BigIOSSLConnection
    if url.startswith("unix://"):
        return BigIOUnixConnection
    return BigIOConnection
