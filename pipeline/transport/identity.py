"""One live process per consumer identity: the heartbeat key that names a consumer is also its claim.

A worker's heartbeat (``ns:health:<stage>:<consumer>``) and a learner rank's (``ns:learner_health:<consumer>:<rank>``)
already name one process: its JSON carries ``host``, ``pid`` and ``started``. ``Claim`` makes that key exclusive.
Every write of it is a compare-and-set (one script): the value is written only when the key is absent or holds this
process's random token. So

* a second process started under a name a live process holds (a rolling restart that starts the new learner before
  the old one stopped, a person starting ``learner-0`` twice, two ``distillq up`` runs naming the same worker) finds
  the key held. It waits up to ``wait_s`` (by default one heartbeat TTL: a holder killed with -9 stops renewing, its
  key expires and the newcomer takes the name), logging ``name_held_waiting`` once, then is refused with one line
  naming the holder (``NameHeld``, exit status 2) and an incident (``name_refused``) that ``distillq stats`` shows;
* a process whose key was taken meanwhile (it was paused past its TTL and another process claimed the name, or the
  key was deleted and claimed) learns it at its next write: ``write`` returns the new holder and the caller stops
  (``name_lost``) instead of acking or reading under a name another process now owns.

A clean exit deletes the key only while it holds this token (``release``), so a leaving process never frees the
name of its successor. Reads of heartbeats (``distillq stats``, ``--check``) see the same JSON as before, plus
``token``.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
import structlog

from pipeline.errors import ConfigurationError
from pipeline.transport import incidents
from pipeline.transport.keys import Keys

log = structlog.get_logger("distillq.identity")

# KEYS[1] the claim; ARGV[1] the value, ARGV[2] this process's token, ARGV[3] the TTL (ms). Returns nothing when
# written, else the value of the process that holds the key.
_WRITE = """
local cur = redis.call('GET', KEYS[1])
if cur and not string.find(cur, ARGV[2], 1, true) then return cur end
redis.call('SET', KEYS[1], ARGV[1], 'PX', tonumber(ARGV[3]))
return false
"""
# KEYS[1] the claim; ARGV[1] the token. Deletes the key only while it holds the token.
_RELEASE = """
local cur = redis.call('GET', KEYS[1])
if cur and string.find(cur, ARGV[1], 1, true) then return redis.call('DEL', KEYS[1]) end
return 0
"""


class NameHeld(ConfigurationError):
    """A consumer name another live process holds (exit status 2: ``distillq up`` does not restart it)."""


@dataclass(frozen=True, slots=True)
class Holder:
    """The process that holds a claim, as its value names it."""

    host: str
    pid: int | None
    started: float | None

    @classmethod
    def parse(cls, raw: bytes | str) -> Holder:
        try:
            info: Any = json.loads(raw)
        except ValueError:
            info = {}
        if not isinstance(info, dict):
            info = {}
        pid, started = info.get("pid"), info.get("started")
        return cls(str(info.get("host", "?")), pid if isinstance(pid, int) else None,
                   float(started) if isinstance(started, int | float) else None)

    def describe(self) -> str:
        since = "" if self.started is None else time.strftime(" since %Y-%m-%d %H:%M:%S UTC",
                                                               time.gmtime(self.started))
        return f"pid {self.pid if self.pid is not None else '?'} on host {self.host}{since}"


class Claim:
    """The exclusive claim of one consumer identity on ``key`` (see the module); ``what`` names it in messages
    (``teacher consumer teacher-0``, ``learner consumer learner-0 rank 0``)."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, key: str, what: str) -> None:
        self.redis, self.keys, self.key, self.what = redis, keys, key, what
        self.token = uuid.uuid4().hex
        self._write: Any = redis.register_script(_WRITE)
        self._release: Any = redis.register_script(_RELEASE)
        self.lost: Holder | None = None  # set by ``write`` when another process holds the key now

    async def write(self, value: dict[str, Any], ttl_ms: int) -> Holder | None:
        """Write ``value`` (with this token) for ``ttl_ms``; ``None`` when written, else the process holding the
        key (``lost`` is set then, and a ``name_lost`` error logged once)."""
        holder = await self._cas(value, ttl_ms)
        return None if holder is None else self._lose(holder)

    def _lose(self, holder: Holder) -> Holder:
        """Another process holds the key now: ``lost`` set, ``name_lost`` logged once."""
        if self.lost is None:
            log.error("name_lost", what=self.what, key=self.key, holder=holder.describe())
        self.lost = holder
        return holder

    def taken(self) -> NameHeld | None:
        """The error to stop with when the name was taken while this process ran (``lost``), else None."""
        if self.lost is None:
            return None
        return NameHeld(f"{self.what} was taken by another process ({self.lost.describe()}) while this one ran: it "
                        "stops without reading or acknowledging under that name")

    async def _cas(self, value: dict[str, Any], ttl_ms: int) -> Holder | None:
        raw = await self._write(keys=[self.key], args=[json.dumps({**value, "token": self.token}), self.token,
                                                       max(1, int(ttl_ms))])
        return None if raw is None else Holder.parse(raw)

    @staticmethod
    def default_wait_s(ttl_ms: int, interval_s: float) -> float:
        """How long a new process waits for a held name by default: one TTL and one beat interval, by when the
        claim of a holder killed -9 (which renews no more) has expired."""
        return ttl_ms / 1000 + interval_s

    async def take(self, value: Callable[[], dict[str, Any]], ttl_ms: int, wait_s: float,
                   sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        """Claim the name: write ``value()``, waiting up to ``wait_s`` for a holder to go; ``NameHeld`` (and an
        incident) if it is still held then."""
        loop = asyncio.get_running_loop()
        end = loop.time() + wait_s
        waited = False
        while True:
            holder = await self._cas(value(), ttl_ms)
            if holder is None:
                self.lost = None
                if waited:
                    log.info("name_taken", what=self.what, key=self.key)
                return
            if loop.time() >= end:
                text = (f"{self.what} is held by a live process ({holder.describe()}): stop it, or start this one "
                        f"under another name")
                await incidents.record(self.redis, self.keys, "name_refused", text, writer=self.what,
                                       key=self.key)
                raise NameHeld(text)
            if not waited:
                log.warning("name_held_waiting", what=self.what, holder=holder.describe(), wait_s=round(wait_s, 1))
                waited = True
            await sleep(min(0.5, max(0.0, end - loop.time())))

    async def check(self) -> Holder | None:
        """Read the key (never refused, even at ``maxmemory``): the process that holds it now if it is not this one
        (``lost`` is set then); ``None`` while it is this process's or has expired unclaimed."""
        raw = await self.redis.get(self.key)
        if raw is None or self.token in (raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)):
            return None
        return self._lose(Holder.parse(raw))

    async def release(self) -> None:
        """Delete the key if this process still holds it."""
        await self._release(keys=[self.key], args=[self.token])
