"""Where is group G: its prompt (entry in ``prompts`` and record), its entries in ``rollouts``, ``scored``,
``batches`` and the DLQ, their pending state, its dedupe markers and the feeder's drop record (``distillq where``).
Reads only; joins no consumer group.

Entries of ``prompts``, ``rollouts``, ``scored`` and the DLQ are matched on their group id field inside Redis (a script
pages through the stream and returns entry ids only, so no payload crosses the network); batches are
matched on the group ids their manifests list. Each dead letter comes with what ``dlq replay`` would do with
it, or why it cannot and what to do instead (``pipeline.cli.recovery.assess``), so the summary advises only
what works.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Final

import redis.asyncio as aioredis

from pipeline.cli.deadletters import PromptReplay, Refusal, Replay, resample_hint
from pipeline.cli.groupscan import batches_listing, find_entries
from pipeline.cli.recovery import assess, dead_letters_of
from pipeline.config import StreamSettings
from pipeline.transport.keys import CONSUMER_GROUPS, Keys, family, pool_stream, stream_pool
from pipeline.transport.pools import known_pools
from pipeline.transport.producer import ACKED, F_ID, WRITTEN
from pipeline.transport.prompts import candidates, read_record
from pipeline.transport.sharding import get_shards
from schemas.pools import DEFAULT_POOL


@dataclass(slots=True)
class Sighting:
    stream: str
    entry_id: str
    consumer: str | None = None  # the consumer holding it (delivered, not acknowledged)
    idle_s: float | None = None
    deliveries: int | None = None
    detail: str = ""
    advice: str = ""  # dead letters: what ``dlq replay`` does with it, or why not and what to do


@dataclass(slots=True)
class Marker:
    stream: str
    value: str
    expires_in_s: float | None


@dataclass(slots=True)
class Whereabouts:
    group_id: str
    namespace: str
    entries: list[Sighting] = field(default_factory=list)
    markers: list[Marker] = field(default_factory=list)
    dropped: dict[str, Any] | None = None  # the feeder's drop record
    prompt: dict[str, str] | None = None  # its prompt's record (``transport.prompts``), the job left out
    summary: str = ""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _s(v: object) -> str:
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)


async def _pending(redis: aioredis.Redis, key: str, group: str, entry_id: str, s: Sighting) -> None:
    try:
        rows: Any = await redis.xpending_range(key, group, min=entry_id, max=entry_id, count=1)
    except aioredis.ResponseError:  # no such group yet
        return
    if rows:
        s.consumer = _s(rows[0]["consumer"])
        s.idle_s = int(rows[0]["time_since_delivered"]) / 1000
        s.deliveries = int(rows[0]["times_delivered"])


async def locate(redis: aioredis.Redis, keys: Keys, group_id: str) -> Whereabouts:
    w = Whereabouts(group_id, keys.namespace)
    shards = await get_shards(redis, keys)
    pools = [pool_stream(p) for p in await known_pools(redis, keys)]  # rollouts and every teacher pool's stream
    for stream in ("prompts", *pools, "scored"):
        key = keys.stream_for(stream, group_id, shards)
        for eid in await find_entries(redis, key, group_id, F_ID):
            s = Sighting(stream, eid)
            await _pending(redis, key, CONSUMER_GROUPS[family(stream)], eid, s)
            w.entries.append(s)
    for eid, batch_id in await batches_listing(redis, keys, group_id):
        s = Sighting("batches", eid, detail=f"batch {batch_id}")
        await _pending(redis, keys.stream("batches"), CONSUMER_GROUPS["batches"], eid, s)
        w.entries.append(s)
    settings = StreamSettings()
    for eid, fields in await dead_letters_of(redis, keys, group_id):
        plan = await assess(redis, keys, eid, fields, settings=settings)
        w.entries.append(Sighting("dlq", eid, detail=f"stage {_s(fields.get(b'stage', b''))}: "
                                                     f"{_s(fields.get(b'reason', b''))}", advice=advice(eid, plan)))
    for stream in (*pools, "scored", "batches"):
        mk = keys.seen(stream, group_id, shards)
        value, ttl = await redis.get(mk), await redis.pttl(mk)
        if value is not None:
            w.markers.append(Marker(stream, _s(value), None if ttl is None or ttl < 0 else ttl / 1000))
    raw = await redis.get(keys.dropped(group_id))
    if raw is not None:
        try:
            w.dropped = json.loads(raw)
        except ValueError:
            w.dropped = {"reason": _s(raw)}
    w.prompt = await prompt_record(redis, keys, group_id)
    w.summary = summarize(w)
    return w


async def prompt_record(redis: aioredis.Redis, keys: Keys, group_id: str) -> dict[str, str] | None:
    """The record of the prompt ``group_id`` was (or is to be) sampled from, without its job; None if none."""
    for epoch, prompt_id in candidates(group_id):
        record = await read_record(redis, keys, epoch, prompt_id)
        if record is not None:
            record.pop("job", None)
            return {"epoch": str(epoch), "prompt_id": prompt_id, **record}
    return None


def prompt_state(w: Whereabouts) -> str | None:
    """Where the group's prompt is, while its group is not written yet: queued, or in flight at a rollout worker."""
    entry = next((s for s in w.entries if s.stream == "prompts"), None)
    if entry is None:
        return None
    error = (w.prompt or {}).get("error")
    last = f"; last error: {error}" if error else ""
    if entry.consumer is None:
        return f"prompt queued for a rollout worker (prompts entry {entry.entry_id})"
    return (f"prompt in flight at rollout worker {entry.consumer} for {entry.idle_s or 0:.1f} s (delivered "
            f"{entry.deliveries} time(s){last})")


def _lost_prompt(w: Whereabouts) -> str | None:
    """A prompt enqueued whose entry is gone with no group, dead letter or drop: lost with Redis data."""
    p = w.prompt
    if p is None or p.get("done") or p.get("gid") != w.group_id:
        return None
    return (f"prompt {p['prompt_id']!r} was enqueued (entry {p.get('entry')}) but is neither queued, in flight, "
            "dead-lettered nor sampled: lost with Redis data; distillq enqueue FILE --epoch "
            f"{p['epoch']} --again enqueues it again")


def _hours(s: float | None) -> str:
    return "until deleted" if s is None else f"for {s / 3600:.1f} h more"


def advice(entry_id: str, plan: Replay | PromptReplay | Refusal) -> str:
    """What to do with one dead letter, as ``where`` and ``dlq show`` print it."""
    if isinstance(plan, Replay | PromptReplay):
        return f"distillq dlq replay {entry_id} {plan.describe()}"
    return f"not replayable: {plan.line()}"


def _flowing(by: set[str]) -> str | None:
    if "batches" in by:
        return "in a batch the learner has not acknowledged yet"
    if "scored" in by:
        return "scored, waiting for the feeder"
    for stream in sorted(by):
        if (pool := stream_pool(stream)) is not None:
            return "waiting for a teacher worker" + ("" if pool == DEFAULT_POOL else f" of pool {pool}")
    return None


def _send_again(w: Whereabouts) -> str:
    """What sends a lost group again: its prompt re-sampled (a group of a prompt with a record), or a push."""
    if w.prompt is not None:
        return f"distillq dlq resample {w.group_id} samples its prompt again"
    return "distillq push --force FILE sends it again"


def _batched(marker: str, w: Whereabouts) -> str:
    """The fate of a group whose ``batches`` marker remains and whose batch entry is no longer in the stream."""
    if marker.startswith(ACKED):
        entry = marker.removeprefix(ACKED)
        return f"batched and acknowledged by the learner (batch entry {entry}): it reached training"
    if marker == WRITTEN:
        return ("batched, and its batch entry (which its dedupe marker does not name) is no longer in the batches "
                "stream: trained, or lost with it")
    return (f"lost: batched into entry {marker}, which no learner acknowledged and which is gone from the batches "
            f"stream (deleted or trimmed); {_send_again(w)}")


def summarize(w: Whereabouts) -> str:
    """One sentence: where the group is now, or what became of it, and what works to send it again."""
    by = {s.stream for s in w.entries}
    marked = {m.stream: m for m in w.markers}
    flowing = _flowing(by) or prompt_state(w)
    dead = [s for s in w.entries if s.stream == "dlq"]
    if dead and flowing is not None:
        return f"{flowing}; {len(dead)} dead letter(s) of it from before (distillq dlq show ENTRY_ID)"
    trained = marked.get("batches")
    if dead and trained is not None and trained.value.startswith(ACKED):  # sent again after its dead letter
        return (f"{_batched(trained.value, w)}; {len(dead)} dead letter(s) of it from before (distillq dlq show "
                "ENTRY_ID)")
    if dead:
        best = next((s for s in reversed(dead) if s.advice.startswith("distillq dlq replay")), dead[-1])
        return f"dead-lettered ({best.detail}): {best.advice}"
    if flowing is not None:
        return flowing
    if w.dropped is not None:
        first = next((m for name, m in marked.items() if stream_pool(name) is not None), marked.get("scored"))
        reason = str(w.dropped.get("reason"))
        todo = resample_hint(w.group_id) if reason == "stale" else "push it again with distillq push --force FILE"
        return (f"dropped by the feeder ({reason}); a push of the same group id is skipped as already present "
                f"{_hours(first.expires_in_s if first else None)}: {todo}")
    if not marked and (lost := _lost_prompt(w)) is not None:
        return lost
    if "batches" in marked:
        return _batched(marked["batches"].value, w)
    if marked:
        last = "scored" if "scored" in marked else sorted(marked)[0]
        return (f"lost: written to {last} (dedupe marker {marked[last].value}) but that entry is gone, and no stage "
                f"after it recorded the group (the stream was deleted or trimmed); {_send_again(w)}")
    return "not found: no entry, dedupe marker or drop record for this group id in this namespace"


#: What became of a group, by the start of its summary (``summarize``), for a count over many (``where --epoch``).
FATES: Final = (
    ("batched and acknowledged", "trained"),
    ("lost", "lost"),
    ("dead-lettered", "dead-lettered"),
    ("dropped by the feeder", "dropped"),
    ("not found", "not found"),
    ("prompt ", "in flight"),  # queued or sampled now
    ("in a batch", "in flight"),
    ("scored", "in flight"),
    ("waiting", "in flight"),
    ("batched, and its batch entry", "trained or lost"),
)


def fate(summary: str) -> str:
    """One word for ``summary``: trained, in flight, dead-lettered, dropped, lost, not found (``FATES``)."""
    if "lost with Redis data" in summary:  # a prompt enqueued, then gone with Redis's data (``_lost_prompt``)
        return "lost"
    return next((name for prefix, name in FATES if summary.startswith(prefix)), "other")


async def prompt_group_ids(redis: aioredis.Redis, keys: Keys, epoch: int) -> list[str]:
    """The group id of every prompt enqueued for ``epoch`` whose record lives (``transport.prompts``)."""
    prefix = keys.prompt_record(epoch, "")
    found = sorted({_s(k)[len(prefix):] async for k in redis.scan_iter(match=prefix + "*", count=1000)})
    return [f"{int(epoch)}:{pid}" for pid in found]
