"""The student server's HTTP routes (FastAPI), in the shapes verifiers 0.4 uses.

=========================================  ===================================================================
``GET /v1/models``                         served model names with ``max_model_len`` (the train client's
                                           prompt-length check reads it)
``POST /inference/v1/generate``            token ids in, ``choices[0].token_ids`` and
                                           ``choices[0].logprobs.content[i] = {"token": "token_id:<id>",
                                           "logprob": x}`` out (verifiers' train client mode)
``POST /v1/chat/completions``              OpenAI chat completions, ``stream`` and
                                           ``stream_options.include_usage`` honoured (eval client mode)
``POST /sessions/{id}/finish``             close a rollout: ``{"task", "reward", "trainable", "group_size"?,
                                           "env_id"?, "policy_version"?, "group_overrides"?}``; full groups
                                           are pushed onto ``rollouts``
``DELETE /sessions/{id}``                  drop a rollout without training on it
``GET /sessions/{id}``                     what is tracked for a rollout (debugging)
``GET /health``                            sessions, open groups, groups waiting to be pushed
=========================================  ===================================================================

Every inference request carrying ``X-Session-ID`` is recorded in that session's tree-mode tracker.
A request body above ``max_body_bytes`` is refused with 413 (counted as it arrives, never read in full), one
that stalls (no bytes for ``body_timeout_s``) with 408, one nested more than ``jsonbody.MAX_DEPTH`` levels or
holding a lone surrogate with 400 naming the field.
Errors use the OpenAI shape ``{"error": {"message", "type", "param", "code"}}``. A malformed body (a missing
or out-of-range field, invalid JSON) is a 400 naming the field, as vLLM and OpenAI answer it, so an OpenAI
client (verifiers') raises its ``BadRequestError`` with the reason rather than FastAPI's ``{"detail": [...]}``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
from collections.abc import AsyncIterator
from typing import Any

import structlog
from fastapi import FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from pipeline.rollout.openai_types import Stream
from pipeline.serve.http import GONE, STALLED, read_capped, replayed, stalled_message
from pipeline.serve.student.jsonbody import body_problem
from pipeline.serve.student.service import (
    FinishRequest,
    GenerateRequest,
    ServeError,
    StudentService,
    sse_events,
)

log = structlog.get_logger(__name__)
SESSION_HEADER = "X-Session-ID"


#: The default cap on a request body (``--max-body-bytes``): a generate request of 100,000 token ids is ~0.7 MB.
MAX_BODY_BYTES = 32 << 20


#: The default wait for the next bytes of a request body (``--body-timeout-s``).
BODY_TIMEOUT_S = 30.0


#: The largest request header (name and value) the server takes (nginx's default buffer for one is 8 KiB).
MAX_HEADER_BYTES = 8192


class BodyCap:
    """Every request body read with a size cap and a read timeout, and checked for what no field's own check
    sees (``jsonbody``), each refusal in the OpenAI shape: a header above ``MAX_HEADER_BYTES`` 431 and a declared
    ``Content-Length`` above ``max_bytes`` 413 before any body byte is read; a body above ``max_bytes`` 413 (the
    rest of it is read and dropped as it arrives, so the client gets the answer); no bytes of it for ``timeout_s``
    408 (and the connection closed); nested too deep or holding a lone surrogate 400 naming the field."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float = BODY_TIMEOUT_S) -> None:
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    def _head_refusal(self, scope: Scope) -> tuple[int, str, str] | None:
        """A request refused on its head alone: a header above ``MAX_HEADER_BYTES`` (431), or a declared
        ``Content-Length`` above ``max_bytes`` (413: nobody waits for a body that would be refused)."""
        for name, value in scope.get("headers") or ():
            if len(name) + len(value) > MAX_HEADER_BYTES:
                shown = name.decode("latin-1")[:40]
                return 431, f"header {shown} is {len(value)} bytes (at most {MAX_HEADER_BYTES})", "HeaderTooLarge"
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                return 413, f"request body is more than {self.max_bytes} bytes", "RequestTooLarge"
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._head_refusal(scope)
        if refusal is not None:  # answered before any body byte is read, and the connection closed
            status, message, kind = refusal
            err = ServeError(status, message, kind)
            await JSONResponse(err.body(), status_code=status, headers={"Connection": "close"})(scope, receive, send)
            return
        body = await read_capped(receive, self.max_bytes, self.timeout_s)
        if body is GONE:
            return
        if body is STALLED:
            log.warning("student.request_body_stalled", path=scope.get("path"), timeout_s=self.timeout_s)
            err = ServeError(408, stalled_message(self.timeout_s), "RequestTimeout")
            await JSONResponse(err.body(), status_code=408, headers={"Connection": "close"})(scope, receive, send)
            return
        if body is None:
            err = ServeError(413, f"request body is more than {self.max_bytes} bytes", "RequestTooLarge")
            await JSONResponse(err.body(), status_code=413)(scope, receive, send)
            return
        problem = body_problem(body)
        if problem is not None:
            err = ServeError(400, f"invalid request: {problem}", param=problem.field)
            await JSONResponse(err.body(), status_code=400)(scope, receive, send)
            return
        await self.app(scope, replayed(body, receive), send)


def create_app(
    service: StudentService,
    *,
    maintain_every_s: float = 10.0,
    api_key: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    body_timeout_s: float = BODY_TIMEOUT_S,
) -> FastAPI:
    """The app; a background task runs ``service.maintain`` every ``maintain_every_s`` seconds. With
    ``api_key``, every route but ``/health`` wants ``Authorization: Bearer <api_key>`` (else 401). A request
    body above ``max_body_bytes`` gets 413, one whose next bytes take more than ``body_timeout_s`` 408."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async def loop() -> None:
            while True:
                await asyncio.sleep(maintain_every_s)
                try:
                    await service.maintain()
                except Exception:  # keep bounding sessions whatever one pass hit
                    log.exception("student.maintain_failed")

        task = asyncio.create_task(loop())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await service.close()

    app = FastAPI(title="distillq student", lifespan=lifespan)
    app.state.service = service

    @app.exception_handler(ServeError)
    async def serve_error(request: Request, exc: ServeError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def malformed(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = validation_error(exc)
        return JSONResponse(err.body(), status_code=err.status)

    if api_key:
        expected = f"Bearer {api_key}".encode()

        @app.middleware("http")
        async def authorize(request: Request, call_next: Any) -> Response:
            given = request.headers.get("authorization", "").encode("latin-1")  # the header's bytes as sent
            if request.url.path != "/health" and not hmac.compare_digest(given, expected):
                return JSONResponse(ServeError(401, "invalid or missing API key", "AuthenticationError").body(), 401)
            response: Response = await call_next(request)
            return response

    app.add_middleware(BodyCap, max_bytes=max_body_bytes, timeout_s=body_timeout_s)
    _inference_routes(app, service)
    _session_routes(app, service)
    return app


def _inference_routes(app: FastAPI, service: StudentService) -> None:
    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return service.models()

    @app.post("/inference/v1/generate")
    async def generate(
        req: GenerateRequest, x_session_id: str | None = Header(None, alias=SESSION_HEADER)
    ) -> dict[str, Any]:
        return await service.generate(req, x_session_id)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(request: Request, x_session_id: str | None = Header(None, alias=SESSION_HEADER)) -> Response:
        body = await _json_object(request)
        out = await service.chat(body, x_session_id)
        if isinstance(out, Stream):
            events = sse_events(out.chunks)

            async def send() -> AsyncIterator[bytes]:
                for e in events:
                    yield e

            return StreamingResponse(send(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return JSONResponse(out.model_dump())


def _session_routes(app: FastAPI, service: StudentService) -> None:
    @app.post("/sessions/{session_id}/finish")
    async def finish(session_id: str, req: FinishRequest) -> dict[str, Any]:
        return await service.finish(session_id, req)

    @app.delete("/sessions/{session_id}", status_code=204)
    async def discard(session_id: str) -> Response:
        if not service.discard(session_id):
            raise ServeError(404, f"no session {session_id!r}", "NotFoundError")
        return Response(status_code=204)

    @app.get("/sessions/{session_id}")
    async def session(session_id: str) -> dict[str, Any]:
        s = service.sessions.get(session_id)
        if s is None:
            raise ServeError(404, f"no session {session_id!r}", "NotFoundError")
        return {
            "id": s.id,
            "requests": s.requests,
            "branches": [{"tokens": n.length, "sampled": sum(n.mask), "turns": n.turns} for n in s.tracker.leaves()],
            "divergences": s.tracker.stats.divergences,
        }

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "sessions": len(service.sessions),
            "open_groups": len(service.groups),
            "unsent_groups": len(service.unsent),
            "untracked_requests": service.untracked,
        }


#: How many validation errors a 400 lists (a large malformed body can fail on every element).
MAX_REPORTED_ERRORS = 10


def validation_error(exc: RequestValidationError) -> ServeError:
    """A 400 in the OpenAI shape for a body FastAPI could not validate: each failing field with pydantic's
    reason (never the offending value), ``param`` the first field."""
    errors = list(exc.errors())
    where = [".".join(str(x) for x in e.get("loc", ()) if x != "body") or "body" for e in errors]
    parts = [f"{w}: {e.get('msg', 'invalid')}" for w, e in zip(where, errors, strict=True)][:MAX_REPORTED_ERRORS]
    if len(errors) > MAX_REPORTED_ERRORS:
        parts.append(f"and {len(errors) - MAX_REPORTED_ERRORS} more")
    message = "invalid request: " + ("; ".join(parts) or "the body does not validate")
    return ServeError(400, message, param=where[0] if where else None)


async def _json_object(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError as e:
        raise ServeError(400, f"request body is not JSON: {e}") from e
    except RecursionError as e:  # BodyCap refuses deep bodies first: a parser deeper than its scan
        raise ServeError(400, "request body is nested too deep", param="body") from e
    if not isinstance(body, dict):
        raise ServeError(400, f"request body must be a JSON object, got {type(body).__name__}")
    return body
