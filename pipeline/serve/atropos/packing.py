"""Pure batching arithmetic of the Atropos-compatible server: which queued groups make a batch, which
buffered groups fill an env's group size, and the queue figures ``/status-env`` reports. No I/O.

A batch is whole groups whose sequences sum exactly to the trainer's ``batch_size``: the earliest such set
in queue order (a group is taken whenever the rest of the batch can still be filled by later groups), so
the oldest groups go first and no group size has to divide another (the reference packs powers of two
and serves the newest batch first). With envs registered with ``min_batch_allocation``, each such env's
share is filled from its own oldest groups first, as the reference does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

#: The smallest share of ``/status-env``'s weight an env gets (the reference's ``MIN_ENV_WEIGHT``).
MIN_ENV_WEIGHT: Final = 0.01


@dataclass(frozen=True, slots=True)
class Queued:
    """One scored group waiting on the queue."""

    entry_id: str  # its entry on the queue stream
    group_id: str
    key: str  # where its encoded ScoredGroup lives (claim check)
    sequences: int
    env_id: int | None
    source_id: str = ""  # its entry on the scored stream, for dead letters


def pick_exact(sizes: Sequence[int], target: int) -> list[int] | None:
    """Ascending indices of the earliest subset of ``sizes`` that sums to ``target``, or None.

    Earliest: lexicographically smallest index list, i.e. index ``i`` is taken whenever ``target`` can
    still be reached with it and later items. Subset sums as bit sets (Python integers), so a queue of
    thousands of groups takes ``O(len(sizes) * target / 64)`` word operations.
    """
    if target <= 0:
        return None
    full = (1 << (target + 1)) - 1
    reach = [0] * (len(sizes) + 1)  # reach[i]: the sums items i.. can make
    reach[-1] = 1
    for i in range(len(sizes) - 1, -1, -1):
        s = sizes[i]
        reach[i] = (reach[i + 1] | (reach[i + 1] << s)) & full if 0 < s <= target else reach[i + 1]
    if not (reach[0] >> target) & 1:
        return None
    out, left = [], target
    for i, s in enumerate(sizes):
        if 0 < s <= left and (reach[i + 1] >> (left - s)) & 1:
            out.append(i)
            left -= s
            if left == 0:
                break
    return out


def minimum_sequences(envs: Sequence[dict[str, Any]], batch_size: int, queue: Sequence[Queued]) -> dict[int, int]:
    """Sequences each connected env with a ``min_batch_allocation`` must get in a batch (scaled down when
    they add up to more than ``batch_size``, each keeping at least its smallest queued group)."""
    mins = {int(e["registered_id"]): int(batch_size * e["min_batch_allocation"]) for e in envs
            if e.get("connected") and e.get("min_batch_allocation") is not None}
    mins = {env: n for env, n in mins.items() if n > 0}
    total = sum(mins.values())
    if total > batch_size:
        for env in mins:
            own = [q.sequences for q in queue if q.env_id == env]
            mins[env] = max(min(own, default=1), int(mins[env] * batch_size / total))
    return mins


def pick_batch(queue: Sequence[Queued], batch_size: int, minimums: dict[int, int] | None = None) -> list[int] | None:
    """Indices (ascending) of the queued groups that make the next batch, or None when none can be made.

    ``minimums``: env id -> sequences that env must get; its oldest groups are taken first (up to the
    batch), then the rest is filled from every group, earliest first. An env with a minimum and no
    group queued means no batch.
    """
    sizes = [q.sequences for q in queue]
    if not minimums:
        return pick_exact(sizes, batch_size)
    chosen: list[int] = []
    total = 0
    for env, need in minimums.items():
        own = [i for i, q in enumerate(queue) if q.env_id == env]
        if not own:
            return None
        got = 0
        for i in own:
            if got >= need:
                break
            if total + sizes[i] <= batch_size:
                chosen.append(i)
                got += sizes[i]
                total += sizes[i]
    taken = set(chosen)
    rest_idx = [i for i in range(len(queue)) if i not in taken]
    if total == batch_size:
        return sorted(chosen)
    rest = pick_exact([sizes[i] for i in rest_idx], batch_size - total)
    if rest is None:
        return None
    return sorted(chosen + [rest_idx[j] for j in rest])


def status_env(
    envs: Sequence[dict[str, Any]], env_id: int, items: Sequence[tuple[int | None, int]], step: int, batch_size: int
) -> tuple[dict[str, Any], int]:
    """``/status-env`` for ``env_id`` from ``items`` (env id, sequences) of every group not yet handed
    out, as the reference computes it; and the env's group size raised to its largest group (the
    reference's side effect). Queue sizes are in units of that group size."""
    env = envs[env_id]
    connected = [e for e in envs if e.get("connected")]
    total = sum(e["max_context_len"] * max(0.0, e["weight"]) for e in connected)
    weight = env["max_context_len"] * env["weight"] / total if total else 1.0
    min_alloc = sum(e["min_batch_allocation"] for e in connected if e.get("min_batch_allocation") is not None)
    group_size = int(env["group_size"])
    max_group, own = 1, 0
    others: dict[int | None, int] = {}
    for env_of, n in items:
        max_group = max(max_group, n)
        if env_of == env_id:
            group_size = max(group_size, n)
            own += n
        else:
            others[env_of] = others.get(env_of, 0) + n
    mins = {int(e["registered_id"]): int(batch_size * e["min_batch_allocation"]) for e in connected
            if e.get("min_batch_allocation") is not None}
    available = 0
    if max_group > 1:
        for other, n in others.items():
            packed = math.ceil(n / max_group) * max_group
            available += max(0, packed - (mins.get(other, 0) if other is not None else 0))
    group_size = max(group_size, 1)
    return {
        "current_step": step,
        "queue_size": (own + available) // group_size,
        "unallocated_fraction": 1.0 - min(min_alloc, 1.0),
        "self_queue_size": own // group_size,
        "max_group_size": max_group,
        "env_weight": max(MIN_ENV_WEIGHT, weight),
    }, group_size


def scoring_completes_batch(queued: Sequence[tuple[int | None, int]], inflight: Sequence[tuple[int | None, int]],
                            batch_size: int, envs: Sequence[dict[str, Any]]) -> bool:
    """Whether the groups being scored (``inflight``: (env id, sequences) each), once queued behind
    ``queued``, would let a batch be made that cannot be made now (``GET /batch`` then waits for them)."""
    if not inflight or batch_size < 1:
        return False
    later = [Queued(f"q{i}", "", "", n, env) for i, (env, n) in enumerate(queued)]
    later += [Queued(f"s{i}", "", "", n, env) for i, (env, n) in enumerate(inflight)]
    return pick_batch(later, batch_size, minimum_sequences(envs, batch_size, later)) is not None
