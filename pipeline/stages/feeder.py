"""Trainer-feeder worker: scored groups in, train batches out (Redis I/O around ``pipeline.stages.batching``).

The feeder reads only the headers of scored entries (``pipeline.transport.claimcheck``) and writes batches by
reference (``BatchManifest``); it never fetches, decodes or re-writes a group's payload, which stays in
its key until the learner acknowledges the batch. An entry without a header is dead-lettered.

Scored entries stay pending (their leases renewed) until the batch holding their group is written;
only then are they acknowledged. A crash therefore loses nothing: a restarted feeder gets them again,
and the batches stream's per-group dedupe keeps any group from reaching the learner twice. Stale
groups are acknowledged and counted, never trained on. The KL controller's state is written to Redis
after each batch so a restarted feeder continues where the last one stopped.

Before a batch is written, its groups' entries are checked to be still pending to this feeder: a Redis
restarted from an AOF without its last second (a host crash under ``appendfsync everysec``) may not have
them, nor their payload keys (docs/reliability.md, section 2).

The heartbeat, lease renewal and Redis back-off around the loop are ``pipeline.stages.lifecycle``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import redis.asyncio as aioredis
import structlog
from redis.exceptions import ResponseError

from pipeline import metrics
from pipeline.config import StreamSettings
from pipeline.stages.batching import POOL_STAT, BatchingConfig, Pending, admit, build_batch, take_batch
from pipeline.stages.kl_control import AdaptiveKL, ConstantKL, load_controller
from pipeline.stages.lifecycle import Heartbeat, RunStats, WorkerLifecycle, default_consumer_name
from pipeline.transport.audit import AUDIT_EVERY_S, audit_streams
from pipeline.transport.claimcheck import decode_header
from pipeline.transport.connection import TRANSIENT, retry_transient
from pipeline.transport.consumer import Delivery
from pipeline.transport.keys import Keys
from pipeline.transport.producer import (
    AddResult,
    BackpressureTimeout,
    MessageTooLarge,
    ProducerStopped,
    StreamProducer,
)
from pipeline.transport.sharding import make_consumer
from schemas import DecodeError, GroupHeader

log = structlog.get_logger("distillq.feeder")

VERSION_REFRESH_S = 0.02



@dataclass
class FeederState:
    buffer: list[Pending] = field(default_factory=list)
    policy_version: int = 0
    stats: RunStats = field(default_factory=RunStats)


class Feeder:
    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        cfg: BatchingConfig,
        controller: ConstantKL | AdaptiveKL,
        settings: StreamSettings | None = None,
        *,
        consumer_name: str | None = None,
        max_buffered_groups: int = 1024,
        shards: int = 1,
        assigned: Sequence[int] | None = None,
        max_ready_batches: int | None = None,
    ) -> None:
        """``max_ready_batches``: batches written and not yet acknowledged by the learner, at most (the
        feeder waits, its groups pending, rather than build batches far ahead of the learner: their groups
        would age meanwhile); ``None``: up to ``settings.max_backlog``."""
        self.redis, self.keys, self.cfg = redis, keys, cfg
        self.settings = s = settings or StreamSettings()
        self.controller = controller
        self.name = consumer_name or default_consumer_name("feeder")
        self.consumer = make_consumer(redis, keys, "scored", self.name, s, stage="feeder", shards=shards,
                                      assigned=assigned, resolve_payloads=False)
        if max_ready_batches is not None and max_ready_batches < 1:
            raise ValueError("max_ready_batches must be >= 1")
        ready = s if max_ready_batches is None else s.model_copy(
            update={"max_backlog": min(s.max_backlog, max_ready_batches)})
        self.producer = StreamProducer(redis, keys, "batches", ready)
        self.heartbeat = Heartbeat(redis, keys, "feeder", self.name, s.heartbeat_interval_s,
                                   extra=self.report)
        self.max_buffered = max_buffered_groups
        self.max_ready_batches = max_ready_batches
        self.state = FeederState()
        self._version_read_at = float("-inf")
        self._audited_at = time.monotonic()  # the first audit one period after start: the streams are settled

    def report(self) -> dict[str, object]:
        """For the heartbeat: the effective settings this feeder batches by (``distillq stats`` names the ones on
        which two feeders of a namespace disagree)."""
        c = self.controller
        kl = (f"adaptive target {c.target} horizon {c.horizon}" if isinstance(c, AdaptiveKL)
              else f"constant {c.value}")
        return {"settings": {**dataclasses.asdict(self.cfg), "kl": kl, "max_buffered_groups": self.max_buffered,
                             "max_ready_batches": self.max_ready_batches}}

    async def restore_controller(self) -> None:
        """Continue from the KL controller state stored in Redis, if any."""
        raw = await self.redis.get(self.keys.kl_state)
        if raw is None:
            return
        try:
            stored = load_controller(raw)
        except ValueError as e:
            log.error("kl_state_invalid", error=str(e))
            return
        if isinstance(stored, AdaptiveKL) and isinstance(self.controller, AdaptiveKL):
            # Continue from the learned coefficient; the configured target and horizon win over stored ones.
            stored.target, stored.horizon = self.controller.target, self.controller.horizon
            self.controller = stored
            log.info("kl_state_restored", controller=repr(stored))
        elif isinstance(stored, ConstantKL) and isinstance(self.controller, ConstantKL):
            log.info("kl_state_ignored", reason="constant coefficient: the configured value applies",
                     stored=stored.value, configured=self.controller.value)

    async def run(self, stop: asyncio.Event, *, burst: bool = False, max_batches: int | None = None) -> RunStats:
        s = self.settings
        await retry_transient(self.consumer.ensure_group, stop=stop, redis=self.redis)
        await retry_transient(self.restore_controller, stop=stop, redis=self.redis)
        life = WorkerLifecycle("feeder", stop, self.state.stats, heartbeat=self.heartbeat, leases=self.consumer,
                               claim_idle_ms=s.claim_idle_ms, grace_s=s.shutdown_grace_s)
        written = 0
        try:
            async with life:
                log.info("feeder_started", consumer=self.name, config=self.cfg)
                while not stop.is_set() and (max_batches is None or written < max_batches):
                    free = self.max_buffered - len(self.state.buffer)
                    try:
                        want = min(free, s.read_count)
                        got = await self.consumer.read(want, block_ms=min(s.block_ms, 250)) if want else []
                        life.ok()
                    except TRANSIENT as e:
                        await life.redis_error(e)
                        continue
                    # Entries read are ours now: nothing may fail between here and their admission, or they
                    # would sit in ``owned`` (their leases renewed, skipped by reclaim) and never be batched.
                    await self._refresh_version()
                    await self._audit()
                    for d in got:
                        await self._admit(d)
                    drained = burst and not got and await self._input_drained()
                    while (items := take_batch(self.state.buffer, self.cfg, flush=drained)) is not None:
                        if not await self._write(items, stop):
                            break
                        written += 1
                        if max_batches is not None and written >= max_batches:
                            break
                    if drained and not self.state.buffer:
                        break
            # Buffered groups stay pending (unacked): a restarted feeder gets them again.
        finally:
            log.info("feeder_stopped", batches=written, buffered=len(self.state.buffer),
                     outcomes=dict(self.state.stats.outcomes))
        return self.state.stats

    async def _input_drained(self) -> bool:
        return await self.consumer.backlog() == len(self.state.buffer)

    async def _refresh_version(self) -> None:
        """Read the learner's policy version, at most every ``VERSION_REFRESH_S`` (staleness is counted in
        versions, each at least one optimiser step apart: a few ms of lag cannot matter). Never raises: on a
        Redis error the last version read stays."""
        now = time.monotonic()
        if now - self._version_read_at < VERSION_REFRESH_S:
            return
        self._version_read_at = now
        try:
            raw = await self.redis.get(self.keys.policy_version)
        except TRANSIENT:  # keep the last version read; the next read retries
            metrics.REDIS_ERRORS.labels("feeder").inc()
            return
        if raw is not None:
            with contextlib.suppress(ValueError):
                self.state.policy_version = int(raw)

    async def _audit(self) -> None:
        """Every ``AUDIT_EVERY_S``: entries the stage streams lost outside distillq, each loss an incident
        (``pipeline.transport.audit``). Never raises: a failed audit is counted and the next one tries again."""
        now = time.monotonic()
        if now - self._audited_at < AUDIT_EVERY_S:
            return
        self._audited_at = now
        try:
            await audit_streams(self.redis, self.keys, writer=self.name)
        except (*TRANSIENT, ResponseError):
            metrics.REDIS_ERRORS.labels("feeder").inc()

    async def _admit(self, d: Delivery) -> None:
        try:
            h, key = self._header(d)
        except DecodeError as e:
            metrics.DECODE_ERRORS.labels("feeder").inc()
            reason = f"decode_error: {e}"
            await retry_transient(functools.partial(self.consumer.dead_letter, d, reason), deadline_s=60)
            self._count("dead_letter")
            return
        metrics.FEEDER_STALENESS.observe(max(0, self.state.policy_version - h.policy_version))
        why = admit(h, self.state.policy_version, self.cfg)
        if why is not None:
            metrics.FEEDER_DROPPED.labels(why.split("_", 2)[0] if why.startswith("no_distill") else why).inc()
            log.info("group_not_batched", group_id=h.group_id, reason=why,
                     group_version=h.policy_version, current_version=self.state.policy_version)
            await retry_transient(lambda: self.consumer.ack([d]), deadline_s=60)  # payload deleted with it
            self._count(why)
            await self._record_drop(h, why)
            return
        self.state.buffer.append(Pending(d.entry_id, h, key, ref=d))

    async def _record_drop(self, h: GroupHeader, why: str) -> None:
        """Why the group was dropped, for ``distillq where`` (kept as long as the dedupe markers that make a
        re-push of the group a duplicate). Best effort: a Redis error only loses the note."""
        note = json.dumps({"reason": why, "group_version": h.policy_version,
                           "current_version": self.state.policy_version, "at": round(time.time(), 3)})
        with contextlib.suppress(*TRANSIENT):
            await self.redis.set(self.keys.dropped(h.group_id), note, ex=max(1, int(self.settings.dedupe_ttl_s)))

    def _header(self, d: Delivery) -> tuple[GroupHeader, str]:
        """The entry's header and payload key (``pipeline.transport.claimcheck``); a ``DecodeError`` if either is
        missing or the header is invalid or names another group."""
        if d.header is None:
            raise DecodeError("h", "missing: a scored entry carries a header and its payload's key")
        h, key = decode_header(d.header), d.payload_key
        if key is None:
            raise DecodeError("p", "claim-checked entry without a payload key")
        if h.group_id != d.group_id:
            raise DecodeError("h.group_id", f"{h.group_id!r} != entry group id {d.group_id!r}")
        return h, key

    async def _write(self, items: list[Pending], stop: asyncio.Event) -> bool:
        """Write one batch, then ack its groups' entries. False if stopped while waiting for capacity."""
        items[:] = await self._still_ours(items)
        while items:
            built = build_batch(items, self.controller.value, self.state.policy_version, self.cfg)
            try:
                added = await self.producer.send(built.batch, stop=stop)
            except ProducerStopped:
                self.state.buffer[:0] = items  # back in front, still pending
                return False
            except BackpressureTimeout as e:  # the learner is stalled: keep waiting, lose nothing
                log.error("learner_stalled", error=str(e), buffered=len(self.state.buffer) + len(items))
                continue
            except MessageTooLarge as e:
                if len(items) > 1:  # split: the second half goes back to the front of the buffer
                    self.state.buffer[:0] = items[len(items) // 2 :]
                    del items[len(items) // 2 :]
                    continue
                await retry_transient(functools.partial(self.consumer.dead_letter, items[0].ref,
                                                        f"batch_too_large: {e}"), stop=stop, redis=self.redis)
                self._count("dead_letter")
                return True
            if added.result is AddResult.ADDED:
                break
            dup = items.pop(added.duplicate_index)  # already in an earlier batch: never twice
            log.warning("group_already_batched", group_id=dup.group_id, batch_entry=added.entry_id)
            # the earlier batch references the payload: keep it
            await retry_transient(functools.partial(self.consumer.ack, [dup.ref], keep_payloads=True), stop=stop)
            self._count("already_batched")
        if not items:
            return True
        # Retried until stop, however long Redis is away: giving up here would end the feeder.
        missed = await retry_transient(lambda: self.consumer.ack(built.refs, keep_payloads=True), stop=stop)
        if missed:
            await self._unbatch(items, missed, added.entry_id)
        if built.observed_kl is not None and isinstance(self.controller, AdaptiveKL):  # a constant never changes
            self.controller.update(built.observed_kl, n_steps=1)
            await retry_transient(lambda: self.redis.set(self.keys.kl_state, self.controller.to_json()), deadline_s=60)
        self._observe(built.batch.stats or {})
        self._count("batched", len(items))
        return True

    async def _still_ours(self, items: list[Pending]) -> list[Pending]:
        """The items whose scored entries are still pending to us; the rest were lost by a Redis restart
        that rolled back to an older state (``StreamConsumer.still_pending``): batching one would hand the
        learner a payload key that may not exist. The teacher writes such a group again from its rollout."""
        alive = {id(d) for d in await retry_transient(
            lambda: self.consumer.still_pending([i.ref for i in items]), deadline_s=60)}
        gone = [i for i in items if id(i.ref) not in alive]
        if gone:
            log.warning("scored_entries_gone", reason="Redis restarted without them (rolled back)",
                        groups=[i.group_id for i in gone], entries=[i.entry_id for i in gone])
            self._count("entry_gone", len(gone))
        return [i for i in items if id(i.ref) in alive]

    async def _unbatch(self, items: list[Pending], missed: list[Delivery], batch_entry: str) -> None:
        """Redis rolled back while the batch was being written (the write was retried on the restarted
        server): the groups whose entries are gone are in the batch, but their payload keys may be too.
        Their dedupe markers are cleared so that the copies the teacher writes again get batched; the
        learner dead-letters a reference whose key is gone (``payload_missing``) and receives the copy."""
        gone = {id(d) for d in missed}
        groups = [i.group_id for i in items if id(i.ref) in gone]
        if not groups:
            return
        await retry_transient(lambda: self.redis.delete(*(self.keys.seen("batches", g) for g in groups)),
                              deadline_s=60)
        log.error("batched_entries_gone", reason="Redis restarted without them (rolled back) during the write",
                  groups=groups, batch_entry=batch_entry)
        self._count("entry_gone_after_batching", len(groups))

    def _observe(self, stats: dict[str, float]) -> None:
        metrics.FEEDER_BATCHES.inc()
        metrics.FEEDER_BATCH_TOKENS.observe(stats.get("tokens", 0.0))
        metrics.FEEDER_PADDING.set(stats.get("padding_fraction", 0.0))
        metrics.FEEDER_NO_DISTILL.set(stats.get("no_distill_share", 0.0))
        metrics.FEEDER_KL_COEF.set(self.controller.value)
        if "reverse_kl" in stats:
            metrics.FEEDER_REVERSE_KL.set(stats["reverse_kl"])
        for name, value in stats.items():  # teacher.<pool>.groups: groups batched per teacher pool
            if name.startswith(f"{POOL_STAT}.") and name.endswith(".groups"):
                metrics.POOL_BATCHED.labels(name[len(POOL_STAT) + 1 : -len(".groups")]).inc(value)
        log.info("batch_written", **{k: round(v, 5) for k, v in stats.items()})

    def _count(self, outcome: str, n: int = 1) -> None:
        self.state.stats.handled += n
        self.state.stats.outcomes[outcome] += n
        metrics.STAGE_MESSAGES.labels("feeder", outcome).inc(n)
