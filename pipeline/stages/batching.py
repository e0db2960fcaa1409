"""Trainer-feeder stage logic (no Redis): staleness filter, whole-group batching, per-token advantages.

The feeder batches from each scored group's header (``GroupHeader``: version, status, sizes, KL sums) and
writes a ``BatchManifest`` of payload keys (``pipeline.transport.claimcheck``); the learner client turns the
manifest and the fetched groups into a ``TrainBatch`` with ``materialize``, which computes the advantages.

Advantages, per sequence, on trainable positions p (``loss_mask[p] == 1``), with the teacher's
logits-aligned row ``r = p - 1``:

    adv[p] = kl_coef * (teacher_sampled_logprob[p - 1] - student_logprob[p])      (reverse-KL signal)
           + reward_weight * (score - mean(scores of the group)) / (std + eps)     (task reward)

A payload from a teacher of another tokenizer (``TeacherPayload.chunk_last``) gives the reverse-KL term per aligned
chunk: every trained token of chunk ``c`` gets ``kl_coef * (q_c - s_c)``, the teacher's minus the sampler's
log-probability of the chunk (``schemas.crosschunks``; 0 in a chunk with no teacher signal).

Groups without a teacher payload (dropped or skipped) get the task-reward term only (``keep``) or are
left out (``drop``). ``batch_kl`` is the mean of ``student - teacher`` sampled-token logprob over the
trainable positions of the batch: the Monte-Carlo estimate of KL(student || teacher) that the KL
controller tracks (from the headers' ``kl_sum``/``kl_tokens``, see ``pipeline.transport.claimcheck.group_kl``).
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import structlog

from schemas import Array, BatchManifest, DistillStatus, GroupHeader, GroupRef, ScoredGroup, TrainBatch, crosschunks
from schemas.arrays import FLOAT32
from schemas.messages import BASE_SCHEMA

log = structlog.get_logger("distillq.feeder")
#: Batch stats per teacher pool: ``teacher.<pool>.groups``, ``.tokens`` and ``.reverse_kl`` (that pool's groups'
#: mean ``student - teacher`` sampled-token logprob, when they carry teacher data).
POOL_STAT = "teacher"
#: Batch stats of groups scored by a teacher of another tokenizer: ``cross.groups``, ``cross.aligned_share`` (the
#: share of their trained tokens in aligned chunks with teacher signal) and ``cross.topk_mapped_mass`` (the mean,
#: over their trained rows with a mapped top-k slot, of the teacher probability mass those slots carry).
CROSS_STAT = "cross"


@dataclass(frozen=True, slots=True)
class BatchingConfig:
    max_batch_tokens: int = 65536  # sum of sequence lengths (or padded size, see token_count)
    max_batch_groups: int | None = None
    token_count: Literal["sum", "padded"] = "sum"
    max_staleness: int | None = 4  # drop groups sampled more than this many versions ago
    missing_distill: Literal["keep", "drop"] = "keep"
    reward_weight: float = 0.0
    length_bucketing: bool = False
    bucket_window: int = 64  # groups considered when bucketing by length
    max_wait_s: float = 2.0  # flush a partial batch when its oldest group has waited this long

    def __post_init__(self) -> None:
        if self.max_batch_tokens < 1 or (self.max_batch_groups is not None and self.max_batch_groups < 1):
            raise ValueError("max_batch_tokens and max_batch_groups must be >= 1")
        if self.max_staleness is not None and self.max_staleness < 0:
            raise ValueError("max_staleness must be >= 0")


@dataclass(slots=True)
class Pending:
    """A scored group waiting for a batch: its header, where its payload is, the entry that carried it."""

    entry_id: str
    header: GroupHeader
    key: str = ""  # the payload key (pipeline.transport.claimcheck)
    arrived: float = field(default_factory=time.monotonic)
    ref: Any = None  # the transport's handle for acknowledging the entry (a Delivery)

    @property
    def group_id(self) -> str:
        return self.header.group_id

    @property
    def tokens(self) -> int:
        return self.header.tokens

    @property
    def longest(self) -> int:
        return self.header.longest

    @property
    def sequences(self) -> int:
        return self.header.sequences


def is_stale(h: GroupHeader, current_version: int, max_staleness: int | None) -> bool:
    return max_staleness is not None and current_version - h.policy_version > max_staleness


def admit(h: GroupHeader, current_version: int, cfg: BatchingConfig) -> str | None:
    """Why the group of header ``h`` must not be batched (``None`` if it may)."""
    if is_stale(h, current_version, cfg.max_staleness):
        return "stale"
    if h.status is not DistillStatus.OK and cfg.missing_distill == "drop":
        return f"no_distill_{h.status.value}"
    return None


def _cost(items: list[Pending], cfg: BatchingConfig) -> int:
    if cfg.token_count == "sum":
        return sum(p.tokens for p in items)
    return sum(p.sequences for p in items) * max((p.longest for p in items), default=0)


def take_batch(buffer: list[Pending], cfg: BatchingConfig, *, flush: bool = False) -> list[Pending] | None:
    """Remove and return whole groups for one batch, oldest first; ``None`` if no batch is due.

    A batch is due when the next group would overflow the token budget or the group count is reached,
    or (``flush``) when the oldest group waited ``max_wait_s``. A group larger than the whole budget
    forms a batch of its own; groups are never split.
    """
    if not buffer:
        return None
    order = list(range(len(buffer)))
    if cfg.length_bucketing:
        head = buffer[0].longest  # the oldest group always goes; fill with groups of similar length
        window = order[: cfg.bucket_window]
        order = [0, *sorted(window[1:], key=lambda i: abs(buffer[i].longest - head)), *order[cfg.bucket_window :]]
    chosen: list[int] = []
    full = False
    seqs = tokens = longest = 0  # running totals: the cost of a candidate is O(1)
    for i in order:
        p = buffer[i]
        n_seqs, n_tok, n_long = seqs + p.sequences, tokens + p.tokens, max(longest, p.longest)
        cost = n_tok if cfg.token_count == "sum" else n_seqs * n_long
        if chosen and cost > cfg.max_batch_tokens:
            full = True
            break
        chosen.append(i)
        seqs, tokens, longest = n_seqs, n_tok, n_long
        if cfg.max_batch_groups is not None and len(chosen) >= cfg.max_batch_groups:
            full = True
            break
    if len(chosen) == 1 and _cost([buffer[chosen[0]]], cfg) >= cfg.max_batch_tokens:
        full = True
    waited = time.monotonic() - buffer[0].arrived >= cfg.max_wait_s
    if not (full or flush or waited):
        return None
    picked = [buffer[i] for i in sorted(chosen)]
    for i in sorted(chosen, reverse=True):
        del buffer[i]
    return picked


_ZERO4 = bytes(4)  # one float32 0.0


def sequence_advantages(g: ScoredGroup, kl_coef: float, reward_weight: float) -> list[npt.NDArray[np.float32]]:
    """Per-token advantages of each sequence of ``g`` (see the module docstring)."""
    return batch_advantages([g], kl_coef, reward_weight)


def batch_advantages(
    groups: list[ScoredGroup], kl_coef: float, reward_weight: float
) -> list[npt.NDArray[np.float32]]:
    """Per-token advantages of every sequence of ``groups``, in order: views into one array.

    Computed once over the concatenated sequences (their bytes joined, no per-array numpy calls);
    masked positions are zeroed by multiplying with the 0/1 loss mask, so the arrays must be finite
    (``decode`` checks that by default).
    """
    teacher: list[bytes | memoryview] = []  # per sequence [0, q_0 .. q_{L-2}]: row r pairs with token r + 1
    student: list[bytes | memoryview] = []
    masks: list[bytes | memoryview] = []
    lengths: list[int] = []
    rewards: list[float] = []
    zeroed: list[int] = []
    cross: list[tuple[int, npt.NDArray[np.float32]]] = []  # (sequence, chunk reverse-KL advantages)
    for g in groups:
        seqs = g.group.sequences
        if reward_weight and len(seqs) > 1:
            scores = np.array([s.score for s in seqs], dtype=np.float64)
            rewards += (reward_weight * (scores - scores.mean()) / (scores.std() + 1e-6)).tolist()
        else:
            rewards += [0.0] * len(seqs)
        for i, s in enumerate(seqs):
            n = s.length
            if g.teacher is not None and g.teacher[i].chunk_last is not None:  # per chunk, added below
                cross.append((len(lengths), crosschunks.sequence_advantages(s, g.teacher[i], kl_coef)))
                teacher.append(bytes(4 * n))
                student.append(teacher[-1])
            elif g.teacher is not None and s.logprobs is not None and n > 1:
                t = g.teacher[i]  # a payload of the trained rows only is spread over its L - 1 rows
                teacher += [_ZERO4, t.sampled_logprobs.data if t.rows is None else t.dense_sampled(n).data]
                student.append(s.logprobs.data)
            else:  # no teacher signal for this sequence
                teacher.append(bytes(4 * n))
                student.append(teacher[-1])
            masks.append(s.loss_mask.data)
            if s.overrides and s.overrides.get("set_advantage_to_zero"):  # reference semantics: no signal
                zeroed.append(len(lengths))
            lengths.append(n)
    f32 = np.dtype("<f4")
    adv = np.subtract(np.frombuffer(b"".join(teacher), f32), np.frombuffer(b"".join(student), f32))
    adv *= np.float32(kl_coef)
    if any(rewards):
        adv += np.repeat(np.asarray(rewards, np.float32), lengths)
    adv *= np.frombuffer(b"".join(masks), np.uint8)
    ends = np.cumsum(lengths).tolist()
    out = [adv[e - n : e] for e, n in zip(ends, lengths, strict=True)]
    for k, extra in cross:
        out[k] += extra  # already 0 outside the loss mask
    for k in zeroed:
        out[k][:] = 0.0
    return out


@dataclass
class BuiltBatch:
    batch: BatchManifest
    observed_kl: float | None  # mean (student - teacher) sampled-token logprob; None without teacher data
    entry_ids: list[str]
    refs: list[Any]


def build_batch(items: list[Pending], kl_coef: float, policy_version: int, cfg: BatchingConfig) -> BuiltBatch:
    """A ``BatchManifest`` of ``items`` (whole groups, in order) with per-batch stats, from headers alone."""
    kl_sum, kl_n = 0.0, 0
    tokens = seqs = longest = 0
    staleness: Counter[int] = Counter()
    without = 0
    per_pool: dict[str, list[float]] = {}  # pool -> [groups, tokens, kl_sum, kl_tokens]
    cross = [0.0, 0.0, 0.0, 0.0, 0.0]  # groups, trained tokens, aligned tokens, top-k rows, mapped mass
    for p in items:
        h = p.header
        if h.cross_tokens:
            cross = [cross[0] + 1, cross[1] + h.cross_tokens, cross[2] + h.cross_aligned,
                     cross[3] + h.cross_topk_rows, cross[4] + h.cross_topk_mass]
        pool = per_pool.setdefault(h.pool, [0.0, 0.0, 0.0, 0.0])
        pool[0], pool[1], pool[2], pool[3] = pool[0] + 1, pool[1] + h.tokens, pool[2] + h.kl_sum, pool[3] + h.kl_tokens
        kl_sum, kl_n = kl_sum + h.kl_sum, kl_n + h.kl_tokens
        tokens, seqs, longest = tokens + h.tokens, seqs + h.sequences, max(longest, h.longest)
        staleness[policy_version - h.policy_version] += 1
        without += h.status is not DistillStatus.OK
    padded = seqs * longest
    observed = kl_sum / kl_n if kl_n else None
    stats: dict[str, float] = {
        "groups": float(len(items)), "sequences": float(seqs), "tokens": float(tokens),
        "padding_fraction": 1.0 - tokens / padded if padded else 0.0,
        "no_distill_share": without / len(items) if items else 0.0,
        "kl_coef": kl_coef,
    }
    if observed is not None:
        stats["reverse_kl"] = observed
    for lag, n in sorted(staleness.items()):
        stats[f"staleness_{lag}"] = float(n)
    for name, (groups, pool_tokens, pool_kl, pool_kl_n) in sorted(per_pool.items()):
        stats[f"{POOL_STAT}.{name}.groups"], stats[f"{POOL_STAT}.{name}.tokens"] = groups, pool_tokens
        if pool_kl_n:
            stats[f"{POOL_STAT}.{name}.reverse_kl"] = pool_kl / pool_kl_n
    if cross[0]:
        stats[f"{CROSS_STAT}.groups"] = cross[0]
        stats[f"{CROSS_STAT}.aligned_share"] = cross[2] / cross[1]
        stats[f"{CROSS_STAT}.topk_mapped_mass"] = cross[4] / cross[3] if cross[3] else 0.0
    stats["max_staleness"] = float(-1 if cfg.max_staleness is None else cfg.max_staleness)  # the learner's bound
    refs = [GroupRef(p.group_id, p.key, p.entry_id, p.tokens) for p in items]
    manifest = BatchManifest(
        batch_id=uuid.uuid4().hex, refs=refs, kl_coef=kl_coef,
        reward_weight=cfg.reward_weight, policy_version=policy_version, created_at=time.time(), stats=stats,
    )
    return BuiltBatch(manifest, observed, [p.entry_id for p in items], [p.ref for p in items])


def materialize(manifest: BatchManifest, groups: list[ScoredGroup]) -> TrainBatch:
    """The ``TrainBatch`` a manifest stands for, given its groups (fetched and validated, in order)."""
    advantages = [Array(FLOAT32, a.shape, a.data.cast("B"))
                  for a in batch_advantages(groups, manifest.kl_coef, manifest.reward_weight)]
    return TrainBatch(
        batch_id=manifest.batch_id, groups=groups, advantages=advantages, kl_coef=manifest.kl_coef,
        policy_version=manifest.policy_version, created_at=manifest.created_at, stats=manifest.stats,
        schema=max([BASE_SCHEMA, *(g.schema for g in groups)]),  # 3 when it holds cross-tokenizer payloads
    )
