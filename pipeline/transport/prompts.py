"""Prompts for the rollout stage: the ``prompts`` stream (read by the consumer group ``rollout``) and one record per
(epoch, prompt id).

* A prompt entry holds its type (``prompt``), the group id the rollout worker gives the group it samples
  (``gid``), the epoch and the ``PromptJob`` as JSON (``d``). Entries are read, reclaimed, dead-lettered and
  acknowledged by ``StreamConsumer`` like those of every other stage stream.
* The record ``{ns:prompts}:prompt:<epoch>:<id>`` (a hash, ``RECORD_TTL_S``) holds the job (``job``), the prompt
  entry of its latest attempt (``entry``, ``gid``), the group written for it (``done``), the last error a rollout
  worker met on it (``error``) and the group ids it was re-sampled as (``resampled:<group id>``). It shares the
  stream's hash slot, so one script checks it and adds the entry atomically (also on Redis Cluster): an enqueue
  never leaves a record without its entry.
* ``add_prompt`` is idempotent per (epoch, prompt id) (``FIRST``); ``AGAIN`` adds a prompt whose last attempt left
  no group (dead-lettered, or lost with Redis data) and skips one still queued, in flight or done; ``FORCE`` adds it
  whatever the record says (``dlq replay``); ``RESAMPLE`` adds it under a new group id once per source group.
* Group ids: ``<epoch>:<prompt id>`` for an enqueued prompt; ``<epoch>:<prompt id>@v<N>`` for one re-sampled
  (``distillq dlq resample``) when the learner's policy version was N: a group id no dedupe marker holds yet.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Any, Final

import msgspec
import redis.asyncio as aioredis

from pipeline.errors import WireFormatError
from pipeline.transport.keys import Keys
from pipeline.transport.producer import F_DATA, F_ID, F_TYPE
from schemas.pools import TEACHER_FIELD, pool_problem

#: The prompts stream's short name and its entries' type field.
STREAM: Final = "prompts"
PROMPT_TYPE: Final = b"prompt"
F_EPOCH: Final = b"epoch"
#: How long a prompt record lives (from its latest enqueue).
RECORD_TTL_S: Final = 30 * 86400
_RESAMPLED: Final = re.compile(r"^(.*)@v[0-9]+$")


class PromptJob(msgspec.Struct, frozen=True, kw_only=True):
    """One line of ``distillq enqueue``: a prompt (text or chat messages) and how to roll it out."""

    id: str
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    answer: str | None = None
    env_id: int = 0
    task_id: str = ""
    group_overrides: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    teacher: str | None = None  # the teacher pool of its groups (``group_overrides.teacher``, which wins)

    def __post_init__(self) -> None:
        if not self.id:
            raise ValueError("id must be non-empty")
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("exactly one of 'prompt' or 'messages' is needed")
        if self.teacher is not None and (problem := pool_problem(self.teacher)) is not None:
            raise ValueError(f"teacher: {problem}")
        pool = (self.group_overrides or {}).get(TEACHER_FIELD)
        if pool is not None and (problem := pool_problem(pool)) is not None:
            raise ValueError(f"group_overrides.{TEACHER_FIELD}: {problem}")

    def overrides(self, teacher: str | None = None) -> dict[str, Any] | None:
        """Its groups' ``group_overrides``: its own, with the teacher pool of ``group_overrides.teacher``, else
        of the prompt's ``teacher``, else ``teacher`` (a rollout worker's ``--teacher``), else none."""
        pool = (self.group_overrides or {}).get(TEACHER_FIELD) or self.teacher or teacher
        if pool is None or pool == (self.group_overrides or {}).get(TEACHER_FIELD):
            return self.group_overrides
        return {**(self.group_overrides or {}), TEACHER_FIELD: pool}


PROMPT_DECODER = msgspec.json.Decoder(PromptJob)
_ENCODER = msgspec.json.Encoder()


class BadPrompt(WireFormatError, ValueError):
    """A prompt entry that does not decode (its field named)."""


@dataclass(frozen=True, slots=True)
class PromptEntry:
    """A prompt entry's content: which group to sample, for which epoch, from which job."""

    job: PromptJob
    epoch: int
    group_id: str

    def fields(self) -> dict[bytes, bytes]:
        return {F_TYPE: PROMPT_TYPE, F_ID: self.group_id.encode(), F_EPOCH: str(self.epoch).encode(),
                F_DATA: _ENCODER.encode(self.job)}

    @classmethod
    def from_fields(cls, fields: dict[bytes, bytes]) -> PromptEntry:
        if fields.get(F_TYPE) != PROMPT_TYPE:
            raise BadPrompt(f"t: expected 'prompt', got {fields.get(F_TYPE)!r}")
        try:
            epoch = int(fields.get(F_EPOCH, b""))
        except ValueError:
            raise BadPrompt(f"epoch: not an integer: {fields.get(F_EPOCH)!r}") from None
        try:
            job = PROMPT_DECODER.decode(fields.get(F_DATA, b""))
        except (msgspec.DecodeError, ValueError) as e:
            raise BadPrompt(f"d: {e}") from None
        gid = fields.get(F_ID, b"").decode("utf-8", "replace")
        if (epoch, job.id) not in candidates(gid):
            raise BadPrompt(f"gid: {gid!r} is not a group id of prompt {job.id!r} in epoch {epoch}")
        return cls(job, epoch, gid)


def group_id(epoch: int, prompt_id: str, resampled_at: int | None = None) -> str:
    """The group id of a prompt's group: ``<epoch>:<id>``, or ``<epoch>:<id>@v<N>`` re-sampled at version N."""
    return f"{epoch}:{prompt_id}" + ("" if resampled_at is None else f"@v{resampled_at}")


def prompt_of(gid: str) -> tuple[int, str] | None:
    """(epoch, prompt id) of a rollout-stage group id, or None for a group id of another origin (a push)."""
    epoch, sep, rest = gid.partition(":")
    if not sep or not rest or not epoch.isdigit():
        return None
    m = _RESAMPLED.match(rest)
    return int(epoch), m.group(1) if m else rest


def candidates(gid: str) -> list[tuple[int, str]]:
    """The (epoch, prompt id) a group id may name: a prompt id may itself end in ``@v<N>``, so both readings."""
    epoch, sep, rest = gid.partition(":")
    if not sep or not rest or not epoch.isdigit():
        return []
    found = prompt_of(gid)
    out = [(int(epoch), rest)]
    return [*out, found] if found is not None and found[1] != rest else out


class Mode(enum.Enum):
    FIRST = "first"
    AGAIN = "again"
    FORCE = "force"
    RESAMPLE = "resample"


class Added(enum.Enum):
    ADDED = 1
    ENQUEUED_BEFORE = 0  # FIRST: a record exists
    STILL_QUEUED = 2  # AGAIN: its entry is still in the stream (queued or in flight)
    DONE = 3  # AGAIN: a group was written for it
    RESAMPLED_BEFORE = 4  # RESAMPLE: this source group was re-sampled already


# KEYS: the prompts stream, the record. ARGV: mode, ttl s, job JSON, group id, source group id, entry fields...
# Returns {code, detail}: code as ``Added``; detail the entry id (1, 0, 2) or a group id (3, 4).
_ADD: Final = """
local mode = ARGV[1]
if mode == 'first' then
  local entry = redis.call('HGET', KEYS[2], 'entry')
  if entry then return {0, entry} end
elseif mode == 'again' then
  local entry = redis.call('HGET', KEYS[2], 'entry')
  if entry and #redis.call('XRANGE', KEYS[1], entry, entry) > 0 then return {2, entry} end
  local done = redis.call('HGET', KEYS[2], 'done')
  if done then return {3, done} end
elseif mode == 'resample' then
  local before = redis.call('HGET', KEYS[2], 'resampled:' .. ARGV[5])
  if before then return {4, before} end
end
local id = redis.call('XADD', KEYS[1], '*', unpack(ARGV, 6))
redis.call('HSET', KEYS[2], 'job', ARGV[3], 'entry', id, 'gid', ARGV[4])
redis.call('HDEL', KEYS[2], 'done', 'error')
if mode == 'resample' then redis.call('HSET', KEYS[2], 'resampled:' .. ARGV[5], ARGV[4]) end
redis.call('EXPIRE', KEYS[2], tonumber(ARGV[2]))
return {1, id}
"""

# KEYS: the record. ARGV: field, value. Sets it only on a record that exists (one expired stays gone).
_NOTE: Final = """
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('HSET', KEYS[1], ARGV[1], ARGV[2]) return 1 end
return 0
"""


async def add_prompt(
    redis: aioredis.Redis, keys: Keys, entry: PromptEntry, mode: Mode = Mode.FIRST, *, source: str = ""
) -> tuple[Added, str]:
    """Add one prompt entry as ``mode`` says (see the module); (outcome, entry id or group id)."""
    record = keys.prompt_record(entry.epoch, entry.job.id)
    flat = [x for kv in entry.fields().items() for x in kv]
    code, detail = await redis.register_script(_ADD)(
        keys=[keys.stream(STREAM), record],
        args=[mode.value, RECORD_TTL_S, entry.fields()[F_DATA], entry.group_id, source, *flat])
    return Added(int(code)), detail.decode() if isinstance(detail, bytes) else str(detail)


async def enqueue_prompts(
    redis: aioredis.Redis, keys: Keys, jobs: list[PromptJob], *, epoch: int = 0, again: bool = False
) -> dict[Added, int]:
    """One prompt entry per job (group id ``<epoch>:<id>``); how many ended each way."""
    counts = dict.fromkeys(Added, 0)
    mode = Mode.AGAIN if again else Mode.FIRST
    for job in jobs:
        got, _ = await add_prompt(redis, keys, PromptEntry(job, epoch, group_id(epoch, job.id)), mode)
        counts[got] += 1
    return counts


async def note(redis: aioredis.Redis, keys: Keys, entry: PromptEntry, name: str, value: str) -> None:
    """Set ``name`` (``done``: the group written; ``error``: the last failure) on the prompt's record, if it exists."""
    await redis.register_script(_NOTE)(keys=[keys.prompt_record(entry.epoch, entry.job.id)], args=[name, value])


async def read_record(redis: aioredis.Redis, keys: Keys, epoch: int, prompt_id: str) -> dict[str, str] | None:
    """The prompt's record (field -> value), or None when there is none (never enqueued, or expired)."""
    raw: Any = await redis.hgetall(keys.prompt_record(epoch, prompt_id))  # type: ignore[misc]
    if not raw:
        return None
    return {k.decode("utf-8", "replace"): v.decode("utf-8", "replace") for k, v in raw.items()}
