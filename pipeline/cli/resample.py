"""Dead letters and drops of the rollout stage's prompts that come back through the prompts stream.

* ``replay_prompt``: a prompt's dead letter (stage ``rollout``, source ``prompts``) back onto ``prompts``, with the
  same group id (``dlq replay``).
* ``resample``: a group dropped as stale (the learner's dead letter ``stale: ...``, or the feeder's drop record
  ``stale``), or one ``distillq where`` calls lost (its entry removed from a stream by hand, never acknowledged by a
  learner), sampled again from its prompt's record at the current policy version N, as the group
  ``<epoch>:<prompt id>@v<N>`` (``dlq resample``): a new group id, so no dedupe marker of the first group
  (rollouts, scored, batches) holds it back, and once per group (the record remembers what it was re-sampled as).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Final

import redis.asyncio as aioredis

from pipeline.cli.groupscan import find_entries
from pipeline.cli.locate import fate, locate, summarize
from pipeline.transport.keys import Keys
from pipeline.transport.producer import F_ID
from pipeline.transport.prompts import (
    PROMPT_DECODER,
    Added,
    BadPrompt,
    Mode,
    PromptEntry,
    add_prompt,
    candidates,
    group_id,
    read_record,
)

ORIG: Final = b"orig_"


@dataclass(slots=True)
class Outcome:
    ident: str
    ok: bool
    detail: str  # where it went, or why it stayed


def _s(b: bytes | None) -> str:
    return b.decode("utf-8", "replace") if b is not None else ""


async def replay_prompt(redis: aioredis.Redis, keys: Keys, entry_id: str, fields: dict[bytes, bytes]) -> Outcome:
    """A prompt's dead letter back onto ``prompts`` (same group id); the dead letter is deleted after the write."""
    original = {k[len(ORIG):]: v for k, v in fields.items() if k.startswith(ORIG)}
    try:
        entry = PromptEntry.from_fields(original)
    except BadPrompt as e:
        return Outcome(entry_id, False, f"still invalid: {e}")
    _, new_id = await add_prompt(redis, keys, entry, Mode.FORCE)
    await redis.xdel(keys.dlq, entry_id)  # only after the write succeeded
    return Outcome(entry_id, True, f"-> prompts {new_id} (group {entry.group_id})")


async def _resamplable(redis: aioredis.Redis, keys: Keys, ident: str) -> tuple[str, str | None] | str:
    """(group id, its stale dead letter's entry id or None) of a stale group named by a dead letter's entry id or
    by a group id (of a stale dead letter, or of the feeder's drop record), or of a group ``where`` calls lost;
    else why it cannot be re-sampled."""
    if ":" not in ident:  # an entry id (a group id from the rollout stage always holds ':')
        rows = await redis.xrange(keys.dlq, min=ident, max=ident)
        if not rows:
            return "not in the DLQ"
        fields = rows[0][1]
        reason = _s(fields.get(b"reason"))
        if not reason.startswith("stale"):
            return f"not a stale group (reason {reason[:120]!r}): distillq dlq show {ident} says what works"
        return _s(fields.get(ORIG + F_ID)), ident
    for eid in await find_entries(redis, keys.dlq, ident, ORIG + F_ID):
        rows = await redis.xrange(keys.dlq, min=eid, max=eid)
        if rows and _s(rows[0][1].get(b"reason")).startswith("stale"):
            return ident, eid
    raw = await redis.get(keys.dropped(ident))
    if raw is None:
        summary = summarize(await locate(redis, keys, ident))
        if fate(summary) == "lost":  # removed from a stream by hand, never acknowledged by a learner
            return ident, None
        return f"neither stale nor lost: {summary}"
    try:
        why = str(json.loads(raw).get("reason"))
    except (ValueError, AttributeError):
        why = _s(raw)
    if why != "stale":
        return f"dropped as {why!r}, not as stale"
    return ident, None


async def resample(redis: aioredis.Redis, keys: Keys, ident: str) -> Outcome:
    """One stale or lost group sampled again from its prompt at the current policy version (see the module)."""
    found = await _resamplable(redis, keys, ident)
    if isinstance(found, str):
        return Outcome(ident, False, found)
    gid, dead_letter = found
    for epoch, prompt_id in candidates(gid):
        record = await read_record(redis, keys, epoch, prompt_id)
        if record is not None and "job" in record:
            break
    else:
        return Outcome(ident, False, f"group {gid} has no prompt record (not from distillq enqueue, or the record "
                                     "expired): enqueue its prompt again with a new --epoch")
    raw = await redis.get(keys.policy_version)
    version = int(raw) if raw is not None else 0
    entry = PromptEntry(PROMPT_DECODER.decode(record["job"]), epoch, group_id(epoch, prompt_id, version))
    got, detail = await add_prompt(redis, keys, entry, Mode.RESAMPLE, source=gid)
    if got is Added.RESAMPLED_BEFORE:
        return Outcome(ident, False, f"group {gid} was re-sampled already, as {detail}")
    if dead_letter is not None:
        await redis.xdel(keys.dlq, dead_letter)  # only after the write succeeded
    return Outcome(ident, True, f"-> prompts {detail}: prompt {prompt_id!r} (epoch {epoch}) sampled again at policy "
                                f"version {version} as group {entry.group_id}")


async def dlq_resample(redis: aioredis.Redis, keys: Keys, args: argparse.Namespace) -> int:
    done = 0
    for ident in dict.fromkeys(args.ids):
        res = await resample(redis, keys, ident)
        done += res.ok
        print(f"{'resampled' if res.ok else 'kept     '} {ident} {res.detail}", flush=True)
    left = len(dict.fromkeys(args.ids)) - done
    print(f"re-sampled {done} of {done + left}" + (f"; {left} not" if left else ""), file=sys.stderr)
    return 0 if not left else 1
