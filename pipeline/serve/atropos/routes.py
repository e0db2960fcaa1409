"""The Atropos API's routes, answering as atroposlib 0.4.0's server does (see docs/integrations.md).

Differences a client can see, all opt-in or where the reference fails: ``/batch`` hands batches out
oldest first, and with ``?lease=1`` returns a ``batch_id`` to acknowledge (``POST /batch/ack``) before
the lease runs out, else the batch is handed out again; a group that can never fit a batch is
dead-lettered (``{"status": "dead_lettered", "reason": ...}``); bad requests get a 4xx naming the field
where the reference answers 500 (unknown env id: 404; a group our wire cannot take: 422); a full pipeline
answers 503 (``Retry-After``) when the rollouts stream stays at its cap; posts answer ``kept`` and
``repeated`` besides the reference's keys (a group whose idempotency key, its ``group_id`` or the request's
``Idempotency-Key``, was posted before is a repeat, dropped).
"""

from __future__ import annotations

import asyncio
import re
from typing import Any, Final

import msgspec
from fastapi import APIRouter, FastAPI, Header, HTTPException, Query, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from pipeline.serve.atropos.bodies import BatchAck, EnvIdentifier, RegisterEnv, Registration, ScoredData
from pipeline.serve.atropos.ingest import Prepared, group_key
from pipeline.serve.atropos.packing import status_env
from pipeline.serve.atropos.queue import Handout
from pipeline.serve.atropos.startup import Server
from pipeline.transport.connection import TRANSIENT
from pipeline.transport.producer import BackpressureTimeout, MessageTooLarge
from schemas import DecodeError
from schemas.atropos import ATROPOS_KEYS, to_atropos

router = APIRouter()
#: The request header a client names its post with (a retried post with the same key is queued once).
IDEMPOTENCY_HEADER: Final = "Idempotency-Key"
#: How often ``GET /batch`` looks again while it waits for groups being scored.
BATCH_POLL_S: Final = 0.05
_JSON: Final = msgspec.json.Encoder()
NOT_REGISTERED: Final = {"status": "error", "message": "Trainer not registered. Call /register first.", "batch": []}
#: ``/latest_example`` before any group, as the reference answers it.
NO_EXAMPLE: Final[dict[str, list[Any]]] = {
    key: [] for key in ("tokens", "masks", "scores", "advantages", "ref_logprobs", "generation_params",
                        "inference_logprobs", "messages", "images")
}


def _server(request: Request) -> Server:
    server: Server = request.app.state.server
    return server


@router.get("/")
async def root() -> dict[str, str]:
    return {"message": "AtroposLib API"}


@router.post("/register")
async def register(reg: Registration, request: Request) -> dict[str, int]:
    srv = _server(request)
    async with srv.lock:
        return {"uuid": await srv.state.register(reg)}


@router.post("/register-env")
async def register_env(req: RegisterEnv, request: Request) -> dict[str, Any]:
    srv = _server(request)
    async with srv.lock:
        t = await srv.state.trainer()
        if not t.started:
            return {"status": "wait for trainer to start"}
        return await srv.state.register_env(req, t)


@router.post("/disconnect-env")
async def disconnect_env(env: EnvIdentifier, request: Request) -> dict[str, str]:
    srv = _server(request)
    async with srv.lock:
        envs = await srv.state.envs()
        if not 0 <= env.env_id < len(envs):
            return {"status": "failure", "error": "list index out of range"}
        await srv.state.save_env({**envs[env.env_id], "connected": False})
    return {"status": "success"}


@router.get("/wandb_info")
async def wandb_info(request: Request) -> dict[str, str | None]:
    t = await _server(request).state.trainer()
    return {"group": t.wandb_group, "project": t.wandb_project}


@router.get("/info")
async def info(request: Request) -> dict[str, int]:
    t = await _server(request).state.trainer()
    return {"batch_size": t.batch_size, "max_token_len": t.max_token_len}


def _batch_body(h: Handout) -> bytes:
    items = []
    for g in h.groups:
        full = to_atropos(g)
        items.append({**{key: full[key] for key in ATROPOS_KEYS}, "teacher": full["teacher"]})  # who scored it
    out: dict[str, Any] = {"batch": items}
    if h.batch_id is not None:
        out.update(batch_id=h.batch_id, deliveries=h.deliveries, lease_s=h.lease_s)
    return _JSON.encode(out)


@router.get("/batch", response_model=None)
async def batch(
    request: Request,
    lease: bool = Query(False, description="lease the batch: acknowledge it with POST /batch/ack"),
    lease_s: float | None = Query(None, gt=0, description="lease length (default: the server's --lease-s)"),
) -> Response | dict[str, Any]:
    """The next batch. When none is ready but groups being scored would complete one, waits for them (polling,
    the lock released in between) up to the server's ``batch_wait_s``."""
    srv = _server(request)
    leased = lease or lease_s is not None
    loop = asyncio.get_running_loop()
    deadline = loop.time() + srv.cfg.batch_wait_s
    while True:
        async with srv.lock:
            t = await srv.state.trainer()
            if not t.registered:
                return NOT_REGISTERED
            if not t.started:
                await srv.state.mark_started()
            envs = await srv.state.envs()
            handout = await srv.queue.take(t, envs, (lease_s or srv.cfg.lease_s) if leased else None)
            srv.items_cache = (0.0, [])
        if handout is not None:
            return Response(await asyncio.to_thread(_batch_body, handout), media_type="application/json")
        if loop.time() >= deadline or not await srv.scoring_completes_batch(t, envs):
            return {"batch": None}
        await asyncio.sleep(min(BATCH_POLL_S, max(deadline - loop.time(), 0.0)))


@router.post("/batch/ack")
async def batch_ack(body: BatchAck, request: Request) -> dict[str, str]:
    srv = _server(request)
    async with srv.lock:
        acked = await srv.queue.ack(body.batch_id)
    if not acked:
        raise HTTPException(404, f"no leased batch {body.batch_id!r}: never leased, already acknowledged, or its "
                                 "groups were dead-lettered after too many deliveries")
    return {"status": "acked", "batch_id": body.batch_id}


@router.get("/latest_example", response_model=None)
async def latest_example(request: Request) -> Response | dict[str, Any]:
    raw = await _server(request).state.latest()
    return NO_EXAMPLE if raw is None else Response(raw, media_type="application/json")


def _counts(results: list[dict[str, Any]]) -> dict[str, int]:
    """``kept`` (queued for scoring or buffered) and ``repeated`` (an idempotency key posted before: dropped)."""
    repeated = sum(r["status"] == "repeated" for r in results)
    kept = sum(r["status"] in ("received", "buffered") for r in results)
    return {"kept": kept, "repeated": repeated}


@router.post("/scored_data")
async def scored_data(data: ScoredData, request: Request,
                      idempotency_key: str | None = Header(None, alias=IDEMPOTENCY_HEADER)) -> dict[str, Any]:
    """One group: the reference's answer, plus ``kept`` and ``repeated`` (0 or 1 each). A repeat answers
    ``"status": "received"`` too (a client retrying after a lost answer sees its post done)."""
    srv = _server(request)
    async with srv.gate.post():
        t = await srv.state.trainer()
        prepared = await asyncio.to_thread(srv.ingest.prepare, data, t, group_key(data, idempotency_key, None))
        res = await srv.ingest.submit(prepared, t, await srv.state.envs())
    srv.items_cache = (0.0, [])
    out = {**res, "status": "received"} if res["status"] == "repeated" else res
    return {**out, **_counts([res])}


@router.post("/scored_data_list")
async def scored_data_list(items: list[ScoredData], request: Request,
                           idempotency_key: str | None = Header(None, alias=IDEMPOTENCY_HEADER)) -> dict[str, Any]:
    """Every group is converted before any is written: one bad group refuses the whole list (422). The answer
    is the reference's plus ``kept`` and ``repeated`` (``groups_processed`` counts every group, as there)."""
    srv = _server(request)
    out: dict[str, Any] = {"status": "received", "groups_processed": len(items)}
    results: list[dict[str, Any]] = []
    async with srv.gate.post():
        t = await srv.state.trainer()
        prepared: list[Prepared] = []
        for i, data in enumerate(items):
            try:
                prepared.append(await asyncio.to_thread(srv.ingest.prepare, data, t,
                                                        group_key(data, idempotency_key, i)))
            except DecodeError as e:
                raise DecodeError(f"{i}.{e.field}", e.reason) from None
        envs = await srv.state.envs()
        for p in prepared:
            results.append(await srv.ingest.submit(p, t, envs))
    srv.items_cache = (0.0, [])
    buffered = [r["buffer_size"] for r in results if r["status"] == "buffered"]
    dead = sum(r["status"] == "dead_lettered" for r in results)
    if buffered:
        out.update(buffered=len(buffered), last_buffer_size=buffered[-1])
    if dead:
        out["dead_lettered"] = dead
    return {**out, **_counts(results)}


@router.get("/status")
async def status(request: Request) -> dict[str, int]:
    srv = _server(request)
    t = await srv.state.trainer()
    if not t.registered:
        return {"current_step": 0, "queue_size": 0}
    return {"current_step": t.step, "queue_size": len(await srv.pending())}


@router.get("/status-env")
async def status_env_route(env: EnvIdentifier, request: Request) -> dict[str, Any]:
    srv = _server(request)
    async with srv.lock:
        envs = await srv.state.envs()
        if not 0 <= env.env_id < len(envs):
            raise HTTPException(404, f"unknown env_id {env.env_id}: {len(envs)} env(s) registered; "
                                     "register with POST /register-env")
        t = await srv.state.trainer()
        out, group_size = status_env(envs, env.env_id, await srv.pending(), t.step, t.batch_size)
        if group_size != envs[env.env_id]["group_size"]:
            await srv.state.save_env({**envs[env.env_id], "group_size": group_size})
    return out


@router.get("/reset_data")
async def reset_data(request: Request) -> PlainTextResponse:
    srv = _server(request)
    async with srv.gate.reset(), srv.lock:  # no post half before and half after it
        await srv.state.reset()
        await srv.queue.clear()
        srv.items_cache = (0.0, [])
    return PlainTextResponse("Reset successful")


_PART = re.compile(r"[^.\[\]]+|\[(\d+)\]")


def _loc(field: str) -> list[str | int]:
    """``distill_logprobs[0][5]`` -> ``["distill_logprobs", 0, 5]`` (FastAPI's ``loc`` style)."""
    return [int(m.group(1)) if m.group(1) else (int(m.group(0)) if m.group(0).isdigit() else m.group(0))
            for m in _PART.finditer(field)]


def install_handlers(app: FastAPI) -> None:
    """4xx/503 with a clear message for what the reference would answer 500 (or accept and never batch)."""

    async def bad_group(_: Request, e: Exception) -> JSONResponse:
        assert isinstance(e, DecodeError)
        detail = [{"type": "value_error", "loc": ["body", *_loc(e.field)], "msg": f"{e.field}: {e.reason}",
                   "input": None}]
        return JSONResponse({"detail": detail}, status_code=422)

    async def busy(_: Request, e: Exception) -> JSONResponse:
        return JSONResponse({"detail": str(e)}, status_code=503, headers={"Retry-After": "5"})

    async def too_large(_: Request, e: Exception) -> JSONResponse:
        return JSONResponse({"detail": str(e)}, status_code=413)

    app.add_exception_handler(DecodeError, bad_group)
    app.add_exception_handler(BackpressureTimeout, busy)
    for exc in TRANSIENT:
        app.add_exception_handler(exc, busy)
    app.add_exception_handler(MessageTooLarge, too_large)
