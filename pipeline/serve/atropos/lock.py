"""The writers' lock of the Atropos-compatible server, shared by every replica on one namespace.

Several ``serve atropos`` processes may serve one namespace behind any load balancer: what their writers
read, decide and write (a registration, an env id, a batch and its lease, an env's buffer) happens under
one lock in Redis (``redis-py``'s ``Lock``: a key set with ``NX`` and a TTL, released by a script that
checks its token). Within a process an ``asyncio.Lock`` queues the coroutines first, so each replica holds
at most one Redis lock at a time. While held the lock's TTL is renewed every ``ttl_s / 3`` seconds; a
replica killed while holding it stalls the others for at most ``ttl_s`` seconds (the key expires).
"""

from __future__ import annotations

import asyncio
import contextlib
from types import TracebackType

import redis.asyncio as aioredis
import structlog
from redis.exceptions import LockError

log = structlog.get_logger("distillq.serve.atropos")

#: Seconds a lock outlives a replica that died holding it.
LOCK_TTL_S = 5.0


class SharedLock:
    """``async with lock:`` a critical section exclusive across every replica (and every coroutine)."""

    def __init__(self, redis: aioredis.Redis, key: str, *, ttl_s: float = LOCK_TTL_S) -> None:
        self.key, self.ttl_s = key, ttl_s
        self._local = asyncio.Lock()
        self._lock = redis.lock(key, timeout=ttl_s, sleep=0.01, thread_local=False)
        self._renew: asyncio.Task[None] | None = None

    async def __aenter__(self) -> SharedLock:
        await self._local.acquire()
        try:
            await self._lock.acquire()
        except BaseException:
            self._local.release()
            raise
        self._renew = asyncio.create_task(self._keep())
        return self

    async def _keep(self) -> None:
        while True:
            await asyncio.sleep(self.ttl_s / 3)
            try:
                await self._lock.reacquire()
            except LockError:
                log.error("shared_lock_lost", key=self.key)
                return
            except Exception as e:  # Redis away for a moment: try again next period
                log.warning("shared_lock_renew_failed", key=self.key, error=f"{type(e).__name__}: {e}")

    async def __aexit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        try:
            if self._renew is not None:
                self._renew.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._renew
                self._renew = None
            try:
                await self._lock.release()
            except LockError:  # expired (the key's TTL ran out): another replica may hold it now
                log.warning("shared_lock_expired_before_release", key=self.key)
        finally:
            self._local.release()
