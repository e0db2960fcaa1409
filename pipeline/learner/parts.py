"""Learner-side batch logic without Redis: a rank's part of a global batch, staleness at delivery.

``split_by_tokens`` gives each of ``world`` ranks whole groups of one batch, balanced by tokens: groups
are taken largest first (ties: earlier group first) and each goes to the rank with the fewest tokens so
far (ties: the lower rank). Every rank computes the same split from the same manifest, so the parts are
disjoint, their union is the batch, and a batch delivered again is split the same way.

Staleness at delivery: a group is stale when ``version at delivery - group.policy_version >
max_staleness``. The bound is the feeder's (stamped on each batch as ``stats["max_staleness"]``) unless
the learner names its own.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Literal

import msgspec

from schemas import Array, BatchManifest, ScoredGroup, TrainBatch

#: Take the bound the feeder stamped on the batch (``stats["max_staleness"]``; none if absent).
FEEDER: Literal["feeder"] = "feeder"
StalenessBound = int | Literal["feeder"]


def split_by_tokens(tokens: Sequence[int], world: int) -> list[list[int]]:
    """Indices of ``tokens`` per rank (each part in batch order): disjoint, covering, balanced by tokens."""
    if world < 1:
        raise ValueError("world must be >= 1")
    parts: list[list[int]] = [[] for _ in range(world)]
    load = [0] * world
    for i in sorted(range(len(tokens)), key=lambda j: (-tokens[j], j)):
        r = min(range(world), key=lambda q: (load[q], q))
        parts[r].append(i)
        load[r] += max(0, tokens[i])
    return [sorted(p) for p in parts]


def group_tokens(g: ScoredGroup) -> int:
    return sum(s.length for s in g.group.sequences)


def manifest_part(m: BatchManifest, rank: int, world: int) -> BatchManifest:
    """The manifest of rank ``rank``'s groups. A manifest whose references carry no token counts (a feeder
    from before they were written) is split by group count."""
    if world == 1:
        return m
    sizes = [r.tokens if r.tokens > 0 else 1 for r in m.refs]
    keep = split_by_tokens(sizes, world)[rank]
    return msgspec.structs.replace(m, refs=[m.refs[i] for i in keep])


def batch_part(b: TrainBatch, rank: int, world: int) -> TrainBatch:
    """Rank ``rank``'s groups of a batch written by value, with their advantages."""
    if world == 1:
        return b
    keep = split_by_tokens([group_tokens(g) for g in b.groups], world)[rank]
    return select_groups(b, keep)


def select_groups(b: TrainBatch, keep: Sequence[int]) -> TrainBatch:
    """``b`` with only the groups at indices ``keep`` (in order) and their sequences' advantages."""
    starts: list[int] = [0]
    for g in b.groups:
        starts.append(starts[-1] + len(g.group.sequences))
    adv: list[Array] = []
    for i in keep:
        adv += b.advantages[starts[i] : starts[i + 1]]
    return msgspec.structs.replace(b, groups=[b.groups[i] for i in keep], advantages=adv)


def resolve_bound(stats: dict[str, float] | None, bound: StalenessBound) -> int | None:
    """The staleness bound that applies to a batch: ``None`` when there is none."""
    if bound == FEEDER:
        raw = (stats or {}).get("max_staleness")
        value = None if raw is None else int(raw)
    else:
        value = int(bound)
    return value if value is not None and value >= 0 else None


def is_stale(group_version: int, version: int, bound: int | None) -> bool:
    return bound is not None and version - group_version > bound


def delivery_stats(
    stats: dict[str, float] | None, group_versions: Sequence[int], version: int, stale_dropped: int
) -> dict[str, float]:
    """A batch's stats as delivered: ``staleness_<n>`` counts the groups handed out that are ``n`` versions
    behind ``version`` (the policy version at delivery); the feeder's counts at batching time move to
    ``batched_staleness_<n>``; ``delivered_version`` and ``stale_dropped`` are added."""
    out: dict[str, float] = {}
    for k, v in (stats or {}).items():
        out[f"batched_{k}" if k.startswith("staleness_") else k] = v
    for lag, n in sorted(Counter(version - gv for gv in group_versions).items()):
        out[f"staleness_{lag}"] = float(n)
    out["delivered_version"] = float(version)
    out["stale_dropped"] = float(stale_dropped)
    return out
