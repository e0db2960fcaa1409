"""Malformed stream messages, built by mutating valid encoded ones (as msgpack trees, so values of the
wrong type, length or range can be written) and by corrupting their bytes.

Each category is a function ``(tree, rng) -> bytes``. ``GUARANTEED`` categories produce messages that are
invalid by the wire contract (a decoder that accepts one has a bug); ``FILTERED`` ones (random byte
flips, spot-checked teacher properties) may produce a valid message by chance, which is then not used.
"""

from __future__ import annotations

import copy
import random
import struct
from collections.abc import Callable
from typing import Any

import msgspec

from pipeline.config import StreamSettings
from schemas import SCHEMA_VERSION, encode
from schemas.build import synthetic_rollout, synthetic_scored

MAX_BYTES = 65536
VOCAB = 32000
#: The limits the workers under test decode with (DISTILLQ_MAX_MESSAGE_BYTES / DISTILLQ_VOCAB_SIZE).
LIMITS = StreamSettings(max_message_bytes=MAX_BYTES, vocab_size=VOCAB).limits()
ENV = {"DISTILLQ_MAX_MESSAGE_BYTES": str(MAX_BYTES), "DISTILLQ_VOCAB_SIZE": str(VOCAB)}

Tree = dict[str, Any]
Mutation = Callable[[Tree, random.Random], bytes]
pack = msgspec.msgpack.encode


def rollout_tree(i: int) -> Tree:
    tree: Tree = msgspec.msgpack.decode(encode(synthetic_rollout(2, 16, group_id=f"base-{i}", seed=i)))
    return tree


def scored_tree(i: int) -> Tree:
    g = synthetic_rollout(2, 16, group_id=f"base-{i}", seed=i)
    tree: Tree = msgspec.msgpack.decode(encode(synthetic_scored(g, k=4, seed=i)))
    return tree


def group_of(tree: Tree) -> Tree:
    """The rollout part of a rollout or scored tree."""
    return tree["group"] if tree["t"] == "scored" else tree


def seq(tree: Tree, rng: random.Random) -> Tree:
    seqs: list[Tree] = group_of(tree)["sequences"]
    return seqs[rng.randrange(len(seqs))]


def put(arr: list[Any], index: int, fmt: str, value: float) -> None:
    """Overwrite element ``index`` of a wire array ``[dtype, shape, data]``."""
    data = bytearray(arr[2])
    size = struct.calcsize(fmt)
    data[index * size : (index + 1) * size] = struct.pack(fmt, value)
    arr[2] = bytes(data)


def mutation(fn: Callable[[Tree, random.Random], None]) -> Mutation:
    """Turn an in-place tree edit into a category."""

    def build(tree: Tree, rng: random.Random) -> bytes:
        fn(tree, rng)
        return pack(tree)

    build.__name__ = fn.__name__
    build.edit = fn  # type: ignore[attr-defined]  # the raw edit, to apply inside a train batch
    return build


# --- guaranteed invalid: sequences -----------------------------------------------------------------
@mutation
def tokens_wrong_dtype(t: Tree, rng: random.Random) -> None:
    seq(t, rng)["tokens"][0] = rng.choice(["<f4", "<i8", ">i4", "int32", "", "<u4", "|b1"])


@mutation
def tokens_wrong_shape(t: Tree, rng: random.Random) -> None:
    tok = seq(t, rng)["tokens"]
    n = tok[1][0]
    tok[1] = rng.choice([[n, 1], [1, n], [-n], [n + rng.randint(1, 9)], []])


@mutation
def tokens_bytes_short(t: Tree, rng: random.Random) -> None:
    tok = seq(t, rng)["tokens"]
    tok[2] = tok[2][: -rng.randint(1, len(tok[2]))]


@mutation
def mask_length_mismatch(t: Tree, rng: random.Random) -> None:
    mask = seq(t, rng)["loss_mask"]
    mask[1], mask[2] = [mask[1][0] - 1], mask[2][:-1]


@mutation
def logprobs_length_mismatch(t: Tree, rng: random.Random) -> None:
    lp = seq(t, rng)["logprobs"]
    extra = rng.randint(1, 4)
    lp[1], lp[2] = [lp[1][0] + extra], lp[2] + b"\0" * 4 * extra


@mutation
def logprobs_non_finite(t: Tree, rng: random.Random) -> None:
    lp = seq(t, rng)["logprobs"]
    put(lp, rng.randrange(lp[1][0]), "<f", rng.choice([float("nan"), float("inf"), float("-inf")]))


@mutation
def token_id_negative(t: Tree, rng: random.Random) -> None:
    tok = seq(t, rng)["tokens"]
    put(tok, rng.randrange(tok[1][0]), "<i", -rng.randint(1, 2**31))


@mutation
def token_id_huge(t: Tree, rng: random.Random) -> None:
    tok = seq(t, rng)["tokens"]
    put(tok, rng.randrange(tok[1][0]), "<i", rng.randint(VOCAB, 2**31 - 1))


@mutation
def prompt_len_out_of_range(t: Tree, rng: random.Random) -> None:
    s = seq(t, rng)
    s["prompt_len"] = rng.choice([-1, -(2**63), s["tokens"][1][0] + 1, 2**63 - 1])


@mutation
def mask_not_binary(t: Tree, rng: random.Random) -> None:
    mask = seq(t, rng)["loss_mask"]
    put(mask, rng.randrange(mask[1][0]), "<B", rng.randint(2, 255))


@mutation
def mask_on_prompt(t: Tree, rng: random.Random) -> None:
    s = seq(t, rng)
    put(s["loss_mask"], rng.randrange(max(1, s["prompt_len"])), "<B", 1)


@mutation
def spans_out_of_range(t: Tree, rng: random.Random) -> None:
    s = seq(t, rng)
    n = s["tokens"][1][0]
    s["spans"] = [rng.choice([[0, 2], [3, n + 1], [5, 4], [-1, 3]])]


@mutation
def field_wrong_type(t: Tree, rng: random.Random) -> None:
    s = seq(t, rng)
    key, value = rng.choice([("prompt_len", 1.5), ("score", "high"), ("tokens", "1 2 3"), ("logprobs", 7),
                             ("overrides", [1]), ("messages", "hi")])
    s[key] = value


# --- guaranteed invalid: group and envelope --------------------------------------------------------
@mutation
def schema_version_unknown(t: Tree, rng: random.Random) -> None:
    t["schema"] = rng.choice([0, SCHEMA_VERSION + 1, 99, -1, 2**40])


@mutation
def group_id_invalid(t: Tree, rng: random.Random) -> None:
    group_of(t)["group_id"] = rng.choice([12345, None, ["a"], "", b"bytes"])


@mutation
def sequences_invalid(t: Tree, rng: random.Random) -> None:
    group_of(t)["sequences"] = rng.choice([[], "x", None, [None], [1, 2]])


@mutation
def required_field_missing(t: Tree, rng: random.Random) -> None:
    target = rng.choice([group_of(t), seq(t, rng)])
    required = [k for k in ("group_id", "sequences", "tokens", "loss_mask", "prompt_len") if k in target]
    del target[rng.choice(required)]


@mutation
def tag_invalid(t: Tree, rng: random.Random) -> None:
    if rng.random() < 0.5:
        del t["t"]
    else:
        t["t"] = rng.choice(["nope", "", "ROLLOUT", 3])


@mutation
def override_k_not_int(t: Tree, rng: random.Random) -> None:
    group_of(t)["group_overrides"] = {"teacher_top_k": rng.choice(["20", 2.5, True, [1], {"k": 1}])}


def other_message_type(t: Tree, rng: random.Random) -> bytes:
    """A valid message of the wrong kind for the stream (a scored group on rollouts and vice versa)."""
    if t["t"] == "scored":
        return pack(t["group"])
    return pack(scored_tree(rng.randrange(1000)))


def truncated(t: Tree, rng: random.Random) -> bytes:
    data = pack(t)
    return data[: rng.randrange(len(data))]


def not_msgpack(t: Tree, rng: random.Random) -> bytes:
    return rng.choice([b"", b"\xc1", b"null", b"\x00" * rng.randint(1, 64), b"\x91" * 5000 + b"\xc0",
                       pack([1, 2, 3]), pack("rollout"), pack({"t": None})])


def oversize_valid(t: Tree, rng: random.Random) -> bytes:
    """A well-formed message over the byte cap: rejected for its size alone."""
    return bytes(encode(synthetic_rollout(2, rng.randint(7300, 9000), group_id="big", seed=rng.randrange(99))))


def oversize_garbage(t: Tree, rng: random.Random) -> bytes:
    """Over the cap and also malformed (a nesting bomb or noise): the size check must come first."""
    return rng.choice([b"\x91" * (MAX_BYTES + 10) + b"\xc0", rng.randbytes(MAX_BYTES + rng.randint(1, 9999))])


# --- guaranteed invalid: teacher payloads (scored only) --------------------------------------------
def teacher(t: Tree, rng: random.Random) -> Tree:
    payloads: list[Tree] = t["teacher"]
    return payloads[rng.randrange(len(payloads))]


def _resize_k(p: Tree, k: int) -> None:
    rows = p["topk_ids"][1][0]
    p["k"] = k
    p["topk_ids"] = ["<i4", [rows, k], struct.pack(f"<{rows * k}i", *range(rows * k))]
    p["topk_logprobs"] = ["<f4", [rows, k], struct.pack(f"<{rows * k}f", *([-1.0] * rows * k))]


@mutation
def k_over_cap(t: Tree, rng: random.Random) -> None:
    k = rng.randint(LIMITS.max_k + 1, 600)
    for p in t["teacher"]:
        _resize_k(p, k)
    t["k"] = k


@mutation
def k_mismatch(t: Tree, rng: random.Random) -> None:
    t["k"] = t["k"] + rng.choice([-3, -1, 1, 7])


@mutation
def k_zero(t: Tree, rng: random.Random) -> None:
    for p in t["teacher"]:
        _resize_k(p, 0)
    t["k"] = 0


@mutation
def teacher_rows_not_logits_aligned(t: Tree, rng: random.Random) -> None:
    p = teacher(t, rng)
    rows, k = p["topk_ids"][1]
    extra = rng.choice([1, -1])  # L rows (the reference's layout) or L-2
    for name, size in (("topk_ids", 4 * k), ("topk_logprobs", 4 * k)):
        arr = p[name]
        arr[1] = [rows + extra, k]
        arr[2] = arr[2] + arr[2][:size] if extra > 0 else arr[2][:-size]


@mutation
def teacher_non_finite(t: Tree, rng: random.Random) -> None:
    p = teacher(t, rng)
    name = rng.choice(["topk_logprobs", "sampled_logprobs"])
    n = len(p[name][2]) // 4
    put(p[name], rng.randrange(n), "<f", rng.choice([float("nan"), float("inf"), float("-inf")]))


@mutation
def teacher_ids_out_of_range(t: Tree, rng: random.Random) -> None:
    p = teacher(t, rng)
    n = len(p["topk_ids"][2]) // 4
    put(p["topk_ids"], rng.randrange(n), "<i", rng.choice([-1, -(2**31), VOCAB, 2**31 - 1]))


@mutation
def teacher_positive_logprob(t: Tree, rng: random.Random) -> None:
    p = teacher(t, rng)
    rows, k = p["topk_logprobs"][1]
    put(p["topk_logprobs"], rng.randrange(rows) * k, "<f", rng.uniform(0.01, 50.0))


@mutation
def teacher_count_mismatch(t: Tree, rng: random.Random) -> None:
    t["teacher"] = t["teacher"][:1] if rng.random() < 0.5 else t["teacher"] * 2


@mutation
def status_inconsistent(t: Tree, rng: random.Random) -> None:
    case = rng.randrange(4)
    if case == 0:
        t["teacher"] = None  # ok without payload
    elif case == 1:
        t.update(status="dropped", teacher=None, reason=None)  # dropped without a reason
    elif case == 2:
        t["status"] = "skipped"  # skipped with a payload
    else:
        t["status"] = rng.choice(["great", "", None, 1])


# --- may be valid by chance (filtered) --------------------------------------------------------------
def byte_flips(t: Tree, rng: random.Random) -> bytes:
    data = bytearray(pack(t))
    for _ in range(rng.randint(1, 4)):
        data[rng.randrange(len(data))] = rng.randrange(256)
    return bytes(data)


@mutation
def teacher_rows_shifted(t: Tree, rng: random.Random) -> None:
    """Rows rotated by one: row r describes token r+2 (an off-by-one a backend could make)."""
    p = teacher(t, rng)
    k = p["topk_ids"][1][1]
    for name in ("topk_ids", "topk_logprobs"):
        data = p[name][2]
        p[name][2] = data[4 * k :] + data[: 4 * k]


ROLLOUT_GUARANTEED: list[Mutation] = [
    tokens_wrong_dtype, tokens_wrong_shape, tokens_bytes_short, mask_length_mismatch, logprobs_length_mismatch,
    logprobs_non_finite, token_id_negative, token_id_huge, prompt_len_out_of_range, mask_not_binary,
    mask_on_prompt, spans_out_of_range, field_wrong_type, schema_version_unknown, group_id_invalid,
    sequences_invalid, required_field_missing, tag_invalid, override_k_not_int, other_message_type, truncated,
    not_msgpack,
]
SCORED_GUARANTEED: list[Mutation] = [
    *ROLLOUT_GUARANTEED, k_over_cap, k_mismatch, k_zero, teacher_rows_not_logits_aligned, teacher_non_finite,
    teacher_ids_out_of_range, teacher_positive_logprob, teacher_count_mismatch, status_inconsistent,
]
OVERSIZE: list[Mutation] = [oversize_valid, oversize_garbage]
FILTERED: dict[str, list[Mutation]] = {"rollouts": [byte_flips], "scored": [byte_flips, teacher_rows_shifted]}


_BASES: dict[str, list[Tree]] = {}


def make(stream: str, category: Mutation, i: int, rng: random.Random) -> bytes:
    """Category ``category`` applied to one of 64 valid base messages of ``stream``."""
    if stream not in _BASES:
        _BASES[stream] = [rollout_tree(j) if stream == "rollouts" else scored_tree(j) for j in range(64)]
    return category(copy.deepcopy(_BASES[stream][i % 64]), rng)
