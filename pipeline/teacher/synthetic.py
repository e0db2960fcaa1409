"""A synthetic teacher: valid, deterministic payloads at negligible cost, with optional fixed latency.

For benchmarks (a no-op teacher, or a fixed 50 ms per call for scaling runs) and fault tests (the
same input always yields the same arrays, so a run under faults can be compared with a clean one).
Only the requested rows are made (``ScoreRequest.rows``). Row r's top-k ids are
``(tokens[r+1] + j) % vocab_size`` for ``j = 0..k-1``, with logprobs ``-0.1 - j``:
distinct within a row (k <= vocab_size), all in ``[0, vocab_size)`` for tokens in it, and the sampled
token always first, so its teacher logprob is ``-0.1``.

Cost: the modulo is applied only to the rows that need it (``tokens[r+1] > vocab_size - k``, about
``k / vocab_size`` of random tokens), not as an integer division over all ``rows x k`` ids; tokens outside
``[0, vocab_size)`` (invalid input) take the plain full modulo, with the same result.
"""

from __future__ import annotations

import asyncio

import numpy as np
import numpy.typing as npt

from pipeline.teacher.base import ScoreOutcome, ScoreRequest, ScoreResult

_INT32_LIMIT = 1 << 31


class SyntheticTeacher:
    CACHE_SIZE = 4096  # (rows, k) logprob and offset templates kept

    def __init__(self, *, vocab_size: int = 32000, max_k: int = 256, latency_s: float = 0.0) -> None:
        self.vocab_size, self._max_k, self.latency_s = vocab_size, max_k, latency_s
        self.calls = 0
        # The logprob arrays (and the id offsets) depend only on (rows, k): made once, shared read-only
        # (encoding copies them).
        self._logprobs: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    @property
    def identity(self) -> str:
        return f"synthetic:v{self.vocab_size}"

    @property
    def max_k(self) -> int:
        return self._max_k

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def score(self, reqs: list[ScoreRequest]) -> list[ScoreOutcome]:
        self.calls += 1
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        out: list[ScoreOutcome] = []
        for req in reqs:
            nxt = req.tokens[1:] if req.rows is None else req.tokens[req.rows + 1]
            lps, sampled, offsets = self._cached(nxt.shape[0], req.k)
            out.append(ScoreResult(self._ids(nxt, req.k, offsets), lps, sampled))
        return out

    def _ids(self, nxt: npt.NDArray[np.int32], k: int, offsets: npt.NDArray[np.int32]) -> npt.NDArray[np.int32]:
        """``(nxt[:, None] + arange(k)) % vocab_size`` as int32 ``[rows, k]``; ``offsets`` is ``arange(k)`` tiled.

        Repeat-then-add over flat arrays (half the time of the broadcast add over short rows), and the
        modulo only on the rows that run past the vocabulary.
        """
        vocab, rows = self.vocab_size, nxt.shape[0]
        if not rows:
            return np.zeros((0, k), np.int32)
        lo, hi = int(nxt.min()), int(nxt.max())
        if lo < 0 or hi >= vocab or k > vocab or vocab + k > _INT32_LIMIT:  # invalid input: plain formula, int64
            wide = nxt[:, None].astype(np.int64) + np.arange(k)
            return (wide % vocab).astype(np.int32)
        flat = np.repeat(nxt.astype(np.int32, copy=False), k)
        flat += offsets  # at most hi + k - 1 < vocab + k: fits int32
        ids = flat.reshape(rows, k)
        if hi + k > vocab:  # some rows run past the end (about k / vocab of random tokens): wrap only those
            wrap = np.flatnonzero(nxt > vocab - k)
            ids[wrap] %= vocab
        return ids

    def _cached(self, rows: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        got = self._logprobs.get((rows, k))
        if got is None:
            lps = np.broadcast_to(-0.1 - np.arange(k, dtype=np.float32), (rows, k)).copy()
            sampled = np.full(rows, -0.1, np.float32)
            offsets = np.tile(np.arange(k, dtype=np.int32), rows)
            lps.flags.writeable = sampled.flags.writeable = offsets.flags.writeable = False
            got = self._logprobs[(rows, k)] = (lps, sampled, offsets)
            if len(self._logprobs) > self.CACHE_SIZE:  # bounded: many distinct lengths evict the oldest
                del self._logprobs[next(iter(self._logprobs))]
        return got
