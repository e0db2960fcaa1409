"""Messages between the ``vllm-engine`` teacher (``vllm_engine``) and its engine process
(``vllm_engine_proc``): msgpack (msgspec) frames over the process's stdin/stdout pipes.

A frame is a 4-byte little-endian length and a msgpack body. Arrays travel as raw little-endian bytes in
msgpack ``bin`` fields (one copy each way, no per-entry object, no JSON, no pickle). Both sides import this
module only (numpy and msgspec): it runs under the main environment and under vLLM's own.
"""

from __future__ import annotations

import struct
from typing import BinaryIO, Final

import msgspec
import numpy as np
import numpy.typing as npt

#: Largest frame accepted (a 256-wide top-k over 128k rows is about 260 MB).
MAX_FRAME: Final = 1 << 31
_LEN: Final = struct.Struct("<I")


class Item(msgspec.Struct, frozen=True):
    """One sequence: ``tokens`` int32 bytes (through the last wanted row + 1), ``rows`` int32 bytes."""

    tokens: bytes
    rows: bytes
    k: int


class Batch(msgspec.Struct, frozen=True, tag="batch"):
    id: int
    items: list[Item]


class ItemResult(msgspec.Struct, frozen=True):
    """``error`` empty on success; else the arrays are empty. ``ids`` int32 / ``lps`` float32 ``[R, k]``,
    ``sampled`` float32 ``[R]``."""

    error: str = ""
    ids: bytes = b""
    lps: bytes = b""
    sampled: bytes = b""


class BatchResult(msgspec.Struct, frozen=True, tag="result"):
    id: int
    results: list[ItemResult]


class Ready(msgspec.Struct, frozen=True, tag="ready"):
    """Sent once when the engine is up."""

    vocab: int
    max_logprobs: int
    max_model_len: int
    vllm_version: str
    model: str


class Fatal(msgspec.Struct, frozen=True, tag="fatal"):
    """Sent when the engine process cannot go on (start-up failed, engine died); it exits after."""

    error: str


ToEngine = Batch
FromEngine = Ready | BatchResult | Fatal

_enc = msgspec.msgpack.Encoder()
to_engine_decoder: Final[msgspec.msgpack.Decoder[Batch]] = msgspec.msgpack.Decoder(Batch)
from_engine_decoder: Final[msgspec.msgpack.Decoder[FromEngine]] = msgspec.msgpack.Decoder(FromEngine)


def frame(msg: Batch | BatchResult | Ready | Fatal) -> bytes:
    """Length-prefixed msgpack body of ``msg``."""
    body = _enc.encode(msg)
    return _LEN.pack(len(body)) + body


def frame_length(header: bytes) -> int:
    """Body length from a 4-byte frame header; ValueError above ``MAX_FRAME``."""
    (n,) = _LEN.unpack(header)
    if n > MAX_FRAME:
        raise ValueError(f"frame of {n} bytes exceeds {MAX_FRAME}")
    return int(n)


def read_frame(f: BinaryIO) -> bytes | None:
    """One frame body from a blocking stream, or None at end of stream."""
    header = f.read(4)
    if len(header) < 4:
        return None
    n = frame_length(header)
    body = f.read(n)
    if len(body) < n:
        return None
    return body


def i32(a: npt.NDArray[np.integer]) -> bytes:
    return np.ascontiguousarray(a, dtype="<i4").tobytes()


def f32(a: npt.NDArray[np.floating]) -> bytes:
    return np.ascontiguousarray(a, dtype="<f4").tobytes()


def as_i32(b: bytes) -> npt.NDArray[np.int32]:
    return np.frombuffer(b, dtype="<i4").astype(np.int32, copy=False)


def as_f32(b: bytes) -> npt.NDArray[np.float32]:
    return np.frombuffer(b, dtype="<f4").astype(np.float32, copy=False)
