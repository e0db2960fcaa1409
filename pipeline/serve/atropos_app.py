"""The Atropos-compatible HTTP server (``distillq serve atropos``): FastAPI app, middleware, lifecycle.

The routes (``atropos_routes``) answer as atroposlib 0.4.0's server does, path for path and shape for
shape; the state lives in Redis (``atropos_state``, ``atropos_queue``), so a restart loses nothing. One
process per namespace (its writers are serialized by one lock). gzip as the reference: request bodies
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
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pipeline.serve.atropos_queue import STAGE
from pipeline.serve.atropos_routes import install_handlers, router
from pipeline.serve.atropos_server import ServeConfig, open_server

log = structlog.get_logger("distillq.serve.atropos")


class GzipRequest:
    """Inflate ``Content-Encoding: gzip`` request bodies (the reference's middleware), with a size cap."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or "gzip" not in MutableHeaders(scope=scope).get("content-encoding", "").lower():
            await self.app(scope, receive, send)
            return
        chunks, more = [], True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        try:
            inflated = _inflate(body, self.max_bytes) if body else b""
        except (OSError, EOFError, zlib.error):
            await PlainTextResponse("Invalid gzip payload", status_code=400)(scope, receive, send)
            return
        except OverflowError:
            text = f"request body inflates to more than {self.max_bytes} bytes"
            await PlainTextResponse(text, status_code=413)(scope, receive, send)
            return
        headers = MutableHeaders(scope=scope)
        headers["content-length"] = str(len(inflated))
        del headers["content-encoding"]
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if sent:
                return {"type": "http.request", "body": b"", "more_body": False}
            sent = True
            return {"type": "http.request", "body": inflated, "more_body": False}

        await self.app(scope, replay, send)


def _inflate(body: bytes, limit: int) -> bytes:
    """gunzip ``body`` (every member, as ``gzip.decompress``), refusing output above ``limit`` bytes."""
    d = zlib.decompressobj(wbits=31)
    out = [d.decompress(body, limit + 1)]
    size = len(out[0])
    while d.eof and d.unused_data:  # concatenated members
        rest = d.unused_data
        d = zlib.decompressobj(wbits=31)
        out.append(d.decompress(rest, limit + 1 - size))
        size += len(out[-1])
    if size > limit or d.unconsumed_tail:
        raise OverflowError
    if not d.eof:
        raise EOFError("truncated gzip body")
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
                await server.redis.delete(server.keys.heartbeat(STAGE, config.consumer_name))
            await server.redis.aclose()

    app = FastAPI(title="distillq Atropos API", lifespan=lifespan)
    app.add_middleware(CORSMiddleware, allow_origins=["*"], allow_credentials=True, allow_methods=["*"],
                       allow_headers=["*"])
    app.add_middleware(GZipMiddleware, minimum_size=1000, compresslevel=config.gzip_level)
    app.add_middleware(GzipRequest, max_bytes=config.max_body_bytes)
    app.include_router(router)
    install_handlers(app)
    return app

