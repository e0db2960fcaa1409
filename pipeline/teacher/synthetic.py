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
    def __init__(self, *, vocab_size: int = 32000, max_k: int = 256, latency_s: float = 0.0) -> None:
        self.vocab_size, self._max_k, self.latency_s = vocab_size, max_k, latency_s
        self.calls = 0

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
            nxt = req.tokens[1:].astype(np.int64)
            ids = ((nxt[:, None] + np.arange(req.k)) % self.vocab_size).astype(np.int32)
            lps = np.broadcast_to(-0.1 - np.arange(req.k, dtype=np.float32), ids.shape).copy()
            out.append(ScoreResult(ids, lps, np.full(nxt.shape[0], -0.1, np.float32)))
        return out
