"""Sharded stage streams: the pipeline's shard count (kept in Redis) and a consumer over all shards.

The shard count S is part of the pipeline's configuration in ``ns:config`` (field ``shards``), so every
worker agrees on it. Changing it is an explicit operation (``distillq shards set S``) that refuses
while any shard of ``rollouts`` or ``scored`` still holds entries, since entries would be stranded on
shards nobody reads; stop producers, let the pipeline drain, then change it.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Sequence

import redis.asyncio as aioredis

from pipeline.config import StreamSettings
from pipeline.errors import ConfigurationError
from pipeline.transport.consumer import Delivery, StreamConsumer
from pipeline.transport.keys import MAX_SHARDS, SHARDABLE, Keys, family, pool_stream
from pipeline.transport.pools import known_pools
from schemas.pools import DEFAULT_POOL

SHARDS_FIELD = "shards"


class ShardConfigError(ConfigurationError, RuntimeError):
    """A shard count or assignment out of range, or a change of the count while sharded streams hold entries."""


async def get_shards(redis: aioredis.Redis, keys: Keys) -> int:
    raw = await redis.hget(keys.config, SHARDS_FIELD)  # type: ignore[misc]
    if raw is None:
        return 1
    n = int(raw)
    if not 1 <= n <= MAX_SHARDS:
        raise ShardConfigError(f"{keys.config} has shards={n}, outside [1, {MAX_SHARDS}]")
    return n


async def set_shards(redis: aioredis.Redis, keys: Keys, shards: int, *, force: bool = False) -> int:
    """Set the shard count; refuses while sharded streams hold entries (unless ``force``)."""
    if not 1 <= shards <= MAX_SHARDS:
        raise ShardConfigError(f"shards must be in [1, {MAX_SHARDS}]")
    current = await get_shards(redis, keys)
    if not force and current != shards:
        pools = [pool_stream(p) for p in await known_pools(redis, keys) if p != DEFAULT_POOL]  # sharded alike
        for name in [*sorted(SHARDABLE), *pools]:
            for key in keys.streams(name, current):
                n = await redis.xlen(key)
                if n:
                    raise ShardConfigError(
                        f"{key} still holds {n} entries: drain the pipeline before changing shards "
                        f"({current} -> {shards}), or pass --force to strand them"
                    )
    await redis.hset(keys.config, SHARDS_FIELD, str(shards))  # type: ignore[misc]
    return current


def parse_assigned(value: str | None, shards: int) -> list[int]:
    """``"0,2"`` -> [0, 2]; ``None`` -> every shard."""
    if not value:
        return list(range(shards))
    out = sorted({int(x) for x in value.split(",") if x.strip()})
    if not out or out[0] < 0 or out[-1] >= shards:
        raise ShardConfigError(f"assigned shards {value!r} outside [0, {shards})")
    return out


class ShardedConsumer:
    """The consumer group of a stream read across several shards, fairly (the start rotates)."""

    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        stream: str,
        name: str,
        settings: StreamSettings | None = None,
        *,
        shards: Sequence[int],
        total: int,
        stage: str | None = None,
        resolve_payloads: bool = True,
    ) -> None:
        """Read ``shards`` (a subset of ``range(total)``) of ``stream``."""
        self.settings = settings or StreamSettings()
        self.stream = stream
        self.parts = {
            i: StreamConsumer(redis, keys, stream, name, self.settings, stage=stage, shard=i, shards=total,
                              resolve_payloads=resolve_payloads)
            for i in shards
        }
        self._order = list(self.parts)
        self._next = 0
        first = self.parts[self._order[0]]
        self.name, self.group, self.stage, self.key = name, first.group, first.stage, first.key

    @property
    def owned(self) -> set[str]:
        return set().union(*(c.owned for c in self.parts.values()))

    async def ensure_group(self) -> None:
        for c in self.parts.values():
            await c.ensure_group()

    async def read(self, count: int, block_ms: int | None = None, *, block: bool = True) -> list[Delivery]:
        """A non-blocking pass over every shard from a rotating start; if empty, a short blocking read."""
        n = len(self._order)
        start = self._next
        self._next = (start + 1) % n
        out: list[Delivery] = []
        try:
            for j in range(n):
                if len(out) >= count:
                    break
                out += await self.parts[self._order[(start + j) % n]].read(count - len(out), block=False)
        except BaseException:
            self.release(out)  # as StreamConsumer.read: never leave an entry owned but not handed out
            raise
        if out or not block:
            return out
        wait = self.settings.block_ms if block_ms is None else block_ms
        return await self.parts[self._order[start]].read(count, block_ms=max(1, wait // n))

    def _by_shard(self, deliveries: Sequence[Delivery]) -> dict[int, list[Delivery]]:
        groups: dict[int, list[Delivery]] = defaultdict(list)
        for d in deliveries:
            groups[d.shard].append(d)
        return groups

    async def ack(self, deliveries: Sequence[Delivery], *, keep_payloads: bool = False) -> list[Delivery]:
        missed: list[Delivery] = []
        for shard, ds in self._by_shard(deliveries).items():
            missed += await self.parts[shard].ack(ds, keep_payloads=keep_payloads)
        return missed

    async def still_pending(self, deliveries: Sequence[Delivery]) -> list[Delivery]:
        alive: list[Delivery] = []
        for shard, ds in self._by_shard(deliveries).items():
            alive += await self.parts[shard].still_pending(ds)
        return alive

    async def dead_letter(self, d: Delivery, reason: str) -> None:
        await self.parts[d.shard].dead_letter(d, reason)

    def release(self, deliveries: Sequence[Delivery]) -> None:
        for shard, ds in self._by_shard(deliveries).items():
            self.parts[shard].release(ds)

    async def touch(self) -> None:
        await asyncio.gather(*(c.touch() for c in self.parts.values()))

    async def pending_count(self) -> int:
        return sum([await c.pending_count() for c in self.parts.values()])

    async def backlog(self) -> int:
        return sum([await c.backlog() for c in self.parts.values()])


Consumer = StreamConsumer | ShardedConsumer


def make_consumer(
    redis: aioredis.Redis,
    keys: Keys,
    stream: str,
    name: str,
    settings: StreamSettings | None = None,
    *,
    stage: str | None = None,
    shards: int = 1,
    assigned: Sequence[int] | None = None,
    resolve_payloads: bool = True,
) -> Consumer:
    """A plain consumer for an unsharded stream, else a ``ShardedConsumer`` over ``assigned`` shards."""
    if shards <= 1 or family(stream) not in SHARDABLE:
        return StreamConsumer(redis, keys, stream, name, settings, stage=stage, resolve_payloads=resolve_payloads)
    return ShardedConsumer(redis, keys, stream, name, settings, shards=list(assigned or range(shards)), total=shards,
                           stage=stage, resolve_payloads=resolve_payloads)
