"""Teacher pools on the transport: each group goes to its pool's rollouts stream.

A group names its pool in ``group_overrides.teacher`` (``schemas.pools``); the pool ``default`` is the
``rollouts`` stream, pool P is ``rollouts.P`` (``keys.pool_stream``), each with its own backlog cap, shards and
``teacher`` consumer group. ``PoolProducer`` is the rollouts producer every writer of groups uses (rollout
workers, ``push``, the SDK, ``serve atropos``): it picks the stream by the group's pool and records the pool in
the ``ns:pools`` set the first time it writes there, so ``distillq stats`` can name a pool whose groups wait
with no teacher worker to read them.
"""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from pipeline.config import StreamSettings
from pipeline.transport.keys import Keys, pool_stream
from pipeline.transport.producer import Added, StreamProducer
from schemas.messages import Message, RolloutGroup
from schemas.pools import DEFAULT_POOL, pool_of

__all__ = ["PoolProducer", "known_pools", "register_pool"]


async def register_pool(redis: aioredis.Redis, keys: Keys, pool: str) -> None:
    """Record ``pool`` in the namespace's set of pools."""
    await redis.sadd(keys.pools, pool)  # type: ignore[misc]


async def known_pools(redis: aioredis.Redis, keys: Keys) -> list[str]:
    """Every pool groups were sent to, and ``default``, sorted with ``default`` first."""
    raw = await redis.smembers(keys.pools)  # type: ignore[misc]
    names = {m.decode() if isinstance(m, bytes) else str(m) for m in raw} | {DEFAULT_POOL}
    return sorted(names, key=lambda p: (p != DEFAULT_POOL, p))


class PoolProducer(StreamProducer):
    """The rollouts producer: a ``RolloutGroup`` goes to its pool's stream (``pool_of(group_overrides)``);
    anything else, and a group of the pool ``default``, to ``rollouts``. ``shards`` applies to every pool."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        settings: StreamSettings | None = None,
        *,
        dedupe: bool = True,
        shards: int = 1,
    ) -> None:
        super().__init__(redis, keys, "rollouts", settings, dedupe=dedupe, shards=shards)
        self._pools: dict[str, StreamProducer] = {}
        self._registered: set[str] = set()

    def for_pool(self, pool: str) -> StreamProducer:
        """The producer of ``pool``'s stream (this one for ``default``), with this one's shard count."""
        if pool == DEFAULT_POOL:
            return self
        p = self._pools.get(pool)
        if p is None:
            p = self._pools[pool] = StreamProducer(self.redis, self.keys, pool_stream(pool), self.settings,
                                                   dedupe=self.dedupe, shards=self.shards)
        p.shards = self.shards
        return p

    def seen_key(self, group_id: str, pool: str = DEFAULT_POOL) -> str:
        """The dedupe marker of ``group_id`` on ``pool``'s stream."""
        return self.keys.seen(pool_stream(pool), group_id, self.shards)

    async def send(self, msg: Message, *, stop: asyncio.Event | None = None, token: str | None = None) -> Added:
        pool = pool_of(msg.group_overrides) if isinstance(msg, RolloutGroup) else DEFAULT_POOL
        if pool not in self._registered:
            await register_pool(self.redis, self.keys, pool)
            self._registered.add(pool)
        if pool == DEFAULT_POOL:
            return await super().send(msg, stop=stop, token=token)
        return await self.for_pool(pool).send(msg, stop=stop, token=token)
