"""Token tracker: masks, spans, multi-turn extension by token ids, branching, divergence, modes."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs

from pipeline.rollout.students.base import Completion
from pipeline.rollout.tracker import Tracker, common_prefix_len
from schemas.validate import Limits, validate_sequence

P = [1, 3, 40, 41, 42, 4]  # a prompt
U = [2, 3, 50, 51, 4]  # a later user turn (end of previous turn, user, text, assistant)


def comp(ids: list[int], base: float = -0.5, finish: str = "stop") -> Completion:
    return Completion(list(ids), [base - 0.01 * i for i in range(len(ids))], finish)


def runs(mask: np.ndarray) -> list[tuple[int, int]]:
    out, start = [], None
    for i, m in enumerate([*mask.tolist(), 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


def test_single_turn_n_branches_mask_prompt_and_validate() -> None:
    tr = Tracker()
    cs = [comp([10, 11, 2]), comp([12, 2], base=-1.0), comp([13, 14, 15], finish="length")]
    ids = tr.record(P, cs)
    assert len(ids) == 3 and len(set(ids)) == 3
    seqs = tr.sequences(scores=[1.0, 0.0, 0.5])
    for c, seq in zip(cs, seqs, strict=True):
        tok, mask, lp = seq.tokens.numpy(), seq.loss_mask.numpy(), seq.logprobs.numpy()
        assert tok.tolist() == P + c.token_ids
        assert mask.tolist() == [0] * len(P) + [1] * len(c.token_ids)
        assert seq.prompt_len == len(P)
        assert np.allclose(lp[len(P) :], c.logprobs) and not lp[: len(P)].any()
        assert seq.spans == [(len(P), len(P) + len(c.token_ids))]
        validate_sequence(seq, "seq", Limits(vocab_size=512))
    assert [s.score for s in seqs] == [1.0, 0.0, 0.5]
    assert tr.stats.new_sequences == 1 and tr.stats.completions == 3 and tr.stats.divergences == 0


def test_multi_turn_extends_by_token_ids_and_masks_new_turn() -> None:
    tr = Tracker()
    c1, c2 = comp([10, 11, 2], base=-0.3), comp([20, 21], base=-0.7)
    [n1] = tr.record(P, [c1])
    [n2] = tr.record(P + c1.token_ids + U, [c2])
    assert [n.id for n in tr.nodes()] == [n2]  # default mode: the extension replaces its parent
    node = tr.get(n2)
    assert node.parent == n1 and node.turns == 2
    seq = tr.to_sequence(n2)
    a, b = len(P), len(P) + 3 + len(U)
    assert seq.tokens.numpy().tolist() == P + c1.token_ids + U + c2.token_ids
    assert seq.loss_mask.numpy().tolist() == [0] * a + [1] * 3 + [0] * len(U) + [1] * 2
    assert seq.spans == [(a, a + 3), (b, b + 2)]
    assert seq.prompt_len == len(P)  # the first prompt, not "count of masked positions"
    lp = seq.logprobs.numpy()
    assert np.allclose(lp[a : a + 3], c1.logprobs) and np.allclose(lp[b:], c2.logprobs)
    assert not lp[a + 3 : b].any()
    validate_sequence(seq, "seq", Limits())
    assert tr.stats.extended == 1 and tr.stats.divergences == 0


def test_continuation_without_new_tokens_merges_spans() -> None:
    tr = Tracker()
    c1 = comp([10, 11], finish="length")
    tr.record(P, [c1])
    [n2] = tr.record(P + c1.token_ids, [comp([12, 2])])
    assert tr.get(n2).spans == ((len(P), len(P) + 4),)


def test_parallel_rollouts_each_extend_their_own_branch() -> None:
    tr = Tracker()
    a, b = comp([10, 11, 2]), comp([10, 12, 2])  # share their first sampled token
    na, nb = tr.record(P, [a, b])
    with capture_logs() as logs:
        [nb2] = tr.record(P + b.token_ids + U, [comp([30])])
        [na2] = tr.record(P + a.token_ids + U, [comp([31])])
        [fresh] = tr.record(P, [comp([32])])  # another group with the same prompt
    assert tr.get(na2).parent == na and tr.get(nb2).parent == nb and tr.get(fresh).parent is None
    assert [n.id for n in tr.nodes()] == [na2, nb2, fresh]  # replaced in place, in list order
    assert tr.stats.divergences == 0 and not logs


def test_expected_parent_mismatch_is_a_divergence_and_starts_a_new_sequence() -> None:
    tr = Tracker()
    c1 = comp([22, 26, 2])  # the student sampled "1" "5"; a template re-renders it as "15"
    [n1] = tr.record(P, [c1])
    retok = [*P, 314, 2, *U]
    with capture_logs() as logs:
        [n2] = tr.record(retok, [comp([40])], expected_parents=[n1])
    assert tr.stats.divergences == 1
    [ev] = [e for e in logs if e["event"] == "tracker.prefix_divergence"]
    assert ev["log_level"] == "warning" and ev["node"] == n1 and ev["common_prefix"] == len(P)
    assert ev["action"] == "new_sequence"
    node = tr.get(n2)
    assert node.parent is None and node.tokens == (*retok, 40)
    assert node.spans == ((len(retok), len(retok) + 1),)  # the re-tokenised history is not trainable
    assert {n.id for n in tr.nodes()} == {n1, n2}  # the first turn keeps its own trajectory


def test_partial_match_into_a_completion_is_a_divergence_without_hint() -> None:
    tr = Tracker()
    c1 = comp([10, 11, 12, 2])
    [n1] = tr.record(P, [c1])
    with capture_logs() as logs:
        [n2] = tr.record([*P, 10, 99, *U], [comp([5])])  # agrees with the completion, then drifts
    assert tr.stats.divergences == 1 and tr.get(n2).parent is None
    assert logs[0]["reason"] == "partial_match" and logs[0]["common_prefix"] == len(P) + 1
    assert n1 in tr


def test_tree_mode_keeps_every_node_and_picks_the_longest_prefix() -> None:
    tr = Tracker("tree")
    c1 = comp([10, 2])
    [n1] = tr.record(P, [c1])
    s1 = P + c1.token_ids
    [n2] = tr.record(s1 + U, [comp([20, 2])])
    [n3] = tr.record([*s1, 2, 3, 60, 4], [comp([21])])  # a second follow-up from the first turn
    s2 = list(tr.get(n2).tokens)
    [n4] = tr.record(s2 + U, [comp([22])])  # continues the deeper node, not the root
    assert [n.id for n in tr.state().nodes] == [n1, n2, n3, n4]
    assert tr.get(n3).parent == n1 and tr.get(n4).parent == n2
    assert [n.id for n in tr.leaves()] == [n3, n4]
    assert len(tr.sequences()) == 2 and len(tr.sequences(all_nodes=True)) == 4
    assert tr.stats.divergences == 0


def test_tree_mode_drift_in_a_child_is_reported() -> None:
    tr = Tracker("tree")
    [n1] = tr.record(P, [comp([10, 2])])
    s1 = list(tr.get(n1).tokens)
    [n2] = tr.record(s1 + U, [comp([20, 21, 2])])
    with capture_logs() as logs:
        [n3] = tr.record(s1 + U + [20, 77] + U, [comp([5])])
    assert tr.stats.divergences == 1 and logs[0]["node"] == n2
    assert tr.get(n3).parent == n1 and logs[0]["action"] == "extend_shorter_prefix"


def test_default_mode_follow_up_from_a_replaced_state_starts_fresh() -> None:
    tr = Tracker()
    c1 = comp([10, 2])
    tr.record(P, [c1])
    tr.record(P + c1.token_ids + U, [comp([20])])
    [n3] = tr.record(P + c1.token_ids + [2, 3, 60, 4], [comp([21])])  # branching needs tree mode
    assert tr.get(n3).parent is None and tr.stats.divergences == 0
    assert tr.get(n3).mask[len(P) : len(P) + 2] == (0, 0)  # the first reply is prompt on this sequence


def test_tree_mode_branch_from_an_earlier_turn_keeps_that_turn_trainable() -> None:
    """verifiers' graph: the first reply is on both branches, sampled (trainable) on each."""
    tr = Tracker("tree")
    c1, c2, c3 = comp([10, 2], base=-0.2), comp([20, 2]), comp([21], base=-0.9)
    [n1] = tr.record(P, [c1])
    [n2] = tr.record(P + c1.token_ids + U, [c2])
    [n3] = tr.record(P + c1.token_ids + [2, 3, 60, 4], [c3])
    seqs = tr.sequences(scores=[1.0, 2.0])
    assert [n.id for n in tr.leaves()] == [n2, n3] and tr.get(n3).parent == n1
    for seq, last in zip(seqs, (c2, c3), strict=True):
        mask, lp = seq.loss_mask.numpy(), seq.logprobs.numpy()
        assert mask[len(P) : len(P) + 2].tolist() == [1, 1] and np.allclose(lp[len(P) : len(P) + 2], c1.logprobs)
        assert mask[-len(last.token_ids) :].all() and mask.sum() == 2 + len(last.token_ids)
        validate_sequence(seq, "seq", Limits())


def test_tree_mode_retries_of_one_prompt_are_sibling_leaves() -> None:
    tr = Tracker("tree")
    [a] = tr.record(P, [comp([10, 2])])
    [b] = tr.record(P, [comp([11, 2])])  # the same prompt again (a retry)
    [b2] = tr.record([*P, 11, 2, *U[1:]], [comp([30])])  # continues the retry, not the first attempt
    assert [n.id for n in tr.leaves()] == [a, b2] and tr.get(b2).parent == b and tr.get(b).parent is None
    assert tr.stats.divergences == 0


@pytest.mark.parametrize("mode", ["default", "tree"])
def test_reply_cut_by_max_tokens_continues_when_the_template_closes_it(mode: str) -> None:
    tr = Tracker(mode)  # type: ignore[arg-type]
    cut = comp([10, 11], finish="length")
    [n1] = tr.record(P, [cut], stop_token_ids=[2])
    assert tr.get(n1).open_end
    [n2] = tr.record([*P, 10, 11, 2, 3, 50, 4], [comp([20, 2])], stop_token_ids=[2])  # "</s>" closes it
    assert tr.get(n2).parent == n1 and tr.stats.divergences == 0
    assert tr.to_sequence(n2).loss_mask.numpy()[len(P) : len(P) + 2].tolist() == [1, 1]


def test_reply_changed_after_sampling_is_not_trained_on_that_path() -> None:
    """A reply cut by ``max_tokens`` comes back with text appended ("!" = 12 here): its sampled ids are
    still a prefix, but the reply is a different message, so verifiers starts a new branch."""
    tr = Tracker("tree")
    cut = comp([10, 11], finish="length")
    [n1] = tr.record(P, [cut], stop_token_ids=[2])
    edited = [*P, 10, 11, 12, 2, 3, 50, 4]
    with capture_logs() as logs:
        [n2] = tr.record(edited, [comp([20, 2])], stop_token_ids=[2])
    assert tr.get(n2).parent is None and tr.stats.divergences == 1
    [ev] = logs
    assert ev["reason"] == "reply_changed" and ev["node"] == n1 and ev["action"] == "new_sequence"
    assert [n.id for n in tr.leaves()] == [n1, n2]
    assert tr.to_sequence(n2).loss_mask.numpy().tolist() == [0] * len(edited) + [1, 1]
    legacy = Tracker("tree")  # without stop ids nothing tells a changed reply from a closed one
    [m1] = legacy.record(P, [cut])
    [m2] = legacy.record(edited, [comp([20, 2])])
    assert legacy.get(m2).parent == m1


def test_changed_reply_extends_the_longest_intact_earlier_turn() -> None:
    tr = Tracker("tree")
    [n1] = tr.record(P, [comp([10, 2])], stop_token_ids=[2])  # closed by its stop token
    s1 = list(tr.get(n1).tokens)
    [n2] = tr.record(s1 + U[1:], [comp([20, 21], finish="length")], stop_token_ids=[2])
    with capture_logs() as logs:
        [n3] = tr.record([*s1, *U[1:], 20, 21, 22, 2, 3, 60, 4], [comp([5])], stop_token_ids=[2])
    assert tr.get(n3).parent == n1 and logs[0]["action"] == "extend_shorter_prefix" and logs[0]["node"] == n2
    mask = tr.to_sequence(n3).loss_mask.numpy().tolist()
    assert mask[len(P) : len(P) + 2] == [1, 1] and sum(mask) == 3  # turn 1 and the new reply; not turn 2


def test_state_and_reset() -> None:
    tr = Tracker()
    [n1] = tr.record(P, [comp([10])])
    st1 = tr.state()
    assert st1.mode == "default" and [n.id for n in st1.nodes] == [n1] and st1.stats.requests == 1
    tr.reset()
    assert tr.nodes() == [] and n1 not in tr and tr.stats.requests == 1  # counters are monotonic
    assert st1.stats.requests == 1 and len(st1.nodes) == 1  # snapshots are independent
    [n2] = tr.record(P, [comp([10])], expected_parents=[n1])  # stale ids are ignored
    assert n2 != n1 and tr.stats.divergences == 0


def test_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="mode"):
        Tracker("flat")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="empty"):
        Tracker().record([], [comp([1])])
    tr = Tracker()
    tr.record(P, [comp([1])])
    with pytest.raises(ValueError, match="scores"):
        tr.sequences(scores=[1.0, 2.0])


def test_common_prefix_len() -> None:
    assert common_prefix_len((1, 2, 3), (1, 2, 4)) == 2
    assert common_prefix_len((1, 2), (1, 2, 3)) == 2
    assert common_prefix_len((), (1,)) == 0
    assert common_prefix_len((5,), (1,)) == 0


tokens = st.lists(st.integers(5, 300), min_size=1, max_size=12)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(tokens, tokens), min_size=1, max_size=5), st.sampled_from(["default", "tree"]))
def test_random_conversations_keep_every_sampled_token_aligned(turns, mode) -> None:  # type: ignore[no-untyped-def]
    """Whatever the turns, each position holds what was sent or sampled, trainable exactly when sampled."""
    tr = Tracker(mode)
    context: list[int] = []
    expect_mask: list[int] = []
    expect_lp: list[float] = []
    node_id = -1
    for k, (user, sampled) in enumerate(turns):
        prompt = [*context, *user] if k else [1, *user]
        c = Completion(sampled, [-0.1 * (j + 1) - k for j in range(len(sampled))], "stop")
        [node_id] = tr.record(prompt, [c], expected_parents=[node_id])
        new = len(prompt) - len(context)
        expect_mask += [0] * new + [1] * len(sampled)
        expect_lp += [0.0] * new + c.logprobs
        context = [*prompt, *sampled]
    seq = tr.to_sequence(node_id)
    assert seq.tokens.numpy().tolist() == context
    assert seq.loss_mask.numpy().tolist() == expect_mask
    assert np.allclose(seq.logprobs.numpy(), expect_lp)
    assert seq.spans == runs(seq.loss_mask.numpy())
    assert tr.stats.divergences == 0 and tr.get(node_id).turns == len(turns)
    validate_sequence(seq, "seq", Limits())


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(tokens, tokens, st.booleans()), min_size=1, max_size=5))
def test_random_closed_replies_always_extend_in_tree_mode(turns) -> None:  # type: ignore[no-untyped-def]
    """With stop ids given, a conversation whose template closes every reply with a stop id (2) is one branch."""
    tr = Tracker("tree")
    context: list[int] = []
    node_id = -1
    for k, (user, sampled, stopped) in enumerate(turns):
        closing = [] if not context or context[-1] == 2 else [2]
        prompt = [*context, *closing, *user] if k else [1, *user]
        reply = [*sampled, 2] if stopped else sampled
        c = Completion(reply, [-0.5] * len(reply), "stop" if stopped else "length")
        [node_id] = tr.record(prompt, [c], stop_token_ids=[2])
        context = [*prompt, *reply]
    assert [n.id for n in tr.leaves()] == [node_id] and tr.stats.divergences == 0
    assert tr.get(node_id).turns == len(turns) and tr.get(node_id).tokens == tuple(context)
