"""Process plumbing shared by every worker: signals -> stop event, metrics endpoint, health check.

Signals are handled here only (never in library code), so tests drive a stage by setting ``stop``.
SIGTERM/SIGINT start a graceful shutdown; a second signal cancels at once. SIGUSR1 logs what every
asyncio task is waiting on (``task_stack`` events, innermost call last): where a stuck worker is stuck.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis
import structlog

from pipeline.config import RedisSettings
from pipeline.metrics import serve_metrics
from pipeline.stages.liveness import Beat, read_beats, skew_note
from pipeline.transport.connection import TRANSIENT, connect, mask_url
from pipeline.transport.keys import Keys

log = structlog.get_logger("distillq.worker")
StageMain = Callable[[aioredis.Redis, Keys, asyncio.Event], Awaitable[Any]]


def install_signal_handlers(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()

    def on_signal(sig: signal.Signals) -> None:
        if stop.is_set():
            log.warning("second_signal_cancelling", signal=sig.name)
            if task is not None:
                task.cancel()
            return
        log.info("shutdown_requested", signal=sig.name)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    loop.add_signal_handler(signal.SIGUSR1, log_task_stacks)


def await_chain(coro: Any) -> list[str]:
    """``file:line function`` of each coroutine in the chain ``coro`` awaits, outermost first.

    ``Task.get_stack`` returns one frame for a suspended coroutine; following ``cr_await`` reaches the
    call that actually waits."""
    out: list[str] = []
    while coro is not None:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is not None:
            out.append(f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno} {frame.f_code.co_name}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return out


def task_chains() -> dict[str, list[str]]:
    """Each asyncio task of the running loop (but the calling one) -> its ``await_chain``."""
    me = asyncio.current_task()
    return {t.get_name(): await_chain(t.get_coro()) for t in asyncio.all_tasks() if t is not me}


def log_task_stacks() -> None:
    """One ``task_stack`` log event per asyncio task of the running loop."""
    for name, stack in task_chains().items():
        log.warning("task_stack", task=name, stack=stack)


async def run_worker(
    stage: str,
    redis_settings: RedisSettings,
    main: StageMain,
    *,
    metrics_port: int = 0,
    metrics_host: str = "127.0.0.1",
) -> int:
    """Connect, expose metrics, run ``main`` until it returns or a signal stops it."""
    serve_metrics(metrics_port, metrics_host)
    stop = asyncio.Event()
    install_signal_handlers(stop)
    redis = connect(redis_settings)
    log.info("worker_starting", stage=stage, redis=mask_url(redis_settings.redis_url),
             namespace=redis_settings.namespace, metrics_port=metrics_port or None)
    try:
        await main(redis, Keys(redis_settings.namespace), stop)
    except asyncio.CancelledError:
        log.warning("worker_cancelled", stage=stage)
        return 130
    except TRANSIENT as e:
        if not stop.is_set():
            raise
        log.info("stopped_while_redis_unavailable", stage=stage, error=str(e))
    finally:
        await redis.aclose()
    return 0


async def check_health(
    redis_settings: RedisSettings, stage: str, max_age_s: float = 30.0, *, host: str | None = None
) -> tuple[bool, str]:
    """Healthy when a worker of ``stage`` (on ``host``, if given) wrote its heartbeat within ``max_age_s`` (on the
    Redis clock, ``pipeline.stages.liveness``, as ``distillq stats`` reads it; a worker clock off by more than
    ``MAX_SKEW_S`` is named).

    A container health check passes ``host=socket.gethostname()`` so that each replica reports on its
    own worker, not on any replica of the stage.
    """
    redis = connect(redis_settings)
    keys = Keys(redis_settings.namespace)
    try:
        _, beats = await read_beats(redis, keys, stage)  # aged on the Redis clock, as distillq stats does
        if not beats:
            return False, f"no {stage} worker heartbeat under namespace {keys.namespace!r}"
        fresh: list[Beat] = []
        sick: list[str] = []
        for b in beats:
            if (host is not None and b.info.get("host") != host) or b.age_s > max_age_s:
                continue
            if b.info.get("unhealthy"):  # alive, but says it cannot do its work (a teacher's backend failing)
                sick.append(f"{b.consumer}: {b.info['unhealthy']}")
            else:
                fresh.append(b)
        clocks = [n for b in beats if (n := skew_note(b.consumer, b.skew_s, str(b.info.get("host", ""))))]
        clock = f"; {'; '.join(clocks)}" if clocks else ""
        if not fresh:
            where = f" from host {host!r}" if host is not None else ""
            if sick:
                return False, f"{len(sick)} {stage} worker(s) alive{where} but unhealthy: {'; '.join(sick)}{clock}"
            return False, f"{len(beats)} {stage} heartbeat(s), none{where} fresher than {max_age_s:.0f} s{clock}"
        slow = [f"{b.consumer}: {b.info['slow']}" for b in fresh if b.info.get("slow")]
        extra = f"; {len(sick)} unhealthy: {'; '.join(sick)}" if sick else ""
        extra += f"; {len(slow)} slow: {'; '.join(slow)}" if slow else ""
        return True, f"{len(fresh)} {stage} worker(s) healthy{extra}{clock}"
    finally:
        await redis.aclose()
