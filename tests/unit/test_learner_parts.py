"""A rank's part of a batch and staleness at delivery (``pipeline.learner.parts``), without Redis."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pipeline.learner.parts import delivery_stats, resolve_bound, select_groups, split_by_tokens
from pipeline.stages.batching import batch_advantages
from schemas import Array, TrainBatch
from schemas.arrays import FLOAT32
from schemas.build import synthetic_rollout, synthetic_scored


@given(st.lists(st.integers(1, 5000), max_size=40), st.integers(1, 8))
def test_split_is_disjoint_covering_ordered_and_balanced(tokens: list[int], world: int) -> None:
    parts = split_by_tokens(tokens, world)
    assert len(parts) == world
    flat = sorted(i for p in parts for i in p)
    assert flat == list(range(len(tokens)))
    assert all(p == sorted(p) for p in parts)
    loads = [sum(tokens[i] for i in p) for p in parts]
    if tokens:
        assert max(loads) - min(loads) <= max(tokens)  # greedy largest-first: within the largest group
    assert split_by_tokens(tokens, world) == parts  # deterministic: every rank computes the same split


def test_fewer_groups_than_ranks_leaves_parts_empty() -> None:
    assert split_by_tokens([10, 30], 3) == [[1], [0], []]


def test_select_groups_keeps_each_groups_advantages() -> None:
    groups = [synthetic_scored(synthetic_rollout(n, 8 + n, group_id=f"g{n}", seed=n), k=2, seed=n) for n in (1, 2, 3)]
    adv = [Array(FLOAT32, a.shape, a.data.cast("B")) for a in batch_advantages(groups, 0.5, 0.0)]
    b = TrainBatch(batch_id="b", groups=groups, advantages=adv)
    part = select_groups(b, [0, 2])
    assert [g.group_id for g in part.groups] == ["g1", "g3"]
    assert [a.numpy().tolist() for a in part.advantages] == [a.numpy().tolist() for a in adv[:1] + adv[3:]]


def test_bound_and_stats_at_delivery() -> None:
    assert resolve_bound({"max_staleness": 4.0}, "feeder") == 4
    assert resolve_bound({"max_staleness": -1.0}, "feeder") is None
    assert resolve_bound(None, "feeder") is None and resolve_bound({"max_staleness": 4.0}, 2) == 2
    assert resolve_bound({"max_staleness": 4.0}, -1) is None
    s = delivery_stats({"staleness_0": 3.0, "tokens": 9.0}, [5, 5, 2], 7, 1)
    assert s == {"batched_staleness_0": 3.0, "tokens": 9.0, "staleness_2": 2.0, "staleness_5": 1.0,
                 "delivered_version": 7.0, "stale_dropped": 1.0}
