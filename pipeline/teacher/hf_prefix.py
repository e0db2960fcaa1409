"""Which requests of one teacher call share a prefix, and how long a prefix to run once for them.

The sequences of a rollout group share their prompt. Sorted lexicographically, sequences with a common
prefix are neighbours, and the longest common prefix of a run of neighbours is the minimum of the
adjacent ones; a small dynamic programme over those runs picks the partition that computes the fewest
tokens through the base model (a run sharing ``p`` tokens costs ``sum(len) - (n - 1) * p``). So a group
where one sequence diverges inside the prompt shares the full prompt among the others instead of the
shorter prefix among all.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

#: Runs longer than this many requests are not considered as one shared group (keeps the plan O(n)).
MAX_GROUP = 256


@dataclass(frozen=True, slots=True)
class PrefixGroup:
    """Requests (indices into the planned list) that run ``prefix`` tokens once; ``prefix == 0``: no sharing."""

    members: list[int]
    prefix: int


def common_prefix(a: npt.NDArray[np.int32], b: npt.NDArray[np.int32]) -> int:
    """Length of the longest common prefix of two token arrays."""
    n = min(a.shape[0], b.shape[0])
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else int(n)


def plan_prefix_groups(seqs: list[npt.NDArray[np.int32]], min_prefix: int) -> list[PrefixGroup]:
    """Partition ``seqs`` into groups sharing a prefix of at least ``min_prefix`` tokens, and singletons.

    A shared prefix leaves every member at least one token of its own (``prefix <= len - 1``). Every index
    appears in exactly one group; singletons (and groups whose prefix would be below ``min_prefix``) have
    ``prefix == 0``.
    """
    n = len(seqs)
    if n == 0:
        return []
    # Little-endian int32 bytes: sequences with a common token prefix share a byte prefix, so they sort together.
    order = sorted(range(n), key=lambda i: seqs[i].tobytes())
    lens = [int(seqs[i].shape[0]) for i in order]
    adj = [common_prefix(seqs[order[j]], seqs[order[j + 1]]) for j in range(n - 1)]
    best = [0] * (n + 1)  # best[j]: fewest tokens for the first j sorted sequences
    cut: list[tuple[int, int]] = [(0, 0)] * (n + 1)  # (start of the last group, its prefix)
    for j in range(1, n + 1):
        best[j], cut[j] = best[j - 1] + lens[j - 1], (j - 1, 0)
        total, p = lens[j - 1], lens[j - 1] - 1
        for i in range(j - 2, max(-1, j - 1 - MAX_GROUP), -1):  # group = sorted[i : j]
            p = min(p, adj[i], lens[i] - 1)
            if p < min_prefix:
                break
            total += lens[i]
            cost = best[i] + total - (j - i - 1) * p
            if cost < best[j]:
                best[j], cut[j] = cost, (i, p)
    groups: list[PrefixGroup] = []
    j = n
    while j > 0:
        i, p = cut[j]
        groups.append(PrefixGroup([order[m] for m in range(i, j)], p))
        j = i
    groups.reverse()
    return groups


def planned_tokens(seqs: list[npt.NDArray[np.int32]], groups: list[PrefixGroup]) -> int:
    """Tokens the base model computes under ``groups`` (each shared prefix once)."""
    total = 0
    for g in groups:
        total += sum(int(seqs[m].shape[0]) for m in g.members) - (len(g.members) - 1) * g.prefix
    return total
