"""The minimal HTTP/1.1 request reading the stub servers share."""

from __future__ import annotations

import asyncio


async def read_request(reader: asyncio.StreamReader) -> tuple[str, str, bytes] | None:
    """(method, path, body) of the next request on a keep-alive connection; ``None`` when it closes."""
    line = await reader.readline()
    if not line:
        return None
    method, path, _ = line.decode().split(" ", 2)
    headers: dict[str, str] = {}
    while (h := await reader.readline()) not in (b"\r\n", b"\n", b""):
        key, value = h.decode().split(":", 1)
        headers[key.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return method, path, body
