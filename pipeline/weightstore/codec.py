"""The byte codec of a weights version: chunks of a file, each stored whole or as its difference from the same
chunk of the previous version, byte-plane shuffled, zstandard-compressed and checksummed. Pure: no I/O.

How a delta is taken: each element's bit pattern minus the previous version's, as an integer of the element's
width (wrapping), zigzag-mapped so that a small change either way is a small unsigned number (one bfloat16 ulp up
or down is 2 or 1). An optimizer step moves most parameters by a few ulps at most in bfloat16 (and most by none),
so the difference's high byte is nearly always zero; grouping byte *k* of every element together (``shuffle``)
puts those zeros in long runs zstd compresses to almost nothing. On the real pair's student after an AdamW step at
lr 2e-4 this stores 12% less than the XOR of the same bytes, and a quarter of what the changed elements' indices
and values (a sparse difference) take. In float32 the low mantissa bits of nearly every element change at every
step, so a float32 delta stays near half of the full size whatever the coding (figures: bench/RESULTS.md,
"Weights through Redis"). Bytes that are not whole elements (``itemsize`` 1) are XORed.
"""

from __future__ import annotations

import hashlib

import numpy as np

from pipeline.errors import WireFormatError

#: Raw bytes per chunk: one Redis value or object each (a multiple of every element size).
CHUNK_BYTES = 4 * 2**20
#: zstandard level: 3 (the library's default) is within a few percent of 9 on weights at a fraction of the time.
ZSTD_LEVEL = 3


class CodecError(WireFormatError, ValueError):
    """Bytes that do not decode: a checksum that does not match, or a payload of another size."""


def sha256(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def shuffle(data: bytes, itemsize: int) -> bytes:
    """Byte planes: byte 0 of every element, then byte 1, ... (``data`` as is when it is not whole elements)."""
    if itemsize <= 1 or len(data) % itemsize:
        return data
    return np.frombuffer(data, np.uint8).reshape(-1, itemsize).T.tobytes()


def unshuffle(data: bytes, itemsize: int) -> bytes:
    if itemsize <= 1 or len(data) % itemsize:
        return data
    return np.frombuffer(data, np.uint8).reshape(itemsize, -1).T.tobytes()


def xor(a: bytes, b: bytes) -> bytes:
    if len(a) != len(b):
        raise CodecError(f"XOR of {len(a)} and {len(b)} bytes")
    return np.bitwise_xor(np.frombuffer(a, np.uint8), np.frombuffer(b, np.uint8)).tobytes()


_UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def _elementwise(data: bytes, itemsize: int) -> bool:
    return itemsize in _UINT and len(data) % itemsize == 0


def difference(cur: bytes, base: bytes, itemsize: int) -> bytes:
    """Zigzag of ``cur - base`` per element of ``itemsize`` bytes (their bit patterns as integers); XOR for bytes
    that are not whole elements."""
    if len(cur) != len(base):
        raise CodecError(f"difference of {len(cur)} and {len(base)} bytes")
    if not _elementwise(cur, itemsize):
        return xor(cur, base)
    u = _UINT[itemsize]
    bits = 8 * itemsize
    d = (np.frombuffer(cur, u) - np.frombuffer(base, u)).astype(u)  # wraps modulo 2**bits
    return bytes(((d << u(1)) ^ (d.view(f"i{itemsize}") >> (bits - 1)).view(u)).tobytes())


def apply_difference(diff: bytes, base: bytes, itemsize: int) -> bytes:
    """The inverse of ``difference``: ``cur`` from the zigzagged difference and ``base``."""
    if len(diff) != len(base):
        raise CodecError(f"difference of {len(diff)} bytes against {len(base)}")
    if not _elementwise(diff, itemsize):
        return xor(diff, base)
    u = _UINT[itemsize]
    z = np.frombuffer(diff, u)
    d = (z >> u(1)) ^ (np.zeros_like(z) - (z & u(1)))
    return bytes((np.frombuffer(base, u) + d).astype(u).tobytes())


def encode_chunk(raw: bytes, base: bytes | None, itemsize: int, level: int = ZSTD_LEVEL) -> bytes:
    """``raw`` stored: its ``difference`` from ``base`` (the previous version's same chunk, same size) when given,
    shuffled by ``itemsize``, zstd-compressed."""
    import zstandard

    data = difference(raw, base, itemsize) if base is not None else raw
    return zstandard.ZstdCompressor(level=level).compress(shuffle(data, itemsize))


def decode_chunk(stored: bytes, base: bytes | None, itemsize: int, raw_size: int) -> bytes:
    """The inverse of ``encode_chunk``; ``CodecError`` for bytes that do not decode to ``raw_size`` bytes."""
    import zstandard

    try:
        data = zstandard.ZstdDecompressor().decompress(stored, max_output_size=raw_size)
    except zstandard.ZstdError as e:
        raise CodecError(f"zstd: {e}") from None
    if len(data) != raw_size:
        raise CodecError(f"decoded {len(data)} bytes, {raw_size} expected")
    data = unshuffle(data, itemsize)
    return apply_difference(data, base, itemsize) if base is not None else data


def chunk_spans(size: int, chunk: int = CHUNK_BYTES) -> list[tuple[int, int]]:
    """(offset, length) of each chunk of a ``size``-byte file (one empty chunk for an empty file)."""
    if size == 0:
        return [(0, 0)]
    return [(o, min(chunk, size - o)) for o in range(0, size, chunk)]
