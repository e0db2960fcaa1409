"""Which distillq namespaces a Redis holds (``distillq namespaces``), and whether one has any key.

A namespace is recognised by the keys ``pipeline.transport.keys`` names: its streams (``{ns:prompts}``,
``{ns:rollouts}``, shards ``{ns:rollouts:i~s}``, ``{ns:scored}``, ``{ns:batches}``, ``{ns:dlq}``, with their
markers, prompt records and payload keys), ``ns:health:*``, ``ns:config``, ``ns:policy_version``, ``ns:kl``,
``ns:dropped:*`` and ``{ns:atropos}:*``. Found with SCAN (never KEYS), so a large Redis is not blocked.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Final

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from pipeline.transport.keys import STREAMS, Keys

_NS: Final = r"[A-Za-z0-9_.-]+"
_STREAM_KEY: Final = re.compile(rf"^\{{({_NS}):({'|'.join(STREAMS)})(?::\d+~\d+)?\}}$")
_TAGGED: Final = re.compile(rf"^\{{({_NS}):(?:{'|'.join(STREAMS)}|atropos)(?::\d+~\d+)?\}}")
_PLAIN: Final = re.compile(rf"^({_NS}):(?:health|config|policy_version|kl|dropped)(?::|$)")
_SCAN_COUNT: Final = 1000


@dataclass(slots=True)
class NamespaceInfo:
    name: str
    keys: int = 0
    streams: dict[str, int] = field(default_factory=dict)  # short name -> entries (over shards)
    workers: int = 0  # heartbeat keys


def namespace_of(key: str) -> str | None:
    """The distillq namespace a key belongs to, or None for a key that is not distillq's."""
    m = _TAGGED.match(key) or _PLAIN.match(key)
    return m.group(1) if m else None


async def list_namespaces(redis: aioredis.Redis) -> list[NamespaceInfo]:
    """Every namespace with at least one key, with its stream lengths and live workers."""
    found: dict[str, NamespaceInfo] = {}
    streams: list[tuple[str, str, str]] = []
    async for raw in redis.scan_iter(match="*", count=_SCAN_COUNT):
        key = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
        ns = namespace_of(key)
        if ns is None:
            continue
        info = found.setdefault(ns, NamespaceInfo(ns))
        info.keys += 1
        if (m := _STREAM_KEY.match(key)) is not None:
            streams.append((ns, m.group(2), key))
        elif key.startswith(f"{ns}:health:"):
            info.workers += 1
    for ns, name, key in streams:
        try:
            n = int(await redis.xlen(key))
        except ResponseError:  # a key of that name that is not a stream (WRONGTYPE): not counted, never fatal
            continue
        found[ns].streams[name] = found[ns].streams.get(name, 0) + n
    return sorted(found.values(), key=lambda i: i.name)


async def has_keys(redis: aioredis.Redis, keys: Keys) -> bool:
    """Whether the namespace of ``keys`` holds any key in this Redis (an unused one is likely a typo)."""
    ns = keys.namespace
    direct = [keys.stream(s) for s in STREAMS] + [keys.config, keys.policy_version, keys.kl_state]
    for key in direct:  # one key per EXISTS: on a cluster they live in different slots
        if int(await redis.exists(key)):
            return True
    for pattern in (f"{{{ns}:*", f"{ns}:*"):
        async for _ in redis.scan_iter(match=pattern, count=_SCAN_COUNT):
            return True
    return False


async def absent_note(redis: aioredis.Redis, keys: Keys) -> str | None:
    """A one-line remark when ``keys``' namespace has no key here, naming the namespaces that do."""
    if await has_keys(redis, keys):
        return None
    others = [i.name for i in await list_namespaces(redis)]
    where = f"namespaces here: {', '.join(others)}" if others else "this Redis holds no distillq namespace"
    return f"namespace {keys.namespace!r} has no keys in this Redis ({where}; --namespace or DISTILLQ_NAMESPACE " \
           "chooses one)"
