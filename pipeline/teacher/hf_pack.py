"""Packing sequences into rows for the transformers teacher: no padding waste.

``plan_rows`` places sequences into rows by first-fit decreasing. A row holds several sequences back to
back, each with its own position ids (``0 .. len - 1``); with no attention mask, transformers reads the
restarts of the position ids as sequence boundaries (``masking_utils.find_packed_sequence_indices``):
sdpa and eager attention get a block-diagonal causal mask, flash-attention runs varlen over the
boundaries. Row width: the longest sequence of the chunk for sdpa/eager (attention cost at most that of
padding, never the square of the whole batch), everything in one row for flash-attention (varlen costs
each sequence its own square). The tail of a row that no sequence fills is one more block of position ids
whose outputs are never read.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

#: Attention implementations whose packed path is varlen (each sequence alone): one row for the whole chunk.
VARLEN_ATTENTION = ("flash_attention_2", "flash_attention_3", "flash_attention_4")


@dataclass(frozen=True, slots=True)
class Packed:
    """``ids``/``positions`` ``[rows, width]`` int64; ``where[i]`` = (row, start column) of sequence ``i``."""

    ids: npt.NDArray[np.int64]
    positions: npt.NDArray[np.int64]
    where: list[tuple[int, int]]


def plan_rows(lengths: list[int], width: int) -> list[list[int]]:
    """Sequence indices per row, first-fit decreasing into rows of ``width`` (a longer sequence gets a row
    of its own)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    rows: list[list[int]] = []
    free: list[int] = []
    for i in order:
        n = lengths[i]
        j = next((r for r, f in enumerate(free) if f >= n), -1)
        if j < 0:
            rows.append([i])
            free.append(width - n)
        else:
            rows[j].append(i)
            free[j] -= n
    return rows


def pack(seqs: list[npt.NDArray[np.int32]], varlen: bool) -> Packed:
    """``seqs`` packed into rows (one row when ``varlen``, else rows as wide as the longest sequence)."""
    lengths = [int(s.shape[0]) for s in seqs]
    width = sum(lengths) if varlen else max(lengths)
    rows = plan_rows(lengths, width)
    width = max(sum(lengths[i] for i in r) for r in rows)
    ids = np.zeros((len(rows), width), np.int64)
    positions = np.zeros((len(rows), width), np.int64)
    where: list[tuple[int, int]] = [(0, 0)] * len(seqs)
    for r, members in enumerate(rows):
        col = 0
        for i in members:
            n = lengths[i]
            ids[r, col : col + n] = seqs[i]
            positions[r, col : col + n] = np.arange(n)
            where[i] = (r, col)
            col += n
        positions[r, col:] = np.arange(width - col)  # the unused tail: its own block, never read
    return Packed(ids, positions, where)


def plan_packed_chunks(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Indices grouped into chunks of at most ``max_tokens`` real tokens, longest first (a sequence above
    the budget forms its own chunk)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    chunks: list[list[int]] = []
    cur: list[int] = []
    total = 0
    for i in order:
        if cur and total + lengths[i] > max_tokens:
            chunks.append(cur)
            cur, total = [], 0
        cur.append(i)
        total += lengths[i]
    if cur:
        chunks.append(cur)
    return chunks
