"""Encode and decode stream messages (msgpack via msgspec; never pickle).

``decode`` never raises anything but ``DecodeError`` on bad bytes: a reader can dead-letter the entry
with the reason and go on.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Final, TypeVar, overload

import msgspec

from schemas.arrays import Array
from schemas.messages import Message, RolloutGroup, ScoredGroup, Sequence, TrainBatch
from schemas.structure import validate_decoded
from schemas.validate import DecodeError, Limits

_ENCODER: Final = msgspec.msgpack.Encoder()
_DECODER: Final = msgspec.msgpack.Decoder(Message)
DEFAULT_LIMITS: Final = Limits()

M = TypeVar("M", bound=Message)

# --- exact-size encoding ---------------------------------------------------------------------------
#
# ``Encoder.encode`` starts from a 32-byte buffer and regrows it by 1.5x whenever a write does not fit,
# so a 5.7 MB group goes through ~15 reallocations. Whether those copy depends on the malloc heap: in
# a fresh process the buffer mostly grows in place, but once the heap is churned (e.g. by tens of MB of
# short-lived JSON) the allocator moves it, and encoding measured 1.1-1.7x a plain copy of its output
# on an AMD EPYC and 1.3x on an Intel Xeon, instead of ~1.0x (bench/codec.py, rows marked *).
#
# So ``encode`` sizes the buffer up front: the array bytes (~2 us to sum for a group of 48 arrays) plus
# slack for the msgpack structure, field names and small fields. ``PyByteArray_Resize`` on an empty
# bytearray allocates that much without zero-filling it (``bytearray(n)`` would memset n bytes, half
# the cost of the copy we are saving), then ``encode_into`` writes into it and shrinks its logical size
# to what was written (no reallocation). If the estimate falls short (long chat ``messages``, large
# metadata), msgspec grows the buffer as ``encode`` would: the output is the same either way. msgspec
# has no option to size ``encode``'s own buffer, and a ``bytes`` cannot be filled in place.
#
# The result is a read-only memoryview of that bytearray (and, on the plain path, of msgspec's bytes,
# so the type is the same): a bytearray would be mutable, and redis-py rejects it, whereas redis-py,
# sockets, files and ``decode`` take a memoryview as they take bytes, and it supports ``len``, slicing
# and ``==``. Copying it into a ``bytes`` would cost the copy again. It is not hashable and has no
# ``bytes`` methods. Where ``ctypes.pythonapi`` is missing (not CPython) ``Encoder.encode`` is used.
#
# Messages with under 256 KiB of arrays (headers, short rollouts) go straight to ``Encoder.encode``:
# there the exact-size path costs 1-3 us more per call (summing sizes, the ctypes call, a malloc'd
# buffer), about what the regrowth costs at that size; from ~1 MB up it wins on any heap.

#: Bytes allowed on top of the arrays' own for the rest of a message (ids, metadata, ...).
ENCODE_SLACK: Final = 4096
#: Per sequence and per teacher payload: field names, array headers (dtype, shape, length), scalars.
ENCODE_SLACK_PER_STRUCT: Final = 512
#: Messages whose arrays hold fewer bytes are encoded by ``Encoder.encode`` directly.
EXACT_SIZE_MIN_BYTES: Final = 256 * 1024


def _byte_array_resize() -> Callable[[bytearray, int], int] | None:
    try:
        fn = ctypes.pythonapi.PyByteArray_Resize
    except AttributeError:  # not CPython
        return None
    fn.argtypes = (ctypes.py_object, ctypes.c_ssize_t)
    fn.restype = ctypes.c_int  # -1 with MemoryError set, which ctypes raises (pythonapi holds the GIL)
    return fn


_resize: Callable[[bytearray, int], int] | None = _byte_array_resize()


def _sequence_bytes(seqs: list[Sequence]) -> int:
    size = 0
    for s in seqs:  # unrolled: ~2 us for a group of 48 arrays
        size += s.tokens.data.nbytes + s.loss_mask.data.nbytes
        if (a := s.logprobs) is not None:
            size += a.data.nbytes
        if (a := s.advantages) is not None:
            size += a.data.nbytes
        if (a := s.ref_logprobs) is not None:
            size += a.data.nbytes
    return size


def _scored_sizes(g: ScoredGroup) -> tuple[int, int]:
    teacher = g.teacher or ()
    size = _sequence_bytes(g.group.sequences)
    for t in teacher:
        size += t.topk_ids.data.nbytes + t.topk_logprobs.data.nbytes + t.sampled_logprobs.data.nbytes
        if (a := t.rows) is not None:
            size += a.data.nbytes
    return size, len(g.group.sequences) + len(teacher)


def _array_sizes(msg: Message) -> tuple[int, int]:
    """Bytes in the arrays of ``msg``, and its number of sequences and teacher payloads."""
    if isinstance(msg, ScoredGroup):
        return _scored_sizes(msg)
    if isinstance(msg, RolloutGroup):
        return _sequence_bytes(msg.sequences), len(msg.sequences)
    if isinstance(msg, TrainBatch):
        advantages: list[Array] = msg.advantages
        size, count = sum(a.data.nbytes for a in advantages), 0
        for g in msg.groups:
            gs, gc = _scored_sizes(g)
            size, count = size + gs, count + gc
        return size, count
    return 0, 0


def _buffer_size(array_bytes: int, structs: int) -> int:
    return array_bytes + structs * ENCODE_SLACK_PER_STRUCT + ENCODE_SLACK


def encoded_size_bound(msg: Message) -> int:
    """The buffer ``encode`` starts from: the arrays' bytes plus slack (see above); not a hard bound."""
    return _buffer_size(*_array_sizes(msg))


def encode(msg: Message) -> memoryview:
    """Serialise a message into a read-only byte buffer; array bytes are copied once, into it.

    The buffer is sized from the arrays up front (no regrowth, see above). Pass it on as it is: redis-py
    and ``decode`` take it like ``bytes`` (``bytes(buf)`` would copy the message again).
    """
    resize = _resize
    if resize is not None:
        size, structs = _array_sizes(msg)
        if size >= EXACT_SIZE_MIN_BYTES:
            buf = bytearray()
            resize(buf, _buffer_size(size, structs))  # no zero-fill
            _ENCODER.encode_into(msg, buf)  # shrinks the logical size only; grows if the bound was short
            return memoryview(buf).toreadonly()
    return memoryview(_ENCODER.encode(msg))


@overload
def decode(data: bytes | bytearray | memoryview, limits: Limits = ..., *, expect: None = None) -> Message: ...
@overload
def decode(data: bytes | bytearray | memoryview, limits: Limits = ..., *, expect: type[M]) -> M: ...
def decode(
    data: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS, *, expect: type[M] | None = None
) -> Message | M:
    """Decode and validate one message; arrays are views into ``data`` (no copy).

    Raises ``DecodeError`` (with the failing field) for anything that is not a valid message: oversize,
    truncated or corrupted bytes, wrong types, inconsistent lengths, non-finite logprobs, bad ids.
    """
    # msgspec is handed a flat byte view: its array views are then flat bytes too (which the fast
    # structural checks rely on), and slicing them out of a memoryview is faster than out of a bytes.
    try:
        view = data if type(data) is memoryview else memoryview(data)
        if view.itemsize != 1 or view.ndim != 1 or not view.c_contiguous:
            view = view.cast("B")  # C-contiguous only: TypeError otherwise
        size = view.nbytes
    except (TypeError, ValueError) as e:
        raise DecodeError("message", f"not a contiguous byte buffer: {e}") from None
    if size > limits.max_bytes:
        raise DecodeError("message", f"{size} bytes exceeds the cap of {limits.max_bytes}")
    try:
        msg: Message = _DECODER.decode(view)
    except msgspec.ValidationError as e:
        raise DecodeError("message", f"invalid: {e}") from None
    except (msgspec.DecodeError, RecursionError, ValueError, TypeError, OverflowError) as e:
        raise DecodeError("message", f"malformed msgpack: {e}") from None
    if expect is not None and not isinstance(msg, expect):
        raise DecodeError("t", f"expected a {expect.__name__}, got a {type(msg).__name__}")
    try:
        validate_decoded(msg, limits)
    except DecodeError:
        raise
    except (ValueError, TypeError, IndexError, OverflowError) as e:  # defensive: never another type
        raise DecodeError("message", f"invalid: {e}") from None
    return msg
