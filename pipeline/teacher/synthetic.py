"""A synthetic teacher: valid, deterministic payloads at negligible cost, with optional fixed latency.

For benchmarks (a no-op teacher, or a fixed 50 ms per call for scaling runs) and fault tests (the
same input always yields the same arrays, so a run under faults can be compared with a clean one).
Row r's top-k is ``tokens[r+1] + 0..k-1`` (mod vocab) with logprobs ``-0.1 - j``: the sampled token
is always first, so its teacher logprob is ``-0.1``.
"""

from __future__ import annotations

import asyncio

import numpy as np

from pipeline.teacher.base import ScoreOutcome, ScoreRequest, ScoreResult


class SyntheticTeacher:
    CACHE_SIZE = 4096  # (rows, k) logprob templates kept

    def __init__(self, *, vocab_size: int = 32000, max_k: int = 256, latency_s: float = 0.0) -> None:
        self.vocab_size, self._max_k, self.latency_s = vocab_size, max_k, latency_s
        self.calls = 0
        # The logprob arrays depend only on (rows, k): made once, shared read-only (encoding copies them).
        self._logprobs: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}

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
            nxt = req.tokens[1:]
            ids = np.add(nxt[:, None], np.arange(req.k, dtype=np.int32), dtype=np.int32)
            if nxt.size and int(nxt.max()) + req.k > self.vocab_size:  # ids stay below the vocabulary
                ids %= self.vocab_size
            lps, sampled = self._cached(nxt.shape[0], req.k)
            out.append(ScoreResult(ids, lps, sampled))
        return out

    def _cached(self, rows: int, k: int) -> tuple[np.ndarray, np.ndarray]:
        got = self._logprobs.get((rows, k))
        if got is None:
            lps = np.broadcast_to(-0.1 - np.arange(k, dtype=np.float32), (rows, k)).copy()
            sampled = np.full(rows, -0.1, np.float32)
            lps.flags.writeable = sampled.flags.writeable = False
            got = self._logprobs[(rows, k)] = (lps, sampled)
            if len(self._logprobs) > self.CACHE_SIZE:  # bounded: many distinct lengths evict the oldest
                del self._logprobs[next(iter(self._logprobs))]
        return got
