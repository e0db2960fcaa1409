"""Producer SDK for users who run their own environments: ``push(group)`` from any Python program.

    from pipeline.transport.sdk import GroupProducer            # sync; AsyncGroupProducer for asyncio
    with GroupProducer("redis://127.0.0.1:6379/0") as producer:
        producer.push(group)                           # a schemas.RolloutGroup
        producer.push_atropos(scored_data_group_dict)  # or the reference ScoredDataGroup layout

Pushes are idempotent by group id and wait (backpressure) while the rollouts stream is full. A
ScoredDataGroup without ``group_id`` gets one derived from its content
(``schemas.atropos.content_group_id``), so pushing the same group again after an error is safe.
"""

from __future__ import annotations

import asyncio
from types import TracebackType
from typing import Any

import redis.asyncio as aioredis

from pipeline.config import StreamSettings, redis_settings
from pipeline.transport.connection import connect
from pipeline.transport.keys import Keys
from pipeline.transport.pools import PoolProducer
from pipeline.transport.producer import Added, StreamProducer
from pipeline.transport.sharding import get_shards
from schemas import Limits, RolloutGroup
from schemas.atropos import rollout_group_from_atropos
from schemas.validate import validate


class AsyncGroupProducer:
    def __init__(
        self,
        redis_url: str | None = None,
        *,
        namespace: str | None = None,
        stream: str = "rollouts",
        settings: StreamSettings | None = None,
        redis: aioredis.Redis | None = None,
    ) -> None:
        rs = redis_settings(redis_url, namespace)
        self._own = redis is None
        self.redis = redis if redis is not None else connect(rs)
        self.settings = settings or StreamSettings()
        # rollouts: each group to its teacher pool's stream (``group_overrides.teacher``)
        self.producer = (PoolProducer(self.redis, Keys(rs.namespace), self.settings) if stream == "rollouts"
                         else StreamProducer(self.redis, Keys(rs.namespace), stream, self.settings))
        self.limits: Limits = self.settings.limits()
        self._keys = Keys(rs.namespace)
        self._shards_known = False

    async def push(self, group: RolloutGroup) -> Added:
        """Validate and add one group (raises ``schemas.DecodeError`` naming the bad field)."""
        validate(group, self.limits)
        return await self._send(group)

    async def _send(self, group: RolloutGroup) -> Added:
        """Add one group already validated under ``self.limits``."""
        if not self._shards_known:
            self.producer.shards = await get_shards(self.redis, self._keys)
            self._shards_known = True
        return await self.producer.send(group)

    async def push_atropos(self, obj: dict[str, Any], *, policy_version: int = 0) -> Added:
        """Convert and add one ScoredDataGroup dict; without ``group_id`` its id is ``content_group_id(obj)``
        (derived by ``rollout_group_from_atropos``), so a retried push is the same group."""
        return await self._send(rollout_group_from_atropos(obj, policy_version=policy_version, limits=self.limits))

    async def aclose(self) -> None:
        if self._own:
            await self.redis.aclose()

    async def __aenter__(self) -> AsyncGroupProducer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class GroupProducer:
    """Synchronous producer (an ``AsyncGroupProducer`` on a private ``asyncio.Runner``)."""

    def __init__(self, redis_url: str | None = None, **kwargs: Any) -> None:
        self._runner = asyncio.Runner()
        self._client: AsyncGroupProducer = self._runner.run(_make(redis_url, kwargs))

    def push(self, group: RolloutGroup) -> Added:
        return self._runner.run(self._client.push(group))

    def push_atropos(self, obj: dict[str, Any], *, policy_version: int = 0) -> Added:
        return self._runner.run(self._client.push_atropos(obj, policy_version=policy_version))

    def close(self) -> None:
        self._runner.run(self._client.aclose())
        self._runner.close()

    def __enter__(self) -> GroupProducer:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


async def _make(redis_url: str | None, kwargs: dict[str, Any]) -> AsyncGroupProducer:
    return AsyncGroupProducer(redis_url, **kwargs)
