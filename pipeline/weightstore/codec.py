"""The byte codec of a weights version: chunks of a file, each stored whole or as the XOR against the same
chunk of the previous version, byte-plane shuffled, zstandard-compressed and checksummed. Pure: no I/O.

Why XOR + shuffle + zstd: an optimizer step moves most parameters by less than a bfloat16 ulp, so in bf16 most
elements are bit-identical to the previous version's and their XOR is zero; the elements that did change differ
mostly in their low mantissa bits. Grouping byte *k* of every element together (``shuffle``) puts the sign and
exponent bytes, nearly all zero after the XOR, in long runs zstd compresses to almost nothing. In float32 the
low 16 mantissa bits of nearly every element change at every step, so a float32 delta stays about half of the
full size whatever the coding (measured figures: bench/RESULTS.md, "Weights through Redis").
"""

from __future__ import annotations

import hashlib

import numpy as np

#: Raw bytes per chunk: one Redis value or object each (a multiple of every element size).
CHUNK_BYTES = 4 * 2**20
#: zstandard level: 3 (the library's default) is within a few percent of 9 on weights at a fraction of the time.
ZSTD_LEVEL = 3


class CodecError(ValueError):
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


def encode_chunk(raw: bytes, base: bytes | None, itemsize: int, level: int = ZSTD_LEVEL) -> bytes:
    """``raw`` stored: XOR ``base`` (the previous version's same chunk, same size) when given, shuffled by
    ``itemsize``, zstd-compressed."""
    import zstandard

    data = xor(raw, base) if base is not None else raw
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
    return xor(data, base) if base is not None else data


def chunk_spans(size: int, chunk: int = CHUNK_BYTES) -> list[tuple[int, int]]:
    """(offset, length) of each chunk of a ``size``-byte file (one empty chunk for an empty file)."""
    if size == 0:
        return [(0, 0)]
    return [(o, min(chunk, size - o)) for o in range(0, size, chunk)]
