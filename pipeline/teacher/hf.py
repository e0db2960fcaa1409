"""Local transformers teacher: batched forward passes on CPU (or any torch device).

Sequences are sorted by length and chunked so that each forward holds at most ``max_batch_tokens``
padded tokens (rows x longest row); right padding with an attention mask keeps every real position
exact under causal attention. Forwards run under ``torch.inference_mode`` in one dedicated worker
thread (the event loop stays free; torch keeps a single intra-op thread team, and forwards never
compete with each other for the cores).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from pipeline.teacher.base import (
    K_OVER_CAP,
    ScoreFailure,
    ScoreOutcome,
    ScoreRequest,
    ScoreResult,
    empty_result,
)


def plan_chunks(lengths: list[int], max_batch_tokens: int) -> list[list[int]]:
    """Indices grouped into chunks, longest first, each with ``len(chunk) * longest <= budget``
    (a single sequence above the budget forms its own chunk)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    chunks: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        longest = lengths[cur[0]] if cur else lengths[i]
        if cur and (len(cur) + 1) * longest > max_batch_tokens:
            chunks.append(cur)
            cur = []
        cur.append(i)
    if cur:
        chunks.append(cur)
    return chunks


def load_model(path: str, dtype: str = "float32") -> Any:
    """Load a causal LM from a local directory in ``dtype``, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
    model.eval()
    return model


class HFTeacher:
    """A ``TeacherBackend`` running a transformers causal LM in-process. ``max_k`` is the vocabulary size."""

    def __init__(
        self,
        model_path: str | Path | None = None,
        *,
        model: Any = None,
        identity: str | None = None,
        max_batch_tokens: int = 16384,
        num_threads: int | None = None,
        device: str = "cpu",
        dtype: str = "float32",
    ) -> None:
        if model is None and model_path is None:
            raise ValueError("HFTeacher needs model_path or model")
        if max_batch_tokens < 1:
            raise ValueError("max_batch_tokens must be >= 1")
        self._path = model_path
        self._model = model
        self._identity = identity or (f"hf:{Path(model_path).name}" if model_path else "hf:model")
        self.max_batch_tokens = max_batch_tokens
        self._num_threads = num_threads
        self._device = device
        self._dtype = dtype
        self._vocab = 0
        self._max_len: int | None = None
        self._executor: ThreadPoolExecutor | None = None

    @property
    def identity(self) -> str:
        return self._identity

    @property
    def max_k(self) -> int:
        return self._vocab

    def _init_thread(self) -> None:
        import torch

        if self._num_threads:
            torch.set_num_threads(self._num_threads)

    async def start(self) -> None:
        self._init_thread()
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="hf-teacher", initializer=self._init_thread)
        if self._model is None:
            self._model = await asyncio.to_thread(load_model, str(self._path), self._dtype)
        self._model.to(self._device)
        self._model.eval()
        self._vocab = int(self._model.get_output_embeddings().out_features)
        max_pos = getattr(self._model.config, "max_position_embeddings", None)
        self._max_len = int(max_pos) if max_pos else None

    async def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self._model = None

    async def score(self, reqs: list[ScoreRequest]) -> list[ScoreOutcome]:
        if not reqs:
            return []
        if self._executor is None:
            return [ScoreFailure("teacher not started", retryable=False) for _ in reqs]
        return await asyncio.get_running_loop().run_in_executor(self._executor, self.score_sync, reqs)

    def _reject(self, req: ScoreRequest) -> ScoreFailure | None:
        n = int(req.tokens.shape[0])
        if self._model is None:
            return ScoreFailure("teacher not started", retryable=False)
        if req.k < 1 or req.k > self._vocab:
            return ScoreFailure(f"{K_OVER_CAP}: k={req.k} outside [1, {self._vocab}]", retryable=False)
        if n == 0:
            return ScoreFailure("empty sequence", retryable=False)
        if self._max_len is not None and n > self._max_len:
            return ScoreFailure(f"sequence of {n} tokens exceeds the model's {self._max_len}", retryable=False)
        lo, hi = int(req.tokens.min()), int(req.tokens.max())
        if lo < 0 or hi >= self._vocab:
            return ScoreFailure(f"token id outside [0, {self._vocab})", retryable=False)
        return None

    def score_sync(self, reqs: list[ScoreRequest]) -> list[ScoreOutcome]:
        """Score ``reqs`` in the calling thread (blocking)."""
        out: list[ScoreOutcome | None] = [None] * len(reqs)
        todo: list[int] = []
        for i, req in enumerate(reqs):
            bad = self._reject(req)
            if bad is not None:
                out[i] = bad
            elif req.tokens.shape[0] == 1:
                out[i] = empty_result(req.k)
            else:
                todo.append(i)
        lengths = [int(reqs[i].tokens.shape[0]) for i in todo]
        for chunk in plan_chunks(lengths, self.max_batch_tokens):
            idx = [todo[c] for c in chunk]
            for i, res in zip(idx, self._forward([reqs[i] for i in idx]), strict=True):
                out[i] = res
        return [o for o in out if o is not None]

    def _forward(self, reqs: list[ScoreRequest]) -> list[ScoreResult]:
        import torch

        lens = [int(r.tokens.shape[0]) for r in reqs]
        width, kmax = max(lens), max(r.k for r in reqs)
        ids = np.zeros((len(reqs), width), np.int64)
        mask = np.zeros((len(reqs), width), np.int64)
        for j, r in enumerate(reqs):
            ids[j, : lens[j]] = r.tokens
            mask[j, : lens[j]] = 1
        with torch.inference_mode():
            t_ids = torch.from_numpy(ids).to(self._device)
            t_mask = torch.from_numpy(mask).to(self._device)
            logits = self._model(input_ids=t_ids, attention_mask=t_mask).logits[:, :-1]
            # Keep only real rows (row r of sequence j is real when r + 1 < len_j) before the softmax.
            keep = t_mask[:, 1:].bool()
            logp = torch.log_softmax(logits[keep].float(), dim=-1)
            top = torch.topk(logp, kmax, dim=-1, sorted=True)
            sampled = logp.gather(-1, t_ids[:, 1:][keep].unsqueeze(-1)).squeeze(-1)
            top_v: npt.NDArray[np.float32] = top.values.cpu().numpy()
            top_i: npt.NDArray[np.int32] = top.indices.to(torch.int32).cpu().numpy()
            samp: npt.NDArray[np.float32] = sampled.cpu().numpy()
        results: list[ScoreResult] = []
        start = 0
        for r, n in zip(reqs, lens, strict=True):
            end = start + n - 1
            results.append(
                ScoreResult(
                    np.ascontiguousarray(top_i[start:end, : r.k]),
                    np.ascontiguousarray(top_v[start:end, : r.k]),
                    samp[start:end],
                )
            )
            start = end
        return results
