"""Conversion to and from the reference system's ScoredDataGroup JSON."""

from __future__ import annotations

import copy
import json
import math
import re
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas.atropos import (
    ATROPOS_KEYS,
    MASKED,
    MASKED_LOGPROB,
    STASH,
    content_group_id,
    rollout_from_atropos,
    rollout_group_from_atropos,
    to_atropos,
)
from schemas.build import make_sequence, no_teacher_reason, synthetic_rollout, synthetic_scored
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


def group_of(msg: RolloutGroup | ScoredGroup) -> RolloutGroup:
    return msg.group if isinstance(msg, ScoredGroup) else msg


def f32(x: float) -> float:
    return float(np.float32(x))


def test_reference_to_ours_to_reference_gives_back_every_value_and_the_real_layout() -> None:
    ref = reference_group(seed=1)
    out = json.loads(json.dumps(to_atropos(rollout_from_atropos(ref))))
    for key in ATROPOS_KEYS[:-2]:  # everything a client sends comes back equal, float64 included
        assert out[key] == ref[key], key
    for s in range(3):
        tok = ref["tokens"][s]
        assert out["distill_token_ids"][s][0] == [] and out["distill_logprobs"][s][0] == []
        for p in range(1, len(tok)):
            got = list(zip(out["distill_token_ids"][s][p], out["distill_logprobs"][s][p], strict=True))
            given = [(i, f32(v)) for i, v in zip(ref["distill_token_ids"][s][p], ref["distill_logprobs"][s][p],
                                                 strict=True)]
            assert sorted(got) == sorted(given)  # the same k or k + 1 items (teacher logprobs as float32)
            assert got[0][0] == tok[p]  # the actual token first, as vLLM's prompt logprobs
            rest = [v for _, v in got[1:]]
            assert rest == sorted(rest, reverse=True)


def same_teacher(a: ScoredGroup, b: ScoredGroup) -> None:
    """The same payloads: rows held (``None`` and all rows alike), top-k and sampled arrays bit for bit."""
    assert a.k == b.k and a.teacher is not None and b.teacher is not None
    for ta, tb, seq in zip(a.teacher, b.teacher, a.group.sequences, strict=True):
        assert np.array_equal(ta.row_index(seq.length), tb.row_index(seq.length))
        for name in ("topk_ids", "topk_logprobs", "sampled_logprobs"):
            same(getattr(ta, name), getattr(tb, name), name)


def test_ours_to_reference_to_ours_is_exact() -> None:
    s = synthetic_scored(synthetic_rollout(3, [20, 1, 33], vocab=VOCAB, seed=5), 6, vocab=VOCAB)
    s = msgspec.structs.replace(s, group=msgspec.structs.replace(s.group, env_id=7, task_id="t", metadata={"m": 1}))
    wire = json.loads(json.dumps(to_atropos(s)))
    assert wire["policy_version"] == 0 and wire["distill_status"] == "ok" and wire["distill_top_k"] == 6
    back = rollout_from_atropos(wire)
    assert isinstance(back, ScoredGroup)
    same(s.group, back.group)
    same_teacher(s, back)  # includes sampled logprobs of tokens outside the top k
    assert (back.status, back.teacher_id, back.scored_at) == (s.status, s.teacher_id, s.scored_at)


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
    assert a == b == content_group_id(ref) and a.startswith("sha256-")  # the same group sent again: one id
    other = rollout_from_atropos({**ref, "scores": [9.0, 9.0, 9.0]}).group_id
    assert other != a and other == content_group_id({**ref, "scores": [9.0, 9.0, 9.0]})


def test_teacher_top_k_override_is_type_checked_with_distill_top_k_too() -> None:
    ref = reference_group()
    for extra in ({}, {"distill_top_k": 4}):
        with pytest.raises(DecodeError) as e:
            rollout_from_atropos({**ref, **extra, "group_overrides": {"teacher_top_k": "4"}})
        assert e.value.field == "group_overrides.teacher_top_k" and "must be an integer" in e.value.reason


@pytest.mark.parametrize(("overrides", "want"), [
    (None, None), ({}, None), ({"teacher_top_k": 5}, None), ({"teacher_top_k": 0}, None),
    ({"teacher_top_k": True}, None), ({"teacher_top_k": -1}, "teacher_top_k=-1: no teacher"),
    ({"teacher_top_k": -3}, "teacher_top_k=-3: no teacher"),
])
def test_no_teacher_reason(overrides: dict[str, Any] | None, want: str | None) -> None:
    assert no_teacher_reason(overrides) == want
    if want is not None:  # the conversion gives the same reason
        msg = rollout_from_atropos({**reference_group(), "group_overrides": overrides})
        assert isinstance(msg, ScoredGroup) and msg.status is DistillStatus.SKIPPED and msg.reason == want


def test_single_token_sequence() -> None:
    ref = reference_group(lengths=(1, 5))
    ref["masks"][0] = [MASKED]
    msg = rollout_from_atropos(ref)
    assert isinstance(msg, ScoredGroup) and msg.teacher is not None
    assert msg.teacher[0].topk_ids.shape == (0, 4)
    assert msg.group.sequences[0].prompt_len == 1


def test_trainable_position_zero_is_forced_off_and_the_masks_come_back_as_sent() -> None:
    ref = reference_group()
    ref["masks"][0][0] = ref["tokens"][0][0]
    msg = rollout_from_atropos(ref)
    assert not msg.group.sequences[0].loss_mask.numpy()[0]  # type: ignore[union-attr]
    assert to_atropos(msg)["masks"] == ref["masks"]


@pytest.mark.parametrize("all_rows", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_what_the_reference_server_keeps_decodes_to_the_same_payload(all_rows: bool, seed: int) -> None:
    """Only ``ATROPOS_KEYS`` survive the reference server: the entries alone give back k, the rows held and
    every sampled logprob (tokens outside the top k included), with and without rows left out."""
    s = synthetic_scored(synthetic_rollout(3, [20, 1, 33], vocab=VOCAB, seed=seed), 6, vocab=VOCAB, seed=seed,
                         all_rows=all_rows)
    wire = json.loads(json.dumps(to_atropos(s)))
    back = rollout_from_atropos({key: wire[key] for key in ATROPOS_KEYS})
    assert isinstance(back, ScoredGroup)
    same_teacher(s, back)
    same(s.group.sequences, back.group.sequences)


def test_positions_without_a_teacher_row_are_empty_entries() -> None:
    seq = make_sequence(list(range(10, 20)), [0, 0, 0, 1, 1, 0, 0, 1, 1, 1], logprobs=[-0.5] * 10)
    g = RolloutGroup(group_id="g", sequences=[seq])
    s = synthetic_scored(g, 3, vocab=VOCAB)  # rows 2, 3, 6, 7, 8 (loss_mask[r + 1] == 1)
    wire = to_atropos(s)
    ids = wire["distill_token_ids"][0]
    assert [p for p, e in enumerate(ids) if e] == [3, 4, 7, 8, 9]
    assert all(e[0] == seq.tokens.numpy()[p] for p, e in enumerate(ids) if e)  # the actual token first
    assert all(len(e) in (3, 4) for e in ids if e)
    same_teacher(s, rollout_from_atropos({key: wire[key] for key in ATROPOS_KEYS}))  # type: ignore[arg-type]
    wire["distill_token_ids"][0][4] = wire["distill_logprobs"][0][4] = []  # a trained position without a row
    with pytest.raises(DecodeError) as info:
        rollout_from_atropos(wire)
    assert info.value.field == "distill_token_ids[0]" and "trained row 3" in info.value.reason


def test_k_when_every_entry_holds_the_actual_token_outside_the_top_k() -> None:
    ref = reference_group(seed=3, lengths=(6, 5), k=3)
    for s, tok in enumerate(ref["tokens"]):  # every entry: k + 1 items, the actual token first and lowest
        for p in range(1, len(tok)):
            ref["distill_token_ids"][s][p] = [tok[p], *((tok[p] + 1 + j) % VOCAB for j in range(3))]
            ref["distill_logprobs"][s][p] = [-3.0, -0.5, -1.0, -1.5]
    msg = rollout_from_atropos(ref)
    assert isinstance(msg, ScoredGroup) and msg.k == 3 and msg.teacher is not None
    tok = np.array(ref["tokens"][0])
    assert np.array_equal(msg.teacher[0].topk_ids.numpy(), (tok[1:, None] + 1 + np.arange(3)) % VOCAB)
    assert (msg.teacher[0].sampled_logprobs.numpy() == -3.0).all()
    ref["group_overrides"] = {"teacher_top_k": 4}  # the reference's k wins: the actual token ranks 4th
    assert rollout_from_atropos(ref).k == 4  # type: ignore[union-attr]


@pytest.mark.parametrize("overrides", [{"teacher_top_k": -1}, {"teacher_top_k": -5}, {"skip_teacher_top_k": True}])
def test_no_teacher_overrides_skip(overrides: dict[str, Any]) -> None:
    ref = reference_group()
    ref["group_overrides"] = overrides
    msg = rollout_from_atropos(ref)
    assert isinstance(msg, ScoredGroup) and msg.status is DistillStatus.SKIPPED and msg.teacher is None
    wire = to_atropos(msg)
    assert wire["distill_token_ids"] is None and wire["group_overrides"] == overrides


def test_masks_other_than_token_ids_are_kept_as_sent() -> None:
    """The reference server's own tests post 0/1-style masks (all 1): trained where != -100, given back as sent."""
    ref = {"tokens": [list(range(8)), list(range(5, 11))], "masks": [[1] * 8, [-100, -100, 0, 1, 1, 7]],
           "scores": [0.5, 0.25]}
    msg = rollout_from_atropos(ref)
    assert group_of(msg).sequences[0].loss_mask.numpy().tolist() == [0, 1, 1, 1, 1, 1, 1, 1]
    assert group_of(msg).sequences[1].loss_mask.numpy().tolist() == [0, 0, 1, 1, 1, 1]
    assert to_atropos(msg)["masks"] == ref["masks"]


def test_float64_values_come_back_equal_and_float32_ones_cost_nothing_extra() -> None:
    ref: dict[str, Any] = {"tokens": [[1, 2, 3]], "masks": [[-100, 2, 3]], "scores": [0.1], "env_id": 0,
                           "advantages": [[0.1, 0.2, 0.30000000000000004]], "ref_logprobs": [[-0.7, -1.1, -2.3]],
                           "inference_logprobs": [[1.0, -0.1, -1 / 3]]}
    out = to_atropos(decode(encode(rollout_from_atropos(ref))))  # type: ignore[arg-type]
    for key in ("scores", "advantages", "ref_logprobs", "inference_logprobs"):
        assert out[key] == ref[key], key
    exact = {**ref, "advantages": [[f32(0.1)] * 3], "ref_logprobs": [[f32(-0.7)] * 3],
             "inference_logprobs": [[1.0, f32(-0.1), f32(-0.2)]]}
    msg = rollout_from_atropos(exact)
    assert group_of(msg).metadata is None
    assert to_atropos(msg)["advantages"] == exact["advantages"]


def test_lengths_the_reference_accepts_are_accepted_and_given_back() -> None:
    """With strict_lengths=False (the Atropos server), no cross-field length checks on advantages, ref_logprobs,
    inference_logprobs, messages, overrides."""
    ref: dict[str, Any] = {"tokens": [[1, 2, 3], [4, 5]], "masks": [[-100, 2, 3], [-100, 5]], "scores": [1.0, 0.0],
                           "advantages": [[0.5] * 5, [0.5, 0.5]], "ref_logprobs": [[-1.0, -1.0, -1.0]],
                           "inference_logprobs": [[1.0, -0.5], [1.0, -0.25]], "messages": [],
                           "overrides": [{"temperature": 0.5}]}
    msg = rollout_from_atropos(ref, strict_lengths=False)
    seqs = group_of(msg).sequences
    assert seqs[0].advantages is None and seqs[1].advantages is not None  # only what fits reaches our wire
    assert seqs[0].logprobs is None and seqs[1].logprobs is not None
    assert all(s.ref_logprobs is None and s.messages is None and s.overrides is None for s in seqs)
    out = to_atropos(decode(encode(msg)))  # type: ignore[arg-type]
    for key in ("advantages", "ref_logprobs", "inference_logprobs", "messages", "overrides"):
        assert out[key] == ref[key], key


@pytest.mark.parametrize(("key", "value", "field", "reason"), [
    ("inference_logprobs", [[1.0, -0.5, -0.5], [1.0]], "inference_logprobs[1]", "1 values for 2 tokens"),
    ("advantages", [[0.5] * 5, [0.5, 0.5]], "advantages[0]", "5 values for 3 tokens"),
    ("ref_logprobs", [[-1.0, -1.0, -1.0]], "ref_logprobs", "1 rows for 2 sequences"),
    ("inference_logprobs", [[1.0, -0.5, -0.5], None], "inference_logprobs[1]", "null"),
])
def test_per_token_arrays_of_another_length_are_refused_naming_the_field(
        key: str, value: Any, field: str, reason: str) -> None:
    """By default a per-token array must hold one number per token: a short one would reach the learner as no
    student logprobs (advantages 0), so it is refused with the field and both lengths."""
    ref: dict[str, Any] = {"tokens": [[1, 2, 3], [4, 5]], "masks": [[-100, 2, 3], [-100, 5]], "scores": [1.0, 0.0],
                           key: value}
    for convert in (rollout_from_atropos, rollout_group_from_atropos):
        with pytest.raises(DecodeError) as err:
            convert(ref)
        assert err.value.field == field and reason in err.value.reason


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"loss_mask": [0, 1, 1]}, "loss_mask: 3 values for 4 tokens"),
    ({"logprobs": [-0.5]}, "logprobs: 1 values for 4 tokens"),
    ({"advantages": [0.0] * 6}, "advantages: 6 values for 4 tokens"),
    ({"ref_logprobs": [[0.0] * 4]}, "ref_logprobs: shape (1, 4) for 4 tokens"),
])
def test_make_sequence_names_the_array_of_another_length(kwargs: dict[str, Any], message: str) -> None:
    args: dict[str, Any] = {"loss_mask": [0, 1, 1, 1], **kwargs}
    with pytest.raises(ValueError, match=re.escape(message)):
        make_sequence([1, 2, 3, 4], args.pop("loss_mask"), **args)


def test_env_id_null_and_images_are_kept() -> None:
    ref = {**reference_group(), "env_id": None, "images": [{"url": "data:image/png;base64,AAAA"}], "metadata": None}
    out = to_atropos(rollout_from_atropos(ref))
    assert out["env_id"] is None and out["images"] == ref["images"] and out["metadata"] is None
    assert STASH not in json.dumps(out)
    ref["metadata"] = {"run": "a"}
    assert to_atropos(rollout_from_atropos(ref))["metadata"] == {"run": "a"}


def test_null_entries_are_never_written() -> None:
    """The reference server rejects null rows (422): a field some sequences lack is null as a whole; missing
    overrides and messages become ``{}`` and ``[]``."""
    a, b = synthetic_rollout(2, [6, 4], vocab=VOCAB, seed=1).sequences
    b = msgspec.structs.replace(b, logprobs=None, overrides={"temperature": 0.7}, messages=None)
    a = msgspec.structs.replace(a, advantages=a.logprobs, messages=[{"role": "user", "content": "q"}])
    out = to_atropos(RolloutGroup(group_id="g", sequences=[a, b]))
    assert out["inference_logprobs"] is None and out["advantages"] is None
    assert out["overrides"] == [{}, {"temperature": 0.7}]
    assert out["messages"] == [[{"role": "user", "content": "q"}], []]


def test_the_reference_server_model_accepts_what_we_write() -> None:
    server = pytest.importorskip("atroposlib.api.server", reason="atroposlib 0.4.0 not installed: "
                                 "pip install atroposlib==0.4.0")
    a, b = synthetic_rollout(2, [6, 4], vocab=VOCAB, seed=1).sequences
    b = msgspec.structs.replace(b, logprobs=None, overrides={"temperature": 0.7})
    native = synthetic_scored(RolloutGroup(group_id="g", sequences=[a, b], env_id=2), 3, vocab=VOCAB)
    for msg in (native, rollout_from_atropos(reference_group()), rollout_from_atropos(reference_group(lengths=(1, 4)))):
        out = json.loads(json.dumps(to_atropos(msg)))
        parsed = server._scored_data_to_dict(server.ScoredData(**out))  # what the reference server stores
        assert parsed == {key: out[key] for key in ATROPOS_KEYS}
        back = rollout_from_atropos(parsed)
        assert isinstance(back, ScoredGroup)
        same_teacher(msg, back)  # type: ignore[arg-type]


def test_real_shapes_round_trip() -> None:
    """8 sequences of 4,096 tokens, vocabulary 151,936, k = 20, teacher rows on the completion only."""
    vocab, k = 151_936, 20
    g = synthetic_rollout(8, 4096, vocab=vocab, prompt_len=1024, seed=7)
    s = synthetic_scored(g, k, vocab=vocab, seed=7)
    wire = json.loads(json.dumps(to_atropos(s)))
    assert sum(1 for e in wire["distill_token_ids"][0] if e) == 4096 - 1024
    back = rollout_from_atropos({key: wire[key] for key in ATROPOS_KEYS}, limits=Limits(vocab_size=vocab))
    assert isinstance(back, ScoredGroup)
    same_teacher(s, back)
    same(s.group.sequences, back.group.sequences)


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
    ("nan inference_logprob", _set(("inference_logprobs", 1, 5), math.nan), "inference_logprobs[1]"),
    ("string logprob", _set(("inference_logprobs", 1, 5), "-1"), "inference_logprobs[1]"),
    ("string advantage", _set(("advantages",), [[0.0] * 9, ["x"] * 14, [0.0] * 6]), "advantages[1]"),
    ("ref_logprobs not a list", _set(("ref_logprobs",), 5), "ref_logprobs"),
    ("scores count", _set(("scores",), [1.0]), "scores"),
    ("override not a dict", _set(("overrides", 1), 5), "overrides[1]"),
    ("messages not dicts", _set(("messages", 0), ["hi"]), "messages[0][0]"),
    ("message without content", _set(("messages", 1), [{"role": "user"}]), "messages[1][0]"),
    ("message without role", _set(("messages", 1), [{"content": "x"}, {"role": "user"}]), "messages[1][0]"),
    ("null message", _set(("messages", 2), [None]), "messages[2][0]"),
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
    ("k above max_k", _set(("distill_top_k",), 257), "distill_top_k"),
    ("k not int", _set(("group_overrides",), {"teacher_top_k": 2.5}), "group_overrides.teacher_top_k"),
    ("fewer than k entries", _set(("distill_top_k",), 6), "distill_token_ids[0][3]"),
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
