"""The Atropos-compatible HTTP server (``distillq serve atropos``): FastAPI app, middleware, lifecycle.

The routes (``routes``) answer as atroposlib 0.4.0's server does, path for path and shape for
shape; the state lives in Redis (``state``, ``queue``), so a restart loses nothing; the
writers of every process on a namespace are serialized by one lock in Redis (``lock``), so several
processes may serve one namespace behind a load balancer (``startup``: replicas). A request body
above ``max_body_bytes`` (as sent or inflated) gets 413, one that stalls (no bytes for ``body_timeout_s``)
408. gzip as the reference: request bodies
with ``Content-Encoding: gzip`` are inflated (400 ``Invalid gzip payload`` if they do not inflate),
responses of 1,000 bytes or more are compressed when the client accepts gzip (level 1 by default rather
than the reference's 9: several times faster on multi-megabyte batches, about 10% larger).
"""

from __future__ import annotations

import asyncio
import contextlib
import zlib
from collections.abc import AsyncIterator

import structlog
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.middleware.gzip import GZipMiddleware
from fastapi.responses import PlainTextResponse
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Receive, Scope, Send

from pipeline.serve.atropos.queue import STAGE
from pipeline.serve.atropos.routes import install_handlers, router
from pipeline.serve.atropos.startup import ServeConfig, open_server
from pipeline.serve.http import GONE, STALLED, read_capped, replayed, stalled_message

log = structlog.get_logger("distillq.serve.atropos")


class GzipRequest:
    """Every request body read with a size cap and a read timeout, and ``Content-Encoding: gzip`` bodies
    inflated (the reference's middleware). A body above ``max_bytes`` (as sent, and once inflated) gets 413:
    the raw bytes are counted as they arrive (past the cap they are read and dropped, so the client gets the
    answer), and gzip is inflated in a worker thread, member by member, never past the cap. A body whose next
    bytes do not come within ``timeout_s`` gets 408 and the connection is closed."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float = 30.0) -> None:
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        gzipped = "gzip" in MutableHeaders(scope=scope).get("content-encoding", "").lower()
        body = await read_capped(receive, self.max_bytes, self.timeout_s)
        if body is GONE:  # the client left mid-body: nobody to answer
            return
        if body is STALLED:
            log.warning("request_body_stalled", path=scope.get("path"), timeout_s=self.timeout_s)
            await PlainTextResponse(stalled_message(self.timeout_s), status_code=408,
                                    headers={"Connection": "close"})(scope, receive, send)
            return
        if body is None:
            await _too_large(self.max_bytes, "is", scope, receive, send)
            return
        if gzipped:
            try:
                body = await asyncio.to_thread(_inflate, body, self.max_bytes) if body else b""
            except (OSError, EOFError, zlib.error):
                await PlainTextResponse("Invalid gzip payload", status_code=400)(scope, receive, send)
                return
            except OverflowError:
                await _too_large(self.max_bytes, "inflates to", scope, receive, send)
                return
            headers = MutableHeaders(scope=scope)
            headers["content-length"] = str(len(body))
            del headers["content-encoding"]
        await self.app(scope, replayed(body, receive), send)


async def _too_large(limit: int, what: str, scope: Scope, receive: Receive, send: Send) -> None:
    await PlainTextResponse(f"request body {what} more than {limit} bytes", status_code=413)(scope, receive, send)


def _inflate(body: bytes, limit: int) -> bytes:
    """gunzip ``body`` (every member, as ``gzip.decompress``), refusing output above ``limit`` bytes: no
    member is inflated past it (each gets what is left of the limit, plus one byte to see it overflow)."""
    out: list[bytes] = []
    size, data = 0, body
    while True:
        d = zlib.decompressobj(wbits=31)
        out.append(d.decompress(data, limit + 1 - size))  # size <= limit here: the bound is at least 1
        size += len(out[-1])
        if size > limit or d.unconsumed_tail:
            raise OverflowError
        if not d.eof:
            raise EOFError("truncated gzip body")
        data = d.unused_data
        if not data:  # else: concatenated members
            return b"".join(out)


def create_app(cfg: ServeConfig | None = None) -> FastAPI:
    """The app; Redis is connected (and the mover started) when it starts (ASGI lifespan)."""
    config = cfg or ServeConfig()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        stop = asyncio.Event()
        server, tasks = await open_server(config, stop)
        app.state.server = server
        try:
            yield
        finally:
            stop.set()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            with contextlib.suppress(Exception):
                await server.redis.delete(server.keys.heartbeat(STAGE, server.replica))
            await server.redis.aclose()

    app = FastAPI(title="distillq Atropos API", lifespan=lifespan)
    app.add_middleware(CORSMiddleware, allow_origins=["*"], allow_credentials=True, allow_methods=["*"],
                       allow_headers=["*"])
    app.add_middleware(GZipMiddleware, minimum_size=1000, compresslevel=config.gzip_level)
    app.add_middleware(GzipRequest, max_bytes=config.max_body_bytes, timeout_s=config.body_timeout_s)
    app.include_router(router)
    install_handlers(app)
    return app

