"""Incidents: faults from outside distillq that a process noticed and that no stream entry records.

A Redis restarted without its data, a consumer group destroyed by hand, entries a restart took with it: the
process that notices writes one incident (``record``) to ``ns:incidents`` (a stream capped at ``MAX_LEN``
entries), and ``distillq stats`` names the recent ones under ``attention:`` (``recent``). An incident is a
kind (a short name such as ``stream_reset``), one line of text for an operator, the writer and the time.
Recording never raises on a Redis error: it is best effort on top of the log line the caller writes.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import redis.asyncio as aioredis
import structlog
from redis.exceptions import ResponseError

from pipeline.transport.connection import TRANSIENT
from pipeline.transport.keys import Keys

log = structlog.get_logger("distillq.incidents")
#: Incidents kept (approximately: ``XADD MAXLEN ~``).
MAX_LEN = 1000


@dataclass(frozen=True)
class Incident:
    kind: str
    text: str
    ts: float
    writer: str = ""
    fields: dict[str, object] = field(default_factory=dict)


async def record(redis: aioredis.Redis, keys: Keys, kind: str, text: str, *, writer: str = "",
                 **fields: object) -> None:
    """Write one incident (and log it as a warning); a Redis error is logged, not raised."""
    log.warning("incident", kind=kind, text=text, writer=writer, **fields)
    entry = {"kind": kind, "text": text, "ts": repr(time.time()), "writer": writer,
             "fields": json.dumps(fields, default=str)}
    try:
        await redis.xadd(keys.incidents, entry, maxlen=MAX_LEN, approximate=True)  # type: ignore[arg-type]
    except (*TRANSIENT, ResponseError) as e:  # Redis away, or full (an XADD is refused at maxmemory)
        log.warning("incident_not_recorded", kind=kind, error=str(e))


def _text(raw: dict[bytes, bytes], name: str) -> str:
    return raw.get(name.encode(), b"").decode("utf-8", "replace")


async def recent(redis: aioredis.Redis, keys: Keys, *, since_s: float = 86400.0, count: int = 50) -> list[Incident]:
    """The incidents of the last ``since_s`` seconds, newest first (at most ``count``)."""
    cutoff = time.time() - since_s
    out: list[Incident] = []
    for _, raw in await redis.xrevrange(keys.incidents, count=count):
        try:
            ts = float(_text(raw, "ts"))
            extra = json.loads(_text(raw, "fields") or "{}")
        except ValueError:
            continue
        if ts < cutoff:
            break
        out.append(Incident(_text(raw, "kind"), _text(raw, "text"), ts, _text(raw, "writer"),
                            extra if isinstance(extra, dict) else {}))
    return out
