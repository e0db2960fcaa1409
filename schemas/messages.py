"""Wire messages: one msgspec Struct per kind of stream entry.

Position convention (checked on decode, see ``schemas.validate``)
------------------------------------------------------------------
A sequence has ``L`` tokens ``tokens[0..L-1]`` (prompt, completions, later turns).

* Per-token arrays (``tokens``, ``loss_mask``, ``logprobs``, ``advantages``, ``ref_logprobs``) have
  length ``L``; entry ``p`` is about token ``p``: ``logprobs[p] = log pi_student(tokens[p] | tokens[:p])``
  and ``loss_mask[p] = 1`` when token ``p`` was sampled by the student and is trained on. Position 0 has
  no prefix and is never trainable; ``logprobs`` is 0.0 wherever ``loss_mask`` is 0.
* Teacher arrays are *logits-aligned*: they have ``L - 1`` rows and row ``r`` is the teacher's
  distribution of token ``r + 1`` given ``tokens[:r + 1]``, i.e. the output at input position ``r``,
  matched with the label ``tokens[r + 1]``. So ``teacher.sampled_logprobs[r] =
  log pi_teacher(tokens[r + 1] | tokens[:r + 1])`` pairs with ``logprobs[r + 1]`` and
  ``loss_mask[r + 1]``. ``topk_ids[r]``/``topk_logprobs[r]`` hold exactly ``k`` entries sorted by
  logprob, highest first. The reference system's layout (entry ``p`` for token ``p``, entry 0 empty) is
  ``[[]] + rows``; ``schemas.atropos`` converts at the boundary.
* Teacher rows only where the learner trains (schema 2): a payload may carry ``rows``, the int32
  row indices it holds, strictly increasing; its top-k arrays then have one row per entry of ``rows``
  (``topk_ids[j]`` is row ``rows[j]``). Every trained row (``loss_mask[r + 1] == 1``) must be among
  them; prompt, earlier-turn and tool-output rows are neither computed nor shipped. ``rows`` absent
  means all ``L - 1`` rows (the schema 1 layout, still accepted).

* Cross-tokenizer payloads (schema 3; a teacher of another tokenizer, ``pipeline.teacher.crossscore``):
  ``chunk_last`` (uint8 ``[R]``) marks, per held row ``r`` (about token ``tokens[r + 1]``), whether the token is
  inside an aligned chunk but not its last (0), the last token of a chunk whose teacher log-probability (the sum
  over the chunk's teacher tokens) is ``sampled_logprobs[j]`` (1), or the last token of a chunk with no teacher
  signal (2: a special token the teacher has no counterpart for; its tokens get advantage 0).
  ``sampled_logprobs`` is 0.0 where ``chunk_last != 1``. ``topk_mapped`` (uint8 ``[R, k]``) is 1 where the slot
  holds a teacher entry mapped to a student id by equal bytes, 0 for an empty slot (id 0, a valid logprob that
  readers ignore). Mapped slots come first, sorted by logprob, highest first; a row with none carries no top-k
  signal (its token does not start on a boundary both tokenizations share, or nothing mapped). The
  position-convention spot check does not apply to such a payload.

Schema evolution: every message carries ``schema``; new fields are appended with defaults only and
readers skip fields they do not know (unknown fields are never forbidden), so rolling deploys work.
``schema`` is bumped only on an incompatible change, which older readers reject with a clear error.

Schema 3 is such a change for the groups it marks: a schema 2 reader skipping ``chunk_last``/``topk_mapped``
would take chunk sums for per-token logprobs and empty slots (id 0) for teacher entries, and train on them
without a word. So a scored group with cross-tokenizer payloads (and its header, and a batch holding it) is
stamped ``schema = 3``, which a schema 2 reader refuses ("version 3 not supported"); every other message is
still stamped ``BASE_SCHEMA`` (2), so a same-tokenizer pipeline keeps rolling deploys across the change.
"""

from __future__ import annotations

import enum
from typing import Any, Final

import msgspec
import numpy as np
import numpy.typing as npt

from schemas.arrays import Array

#: Current wire schema. Readers accept messages whose ``schema`` is at most this.
#: 2: teacher payloads may hold only the trained rows (``TeacherPayload.rows``); a schema 1 reader would
#: mis-read them as the first rows of the sequence, so it must refuse them (it does: "version 2 not supported").
#: 3: cross-tokenizer teacher payloads (``TeacherPayload.chunk_last``/``topk_mapped``), stamped only on the groups
#: that carry them (see the module docstring).
SCHEMA_VERSION: Final = 3
#: The schema every message is stamped with unless it carries a cross-tokenizer payload.
BASE_SCHEMA: Final = 2
#: ``TeacherPayload.chunk_last`` values: inside an aligned chunk, its last token (the teacher's chunk logprob in
#: ``sampled_logprobs``), the last token of a chunk with no teacher signal.
CHUNK_INSIDE, CHUNK_LAST, CHUNK_NO_SIGNAL = 0, 1, 2


class DistillStatus(enum.Enum):
    """Whether a scored group carries the teacher's payload."""

    OK = "ok"
    SKIPPED = "skipped"  # group_overrides.skip_teacher_top_k, or the group was discarded upstream
    DROPPED = "dropped"  # a sequence failed or came back misaligned; ``reason`` says which and why


class TeacherPayload(msgspec.Struct, frozen=True, kw_only=True):
    """The teacher's view of one sequence (logits-aligned): ``R`` rows, those named by ``rows``
    (all ``L - 1`` when ``rows`` is absent)."""

    k: int
    topk_ids: Array  # int32 [R, k]
    topk_logprobs: Array  # float32 (or float16, see schemas.arrays) [R, k], sorted descending per row
    sampled_logprobs: Array  # float32 [R]: teacher logprob of tokens[r + 1] for each row r
    rows: Array | None = None  # int32 [R], strictly increasing rows in [0, L-1); None: R = L - 1, rows 0..L-2
    chunk_last: Array | None = None  # uint8 [R], cross-tokenizer payloads only: 0 inside a chunk, 1 last, 2 no signal
    topk_mapped: Array | None = None  # uint8 [R, k], cross-tokenizer payloads only: 1 = mapped slot, 0 = empty

    @property
    def cross(self) -> bool:
        """A payload from a teacher of another tokenizer (chunk signal, mapped top-k)."""
        return self.chunk_last is not None

    def row_index(self, length: int) -> npt.NDArray[np.int32]:
        """The rows this payload holds, for a sequence of ``length`` tokens."""
        if self.rows is not None:
            return self.rows.numpy()  # type: ignore[return-value]
        return np.arange(max(length - 1, 0), dtype=np.int32)

    def dense_sampled(self, length: int) -> npt.NDArray[np.float32]:
        """``sampled_logprobs`` as ``[L - 1]`` rows, 0.0 at rows the payload does not hold."""
        sampled = self.sampled_logprobs.numpy().astype(np.float32, copy=False)
        if self.rows is None:
            return sampled
        out = np.zeros(max(length - 1, 0), np.float32)
        out[self.rows.numpy()] = sampled
        return out


class Sequence(msgspec.Struct, frozen=True, kw_only=True):
    """One trajectory: prompt plus completion(s), multi-turn aware through ``loss_mask``."""

    tokens: Array  # int32 [L]
    loss_mask: Array  # uint8 [L], 1 = trainable (sampled by the student)
    prompt_len: int  # tokens of the first prompt; loss_mask[:prompt_len] is 0
    logprobs: Array | None = None  # float32 [L], student logprob per token, 0.0 where not trainable
    score: float = 0.0
    advantages: Array | None = None  # float32 [L], optional precomputed advantages
    ref_logprobs: Array | None = None  # float32 [L]
    overrides: dict[str, Any] | None = None  # per-sequence overrides (set_advantage_to_zero, temperature)
    messages: list[dict[str, Any]] | None = None  # chat messages, for debugging only
    spans: list[tuple[int, int]] | None = None  # optional explicit trainable [start, end) spans

    @property
    def length(self) -> int:
        return self.tokens.shape[0] if self.tokens.shape else 0


class RolloutGroup(msgspec.Struct, frozen=True, kw_only=True, tag="rollout", tag_field="t"):
    """G sequences answering one prompt, as sampled by the student."""

    group_id: str
    sequences: list[Sequence]
    schema: int = BASE_SCHEMA
    env_id: int = 0
    task_id: str = ""
    policy_version: int = 0
    created_at: float = 0.0
    group_overrides: dict[str, Any] | None = None  # null and absent mean the same
    generation_params: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    discard: bool = False  # marked for discarding upstream: never sent to the teacher

    @property
    def overrides(self) -> dict[str, Any]:
        """``group_overrides`` with ``None`` read as empty."""
        return self.group_overrides or {}

    @property
    def num_tokens(self) -> int:
        return sum(s.length for s in self.sequences)


class ScoredGroup(msgspec.Struct, frozen=True, kw_only=True, tag="scored", tag_field="t"):
    """A rollout group plus the teacher's payload per sequence (or the reason it has none)."""

    group: RolloutGroup
    status: DistillStatus
    teacher: list[TeacherPayload] | None = None  # one per sequence when status is OK
    reason: str | None = None  # why the payload was dropped or skipped
    k: int = 0  # the k used for this group (after overrides and caps)
    teacher_id: str = ""  # model name and self-test checksum of the scoring teacher
    scored_at: float = 0.0
    schema: int = BASE_SCHEMA
    pool: str = "default"  # the teacher pool that scored it (``schemas.pools``; ``group_overrides.teacher``)

    @property
    def group_id(self) -> str:
        return self.group.group_id


class TrainBatch(msgspec.Struct, frozen=True, kw_only=True, tag="batch", tag_field="t"):
    """Whole scored groups plus per-token advantages, ready for a learner step.

    What the learner client hands the learner. The feeder writes batches by reference
    (``BatchManifest``); a ``TrainBatch`` written to the batches stream by value is accepted as well.
    """

    batch_id: str
    groups: list[ScoredGroup]
    advantages: list[Array]  # float32 [L] per sequence, groups flattened in order
    kl_coef: float = 0.0
    policy_version: int = 0  # learner version the feeder saw when batching
    created_at: float = 0.0
    stats: dict[str, float] | None = None
    schema: int = BASE_SCHEMA


class GroupHeader(msgspec.Struct, frozen=True, kw_only=True):
    """What the feeder needs to batch a scored group without reading its payload.

    Written by the teacher worker in the ``h`` field of each ``scored`` entry, next to the key that holds
    the payload (see ``pipeline.transport.claimcheck``). ``kl_sum``/``kl_tokens``: the sum over trainable positions
    of ``student - teacher`` sampled-token logprob and the number of those positions (sequences with
    ``set_advantage_to_zero`` excluded), so the feeder's KL controller never needs the arrays.
    """

    group_id: str
    policy_version: int
    status: DistillStatus
    sequences: int
    tokens: int  # sum of sequence lengths
    longest: int  # longest sequence
    kl_sum: float = 0.0
    kl_tokens: int = 0
    payload_bytes: int = 0
    created_at: float = 0.0
    schema: int = BASE_SCHEMA
    pool: str = "default"  # the teacher pool that scored the group
    # A group with cross-tokenizer payloads: its trained tokens, those in aligned chunks with teacher signal, its
    # trained rows with a mapped top-k slot, and the sum over those rows of the mapped probability mass.
    cross_tokens: int = 0
    cross_aligned: int = 0
    cross_topk_rows: int = 0
    cross_topk_mass: float = 0.0


class GroupRef(msgspec.Struct, frozen=True, array_like=True):
    """A scored group held in Redis: its id, the key of its encoded ``ScoredGroup``, its scored entry, and its
    tokens (sum of sequence lengths; 0 from writers before the field existed), by which learner ranks split
    a batch."""

    group_id: str
    key: str
    entry_id: str = ""
    tokens: int = 0


class BatchManifest(msgspec.Struct, frozen=True, kw_only=True, tag="manifest", tag_field="t"):
    """A train batch by reference: whole scored groups (oldest first) and how to weigh them.

    The learner client fetches the groups' payloads, validates them, computes per-token advantages with
    ``kl_coef`` and ``reward_weight`` (``pipeline.stages.batching.materialize``) and hands the learner a
    ``TrainBatch``; acknowledging the batch deletes the payloads. Group bytes thus cross Redis once on
    their way from the teacher to the learner.
    """

    batch_id: str
    refs: list[GroupRef]
    kl_coef: float = 0.0
    reward_weight: float = 0.0
    policy_version: int = 0  # learner version the feeder saw when batching
    created_at: float = 0.0
    stats: dict[str, float] | None = None
    schema: int = BASE_SCHEMA


Message = RolloutGroup | ScoredGroup | TrainBatch | BatchManifest
