"""Conversion to and from the reference system's ScoredDataGroup JSON."""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas.atropos import MASKED, MASKED_LOGPROB, rollout_from_atropos, to_atropos
from schemas.build import synthetic_rollout, synthetic_scored
from schemas.codec import decode, encode
from schemas.messages import DistillStatus, RolloutGroup, ScoredGroup
from schemas.validate import DecodeError, Limits
from tests.unit.test_codec import same

VOCAB = 300


def reference_group(seed: int = 0, lengths: tuple[int, ...] = (9, 14, 6), k: int = 4) -> dict[str, Any]:
    """A ScoredDataGroup as the reference system emits it: k or k+1 entries, actual token first, unsorted."""
    rng = np.random.default_rng(seed)
    tokens, masks, inf_lps, ids_all, lps_all = [], [], [], [], []
    for n in lengths:
        tok = [int(t) for t in rng.integers(0, VOCAB, n)]
        mask = [MASKED if p < 3 or p in (6, 7) else t for p, t in enumerate(tok)]  # prompt + a tool span
        tokens.append(tok)
        masks.append(mask)
        inf_lps.append([MASKED_LOGPROB if m == MASKED else float(-rng.exponential()) for m in mask])
        ids_seq: list[Any] = [[]]
        lps_seq: list[Any] = [None] if n % 2 else [[]]
        for p in range(1, n):
            top = [int(i) for i in rng.choice(VOCAB, k, replace=False)]
            lps = [float(v) for v in -rng.exponential(2.0, k)]
            if p % 3 == 0 and tok[p] not in top:  # the actual token is one of the top k
                top[int(rng.integers(k))] = tok[p]
            if tok[p] in top:  # k entries, actual token moved to the front
                j = top.index(tok[p])
                order = [j] + [i for i in range(k) if i != j]
                ids_seq.append([top[i] for i in order])
                lps_seq.append([lps[i] for i in order])
            else:  # k+1 entries: the actual token added in front, below the top k
                ids_seq.append([tok[p], *top])
                lps_seq.append([min(lps) - float(rng.exponential()) - 0.01, *lps])
        ids_all.append(ids_seq)
        lps_all.append(lps_seq)
    return {
        "tokens": tokens,
        "masks": masks,
        "scores": [float(v) for v in rng.random(len(lengths))],
        "advantages": None,
        "ref_logprobs": None,
        "messages": [[{"role": "user", "content": f"q{i}"}] for i in range(len(lengths))],
        "generation_params": {"temperature": 1.0},
        "inference_logprobs": inf_lps,
        "group_overrides": None,
        "overrides": [{"set_advantage_to_zero": i == 1} for i in range(len(lengths))],
        "images": None,
        "distill_token_ids": ids_all,
        "distill_logprobs": lps_all,
        "env_id": 3,
    }


def expected_rows(ref: dict[str, Any], s: int, k: int) -> tuple[list[list[int]], list[list[float]], list[float]]:
    """Independent reference: per entry p >= 1, the k best (id, logprob) by logprob, and the actual token's."""
    ids_out, lps_out, sampled = [], [], []
    for p in range(1, len(ref["tokens"][s])):
        pairs = list(zip(ref["distill_token_ids"][s][p], ref["distill_logprobs"][s][p], strict=True))
        best = sorted(pairs, key=lambda x: -x[1])[:k]
        ids_out.append([i for i, _ in best])
        lps_out.append([float(np.float32(v)) for _, v in best])
        sampled.append(next(v for i, v in pairs if i == ref["tokens"][s][p]))
    return ids_out, lps_out, sampled


def test_reference_group_becomes_a_scored_group_in_our_convention() -> None:
    ref = reference_group()
    msg = rollout_from_atropos(ref, group_id="g1", policy_version=4)
    assert isinstance(msg, ScoredGroup) and msg.status is DistillStatus.OK
    assert msg.k == 4 and msg.group_id == "g1" and msg.group.policy_version == 4 and msg.group.env_id == 3
    assert msg.teacher is not None
    for s, (seq, t) in enumerate(zip(msg.group.sequences, msg.teacher, strict=True)):
        tok = np.array(ref["tokens"][s])
        mask = np.array(ref["masks"][s]) != MASKED
        assert np.array_equal(seq.tokens.numpy(), tok)
        assert np.array_equal(seq.loss_mask.numpy(), mask)
        assert seq.prompt_len == 3
        assert seq.logprobs is not None
        want_lp = np.where(mask, np.array(ref["inference_logprobs"][s], np.float32), 0.0)
        assert np.array_equal(seq.logprobs.numpy(), want_lp)
        ids, lps, sampled = expected_rows(ref, s, 4)
        assert t.topk_ids.numpy().tolist() == ids  # our row r is their entry r + 1
        assert t.topk_logprobs.numpy().tolist() == lps
        assert np.array_equal(t.sampled_logprobs.numpy(), np.array(sampled, np.float32))
        assert seq.messages == ref["messages"][s] and seq.overrides == ref["overrides"][s]
        assert seq.score == ref["scores"][s]
    decode(encode(msg))  # valid on our wire too


def test_reference_to_ours_to_reference_gives_k_sorted_entries() -> None:
    ref = reference_group(seed=1)
    out = json.loads(json.dumps(to_atropos(rollout_from_atropos(ref))))
    for key in ("tokens", "masks", "scores", "messages", "overrides", "generation_params", "env_id"):
        assert out[key] == ref[key], key
    assert out["group_overrides"] is None
    for s in range(3):
        want_inf = [float(np.float32(v)) for v in ref["inference_logprobs"][s]]
        assert out["inference_logprobs"][s] == want_inf
        ids, lps, _ = expected_rows(ref, s, 4)
        assert out["distill_token_ids"][s] == [[], *ids]
        assert out["distill_logprobs"][s] == [[], *lps]
        assert all(len(e) == 4 and e == sorted(e, reverse=True) for e in out["distill_logprobs"][s][1:])


def test_ours_to_reference_to_ours_is_exact() -> None:
    s = synthetic_scored(synthetic_rollout(3, [20, 1, 33], vocab=VOCAB, seed=5), 6, vocab=VOCAB)
    s = msgspec.structs.replace(s, group=msgspec.structs.replace(s.group, env_id=7, task_id="t", metadata={"m": 1}))
    wire = json.loads(json.dumps(to_atropos(s)))
    assert wire["policy_version"] == 0 and wire["distill_status"] == "ok" and wire["distill_top_k"] == 6
    back = rollout_from_atropos(wire)
    same(s, back)  # includes sampled logprobs of tokens outside the top k


def test_rollout_group_round_trips_and_has_null_distill_arrays() -> None:
    g = synthetic_rollout(2, [5, 8], vocab=VOCAB, group_overrides={"teacher_top_k": 3}, policy_version=9)
    wire = json.loads(json.dumps(to_atropos(g)))
    assert wire["distill_token_ids"] is None and wire["distill_logprobs"] is None
    back = rollout_from_atropos(wire)
    assert isinstance(back, RolloutGroup)
    same(g, back)


@pytest.mark.parametrize("status", [DistillStatus.DROPPED, DistillStatus.SKIPPED])
def test_group_without_payload_has_null_distill_arrays(status: DistillStatus) -> None:
    s = ScoredGroup(group=synthetic_rollout(2, 6, vocab=VOCAB), status=status, reason="seq 1 failed")
    wire = to_atropos(s)
    assert wire["distill_token_ids"] is None and wire["distill_logprobs"] is None
    assert wire["distill_status"] == status.value and wire["distill_reason"] == "seq 1 failed"
    assert isinstance(rollout_from_atropos(wire), RolloutGroup)


def test_group_overrides_null_is_kept_and_read_as_empty() -> None:
    ref = reference_group()
    ref["distill_token_ids"] = ref["distill_logprobs"] = None
    msg = rollout_from_atropos(json.loads(json.dumps(ref)))
    assert isinstance(msg, RolloutGroup)
    assert msg.group_overrides is None and msg.overrides == {}
    same(msg, decode(encode(msg)))


def test_teacher_top_k_override_sets_k() -> None:
    ref = reference_group(k=5)
    ref["group_overrides"] = {"teacher_top_k": 2}
    msg = rollout_from_atropos(ref)
    assert isinstance(msg, ScoredGroup) and msg.k == 2 and msg.teacher is not None
    ids, _, _ = expected_rows(ref, 1, 2)
    assert msg.teacher[1].topk_ids.numpy().tolist() == ids
    ref["group_overrides"] = {"teacher_top_k": 0}  # raised to 1, as the reference does
    assert rollout_from_atropos(ref).k == 1  # type: ignore[union-attr]


def test_group_id_precedence() -> None:
    ref = reference_group()
    assert rollout_from_atropos(ref, group_id="arg").group_id == "arg"
    assert rollout_from_atropos({**ref, "group_id": "obj"}, group_id="arg").group_id == "obj"
    a, b = rollout_from_atropos(ref).group_id, rollout_from_atropos(ref).group_id
    assert len(a) == 32 and a != b


def test_single_token_sequence() -> None:
    ref = reference_group(lengths=(1, 5))
    ref["masks"][0] = [MASKED]
    msg = rollout_from_atropos(ref)
    assert isinstance(msg, ScoredGroup) and msg.teacher is not None
    assert msg.teacher[0].topk_ids.shape == (0, 4)
    assert msg.group.sequences[0].prompt_len == 1


def test_trainable_position_zero_is_forced_off() -> None:
    ref = reference_group()
    ref["masks"][0][0] = ref["tokens"][0][0]
    msg = rollout_from_atropos(ref)
    assert not msg.group.sequences[0].loss_mask.numpy()[0]  # type: ignore[union-attr]


def _set(path: tuple[Any, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def apply(ref: dict[str, Any]) -> None:
        node: Any = ref
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    return apply


BAD_INPUTS: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("tokens not a list", _set(("tokens",), "abc"), "tokens"),
    ("string token", _set(("tokens", 2, 4), "x"), "tokens[2]"),
    ("float token", _set(("tokens", 1, 0), 1.5), "tokens[1]"),
    ("bool token", _set(("tokens", 0, 1), True), "tokens[0]"),
    ("negative token", _set(("tokens", 0, 1), -3), "tokens[0]"),
    ("huge token", _set(("tokens", 0, 1), 2**40), "tokens[0]"),
    ("empty sequence", _set(("tokens", 1), []), "tokens[1]"),
    ("short masks", lambda r: r["masks"][1].pop(), "masks[1]"),
    ("missing scores", lambda r: r.pop("scores"), "scores"),
    ("nan score", _set(("scores", 2), math.nan), "scores[2]"),
    ("short inference_logprobs", lambda r: r["inference_logprobs"][0].pop(), "inference_logprobs[0]"),
    ("nan inference_logprob", _set(("inference_logprobs", 1, 5), math.nan), "inference_logprobs[1]"),
    ("string logprob", _set(("inference_logprobs", 1, 5), "-1"), "inference_logprobs[1]"),
    ("advantages ragged", _set(("advantages",), [[0.0] * 9, [0.0] * 13, [0.0] * 6]), "advantages[1]"),
    ("ref_logprobs count", _set(("ref_logprobs",), [[0.0] * 9]), "ref_logprobs"),
    ("overrides count", _set(("overrides",), [{}]), "overrides"),
    ("override not a dict", _set(("overrides", 1), 5), "overrides[1]"),
    ("messages not dicts", _set(("messages", 0), ["hi"]), "messages[0]"),
    ("group_overrides a list", _set(("group_overrides",), []), "group_overrides"),
    ("env_id a string", _set(("env_id",), "3"), "env_id"),
    ("distill short logprob entry", lambda r: r["distill_logprobs"][0][5].pop(), "distill_logprobs[0][5]"),
    ("distill nan", _set(("distill_logprobs", 0, 5, 1), math.nan), "distill_logprobs[0][5]"),
    ("distill inf", _set(("distill_logprobs", 2, 3, 0), -math.inf), "distill_logprobs[2][3]"),
    ("distill string id", _set(("distill_token_ids", 1, 3, 0), "7"), "distill_token_ids[1][3]"),
    ("distill negative id", _set(("distill_token_ids", 1, 4, 1), -7), "distill_token_ids[1][4]"),
    ("distill empty entry", _set(("distill_token_ids", 1, 2), []), "distill_token_ids[1][2]"),
    ("distill null entry", _set(("distill_logprobs", 1, 2), None), "distill_logprobs[1][2]"),
    ("distill entry 0 filled", _set(("distill_token_ids", 0, 0), [1]), "distill_token_ids[0][0]"),
    ("distill wrong length", lambda r: r["distill_token_ids"][2].pop(), "distill_token_ids[2]"),
    ("distill seq count", lambda r: r["distill_logprobs"].pop(), "distill_logprobs"),
    ("only ids", _set(("distill_logprobs",), None), "distill_logprobs"),
    ("sampled token absent", lambda r: _drop_actual(r, 0, 4), "distill_token_ids[0][4]"),
    ("k above max_k", _set(("group_overrides",), {"teacher_top_k": 257}), "group_overrides.teacher_top_k"),
    ("k not int", _set(("group_overrides",), {"teacher_top_k": 2.5}), "group_overrides.teacher_top_k"),
    ("fewer than k entries", _set(("group_overrides",), {"teacher_top_k": 6}), "distill_token_ids[0][3]"),
    ("group_id not a string", _set(("group_id",), 12), "group_id"),
]


def _drop_actual(ref: dict[str, Any], s: int, p: int) -> None:
    ids, lps = ref["distill_token_ids"][s][p], ref["distill_logprobs"][s][p]
    j = ids.index(ref["tokens"][s][p])
    del ids[j], lps[j]


@pytest.mark.parametrize(("case", "mutate", "field"), BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_names_the_field(case: str, mutate: Callable[[dict[str, Any]], None], field: str) -> None:
    ref = reference_group(k=5)
    mutate(ref)
    with pytest.raises(DecodeError) as info:
        rollout_from_atropos(ref)
    assert info.value.field == field, (case, str(info.value))


def test_not_an_object() -> None:
    with pytest.raises(DecodeError) as info:
        rollout_from_atropos([1, 2])  # type: ignore[arg-type]
    assert info.value.field == "group"


def test_vocabulary_bound_from_limits_names_the_input_field() -> None:
    ref = reference_group()
    with pytest.raises(DecodeError) as info:
        rollout_from_atropos(ref, limits=Limits(vocab_size=10))
    assert info.value.field == "tokens[0]"


LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True),
    st.text(max_size=3),
    st.lists(st.integers(-5, 5), max_size=3),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
)


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix] if prefix else []
    if isinstance(node, dict):
        for key, v in node.items():
            out += _paths(v, (*prefix, key))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, (*prefix, i))
    return out


SMALL = reference_group(seed=2, lengths=(4, 1, 3), k=2)
SMALL_PATHS = _paths(SMALL)


@settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(SMALL_PATHS), LEAVES), min_size=1, max_size=3))
def test_any_corrupted_leaf_is_a_decode_error_or_a_valid_group(edits: list[tuple[tuple[Any, ...], Any]]) -> None:
    ref = copy.deepcopy(SMALL)
    for path, value in edits:
        try:
            _set(path, value)(ref)
        except (KeyError, IndexError, TypeError):  # an earlier edit replaced a parent
            continue
    try:
        msg = rollout_from_atropos(ref)
    except DecodeError:
        return
    decode(encode(msg))  # anything accepted is a valid message
