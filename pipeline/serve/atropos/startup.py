"""What the Atropos-compatible server's routes share (``Server``), its settings (``ServeConfig``), and
its startup: Redis connected, the shard count read, the mover (scored -> queue) and heartbeat started.

Replicas: every piece of state is in Redis, and the writers' locks are Redis locks (``lock``), so
several processes can serve one namespace behind a load balancer. What stays in a process is safe per
replica: the ``/status`` figures are cached for 0.2 s; each replica heartbeats under its own name
(``<consumer name>-<host>-<pid>``); the replicas read ``scored`` in one consumer group (under one consumer
name or several: a move onto the queue is idempotent, and entries of a replica that died are reclaimed
once idle); ``PostGate`` holds posts back during a ``/reset_data`` on the replica that resets."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
import structlog

from pipeline.config import RedisSettings, StreamSettings
from pipeline.serve.atropos.ingest import Ingest
from pipeline.serve.atropos.lock import SharedLock
from pipeline.serve.atropos.packing import scoring_completes_batch
from pipeline.serve.atropos.queue import STAGE, AtroposQueue
from pipeline.serve.atropos.state import AtroposState, Trainer
from pipeline.stages.lifecycle import Heartbeat
from pipeline.transport.connection import connect, retry_transient
from pipeline.transport.keys import Keys
from pipeline.transport.sharding import get_shards

log = structlog.get_logger("distillq.serve.atropos")


@dataclass(frozen=True)
class ServeConfig:
    redis: RedisSettings = field(default_factory=RedisSettings)
    streams: StreamSettings = field(default_factory=StreamSettings)
    lease_s: float = 600.0  # lease of ``GET /batch?lease=1`` unless the request names one (``lease_s``)
    consumer_name: str = "atropos-server"  # stable: a restarted server gets back what it had read
    gzip_level: int = 1
    max_body_bytes: int = 1 << 30  # a request body above this (as sent, or inflated) is refused with 413
    body_timeout_s: float = 30.0  # a request body whose next bytes take longer is answered 408
    batch_wait_s: float = 1.0  # how long GET /batch waits when groups being scored would complete a batch


class PostGate:
    """Posts (``/scored_data*``) run side by side; ``/reset_data`` waits for those under way and holds new ones
    back until it is done, so no post writes half before and half after a reset."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._posts, self._resetting = 0, False

    @contextlib.asynccontextmanager
    async def post(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._resetting)
            self._posts += 1
        try:
            yield
        finally:
            async with self._cond:
                self._posts -= 1
                self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def reset(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._resetting)
            self._resetting = True
            await self._cond.wait_for(lambda: self._posts == 0)
        try:
            yield
        finally:
            async with self._cond:
                self._resetting = False
                self._cond.notify_all()


@dataclass
class Server:
    """What the routes share: Redis, the state, the queue, the ingest path, and the writers' lock."""

    cfg: ServeConfig
    redis: aioredis.Redis
    keys: Keys
    state: AtroposState
    queue: AtroposQueue
    ingest: Ingest
    lock: SharedLock | asyncio.Lock = field(default_factory=asyncio.Lock)  # the writers' (every replica's)
    replica: str = "atropos-server"  # this process's name (its heartbeat)
    gate: PostGate = field(default_factory=PostGate)
    items_cache: tuple[float, list[tuple[int | None, int]]] = (0.0, [])

    async def pending(self) -> list[tuple[int | None, int]]:
        """(env id, sequences) of every group posted and not yet handed out, at most 0.2 s old (envs poll
        ``/status-env`` every 0.1 s each): the in-flight records and the queue's running counts."""
        loop = asyncio.get_running_loop()
        at, items = self.items_cache
        if loop.time() - at > 0.2:
            items = [*await self.state.inflight(), *await self.queue.items()]
            self.items_cache = (loop.time(), items)
        return items

    async def scoring_completes_batch(self, t: Trainer, envs: list[dict[str, Any]]) -> bool:
        """Whether groups posted and still being scored would complete a batch the queue cannot make now."""
        inflight = await self.state.inflight()
        return bool(inflight) and scoring_completes_batch(await self.queue.items(), inflight, t.batch_size, envs)


async def open_server(cfg: ServeConfig, stop: asyncio.Event) -> tuple[Server, list[asyncio.Task[Any]]]:
    """Connect, read the shard count, and start the mover (which writes the replica's heartbeat)."""
    redis = connect(cfg.redis)
    keys = Keys(cfg.redis.namespace)
    shards = await retry_transient(lambda: get_shards(redis, keys), deadline_s=60)
    state = AtroposState(redis, keys, ttl_s=cfg.streams.dedupe_ttl_s)
    queue = AtroposQueue(redis, keys, state, cfg.streams, consumer_name=cfg.consumer_name, shards=shards)
    ingest = Ingest(redis, keys, state, cfg.streams, shards=shards, name=cfg.consumer_name,
                    buffers_lock=SharedLock(redis, keys.atropos("buffers_lock")))
    replica = f"{cfg.consumer_name}-{socket.gethostname()}-{os.getpid()}"
    server = Server(cfg, redis, keys, state, queue, ingest, lock=SharedLock(redis, keys.atropos("lock")),
                    replica=replica)
    beat = Heartbeat(redis, keys, STAGE, replica, cfg.streams.heartbeat_interval_s)
    tasks: list[asyncio.Task[Any]] = [asyncio.create_task(queue.run_mover(stop, beat), name="atropos-mover")]
    log.info("atropos_server_ready", namespace=keys.namespace, shards=shards, consumer=cfg.consumer_name,
             replica=replica)
    return server, tasks
