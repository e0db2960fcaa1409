"""The learner's side of the pipeline: iterate train batches, ack after the optimiser step, publish
the policy version.

    from pipeline.learner.client import Learner
    with Learner("redis://127.0.0.1:6379/0") as learner:        # sync; AsyncLearner for asyncio
        version = learner.policy_version()
        for batch in learner.batches():
            loss = step(to_torch(batch.batch))                  # pipeline.learner.torch_batch.to_torch
            learner.ack(batch)                                  # unacked batches are redelivered
            version += 1
            learner.publish_policy_version(version)             # after the new weights are in place

Batches are read through the ``learner`` consumer group under a stable consumer name (default
``learner-0``): a restarted learner first gets back every batch it had read but not acknowledged.
The feeder writes batches by reference (``BatchManifest``): the client fetches the groups' payloads in
one round trip, validates every value, computes the per-token advantages (``pipeline.stages.batching``) and
deletes the payloads when the batch is acknowledged. A group whose payload is invalid or gone is
dead-lettered (stage ``learner``, with its bytes) and left out of the batch; the rest trains. By
default the next batch is read in the background while the caller trains on the current one
(``prefetch``). Arrays are zero-copy numpy views into the received payloads.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
import redis.asyncio as aioredis
import structlog

from pipeline import metrics
from pipeline.config import StreamSettings, redis_settings
from pipeline.stages.batching import materialize
from pipeline.transport.connection import connect, is_cluster_client, retry_transient
from pipeline.transport.consumer import Delivery, StreamConsumer, dead_letter_category, dead_letter_fields
from pipeline.transport.keys import Keys
from pipeline.transport.producer import F_DATA, F_ID, F_TYPE
from schemas import BatchManifest, DecodeError, GroupRef, Limits, ScoredGroup, TrainBatch, decode

log = structlog.get_logger("distillq.learner")
T = TypeVar("T")


@dataclass(frozen=True)
class LearnerBatch:
    """One train batch and the stream entry it came from."""

    entry_id: str
    batch: TrainBatch
    redelivered: bool
    delivery: Delivery
    payload_keys: tuple[str, ...] = ()  # the groups' payloads, deleted on ack

    @property
    def group_ids(self) -> list[str]:
        return [g.group_id for g in self.batch.groups]

    def sequences(self) -> Iterator[dict[str, npt.NDArray[np.generic] | None]]:
        """Per sequence, zero-copy numpy views: tokens, loss_mask, logprobs, advantages, teacher arrays.

        ``teacher_rows`` names the rows the teacher arrays hold (the trained rows; ``arange(L - 1)`` for a
        payload of every row): ``teacher_topk_ids[j]`` is row ``teacher_rows[j]``, predicting token
        ``teacher_rows[j] + 1``.
        """
        i = 0
        for g in self.batch.groups:
            for j, s in enumerate(g.group.sequences):
                t = g.teacher[j] if g.teacher is not None else None
                yield {
                    "tokens": s.tokens.numpy(), "loss_mask": s.loss_mask.numpy(),
                    "logprobs": s.logprobs.numpy() if s.logprobs is not None else None,
                    "advantages": self.batch.advantages[i].numpy(),
                    "teacher_topk_ids": t.topk_ids.numpy() if t else None,
                    "teacher_topk_logprobs": t.topk_logprobs.numpy() if t else None,
                    "teacher_sampled_logprobs": t.sampled_logprobs.numpy() if t else None,
                    "teacher_rows": t.row_index(s.length) if t else None,
                }
                i += 1


@dataclass(frozen=True)
class _Raw:
    """A batch entry read and decoded, with its groups' payloads fetched but not yet validated."""

    delivery: Delivery
    msg: BatchManifest | TrainBatch
    payloads: list[bytes | None]


class AsyncLearner:
    """asyncio learner client."""

    def __init__(
        self,
        redis_url: str | None = None,
        *,
        namespace: str | None = None,
        consumer_name: str = "learner-0",
        settings: StreamSettings | None = None,
        redis: aioredis.Redis | None = None,
        limits: Limits | None = None,
        prefetch: bool = True,
    ) -> None:
        """``prefetch``: fetch, validate and weigh the next batch in the background while the caller works
        on the current one (it is read, so it stays pending until acked, like any batch handed out)."""
        rs = redis_settings(redis_url, namespace)
        self.keys = Keys(rs.namespace)
        self._own = redis is None
        self.redis = redis if redis is not None else connect(rs)
        self.settings = settings or StreamSettings()
        self.consumer = StreamConsumer(self.redis, self.keys, "batches", consumer_name, self.settings, stage="learner")
        # Full validation of every group (the feeder reads headers only; this is where values are checked).
        self.limits = limits or self.settings.limits()
        self._cluster = is_cluster_client(self.redis)
        self._ready = False
        self.prefetch = prefetch
        self._ahead: asyncio.Task[_Raw | None] | None = None

    async def next_batch(self, timeout_s: float | None = None) -> LearnerBatch | None:
        """The next batch (redelivered ones first), or ``None`` after ``timeout_s`` without one.

        With ``prefetch``, the next batch's entry and payloads are read while this one is decoded and
        while the caller trains on it, so Redis and the network work in parallel with the learner.
        """
        loop = asyncio.get_running_loop()
        end = None if timeout_s is None else loop.time() + timeout_s
        while True:
            left = None if end is None else max(0.0, end - loop.time())
            if not self.prefetch:
                raw = await self._read(left)
            else:
                if self._ahead is None:
                    self._ahead = self._start_read()
                try:
                    raw = await asyncio.wait_for(asyncio.shield(self._ahead), left)
                except TimeoutError:
                    return None  # the read goes on; a later call gets its batch
                except BaseException:
                    if self._ahead.done():  # it failed: the next call starts afresh
                        self._ahead = None
                    raise
                self._ahead = self._start_read()  # the next one, in the background
            if raw is None:
                return None
            got = await self._build(raw)
            if got is not None:
                return got

    def _start_read(self) -> asyncio.Task[_Raw | None]:
        task = asyncio.ensure_future(self._read(None))
        # Its error, if any, is raised by the next call; mark it seen so an abandoned one is not logged.
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return task

    async def _read(self, timeout_s: float | None) -> _Raw | None:
        """The next batch entry, decoded, with its groups' payloads fetched (one MGET); not validated yet."""
        if not self._ready:
            await self.consumer.ensure_group()
            self._ready = True
        loop = asyncio.get_running_loop()
        end = None if timeout_s is None else loop.time() + timeout_s
        while True:
            block = self.settings.block_ms if end is None else max(1, int(1000 * min(1.0, end - loop.time())))
            for d in await self.consumer.read(1, block_ms=block):
                try:
                    msg = decode(d.payload, self.limits)
                    if not isinstance(msg, BatchManifest | TrainBatch):
                        raise DecodeError("t", f"expected a BatchManifest or TrainBatch, got a {type(msg).__name__}")
                except DecodeError as e:
                    await self.consumer.dead_letter(d, f"decode_error: {e}")
                    continue
                if isinstance(msg, TrainBatch):
                    return _Raw(d, msg, [])
                keys = [r.key for r in msg.refs]
                try:
                    payloads: list[bytes | None] = await (
                        self.redis.mget_nonatomic(keys) if self._cluster else self.redis.mget(keys)  # type: ignore[attr-defined]
                    )
                except BaseException:
                    self.consumer.release([d])  # not handed out: pending, so a later read reclaims it
                    raise
                return _Raw(d, msg, payloads)
            if end is not None and loop.time() >= end:
                return None

    async def _build(self, raw: _Raw) -> LearnerBatch | None:
        """Validate and weigh a batch's groups; ``None`` (batch settled) if none is usable."""
        d, m = raw.delivery, raw.msg
        if isinstance(m, TrainBatch):
            return LearnerBatch(d.entry_id, m, d.reclaimed, d)
        groups: list[ScoredGroup] = []
        for ref, data in zip(m.refs, raw.payloads, strict=True):
            if data is None:
                metrics.PAYLOAD_MISSING.labels("learner").inc()
                await self._dead_letter_group(d, m, ref, None, f"payload_missing: key {ref.key} is gone")
                continue
            try:
                g = decode(data, self.limits, expect=ScoredGroup)
                if g.group_id != ref.group_id:
                    raise DecodeError("group.group_id", f"{g.group_id!r} != the batch's reference {ref.group_id!r}")
            except DecodeError as e:
                metrics.DECODE_ERRORS.labels("learner").inc()
                await self._dead_letter_group(d, m, ref, data, f"decode_error: {e}")
                continue
            groups.append(g)
        if not groups:
            log.warning("batch_without_usable_groups", batch_id=m.batch_id, groups=len(m.refs))
            await self.consumer.ack([d])
            return None
        return LearnerBatch(d.entry_id, materialize(m, groups), d.reclaimed, d, tuple(r.key for r in m.refs))

    async def _dead_letter_group(
        self, d: Delivery, m: BatchManifest, ref: GroupRef, data: bytes | None, reason: str
    ) -> None:
        """One group of a batch to the DLQ (its bytes, if any, replayable onto ``scored``), then delete it."""
        original = {F_TYPE: b"scored", F_ID: ref.group_id.encode(), **({F_DATA: data} if data is not None else {})}
        fields = dead_letter_fields("learner", reason, "scored", ref.entry_id, self.consumer.name, original,
                                    batch_id=m.batch_id, batch_entry=d.entry_id)
        await retry_transient(lambda: self.redis.xadd(self.keys.dlq, fields), deadline_s=60)  # type: ignore[arg-type]
        await retry_transient(lambda: self.redis.delete(ref.key), deadline_s=60)
        metrics.DEAD_LETTERED.labels("learner", dead_letter_category(reason)).inc()
        log.warning("group_dead_lettered", batch_id=m.batch_id, group_id=ref.group_id, reason=reason)

    async def batches(self, timeout_s: float | None = None) -> AsyncIterator[LearnerBatch]:
        """Batches until none arrives within ``timeout_s`` (forever if ``None``)."""
        while (b := await self.next_batch(timeout_s)) is not None:
            yield b

    async def ack(self, batch: LearnerBatch) -> None:
        """Call after the optimiser step: the batch will not be delivered again, and its groups' payloads
        are deleted (after the batch is settled: a crash in between leaves them behind, never a batch
        without its groups)."""
        await self.consumer.ack([batch.delivery], then_delete=batch.payload_keys)

    async def publish_policy_version(self, version: int) -> None:
        await self.redis.set(self.keys.policy_version, int(version))

    async def policy_version(self) -> int:
        raw = await self.redis.get(self.keys.policy_version)
        return int(raw) if raw is not None else 0

    async def aclose(self) -> None:
        """Stop prefetching (a batch it already read stays pending and comes back) and close."""
        if self._ahead is not None:
            self._ahead.cancel()
            with contextlib.suppress(BaseException):
                await self._ahead
            self._ahead = None
        if self._own:
            await self.redis.aclose()

    async def __aenter__(self) -> AsyncLearner:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def publish_weights(self, model: Any, version: int, directory: str | Path, keep: int = 3,
                              **kwargs: Any) -> Path | None:
        """Write ``model`` as ``version`` into ``directory`` and publish it (``pipeline.learner.publish``)."""
        from pipeline.learner.publish import publish_weights

        loop = asyncio.get_running_loop()

        def announce(v: int) -> None:  # runs in the writer's thread; the version goes out on this loop
            asyncio.run_coroutine_threadsafe(self.publish_policy_version(v), loop).result()

        return await asyncio.to_thread(publish_weights, model, version, directory, keep, publish=announce, **kwargs)


class Learner:
    """Synchronous learner client: an ``AsyncLearner`` on an event loop in a background thread, so the
    next batch is fetched and validated while the caller's optimiser step runs."""

    def __init__(self, redis_url: str | None = None, **kwargs: object) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="distillq-learner", daemon=True)
        self._thread.start()
        try:
            self._client: AsyncLearner = self._call(_make(redis_url, kwargs))
        except BaseException:
            self._stop_loop()
            raise

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def next_batch(self, timeout_s: float | None = None) -> LearnerBatch | None:
        return self._call(self._client.next_batch(timeout_s))

    def batches(self, timeout_s: float | None = None) -> Iterator[LearnerBatch]:
        while (b := self.next_batch(timeout_s)) is not None:
            yield b

    def ack(self, batch: LearnerBatch) -> None:
        self._call(self._client.ack(batch))

    def publish_policy_version(self, version: int) -> None:
        self._call(self._client.publish_policy_version(version))

    def policy_version(self) -> int:
        return self._call(self._client.policy_version())

    def close(self) -> None:
        try:
            self._call(self._client.aclose())
        finally:
            self._stop_loop()

    def __enter__(self) -> Learner:
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def publish_weights(self, model: Any, version: int, directory: str | Path, keep: int = 3,
                        **kwargs: Any) -> Path | None:
        """Write ``model`` as ``version`` into ``directory`` and publish it (``pipeline.learner.publish``)."""
        from pipeline.learner.publish import publish_weights

        return publish_weights(model, version, directory, keep, publish=self.publish_policy_version, **kwargs)


async def _make(redis_url: str | None, kwargs: dict[str, object]) -> AsyncLearner:
    return AsyncLearner(redis_url, **kwargs)  # type: ignore[arg-type]
