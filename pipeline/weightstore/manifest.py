"""A version's manifest: what a reader needs to rebuild the version's folder, written after every chunk.

JSON through msgspec (no pickle). ``base`` is the version a delta applies to (``None``: a snapshot, every file
stored whole); ``depth``: deltas since the last snapshot; each file lists its chunks with the stored size and the
sha256 of the stored bytes, and the sha256 of the whole rebuilt file.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from pipeline.models.weights import CheckpointError


class ChunkRef(msgspec.Struct, frozen=True):
    name: str  # the chunk's name in the store (its key suffix or object name)
    raw: int  # bytes it decodes to
    stored: int  # bytes stored
    sha256: str  # of the stored bytes


class FileEntry(msgspec.Struct, frozen=True):
    name: str
    size: int
    sha256: str  # of the rebuilt file
    itemsize: int  # element size the chunks were shuffled by (1: bytes)
    mode: Literal["full", "delta"]  # "delta": against the same file of ``base``
    chunks: list[ChunkRef]


class Manifest(msgspec.Struct, frozen=True):
    version: int
    kind: str  # "full" or "lora", as the folder's checkpoint marker says
    base: int | None
    snapshot: int  # the snapshot version this one's chain starts from
    depth: int
    files: list[FileEntry]
    created_at: float

    @property
    def full_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def stored_bytes(self) -> int:
        return sum(c.stored for f in self.files for c in f.chunks)

    def chunk_names(self) -> list[str]:
        return [c.name for f in self.files for c in f.chunks]


def encode(m: Manifest) -> bytes:
    return msgspec.json.encode(m)


def decode(raw: bytes, version: int) -> Manifest:
    """``CheckpointError`` (``corrupt``) for bytes that are not a manifest of ``version``."""
    try:
        m = msgspec.json.decode(raw, type=Manifest)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise CheckpointError(f"manifest of v{version} is malformed: {e}", "corrupt", version) from None
    if m.version != version:
        raise CheckpointError(f"manifest of v{version} says version {m.version}", "corrupt", version)
    return m
