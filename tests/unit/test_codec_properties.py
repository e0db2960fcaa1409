"""Property tests: every valid group round-trips exactly; corrupted bytes only ever raise DecodeError."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas.arrays import FLOAT32, Array
from schemas.build import make_sequence, make_teacher
from schemas.codec import _DECODER, decode, encode
from schemas.messages import DistillStatus, Message, RolloutGroup, ScoredGroup, Sequence, TeacherPayload, TrainBatch
from schemas.structure import _structure_ok
from schemas.validate import DecodeError, Limits, validate
from tests.unit.test_codec import _edited, _edits, same

VOCAB = 5000
# print_blob: a failure prints the ``@reproduce_failure(...)`` line that replays it exactly.
SETTINGS = settings(max_examples=200, deadline=None, database=None, print_blob=True,
                    suppress_health_check=[HealthCheck.too_slow])

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.text(max_size=5))
small_dicts = st.dictionaries(st.text(max_size=6), json_scalars, max_size=3)
finite = st.floats(-1e6, 1e6, allow_nan=False, width=32)


@st.composite
def sequences(draw: st.DrawFn) -> Sequence:
    n = draw(st.integers(1, 64))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    tokens = rng.integers(0, VOCAB, n, dtype=np.int32)
    mask = rng.integers(0, 2, n).astype(np.uint8)
    mask[: draw(st.integers(1, n))] = 0  # the prompt (always including position 0)

    def per_token() -> Any:
        return -rng.exponential(1.0, n).astype(np.float32) if draw(st.booleans()) else None

    seq = make_sequence(
        tokens,
        mask,
        logprobs=per_token(),
        score=draw(finite),
        advantages=per_token(),
        ref_logprobs=per_token(),
        overrides=draw(st.none() | small_dicts),
        messages=draw(st.none() | st.lists(small_dicts, max_size=2)),
    )
    if draw(st.booleans()) and n > 1:
        start = draw(st.integers(1, n))
        seq = Sequence(**{**_fields(seq), "spans": [(start, draw(st.integers(start, n)))]})
    return seq


def _fields(s: Sequence) -> dict[str, Any]:
    return {f: getattr(s, f) for f in s.__struct_fields__}


@st.composite
def rollouts(draw: st.DrawFn) -> RolloutGroup:
    return RolloutGroup(
        group_id=draw(st.text(min_size=1, max_size=40)),
        sequences=draw(st.lists(sequences(), min_size=1, max_size=4)),
        env_id=draw(st.integers(0, 2**31)),
        task_id=draw(st.text(max_size=10)),
        policy_version=draw(st.integers(0, 2**40)),
        created_at=draw(st.floats(0, 2e9)),
        group_overrides=draw(st.none() | st.fixed_dictionaries({"teacher_top_k": st.integers(1, 64)})),
        generation_params=draw(st.none() | small_dicts),
        metadata=draw(st.none() | small_dicts),
        discard=draw(st.booleans()),
    )


def teacher_for(seq: Sequence, k: int, seed: int, fp16: bool, layout: str = "all") -> TeacherPayload:
    """A payload obeying the convention: rows sorted, sampled = its top-k entry or below the row.

    ``layout``: ``all`` rows (schema 1), the ``trained`` rows only, or the trained rows ``plus`` some others.
    """
    rng = np.random.default_rng(seed)
    tok = seq.tokens.numpy()
    held: np.ndarray | None = None
    if layout != "all":
        mask = seq.loss_mask.numpy()[1:].astype(bool)
        if layout == "plus":
            mask |= rng.random(mask.shape[0]) < 0.3
        held = np.flatnonzero(mask).astype(np.int32)
    nxt = tok[1:] if held is None else tok[held + 1]
    rows = nxt.shape[0]
    ids = np.stack([rng.choice(VOCAB, k, replace=False) for _ in range(rows)]) if rows else np.empty((0, k))
    ids = ids.astype(np.int32)
    put = rng.random(rows) < 0.5  # half the rows hold the true next token
    ids[put, rng.integers(0, k, rows)[put]] = nxt[put]
    ids[~put] = np.where(ids[~put] == nxt[~put, None], (ids[~put] + 1) % VOCAB, ids[~put])
    lps = np.sort(-rng.exponential(3.0, (rows, k)), axis=1)[:, ::-1].astype(np.float32)
    if fp16:
        lps = lps.astype(np.float16).astype(np.float32)
    hit = ids == nxt[:, None]
    has = hit.any(axis=1)
    sampled = (lps[:, -1] if rows else np.empty(0, np.float32)) - rng.exponential(1.0, rows).astype(np.float32)
    sampled[has] = lps[has, hit[has].argmax(axis=1)]
    return make_teacher(ids, lps, sampled, fp16=fp16, rows=held)


@st.composite
def scored_groups(draw: st.DrawFn, ok: bool = False) -> ScoredGroup:
    g = draw(rollouts())
    status = DistillStatus.OK if ok else draw(st.sampled_from(DistillStatus))
    if status is not DistillStatus.OK:
        return ScoredGroup(group=g, status=status, reason=draw(st.text(min_size=1, max_size=20)))
    k = draw(st.integers(1, 32))
    seed, fp16 = draw(st.integers(0, 2**32 - 1)), draw(st.booleans())
    layout = draw(st.sampled_from(["all", "trained", "plus"]))
    teachers = [teacher_for(s, k, seed + i, fp16, layout) for i, s in enumerate(g.sequences)]
    return ScoredGroup(group=g, status=status, teacher=teachers, k=k, teacher_id=draw(st.text(max_size=8)))


messages: st.SearchStrategy[Message] = st.one_of(rollouts(), scored_groups())


@SETTINGS
@given(messages)
def test_any_valid_group_round_trips_exactly(msg: Message) -> None:
    validate(msg, Limits())  # the strategy only builds valid groups
    data = encode(msg)
    back = decode(data)
    assert _structure_ok(back, Limits())  # valid messages take the fast structural path
    same(msg, back)
    same(msg, decode(data, Limits(check_values=False)))
    assert encode(back) == data


@st.composite
def corrupted(draw: st.DrawFn) -> tuple[str, bytes]:
    data = encode(draw(messages))
    how = draw(st.sampled_from(["truncate", "flip", "random", "insert"]))
    if how == "truncate":
        return how, data[: draw(st.integers(0, len(data) - 1))]
    if how == "random":
        return how, draw(st.binary(max_size=400))
    buf = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        i = draw(st.integers(0, len(buf) - 1))
        if how == "flip":
            buf[i] ^= draw(st.integers(1, 255))
        else:
            buf[i:i] = draw(st.binary(min_size=1, max_size=4))
    return how, bytes(buf)


@SETTINGS
@given(corrupted())
def test_corrupted_bytes_only_ever_raise_decode_error(case: tuple[str, bytes]) -> None:
    how, data = case
    try:
        msg = decode(data)
    except DecodeError as e:
        assert e.field and e.reason
        return
    # A flip or insert inside array bytes or a string can leave a valid message; truncated or random
    # bytes never do (a message is a msgpack map, which truncation leaves incomplete).
    assert how in ("flip", "insert"), how
    validate(msg, Limits())


def test_single_token_rollout_round_trips() -> None:
    seq = make_sequence([7], [0], logprobs=[0.0], advantages=[0.5])
    g = RolloutGroup(group_id="one", sequences=[seq])
    same(g, decode(encode(g)))
    t = make_teacher(np.empty((0, 3), np.int32), np.empty((0, 3), np.float32), np.empty(0, np.float32))
    s = ScoredGroup(group=g, status=DistillStatus.OK, teacher=[t], k=3)
    same(s, decode(encode(s)))
    assert Array.from_numpy(np.empty((0, 3), np.float32), FLOAT32).nbytes == 0


# --- the fast structural path agrees with validate -------------------------------------------------

@st.composite
def batches(draw: st.DrawFn) -> TrainBatch:
    groups = draw(st.lists(scored_groups(), min_size=1, max_size=2))
    adv = [Array.from_numpy(np.full(q.length, 0.5, np.float32), FLOAT32) for g in groups for q in g.group.sequences]
    return TrainBatch(batch_id=draw(st.text(min_size=1, max_size=8)), groups=groups, advantages=adv)


@st.composite
def edited(draw: st.DrawFn) -> tuple[Message, Limits]:
    """A valid message after 0-3 structural edits (of arrays' headers and bytes, lengths, k, status, ids)."""
    msg = draw(st.one_of(messages, scored_groups(ok=True), batches()))
    tree = msgspec.msgpack.decode(encode(msg))
    for _ in range(draw(st.integers(0, 3))):
        tree = _edited(tree, draw(st.sampled_from(_edits(tree))))
    limits = Limits(
        check_values=False,
        max_k=draw(st.sampled_from([256, 256, 256, 8])),
        max_seq_len=draw(st.sampled_from([1 << 20, 1 << 20, 1 << 20, 32])),
        max_sequences=draw(st.sampled_from([4096, 4096, 4096, 2])),
    )
    try:
        return _DECODER.decode(msgspec.msgpack.encode(tree)), limits
    except (msgspec.DecodeError, msgspec.ValidationError):
        return msg, limits


@settings(SETTINGS)
@given(edited())
def test_fast_structural_checks_agree_with_validate(case: tuple[Message, Limits]) -> None:
    """The fast path accepts exactly the messages ``validate`` accepts; decode's errors are validate's."""
    msg, limits = case
    try:
        validate(msg, limits)
        error = None
    except DecodeError as e:
        error = e
    assert _structure_ok(msg, limits) == (error is None), error
    data = encode(msg)
    if error is None:
        decode(data, limits)
    else:
        try:
            decode(data, limits)
        except DecodeError as e:
            assert (e.field, e.reason) == (error.field, error.reason)
        else:
            raise AssertionError(f"decode accepted a message validate rejects: {error}")
    full = dataclasses.replace(limits, check_values=True)
    if error is not None:  # a structural error is reported with value checks on as well
        try:
            validate(msg, full)
        except DecodeError:
            pass
        else:
            raise AssertionError("structurally invalid, yet valid with value checks")
