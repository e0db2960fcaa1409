"""What can be done with a dead letter, by the family of its reason: replay it (onto which stream, with
which bytes) or why not and what to do instead. Pure: the Redis look-ups a decision needs (another copy of
the group, whether it was trained) are ``pipeline.cli.recovery``'s, which applies these rules.

==================  =========================  ==================================================================
family              written by                 what ``dlq replay`` does
==================  =========================  ==================================================================
``stale``           learner (group too old     refuses: a replay would be dropped as stale again; the prompt must
                    at delivery)               be sampled again at the current policy version (``resample_hint``)
``payload_missing`` learner, atropos, readers  re-sends another copy of the group if the DLQ holds one (a rollout
                    of claim-checked entries   goes back to ``rollouts`` and is scored again); else refuses, as
                                               for ``stale``: the teacher deletes a rollout once it is scored
``decode_error``    any stage                  replays bytes that decode now (limits raised); invalid ones of a
                                               group are handled like ``payload_missing``; of a batch: refuses
``output_too_large``  teacher, feeder,         refuses unless ``--force``: it fails the same way until the setting
``batch_too_large``   ``serve atropos``        named in the line changes
``oversize_group``
anything else       (``teacher_dropped``,      replays the original bytes onto their source stream
                    ``max_deliveries``, ...)
==================  =========================  ==================================================================

Whatever goes back towards the feeder passes the batch gate (``batch_gate``): a group that reached a batch
the learner acknowledged is trained and never replayed; one the learner dead-lettered out of its batch was
never trained, and its ``batches`` dedupe marker is cleared so that the feeder batches it again.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final, Literal

from pipeline.transport.consumer import dead_letter_category
from pipeline.transport.keys import family as stream_family
from pipeline.transport.producer import F_DATA
from schemas import BatchManifest, DecodeError, Limits, Message, RolloutGroup, ScoredGroup, TrainBatch, decode

ORIG: Final = b"orig_"
#: What each replay target accepts.
TARGETS: Final[dict[str, tuple[type[Message], ...]]] = {
    "rollouts": (RolloutGroup,), "scored": (ScoredGroup,), "batches": (BatchManifest, TrainBatch),
}
#: Families that fail the same way again until a setting changes: what to change.
REPEATS: Final = {
    "output_too_large": "the teacher's output for it was larger than DISTILLQ_MAX_MESSAGE_BYTES: raise it on the "
                        "teacher workers (or lower their --k)",
    "batch_too_large": "a batch of this group alone was larger than DISTILLQ_MAX_MESSAGE_BYTES: raise it on the "
                       "feeder",
    "oversize_group": "it holds more sequences than the trainer's batch size: register the trainer with a larger "
                      "batch_size",
}
#: The stage of ``serve atropos``: its queue dedupes by group id (``Keys.atropos_seen``).
ATROPOS_STAGE: Final = "atropos"
#: What to do with a dead letter of a stream whose bytes are gone or invalid (no copy is looked for).
_RESEND: Final = {
    "rollouts": "send a valid copy of the group (distillq push --force FILE) or delete it (distillq dlq purge)",
    "batches": "its groups cannot be named from it: delete it (distillq dlq purge)",
}
_PROMPT_GROUP: Final = re.compile(r"(?P<epoch>[0-9]+):(?P<prompt>.+)")


@dataclass(frozen=True, slots=True)
class Replay:
    """Send ``msg`` onto ``target``; ``origin`` says where its bytes come from."""

    target: str
    msg: Message
    origin: str = "its dead letter"
    rescore: bool = False  # a scored group's rollout, scored again by the teacher
    clear_batches: bool = False  # its batches marker goes (it was never trained: see ``batch_gate``)

    def describe(self) -> str:
        how = " to be scored again" if self.rescore or self.target == "rollouts" else ""
        return f"sends it back to {self.target}{how} (from {self.origin})"


@dataclass(frozen=True, slots=True)
class PromptReplay:
    """A prompt's dead letter (rollout stage): its entry goes back onto ``prompts`` (``pipeline.cli.resample``)."""

    target: str = "prompts"

    def describe(self) -> str:
        return "sends the prompt back to prompts, to be sampled again"


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a dead letter cannot be replayed, and what the operator can do instead."""

    why: str
    todo: str

    def line(self) -> str:
        return f"{self.why}; {self.todo}"


@dataclass(frozen=True, slots=True)
class NeedsCopy:
    """Its own bytes will not do (``why``); another copy of the group might (``pipeline.cli.recovery``)."""

    why: str
    target: str


@dataclass(frozen=True, slots=True)
class BatchState:
    """Whether a group was trained, from its ``batches`` dedupe marker and the learner's dead letters.

    ``never``: no marker (never batched, or longer ago than ``DISTILLQ_DEDUPE_TTL_S``); ``excluded``: the
    learner dead-lettered it out of the batch the marker names (never trained); ``in_flight``: in a batch
    not acknowledged yet (or being written); ``trained``: in a batch the learner acknowledged (the marker says
    ``acked:<entry>``); ``lost``: in a batch no learner acknowledged whose entry is gone from the stream (deleted
    or trimmed by hand: never trained); ``unknown``: the marker does not say which batch, and none matches it."""

    verdict: Literal["never", "excluded", "in_flight", "trained", "lost", "unknown"]
    batch_entry: str = ""


def family(reason: str) -> str:
    return dead_letter_category(reason)


def text(b: bytes | None) -> str:
    return b.decode("utf-8", "replace") if b is not None else ""


def resample_hint(group_id: str) -> str:
    """What to do for a group whose tokens must be sampled again at the current policy version."""
    if _PROMPT_GROUP.fullmatch(group_id) is not None:
        return f"sample its prompt again at the current policy version: distillq dlq resample {group_id}"
    return ("sample it again with the current policy and push it: distillq push --force FILE (with "
            "--policy-version N for lines without one)")


def first_look(fields: dict[bytes, bytes], to: str | None, limits: Limits, *, force: bool = False
               ) -> Replay | PromptReplay | Refusal | NeedsCopy:
    """The decision from the dead letter alone."""
    gid, reason = text(fields.get(ORIG + b"gid")), text(fields.get(b"reason"))
    fam = family(reason)
    if fam == "stale":
        return Refusal(f"{reason}: a replay would be dropped as stale again", resample_hint(gid))
    if fam in REPEATS and not force:
        return Refusal(f"{fam}: a replay fails the same way", f"{REPEATS[fam]}, then distillq dlq replay --force ID")
    target = to or stream_family(text(fields.get(b"source")))  # a teacher pool's stream (rollouts.P): rollouts
    if target == "prompts":
        return PromptReplay()
    expect = TARGETS.get(target)
    if expect is None:
        return Refusal(f"unknown source stream {target!r}", "pass --to rollouts|scored|batches")
    payload = fields.get(ORIG + F_DATA)
    scored = target == "scored" or text(fields.get(b"source")) == "scored"  # its rollout was deleted once scored
    if payload is None:
        if scored:
            return NeedsCopy(f"its payload is gone ({reason})" if fam == "payload_missing"
                             else "no original payload (orig_d) in the dead letter", target)
        return Refusal("no original payload (orig_d) in the dead letter", _RESEND[target])
    try:
        msg = decode(payload, limits)
    except DecodeError as e:
        if scored:
            return NeedsCopy(f"its payload is invalid ({e})", target)
        return Refusal(f"still invalid: {e}", _RESEND[target])
    if target == "rollouts" and isinstance(msg, ScoredGroup):
        return Replay("rollouts", msg.group, rescore=True)
    if not isinstance(msg, expect):
        want = " or ".join(t.__name__ for t in expect)
        return Refusal(f"still invalid: t: expected a {want}, got a {type(msg).__name__}",
                       "pass --to with the stream it belongs on")
    return Replay(target, msg)


def from_copy(need: NeedsCopy, group_id: str, copy: tuple[str, Message] | None) -> Replay | Refusal:
    """The decision once the DLQ was searched for another copy of the group (``(dead letter id, message)``)."""
    if copy is None:
        return Refusal(f"{need.why}, and no other copy of the group is left (the teacher deletes a rollout once "
                       "it is scored)", resample_hint(group_id))
    eid, msg = copy
    if isinstance(msg, ScoredGroup) and need.target == "scored":
        return Replay("scored", msg, origin=f"dead letter {eid}")
    rollout = msg.group if isinstance(msg, ScoredGroup) else msg
    assert isinstance(rollout, RolloutGroup)
    return Replay("rollouts", rollout, origin=f"dead letter {eid}", rescore=True)


def batch_gate(group_id: str, state: BatchState, ttl_note: str = "") -> Refusal | None:
    """``None`` when the group may flow to the feeder again (``state.verdict`` never or excluded)."""
    b = state.batch_entry
    if state.verdict == "in_flight":
        return Refusal(f"it is in batch entry {b or '(being written)'}, which the learner has not acknowledged yet",
                       f"wait: distillq where {group_id} shows when the learner has it")
    if state.verdict == "trained":
        return Refusal(f"it was trained already (batch entry {b}, acknowledged by the learner; a group is trained "
                       "once)", "nothing to replay")
    if state.verdict == "unknown":
        return Refusal("cannot tell whether it was trained: its batches dedupe marker does not name the batch it "
                       "went into", f"it can be sent again once that marker expires{ttl_note}")
    return None
