"""Codec: exact round trips, zero-copy decoding, one DecodeError per validation rule, schema evolution."""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import numpy as np
import pytest

from schemas import codec
from schemas.arrays import FLOAT16, FLOAT16_MAX_RELATIVE_ERROR, FLOAT16_MIN_LOGPROB, FLOAT32, INT32, UINT8, Array
from schemas.build import make_sequence, make_teacher, synthetic_rollout, synthetic_scored, synthetic_teacher
from schemas.codec import decode, encode
from schemas.messages import (
    SCHEMA_VERSION,
    DistillStatus,
    RolloutGroup,
    ScoredGroup,
    Sequence,
    TeacherPayload,
    TrainBatch,
)
from schemas.structure import _structure_ok
from schemas.validate import DecodeError, Limits, validate

replace = msgspec.structs.replace


def same(a: Any, b: Any, path: str = "msg") -> None:
    """Assert two messages are identical: arrays bit for bit, every other field by equality."""
    if isinstance(a, Array):
        assert isinstance(b, Array), path
        assert (a.dtype, a.shape) == (b.dtype, b.shape), path
        assert bytes(a.data) == bytes(b.data), path
        assert np.array_equal(a.numpy(), b.numpy()), path
    elif isinstance(a, msgspec.Struct):
        assert type(a) is type(b), path
        for f in msgspec.structs.fields(a):
            same(getattr(a, f.name), getattr(b, f.name), f"{path}.{f.name}")
    elif isinstance(a, list | tuple):
        assert isinstance(b, list | tuple) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same(x, y, f"{path}[{i}]")
    else:
        assert a == b and type(a) is type(b), path


def rollout(**kw: Any) -> RolloutGroup:
    return synthetic_rollout(3, [7, 1, 12], vocab=500, prompt_len=3, seed=4, **kw)


def scored(k: int = 5, **kw: Any) -> ScoredGroup:
    return synthetic_scored(rollout(**kw), k, vocab=500, seed=9)


def seq_replace(g: RolloutGroup, i: int, **changes: Any) -> RolloutGroup:
    seqs = list(g.sequences)
    seqs[i] = replace(seqs[i], **changes)
    return replace(g, sequences=seqs)


def teacher_replace(s: ScoredGroup, i: int, **changes: Any) -> ScoredGroup:
    assert s.teacher is not None
    ts = list(s.teacher)
    ts[i] = replace(ts[i], **changes)
    return replace(s, teacher=ts)


def expect_error(msg: Any, field: str, limits: Limits | None = None, match: str | None = None) -> DecodeError:
    with pytest.raises(DecodeError) as info:
        decode(encode(msg), limits or Limits())
    assert info.value.field == field, info.value
    if match is not None:
        assert match in info.value.reason, info.value
    return info.value


# --- round trips -----------------------------------------------------------------------------------


def test_rollout_round_trip_is_exact() -> None:
    g = rollout(group_overrides={"teacher_top_k": 4}, policy_version=3)
    g = replace(g, env_id=2, task_id="t1", generation_params={"temperature": 0.7}, metadata={"a": [1, 2]})
    g = seq_replace(g, 0, advantages=Array.from_numpy(np.linspace(-1, 1, 7), FLOAT32), spans=[(3, 7)])
    g = seq_replace(g, 2, overrides={"set_advantage_to_zero": True}, messages=[{"role": "user", "content": "x"}])
    back = decode(encode(g), expect=RolloutGroup)
    same(g, back)


def test_scored_round_trip_is_exact_float32_and_float16() -> None:
    s = scored(k=6)
    same(s, decode(encode(s), expect=ScoredGroup))
    g = rollout()
    half = replace(
        s,
        teacher=[synthetic_teacher(q, 6, vocab=500, seed=i, fp16=True) for i, q in enumerate(g.sequences)],
        group=g,
    )
    back = decode(encode(half), expect=ScoredGroup)
    same(half, back)
    assert back.teacher is not None and back.teacher[0].topk_logprobs.dtype == FLOAT16


def test_batch_round_trip_is_exact() -> None:
    s = scored()
    adv = [Array.from_numpy(np.full(q.length, 0.5, np.float32), FLOAT32) for q in s.group.sequences]
    b = TrainBatch(batch_id="b1", groups=[s], advantages=adv, kl_coef=0.1, stats={"x": 1.0})
    same(b, decode(encode(b), expect=TrainBatch))


@pytest.mark.parametrize("status", [DistillStatus.SKIPPED, DistillStatus.DROPPED])
def test_scored_without_payload_round_trips(status: DistillStatus) -> None:
    s = ScoredGroup(group=rollout(), status=status, reason="teacher timed out")
    same(s, decode(encode(s)))


def test_decode_accepts_memoryview_and_bytearray() -> None:
    s = scored()
    data = encode(s)
    same(s, decode(memoryview(data)))
    same(s, decode(bytearray(data)))


def test_expect_names_the_wrong_kind() -> None:
    with pytest.raises(DecodeError) as info:
        decode(encode(rollout()), expect=ScoredGroup)
    assert info.value.field == "t"


# --- zero copy -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["encoded", "bytes", "bytearray"])
def test_decoded_arrays_are_read_only_views_into_the_message_bytes(kind: str) -> None:
    s = big_scored() if kind == "encoded" else scored()
    encoded = encode(s)
    data: memoryview | bytes | bytearray = {"encoded": encoded, "bytes": bytes(encoded),
                                             "bytearray": bytearray(encoded)}[kind]
    owner = data.obj if isinstance(data, memoryview) else data
    back = decode(data, expect=ScoredGroup)
    whole = np.frombuffer(data, np.uint8)
    assert back.teacher is not None
    for arr in (back.group.sequences[0].tokens, back.teacher[0].topk_logprobs, back.teacher[2].topk_ids):
        assert arr.data.obj is owner
        assert arr.data.ndim == 1 and arr.data.itemsize == 1  # flat byte views (the fast checks need it)
        view = arr.numpy()
        assert np.shares_memory(view, whole)
        if kind != "bytearray":
            assert not view.flags.writeable
            with pytest.raises(ValueError):
                view[0] = 0


def test_decode_takes_any_contiguous_byte_buffer() -> None:
    s = scored()
    raw = bytes(encode(s))
    two_d = memoryview(raw).cast("B", shape=[1, len(raw)])
    back = decode(two_d, expect=ScoredGroup)
    same(s, back)
    assert back.teacher is not None
    for a in (back.teacher[0].topk_ids, back.group.sequences[1].tokens):
        assert a.data.ndim == 1 and a.data.itemsize == 1
    s4 = next(m for m in (replace(s, teacher_id="x" * i) for i in range(4)) if len(encode(m)) % 4 == 0)
    same(s4, decode(memoryview(bytes(encode(s4))).cast("i")))  # wider items: read as their bytes
    released = memoryview(raw)
    released.release()
    for bad in (memoryview(raw)[::2], released):  # not contiguous; released
        with pytest.raises(DecodeError) as info:
            decode(bad)
        assert info.value.field == "message" and "contiguous" in info.value.reason


def test_decode_checks_the_byte_size_of_a_buffer_of_wider_items() -> None:
    raw = bytes(encode(scored()))
    padded = raw + b"\0" * (-len(raw) % 4)
    with pytest.raises(DecodeError) as info:
        decode(memoryview(padded).cast("i"), Limits(max_bytes=len(padded) - 1))
    assert "exceeds" in info.value.reason


# --- exact-size encoding -----------------------------------------------------------------------------


@functools.cache
def big_scored(fp16: bool = False) -> ScoredGroup:
    """A group whose arrays exceed EXACT_SIZE_MIN_BYTES, so ``encode`` sizes its buffer up front."""
    g = synthetic_rollout(4, 1024, vocab=32000, seed=5)
    teacher = [synthetic_teacher(q, 20, vocab=32000, seed=6 + i, fp16=fp16) for i, q in enumerate(g.sequences)]
    s = ScoredGroup(group=g, status=DistillStatus.OK, teacher=teacher, k=20)
    assert codec._array_sizes(s)[0] >= codec.EXACT_SIZE_MIN_BYTES
    return s


def big_batch() -> TrainBatch:
    s = big_scored()
    adv = [Array.from_numpy(np.full(q.length, 0.25, np.float32), FLOAT32) for q in s.group.sequences]
    return TrainBatch(batch_id="b", groups=[s, replace(s, group=replace(s.group, group_id="g2"))], advantages=adv * 2)


MESSAGES = {
    "small rollout": rollout,
    "small scored": scored,
    "big rollout": lambda: synthetic_rollout(8, 8192, vocab=32000, seed=3),
    "big scored": big_scored,
    "big scored float16": lambda: big_scored(fp16=True),
    "big batch": big_batch,
    "dropped": lambda: ScoredGroup(group=synthetic_rollout(8, 8192, vocab=32000), status=DistillStatus.DROPPED,
                                   reason="x"),
}


@pytest.mark.parametrize("name", MESSAGES)
def test_encode_is_msgspecs_encoding_byte_for_byte(name: str) -> None:
    msg = MESSAGES[name]()
    data = encode(msg)
    assert isinstance(data, memoryview) and data.readonly and data.format == "B" and data.ndim == 1
    plain = msgspec.msgpack.encode(msg)
    assert data == plain and data.tobytes() == plain and len(data) == len(plain)
    same(msg, decode(data))
    with pytest.raises(TypeError):
        data[0] = 0  # read-only: decoded views share it


@pytest.mark.parametrize("make", [big_scored, big_batch, lambda: synthetic_rollout(8, 8192, vocab=32000, seed=3)])
def test_large_messages_are_encoded_into_a_buffer_allocated_once(make: Any) -> None:
    msg = make()
    data = encode(msg)
    buf = data.obj
    assert type(buf) is bytearray
    bound = codec.encoded_size_bound(msg)
    # Allocated once at the bound (+1 for the trailing NUL bytearray keeps): msgspec never regrew it.
    assert sys.getsizeof(buf) - sys.getsizeof(bytearray()) == bound + 1
    assert len(data) <= bound < len(data) + codec.ENCODE_SLACK + 24 * codec.ENCODE_SLACK_PER_STRUCT


def test_small_messages_use_plain_encode() -> None:
    g = rollout()
    assert codec._array_sizes(g)[0] < codec.EXACT_SIZE_MIN_BYTES
    data = encode(g)
    assert isinstance(data, memoryview) and type(data.obj) is bytes and data.readonly
    assert data == msgspec.msgpack.encode(g)


def test_encode_without_ctypes_falls_back_to_plain_encode(monkeypatch: pytest.MonkeyPatch) -> None:
    msg = big_scored()
    monkeypatch.setattr(codec, "_resize", None)
    data = encode(msg)
    assert isinstance(data, memoryview) and type(data.obj) is bytes and data.readonly
    assert data == msgspec.msgpack.encode(msg)
    same(msg, decode(data))
    monkeypatch.delattr(ctypes, "pythonapi")
    assert codec._byte_array_resize() is None


def test_size_bound_too_small_still_encodes_everything() -> None:
    """Long chat ``messages`` (not counted in the bound): msgspec grows the buffer, output unchanged."""
    chat = [{"role": "user", "content": "x" * 50_000}, {"role": "assistant", "content": "y" * 100_000}]
    s = big_scored()
    seqs = [replace(q, messages=chat, overrides={"note": "z" * 30_000}) for q in s.group.sequences]
    s = replace(s, group=replace(s.group, sequences=seqs, metadata={"blob": "w" * 70_000}))
    data = encode(s)
    bound = codec.encoded_size_bound(s)
    assert len(data) > bound + 500_000
    assert type(data.obj) is bytearray
    assert data == msgspec.msgpack.encode(s)
    back = decode(data, expect=ScoredGroup)
    same(s, back)
    assert back.group.sequences[3].messages == chat


def test_encode_copies_once_and_does_not_alias_the_source() -> None:
    tok = np.arange(10, dtype=np.int32)
    seq = make_sequence(tok, np.r_[np.zeros(3), np.ones(7)].astype(np.uint8))
    assert np.shares_memory(seq.tokens.numpy(), tok)  # from_numpy wraps conforming arrays without a copy
    data = encode(RolloutGroup(group_id="g", sequences=[seq]))
    tok[5] = 99
    back = decode(data, expect=RolloutGroup)
    assert back.sequences[0].tokens.numpy()[5] == 5


def test_empty_teacher_rows_for_single_token_sequences() -> None:
    g = synthetic_rollout(2, [1, 1], vocab=50)
    s = synthetic_scored(g, 3, vocab=50)
    back = decode(encode(s), expect=ScoredGroup)
    assert back.teacher is not None and back.teacher[0].topk_ids.shape == (0, 3)
    same(s, back)


# --- one DecodeError per rule -------------------------------------------------------------------------

SEQ0 = "group.sequences[0]"
SSEQ0 = "scored.group.sequences[0]"


def test_loss_mask_length_mismatch() -> None:
    g = seq_replace(rollout(), 0, loss_mask=Array.from_numpy(np.zeros(6, np.uint8), UINT8))
    expect_error(g, f"{SEQ0}.loss_mask", match="6 != 7")


@pytest.mark.parametrize("field", ["logprobs", "advantages", "ref_logprobs"])
def test_per_token_float_length_mismatch(field: str) -> None:
    g = seq_replace(rollout(), 2, **{field: Array.from_numpy(np.zeros(11, np.float32), FLOAT32)})
    expect_error(g, f"group.sequences[2].{field}", match="11 != 12")


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_student_logprob(bad: float) -> None:
    lp = np.full(7, -1.0, np.float32)
    lp[4] = bad
    g = seq_replace(rollout(), 0, logprobs=Array.from_numpy(lp, FLOAT32))
    expect_error(g, f"{SEQ0}.logprobs", match="flat index 4")
    decode(encode(g), Limits(check_values=False))  # structural checks alone let it through


@pytest.mark.parametrize("dtype", [FLOAT32, FLOAT16])
def test_non_finite_teacher_logprob(dtype: str) -> None:
    s = scored()
    assert s.teacher is not None
    lps = s.teacher[0].topk_logprobs.numpy().astype(np.float32)
    lps[2, 1] = np.nan
    expect_error(teacher_replace(s, 0, topk_logprobs=Array.from_numpy(lps, dtype)), "scored.teacher[0].topk_logprobs")


def test_non_finite_sampled_logprob() -> None:
    s = scored()
    assert s.teacher is not None
    sampled = s.teacher[2].sampled_logprobs.numpy().copy()
    sampled[-1] = -np.inf
    s = teacher_replace(s, 2, sampled_logprobs=Array.from_numpy(sampled, FLOAT32))
    expect_error(s, "scored.teacher[2].sampled_logprobs", match="non-finite")


def test_negative_token_id() -> None:
    tok = rollout().sequences[0].tokens.numpy().copy()
    tok[3] = -1
    g = seq_replace(rollout(), 0, tokens=Array.from_numpy(tok, INT32))
    expect_error(g, f"{SEQ0}.tokens", match="negative")


def test_token_ids_bound_by_vocabulary() -> None:
    g = rollout()
    decode(encode(g), Limits(vocab_size=500))
    expect_error(g, f"{SEQ0}.tokens", Limits(vocab_size=100), match="vocabulary of 100")


def test_teacher_ids_bound_by_vocabulary() -> None:
    s = scored()
    assert s.teacher is not None
    ids = s.teacher[0].topk_ids.numpy().copy()
    ids[0, 0] = 500
    s = teacher_replace(s, 0, topk_ids=Array.from_numpy(ids, INT32))
    expect_error(s, "scored.teacher[0].topk_ids", Limits(vocab_size=500))


def test_k_above_max_k() -> None:
    expect_error(scored(k=5), "scored.teacher[0].k", Limits(max_k=4), match="outside [1, 4]")


def test_k_differs_from_group_k() -> None:
    expect_error(replace(scored(k=5), k=6), "scored.teacher[0].k", match="!= group k 6")


def test_oversize_message() -> None:
    data = encode(scored())
    with pytest.raises(DecodeError) as info:
        decode(data, Limits(max_bytes=len(data) - 1))
    assert info.value.field == "message" and "exceeds" in info.value.reason
    decode(data, Limits(max_bytes=len(data)))


@pytest.mark.parametrize("version", [SCHEMA_VERSION + 1, 0])
def test_unknown_schema_version(version: int) -> None:
    expect_error(replace(rollout(), schema=version), "schema", match="not supported")
    expect_error(replace(scored(), schema=version), "schema")


def test_too_many_sequences_and_too_long() -> None:
    expect_error(rollout(), "group.sequences", Limits(max_sequences=2))
    expect_error(rollout(), "group.sequences[2].tokens", Limits(max_seq_len=11))


def test_empty_group_id_and_empty_group() -> None:
    expect_error(replace(rollout(), group_id=""), "group.group_id")
    expect_error(replace(rollout(), sequences=[]), "group.sequences")


def test_wrong_dtype_shape_and_byte_length() -> None:
    g = rollout()
    f64 = Array("<f8", (7,), memoryview(np.zeros(7).tobytes()))
    expect_error(seq_replace(g, 0, tokens=f64), f"{SEQ0}.tokens", match="not allowed")
    f32 = Array(FLOAT32, (7,), memoryview(np.zeros(7, np.float32).tobytes()))
    expect_error(seq_replace(g, 0, tokens=f32), f"{SEQ0}.tokens", match="expected <i4")
    two_d = Array(INT32, (7, 1), memoryview(np.zeros(7, np.int32).tobytes()))
    expect_error(seq_replace(g, 0, tokens=two_d), f"{SEQ0}.tokens", match="dims")
    short = Array(INT32, (7,), memoryview(b"\0" * 27))
    expect_error(seq_replace(g, 0, tokens=short), f"{SEQ0}.tokens", match="27 bytes")
    negative = Array(INT32, (-1,), memoryview(b""))
    expect_error(seq_replace(g, 0, tokens=negative), f"{SEQ0}.tokens", match="negative dimension")


def test_mask_values_and_prompt_positions() -> None:
    g = rollout()
    m = g.sequences[0].loss_mask.numpy().copy()
    m[5] = 2
    expect_error(seq_replace(g, 0, loss_mask=Array.from_numpy(m, UINT8)), f"{SEQ0}.loss_mask", match="0 or 1")
    m = g.sequences[0].loss_mask.numpy().copy()
    m[0] = 1
    expect_error(seq_replace(g, 0, loss_mask=Array.from_numpy(m, UINT8), prompt_len=0), f"{SEQ0}.loss_mask")
    expect_error(seq_replace(g, 0, prompt_len=5), f"{SEQ0}.loss_mask", match="prompt positions")
    expect_error(seq_replace(g, 0, prompt_len=8), f"{SEQ0}.prompt_len")


def test_spans_outside_sequence() -> None:
    expect_error(seq_replace(rollout(), 0, spans=[(0, 3)]), f"{SEQ0}.spans[0]")
    expect_error(seq_replace(rollout(), 0, spans=[(2, 8)]), f"{SEQ0}.spans[0]")


def test_teacher_top_k_override_must_be_int() -> None:
    expect_error(rollout(group_overrides={"teacher_top_k": "5"}), "group.group_overrides.teacher_top_k")


def test_payload_count_and_status_consistency() -> None:
    s = scored()
    assert s.teacher is not None
    expect_error(replace(s, teacher=s.teacher[:2]), "scored.teacher", match="2 payloads for 3")
    expect_error(replace(s, teacher=None), "scored.teacher")
    expect_error(replace(s, status=DistillStatus.SKIPPED), "scored.teacher", match="status skipped")
    expect_error(ScoredGroup(group=s.group, status=DistillStatus.DROPPED), "scored.reason")


def test_batch_advantages_count_and_length() -> None:
    s = scored()
    adv = [Array.from_numpy(np.zeros(q.length, np.float32), FLOAT32) for q in s.group.sequences]
    expect_error(TrainBatch(batch_id="b", groups=[s], advantages=adv[:2]), "batch.advantages")
    adv[1] = Array.from_numpy(np.zeros(3, np.float32), FLOAT32)
    expect_error(TrainBatch(batch_id="b", groups=[s], advantages=adv), "batch.advantages[1]")


def test_teacher_rows_in_reference_layout_are_rejected() -> None:
    """L rows (entry per token, the reference layout) instead of L-1 logits-aligned rows."""
    s = scored()
    assert s.teacher is not None
    t = s.teacher[0]
    ids = np.vstack([t.topk_ids.numpy()[:1], t.topk_ids.numpy()])
    expect_error(teacher_replace(s, 0, topk_ids=Array.from_numpy(ids, INT32)), "scored.teacher[0].topk_ids")


def _aligned_teacher(seq: Sequence, k: int, seed: int) -> TeacherPayload:
    """A payload whose row r ranks the true next token tokens[r+1] first, clearly ahead of the rest."""
    rng = np.random.default_rng(seed)
    tok = seq.tokens.numpy()
    rows = tok.shape[0] - 1
    ids = rng.integers(10_000, 20_000, (rows, k), dtype=np.int32)
    ids[:, 0] = tok[1:]
    lps = np.sort(-rng.uniform(2.0, 9.0, (rows, k)), axis=1)[:, ::-1].astype(np.float32)
    lps[:, 0] = -0.1
    return make_teacher(ids, lps, lps[:, 0])


@pytest.mark.parametrize("shift", [1, -1])
def test_teacher_rows_shifted_by_one_are_rejected(shift: int) -> None:
    g = synthetic_rollout(2, [40, 40], vocab=500, seed=1)
    good = [_aligned_teacher(q, 4, i) for i, q in enumerate(g.sequences)]
    s = ScoredGroup(group=g, status=DistillStatus.OK, teacher=good, k=4)
    decode(encode(s))
    t = good[1]
    moved = {
        f: Array.from_numpy(np.roll(getattr(t, f).numpy(), shift, axis=0), getattr(t, f).dtype)
        for f in ("topk_ids", "topk_logprobs", "sampled_logprobs")
    }
    err = expect_error(teacher_replace(s, 1, **moved), "scored.teacher[1].sampled_logprobs", match="logits-aligned")
    assert "row" in err.reason


def test_unsorted_teacher_rows_are_rejected() -> None:
    s = scored(k=5)
    assert s.teacher is not None
    lps = s.teacher[2].topk_logprobs.numpy().copy()
    lps[-1] = lps[-1][::-1]  # the last row is always among the spot-checked rows
    s = teacher_replace(s, 2, topk_logprobs=Array.from_numpy(lps, FLOAT32))
    expect_error(s, "scored.teacher[2].topk_logprobs", match="not sorted")


def test_positive_teacher_logprob_is_rejected() -> None:
    s = scored(k=5)
    assert s.teacher is not None
    lps = s.teacher[0].topk_logprobs.numpy().copy()
    lps[0] += 1.0 - lps[0, 0]  # row 0 now starts at +1.0, still sorted
    expect_error(teacher_replace(s, 0, topk_logprobs=Array.from_numpy(lps, FLOAT32)), "scored.teacher[0].topk_logprobs")


def test_sampled_logprob_disagreeing_with_its_topk_entry() -> None:
    g = synthetic_rollout(1, 20, vocab=500, seed=2)
    t = _aligned_teacher(g.sequences[0], 3, 0)
    sampled = t.sampled_logprobs.numpy() - 0.5
    s = ScoredGroup(
        group=g, status=DistillStatus.OK, teacher=[replace(t, sampled_logprobs=Array.from_numpy(sampled, FLOAT32))], k=3
    )
    expect_error(s, "scored.teacher[0].sampled_logprobs")


@pytest.mark.parametrize("cut", [0, 1, 10, -1])
def test_truncated_and_garbage_bytes(cut: int) -> None:
    data = encode(scored())
    with pytest.raises(DecodeError) as info:
        decode(data[:cut])
    assert info.value.field == "message"


def test_garbage_types_are_decode_errors() -> None:
    for junk in (msgspec.msgpack.encode({"t": "rollout", "group_id": 5}), msgspec.msgpack.encode([1, 2]), b"\xc1"):
        with pytest.raises(DecodeError):
            decode(junk)


# --- schema evolution --------------------------------------------------------------------------------


class SequenceNext(Sequence, frozen=True, kw_only=True):
    """A later writer's Sequence: one more defaulted field."""

    teacher_hint: list[int] = msgspec.field(default_factory=list)


class RolloutGroupNext(msgspec.Struct, frozen=True, kw_only=True, tag="rollout", tag_field="t"):
    """A later writer's RolloutGroup: same tag, an added defaulted field (and nested added fields)."""

    group_id: str
    sequences: list[SequenceNext]
    schema: int = SCHEMA_VERSION
    env_id: int = 0
    task_id: str = ""
    policy_version: int = 0
    created_at: float = 0.0
    group_overrides: dict[str, Any] | None = None
    generation_params: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    discard: bool = False
    priority: float = 1.0


class RolloutGroupOld(msgspec.Struct, frozen=True, kw_only=True, tag="rollout", tag_field="t"):
    """An earlier writer's RolloutGroup, before ``generation_params``, ``metadata`` and ``discard``."""

    group_id: str
    sequences: list[Sequence]
    schema: int = SCHEMA_VERSION
    env_id: int = 0
    task_id: str = ""
    policy_version: int = 0
    created_at: float = 0.0
    group_overrides: dict[str, Any] | None = None


def test_message_from_a_newer_writer_with_extra_fields_decodes() -> None:
    g = rollout(policy_version=5)
    seqs = [SequenceNext(**msgspec.structs.asdict(q), teacher_hint=[1, 2]) for q in g.sequences]
    newer = RolloutGroupNext(**{**msgspec.structs.asdict(g), "sequences": seqs}, priority=0.25)
    back = decode(encode(newer), expect=RolloutGroup)
    same(g, back)
    assert not hasattr(back, "priority")


def test_message_from_an_older_writer_without_newer_fields_decodes() -> None:
    g = rollout(policy_version=2)
    fields = {f.name for f in msgspec.structs.fields(RolloutGroupOld)}
    older = RolloutGroupOld(**{k: v for k, v in msgspec.structs.asdict(g).items() if k in fields})
    back = decode(encode(older), expect=RolloutGroup)
    assert back.generation_params is None and back.metadata is None and back.discard is False
    same(replace(g, generation_params=None, metadata=None, discard=False), back)


# --- float16 teacher logprobs ------------------------------------------------------------------------


def test_float16_teacher_logprobs_within_documented_error() -> None:
    rng = np.random.default_rng(0)
    g = synthetic_rollout(2, 300, vocab=1000, seed=3)
    teachers = []
    exact = []
    for q in g.sequences:
        ids = 1000 + np.stack([rng.choice(1000, 8, replace=False) for _ in range(q.length - 1)]).astype(np.int32)
        lps = np.sort(-rng.uniform(0.001, 40.0, ids.shape), axis=1)[:, ::-1].astype(np.float32)
        lps[0, -1] = -999.0  # near the floor, where float16's steps are widest
        exact.append(lps)
        teachers.append(make_teacher(ids, lps, np.minimum(lps[:, -1], -45.0), fp16=True))
    s = ScoredGroup(group=g, status=DistillStatus.OK, teacher=teachers, k=8)
    back = decode(encode(s), expect=ScoredGroup)
    assert back.teacher is not None
    for t, lps in zip(back.teacher, exact, strict=True):
        got = t.topk_logprobs.numpy()
        assert got.dtype == np.float16
        err = np.abs(got.astype(np.float64) - lps.astype(np.float64))
        assert (err <= FLOAT16_MAX_RELATIVE_ERROR * np.abs(lps)).all()
    # Below float16's range: clipped to FLOAT16_MIN_LOGPROB on encode, and that is below the floor of a logprob
    # (a sentinel, never a real one): readers refuse it.
    lps = exact[0].copy()
    lps[1, -1] = -70000.0
    clipped = replace(s, teacher=[make_teacher(teachers[0].topk_ids.numpy(), lps, np.minimum(lps[:, -1], -45.0),
                                               fp16=True), *teachers[1:]])
    assert teachers[0].topk_logprobs.numpy().dtype == np.float16
    raw = decode(encode(clipped), Limits(check_values=False), expect=ScoredGroup)
    assert raw.teacher is not None and raw.teacher[0].topk_logprobs.numpy()[1, -1] == FLOAT16_MIN_LOGPROB
    with pytest.raises(DecodeError, match=r"scored.teacher\[0\].topk_logprobs: logprob -65504 at flat index 15 at "
                                          "or below the floor -1000"):
        decode(encode(clipped), expect=ScoredGroup)


# --- the fast structural path agrees with validate, edit by edit --------------------------------------


def _arrays(node: Any) -> Iterator[list[Any]]:
    """The wire arrays ([dtype, shape, data]) in a msgpack tree."""
    if isinstance(node, list):
        if len(node) == 3 and isinstance(node[0], str) and isinstance(node[1], list) and isinstance(node[2], bytes):
            yield node
        else:
            for x in node:
                yield from _arrays(x)
    elif isinstance(node, dict):
        for x in node.values():
            yield from _arrays(x)


#: Fields whose values are users' free-form dicts: a key in them is data, never a field of the schema
#: (a generated ``overrides`` may well hold a key named ``status`` or ``topk_ids``).
USER_DICTS = frozenset({"overrides", "group_overrides", "generation_params", "metadata", "messages", "stats"})


def _structs(node: Any, key: str) -> Iterator[dict[str, Any]]:
    """The message structs in a msgpack tree that have field ``key`` (users' dicts are not searched)."""
    if isinstance(node, dict):
        if key in node:
            yield node
        for name, x in node.items():
            if name not in USER_DICTS:
                yield from _structs(x, key)
    elif isinstance(node, list):
        for x in node:
            yield from _structs(x, key)


Edit = Callable[[Any], object]


def _swap_first_rows(payload: dict[str, Any]) -> None:
    """Rows no longer strictly increasing."""
    raw = bytearray(payload["rows"][2])
    raw[:4], raw[4:8] = raw[4:8], raw[:4]
    payload["rows"][2] = bytes(raw)


def _shift_rows(payload: dict[str, Any]) -> None:
    """Every row index one higher: the last may leave the sequence, a trained row loses its teacher row."""
    rows = np.frombuffer(payload["rows"][2], "<i4") + 1
    payload["rows"][2] = rows.astype("<i4").tobytes()


def _array_edits(arr: list[Any]) -> list[Edit]:
    itemsize = {INT32: 4, FLOAT32: 4, FLOAT16: 2, UINT8: 1}.get(arr[0], 8)
    rest = int(np.prod(arr[1][1:])) * itemsize

    def resize(a: list[Any], d: int) -> None:  # header and bytes agree; the other fields do not
        a[1][0] += d
        a[2] = a[2][: len(a[2]) - rest] if d < 0 else a[2] + b"\0" * rest

    edits: list[Edit] = [lambda a, d=dtype: a.__setitem__(0, d) for dtype in (INT32, FLOAT32, FLOAT16, UINT8, "<f8")]
    edits += [lambda a, j=j, d=d: a[1].__setitem__(j, a[1][j] + d) for j in range(len(arr[1])) for d in (-1, 1)]
    shapes = ([], [*arr[1], 1], arr[1][:-1], [1, *arr[1]], [-1] * len(arr[1]))
    edits += [lambda a, s=shape: a.__setitem__(1, list(s)) for shape in shapes]
    edits += [lambda a: a.__setitem__(2, a[2][:-1]), lambda a: a.__setitem__(2, a[2] + b"\0")]
    return edits + [lambda a, d=d: resize(a, d) for d in ((-1, 1) if arr[1] else ())]


def _sequence_edits(seq: dict[str, Any]) -> list[Edit]:
    n = seq["tokens"][1][0] if seq["tokens"][1] else 0
    edits: list[Edit] = [lambda q, v=p: q.__setitem__("prompt_len", v) for p in (-1, n + 1)]
    edits += [lambda q, v=span: q.__setitem__("spans", [v]) for span in ([0, 1], [1, n + 1], [2, 1], [n, n])]
    wrong_length = [FLOAT32, [n + 1], b"\0" * 4 * (n + 1)]
    edits += [lambda q, f=f: q.__setitem__(f, wrong_length) for f in ("logprobs", "advantages")]
    return edits


def _group_edits(g: dict[str, Any]) -> list[Edit]:
    edits: list[Edit] = [lambda q: q.__setitem__("group_id", ""), lambda q: q.__setitem__("sequences", []),
                         lambda q: q.__setitem__("sequences", q["sequences"][:-1])]
    return edits + [lambda q, v=k: q.__setitem__("group_overrides", {"teacher_top_k": v}) for k in ("5", True, 2.0, 3)]


def _scored_edits(s: dict[str, Any]) -> list[Edit]:
    edits: list[Edit] = [lambda q, v=k: q.__setitem__("k", v) for k in (0, s["k"] - 1, s["k"] + 1, 300)]
    edits += [lambda q, v=status.value: q.__setitem__("status", v) for status in DistillStatus]
    edits += [lambda q: q.__setitem__("reason", None), lambda q: q.__setitem__("teacher", None)]
    return edits + ([lambda q: q.__setitem__("teacher", q["teacher"][:-1])] if s.get("teacher") else [])


def _edits(tree: dict[str, Any]) -> list[tuple[str, int, Edit]]:
    """One structural edit each, at every array and every length-like field: what to edit, and how."""
    edits: list[tuple[str, int, Edit]] = [("a", i, e) for i, arr in enumerate(_arrays(tree)) for e in _array_edits(arr)]
    for field, make in (("prompt_len", _sequence_edits), ("sequences", _group_edits), ("status", _scored_edits)):
        edits += [(field, i, e) for i, node in enumerate(_structs(tree, field)) for e in make(node)]
    for i, t in enumerate(_structs(tree, "topk_ids")):
        edits += [("topk_ids", i, lambda q, v=k: q.__setitem__("k", v)) for k in (0, t["k"] - 1, t["k"] + 1, 300)]
        edits += [("topk_ids", i, lambda q: q.__setitem__("rows", None))]  # trained rows read as rows 0..R-1
        rows = t.get("rows")
        if isinstance(rows, list) and len(rows) == 3 and isinstance(rows[2], bytes) and len(rows[2]) >= 8 \
                and len(rows[2]) % 4 == 0:
            edits += [("topk_ids", i, _swap_first_rows), ("topk_ids", i, _shift_rows)]
    if "advantages" in tree:
        edits += [("", 0, lambda q: q.__setitem__("advantages", q["advantages"][:-1])),
                  ("", 0, lambda q: q.__setitem__("advantages", q["advantages"] + q["advantages"][:1]))]
    return edits + [("", 0, lambda q, v=v: q.__setitem__("schema", v)) for v in (0, 2)]


def _edited(tree: dict[str, Any], edit: tuple[str, int, Edit]) -> dict[str, Any]:
    """A copy of ``tree`` with one edit from ``_edits(tree)`` applied."""
    kind, i, fn = edit
    copy: dict[str, Any] = msgspec.msgpack.decode(msgspec.msgpack.encode(tree))
    fn(list(_arrays(copy))[i] if kind == "a" else list(_structs(copy, kind))[i] if kind else copy)
    return copy


def _fast_and_reference(msg: Any, limits: Limits) -> tuple[bool, DecodeError | None]:
    try:
        validate(msg, limits)
    except DecodeError as e:
        return _structure_ok(msg, limits), e
    return _structure_ok(msg, limits), None


def _edit_bases() -> list[Any]:
    s = scored(k=5)
    g16 = synthetic_rollout(2, [6, 1], vocab=500, seed=2)
    t16 = [synthetic_teacher(q, 3, vocab=500, seed=i, fp16=True) for i, q in enumerate(g16.sequences)]
    s16 = ScoredGroup(group=g16, status=DistillStatus.OK, k=3, teacher=t16)
    adv = [Array.from_numpy(np.zeros(q.length, np.float32), FLOAT32) for q in s.group.sequences]
    g = seq_replace(rollout(), 1, advantages=adv[1], ref_logprobs=adv[1], spans=[(1, 1)])
    return [g, s, s16, TrainBatch(batch_id="b", groups=[s], advantages=adv),
            ScoredGroup(group=rollout(), status=DistillStatus.DROPPED, reason="r")]


@pytest.mark.parametrize("base", range(5))
def test_fast_structural_checks_agree_with_validate_on_every_single_edit(base: int) -> None:
    """Every one-field structural edit: the fast path accepts iff ``validate`` does; decode reports validate's
    error. Limits at the message's own sizes (valid) and one below (invalid) check the bounds too."""
    msg = _edit_bases()[base]
    tree = msgspec.msgpack.decode(encode(msg))
    seqs = [q for g in (msg.groups if isinstance(msg, TrainBatch) else [msg]) for q in
            (g.sequences if isinstance(g, RolloutGroup) else g.group.sequences)]
    n, count = max(q.length for q in seqs), len(seqs)
    k = max((g.k for g in msg.groups), default=0) if isinstance(msg, TrainBatch) else getattr(msg, "k", 0)
    tight = [Limits(check_values=False, max_seq_len=n, max_sequences=count, max_k=max(k, 1)),
             Limits(check_values=False, max_seq_len=n - 1), Limits(check_values=False, max_sequences=count - 1)]
    if k:
        tight.append(Limits(check_values=False, max_k=k - 1))
    cases = 0
    for limits in [Limits(check_values=False), *tight]:
        for edited in [tree, *(_edited(tree, e) for e in _edits(tree))]:
            try:
                decoded = codec._DECODER.decode(msgspec.msgpack.encode(edited))
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
            fast, error = _fast_and_reference(decoded, limits)
            assert fast == (error is None), (error, edited)
            cases += 1
            try:
                decode(msgspec.msgpack.encode(edited), limits)
            except DecodeError as e:
                assert error is not None and (e.field, e.reason) == (error.field, error.reason)
            else:
                assert error is None
    assert cases > 100


def test_a_schema_1_reader_refuses_trained_rows_payloads_naming_the_schema(monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader built before teacher payloads could hold only the trained rows (schema 1) must not take
    them for the first rows of the sequence: it refuses the message on its ``schema`` before any shape."""
    from schemas import structure
    from schemas import validate as validate_module

    data = encode(synthetic_scored(rollout(), 5, vocab=500, seed=9))  # trained rows only: schema 2
    assert decode(data).schema == 2
    for module in (structure, validate_module):
        monkeypatch.setattr(module, "SCHEMA_VERSION", 1)
    with pytest.raises(DecodeError) as info:
        decode(data)
    assert info.value.field == "schema" and info.value.reason == "version 2 not supported (this reader: 1..1)"
