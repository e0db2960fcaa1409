"""Learner ranks: every one of ``world`` processes trains on its own part of the same batch.

Coordination lives in Redis (keys ``Keys.learner_ranks``, all in the batches stream's hash slot), so
torch.distributed is not needed for it, and it runs beside it:

- **Joining.** Each rank process takes a random token and writes it under its rank in ``joined``. Ranks
  start on a batch only when all ``world`` ranks have joined the current *generation*. A rank that joins
  while its slot holds another token is a restarted rank: the generation goes up, ``joined`` and
  ``acked`` are cleared, and the ranks still running join the new generation on their next call.
- **The current batch.** One entry of ``{ns:batches}`` at a time is the ranks' current batch (``entry``
  in the state hash, with the policy version read when it was chosen). When there is none, one rank
  (holding the ``reading`` lock) reads the next entry through the ``learner`` consumer group, under the
  one consumer name all ranks share, and makes it current. Every rank gets the same entry; each takes its
  own part (``pipeline.learner.parts``).
- **Acknowledgement.** A rank's ack adds it to ``acked`` (only in the generation it got the batch in).
  The ack that completes the set acknowledges and deletes the stream entry and clears ``entry`` in the
  same script; that rank then deletes the groups' payloads. A rank asks for the next batch only after
  acking the current one and waits until every rank has.
- **A rank dies** before every rank acked: the batch stays current and pending. When the rank comes back
  (same rank number, new process), the generation goes up, and every rank receives the whole batch again
  (``redelivered``), split the same way; acks from the old generation are refused, so a batch is
  acknowledged once, when all ``world`` ranks of one generation acked it.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
import structlog

from pipeline import metrics
from pipeline.backoff import Backoff
from pipeline.errors import LearnerError
from pipeline.transport.connection import TRANSIENT
from pipeline.transport.consumer import Delivery, StreamConsumer
from pipeline.transport.keys import Keys

log = structlog.get_logger("distillq.learner")

# KEYS: state, joined, acked. ARGV: rank, world, token. Returns the generation joined.
_JOIN = """
local w = redis.call('HGET', KEYS[1], 'world')
if w and tonumber(w) ~= tonumber(ARGV[2]) then
  redis.call('HSET', KEYS[1], 'world', ARGV[2])
  redis.call('HINCRBY', KEYS[1], 'gen', 1)
  redis.call('DEL', KEYS[2], KEYS[3])
elseif not w then
  redis.call('HSET', KEYS[1], 'world', ARGV[2], 'gen', 0, 'entry', '')
end
local held = redis.call('HGET', KEYS[2], ARGV[1])
if held and held ~= ARGV[3] then
  redis.call('HINCRBY', KEYS[1], 'gen', 1)
  redis.call('DEL', KEYS[2], KEYS[3])
end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
return tonumber(redis.call('HGET', KEYS[1], 'gen'))
"""

# KEYS: state, joined, acked. ARGV: rank. Returns gen, my slot's token, joined count, world, entry,
# entry_gen, version, reclaimed, whether this rank acked.
_POLL = """
local st = redis.call('HMGET', KEYS[1], 'gen', 'world', 'entry', 'entry_gen', 'version', 'reclaimed')
local mine = redis.call('HGET', KEYS[2], ARGV[1]) or ''
return {st[1] or '-1', mine, redis.call('HLEN', KEYS[2]), st[2] or '0', st[3] or '', st[4] or '-1',
        st[5] or '0', st[6] or '0', redis.call('SISMEMBER', KEYS[3], ARGV[1])}
"""

# KEYS: state. ARGV: entry, version, reclaimed (0/1). 1 if made current, 0 if another batch is current.
_ASSIGN = """
local cur = redis.call('HGET', KEYS[1], 'entry')
if cur and cur ~= '' then return 0 end
redis.call('HSET', KEYS[1], 'entry', ARGV[1], 'entry_gen', redis.call('HGET', KEYS[1], 'gen') or '0',
           'version', ARGV[2], 'reclaimed', ARGV[3])
return 1
"""

# KEYS: state, joined, acked, stream. ARGV: rank, token, gen, entry, consumer group.
# -1: refused (the batch was handed out again in a later generation); 1: counted; 2: the batch is settled.
_ACK = """
local st = redis.call('HMGET', KEYS[1], 'gen', 'entry', 'world')
if st[1] ~= ARGV[3] or st[2] ~= ARGV[4] or redis.call('HGET', KEYS[2], ARGV[1]) ~= ARGV[2] then return -1 end
redis.call('SADD', KEYS[3], ARGV[1])
if redis.call('SCARD', KEYS[3]) < tonumber(st[3]) then return 1 end
redis.call('XACK', KEYS[4], ARGV[5], ARGV[4])
redis.call('XDEL', KEYS[4], ARGV[4])
redis.call('HSET', KEYS[1], 'entry', '')
redis.call('DEL', KEYS[3])
return 2
"""

# KEYS: state, acked. ARGV: entry. Drop a current entry that no longer exists in the stream.
_DROP = """
if redis.call('HGET', KEYS[1], 'entry') == ARGV[1] then
  redis.call('HSET', KEYS[1], 'entry', '')
  redis.call('DEL', KEYS[2])
end
return 1
"""

# KEYS: lock. ARGV: token.
_UNLOCK = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"

READ_LOCK_MS = 5000
WAIT_LOG_S = 30.0


class RankTakenOver(LearnerError, RuntimeError):
    """Another process joined under this process's rank number (two processes were started as one rank)."""


@dataclass(frozen=True)
class Current:
    """The batch entry all ranks work on, as handed to this rank."""

    entry_id: str
    generation: int
    version: int  # policy version when the entry was made current
    redelivered: bool


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class RankGroup:
    """This process's membership as ``rank`` of ``world`` learner ranks (see the module docstring)."""

    def __init__(
        self, redis: aioredis.Redis, keys: Keys, consumer: StreamConsumer, rank: int, world: int,
        *, poll_s: float = 0.01,
    ) -> None:
        if not 0 <= rank < world:
            raise ValueError(f"rank must be in [0, world_size): got rank={rank}, world_size={world}")
        self.redis, self.keys, self.consumer = redis, keys, consumer
        self.rank, self.world = rank, world
        self.token = uuid.uuid4().hex
        self.poll_s = poll_s
        self._state = [keys.learner_ranks(), keys.learner_ranks("joined"), keys.learner_ranks("acked")]
        self._lock = keys.learner_ranks("reading")
        self._joined = False
        self._gen = 0  # the ranks' generation at the last look
        self._handed: tuple[int, str] | None = None  # (generation, entry) handed out and not acked
        self._seen: set[str] = set()  # entries handed to this process before (redelivered if again)

    async def _script(self, src: str, keys: list[str], args: list[Any]) -> Any:
        return await self.redis.eval(src, len(keys), *keys, *args)  # type: ignore[misc]

    async def join(self) -> int:
        gen = int(await self._script(_JOIN, self._state, [self.rank, self.world, self.token]))
        self._joined = True
        log.info("learner_rank_joined", rank=self.rank, world=self.world, generation=gen)
        return gen

    async def next(
        self, timeout_s: float | None, read: Callable[[float], Awaitable[tuple[Delivery, int] | None]]
    ) -> Current | None:
        """The current batch once every rank has joined; ``None`` after ``timeout_s`` without one.

        ``read(block_s)`` reads the next usable entry of the stream (with the policy version to check it
        against) or returns ``None``; it is called on one rank at a time, while no batch is current."""
        end = None if timeout_s is None else time.monotonic() + timeout_s
        backoff, waited_log = Backoff(base=self.poll_s, cap=max(self.poll_s, 0.05)), time.monotonic()
        outage = Backoff()  # while Redis is away
        while True:
            try:
                got = await self._poll(read, end)
            except TRANSIENT as e:  # Redis away (restarting, failing over): wait for it, never fail the rank
                delay = outage.next_delay()
                metrics.REDIS_ERRORS.labels("learner").inc()
                log.warning("redis_unavailable", stage="learner", rank=self.rank, error=str(e),
                            retry_in=round(delay, 2))
                await asyncio.sleep(delay)
                continue
            outage.reset()
            if isinstance(got, Current):
                return got
            if got == "again":
                backoff.reset()
                continue
            if got == "waiting" and time.monotonic() - waited_log >= WAIT_LOG_S:
                waited_log = time.monotonic()
                log.warning("learner_ranks_waiting", rank=self.rank, world=self.world, generation=self._gen)
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                return None
            delay = backoff.next_delay()
            await asyncio.sleep(delay if left is None else min(delay, left))

    async def _poll(self, read: Callable[[float], Awaitable[tuple[Delivery, int] | None]], end: float | None
                    ) -> Current | str:
        """One look at the ranks' state: the current batch, ``again`` (look again now: this rank (re)joined or
        read the next batch), ``waiting`` (ranks still joining) or ``idle`` (no batch yet)."""
        gen_raw, mine, joined, world, entry, entry_gen, version, reclaimed, acked = [
            _s(x) for x in await self._script(_POLL, self._state, [self.rank])]
        if mine != self.token:
            if mine and self._joined:
                raise RankTakenOver(f"another process joined as rank {self.rank} of {self.world}")
            await self.join()  # also after Redis lost the ranks' state (restarted empty): join again
            return "again"
        gen = self._gen = int(gen_raw)
        if int(joined) >= self.world and int(world) == self.world:
            if entry and acked == "0":
                if self._handed == (gen, entry):
                    raise RuntimeError("ack the current batch before asking for the next one (learner ranks "
                                       "move through batches together)")
                again = entry in self._seen or int(entry_gen) != gen or reclaimed == "1"
                self._handed = (gen, entry)
                self._seen.add(entry)
                return Current(entry, gen, int(version), again)
            if not entry and await self._read_as_leader(read, end):
                return "again"
            return "idle"
        return "waiting"

    async def _read_as_leader(
        self, read: Callable[[float], Awaitable[tuple[Delivery, int] | None]], end: float | None
    ) -> bool:
        """Read the next entry and make it current, if this rank gets the reading lock. True if it did."""
        if not await self.redis.set(self._lock, self.token, nx=True, px=READ_LOCK_MS):
            return False
        try:
            block = 1.0 if end is None else max(0.001, min(1.0, end - time.monotonic()))
            got = await read(block)
            if got is None:
                return False
            d, version = got
            try:
                assigned = int(await self._script(_ASSIGN, self._state[:1], [d.entry_id, version, int(d.reclaimed)]))
            except BaseException:
                self.consumer.release([d])  # not made current (Redis away): reclaimable once idle
                raise
            if not assigned:
                self.consumer.release([d])  # another batch became current meanwhile: reclaimable once idle
            return True
        finally:
            await self._script(_UNLOCK, [self._lock], [self.token])

    async def ack(self, entry_id: str, generation: int) -> int:
        """-1: refused (the batch is being handed out again: take it from ``next``); 1: counted, other ranks
        have yet to ack; 2: every rank acked, the entry is acknowledged and deleted."""
        res = int(await self._script(
            _ACK, [*self._state, self.consumer.key],
            [self.rank, self.token, generation, entry_id, self.consumer.group]))
        if res > 0 and self._handed == (generation, entry_id):
            self._handed = None
        if res == -1:
            log.warning("learner_rank_ack_refused", rank=self.rank, entry=entry_id, generation=generation,
                        reason="a rank restarted: every rank receives this batch again")
        return res

    async def drop(self, entry_id: str) -> None:
        """Forget a current entry that is gone from the stream."""
        await self._script(_DROP, [self._state[0], self._state[2]], [entry_id])
