"""Trainer-feeder stage logic (no Redis): staleness filter, whole-group batching, per-token advantages.

Advantages, per sequence, on trainable positions p (``loss_mask[p] == 1``), with the teacher's
logits-aligned row ``r = p - 1``:

    adv[p] = kl_coef * (teacher_sampled_logprob[p - 1] - student_logprob[p])      (reverse-KL signal)
           + reward_weight * (score - mean(scores of the group)) / (std + eps)     (task reward)

Groups without a teacher payload (dropped or skipped) get the task-reward term only (``keep``) or are
left out (``drop``). ``batch_kl`` is the mean of ``student - teacher`` sampled-token logprob over the
trainable positions of the batch: the Monte-Carlo estimate of KL(student || teacher) that the KL
controller tracks.
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

from schemas import Array, DistillStatus, ScoredGroup, TrainBatch
from schemas.arrays import FLOAT32

log = structlog.get_logger("distillq.feeder")


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
    """A scored group waiting for a batch, with the stream entry that carried it."""

    entry_id: str
    group: ScoredGroup
    arrived: float = field(default_factory=time.monotonic)
    ref: Any = None  # the transport's handle for acknowledging the entry (a Delivery)

    @property
    def tokens(self) -> int:
        return self.group.group.num_tokens

    @property
    def longest(self) -> int:
        return max(s.length for s in self.group.group.sequences)


def is_stale(group: ScoredGroup, current_version: int, max_staleness: int | None) -> bool:
    return max_staleness is not None and current_version - group.group.policy_version > max_staleness


def admit(group: ScoredGroup, current_version: int, cfg: BatchingConfig) -> str | None:
    """Why ``group`` must not be batched (``None`` if it may)."""
    if is_stale(group, current_version, cfg.max_staleness):
        return "stale"
    if group.status is not DistillStatus.OK and cfg.missing_distill == "drop":
        return f"no_distill_{group.status.value}"
    return None


def _cost(items: list[Pending], cfg: BatchingConfig) -> int:
    if cfg.token_count == "sum":
        return sum(p.tokens for p in items)
    return sum(len(p.group.group.sequences) for p in items) * max((p.longest for p in items), default=0)


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
        n_seqs, n_tok, n_long = seqs + len(p.group.group.sequences), tokens + p.tokens, max(longest, p.longest)
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


def sequence_advantages(
    g: ScoredGroup, kl_coef: float, reward_weight: float
) -> tuple[list[npt.NDArray[np.float32]], float, int]:
    """Per-token advantages of each sequence, the sum of (student - teacher) logprob, and its count."""
    seqs = g.group.sequences
    scores = np.array([s.score for s in seqs], dtype=np.float64)
    reward_adv = (scores - scores.mean()) / (scores.std() + 1e-6) if len(seqs) > 1 else np.zeros(len(seqs))
    out: list[npt.NDArray[np.float32]] = []
    kl_sum, kl_n = 0.0, 0
    for i, s in enumerate(seqs):
        mask = s.loss_mask.numpy().astype(bool)
        adv = np.zeros(s.length, dtype=np.float32)
        zeroed = bool((s.overrides or {}).get("set_advantage_to_zero"))  # reference semantics: no signal at all
        if reward_weight and not zeroed:
            adv[mask] += np.float32(reward_weight * reward_adv[i])
        if g.teacher is not None and s.logprobs is not None and s.length > 1 and not zeroed:
            q = g.teacher[i].sampled_logprobs.numpy().astype(np.float32)  # row r -> token r + 1
            student = s.logprobs.numpy()[1:]
            m = mask[1:]
            diff = q[m] - student[m]
            adv[1:][m] += np.float32(kl_coef) * diff
            kl_sum += float(-diff.sum(dtype=np.float64))
            kl_n += int(m.sum())
        out.append(adv)
    return out, kl_sum, kl_n


@dataclass
class BuiltBatch:
    batch: TrainBatch
    observed_kl: float | None  # mean (student - teacher) sampled-token logprob; None without teacher data
    entry_ids: list[str]
    refs: list[Any]


def build_batch(items: list[Pending], kl_coef: float, policy_version: int, cfg: BatchingConfig) -> BuiltBatch:
    """A ``TrainBatch`` of ``items`` (whole groups, in order) with advantages and per-batch stats."""
    advantages: list[Array] = []
    kl_sum, kl_n = 0.0, 0
    lengths: list[int] = []
    staleness: Counter[int] = Counter()
    without = 0
    for p in items:
        advs, s, n = sequence_advantages(p.group, kl_coef, cfg.reward_weight)
        advantages += [Array.from_numpy(a, FLOAT32) for a in advs]
        kl_sum, kl_n = kl_sum + s, kl_n + n
        lengths += [seq.length for seq in p.group.group.sequences]
        staleness[policy_version - p.group.group.policy_version] += 1
        without += p.group.status is not DistillStatus.OK
    tokens = sum(lengths)
    padded = len(lengths) * max(lengths, default=0)
    observed = kl_sum / kl_n if kl_n else None
    stats: dict[str, float] = {
        "groups": float(len(items)), "sequences": float(len(lengths)), "tokens": float(tokens),
        "padding_fraction": 1.0 - tokens / padded if padded else 0.0,
        "no_distill_share": without / len(items) if items else 0.0,
        "kl_coef": kl_coef,
    }
    if observed is not None:
        stats["reverse_kl"] = observed
    for lag, n in sorted(staleness.items()):
        stats[f"staleness_{lag}"] = float(n)
    batch = TrainBatch(
        batch_id=uuid.uuid4().hex, groups=[p.group for p in items], advantages=advantages, kl_coef=kl_coef,
        policy_version=policy_version, created_at=time.time(), stats=stats,
    )
    return BuiltBatch(batch, observed, [p.entry_id for p in items], [p.ref for p in items])
