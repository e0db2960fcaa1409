"""Teacher behind SGLang servers (native ``/generate`` with ``input_ids``).

Request: ``sampling_params: {max_new_tokens: 0}``, ``return_logprob``, ``logprob_start_len: 0``,
``top_logprobs_num: k``. Response ``meta_info.input_token_logprobs`` = ``[[logprob, id, text], ...]``
(first logprob null) and ``meta_info.input_top_logprobs`` = ``[null, [[logprob, id, text] x k], ...]``
(exactly k; the prompt token's own logprob is in the first list). SGLang has no ``--max-logprobs``; the
cap is ``max_k`` from the configuration. Routing, timeouts and error classes are ``HTTPTeacher``'s.
"""

from __future__ import annotations

from typing import Any, Final

import msgspec
import numpy as np
import numpy.typing as npt

from pipeline.teacher.base import (
    MISALIGNED,
    ScoreFailure,
    ScoreOutcome,
    ScoreRequest,
    ScoreResult,
    TeacherConfigError,
)
from pipeline.teacher.vllm_http import HTTPTeacher, HTTPTeacherConfig

_Entry = list[float | int | str | None]


class _Meta(msgspec.Struct):
    input_token_logprobs: list[_Entry] | None = None
    input_top_logprobs: list[list[_Entry] | None] | None = None


class _Generate(msgspec.Struct):
    meta_info: _Meta


_GENERATE: Final = msgspec.json.Decoder(_Generate)


def _misaligned(why: str) -> ScoreFailure:
    return ScoreFailure(f"{MISALIGNED}: {why}", retryable=False)


def parse_meta_info(meta: _Meta, tokens: npt.NDArray[np.int32], k: int) -> ScoreOutcome:
    """SGLang input logprobs (entry p = token p, entry 0 null) -> our rows (row p-1), sorted top-k."""
    n = int(tokens.shape[0])
    own, top = meta.input_token_logprobs, meta.input_top_logprobs
    if own is None or top is None or len(own) != n or len(top) != n:
        got = (None if own is None else len(own), None if top is None else len(top))
        return _misaligned(f"input logprob lists of lengths {got} for {n} tokens")
    rows = max(n - 1, 0)
    ids = np.empty((rows, k), np.int32)
    lps = np.empty((rows, k), np.float32)
    sampled = np.empty(rows, np.float32)
    toks = tokens.tolist()
    for p in range(1, n):
        entry, row = own[p], top[p]
        if entry[0] is None or int(entry[1] or 0) != toks[p]:
            return _misaligned(f"position {p}: token entry {entry[:2]} for prompt token {toks[p]}")
        if row is None or len(row) < k:
            return _misaligned(f"position {p} has {0 if row is None else len(row)} top entries (k={k})")
        sampled[p - 1] = float(entry[0])
        best = sorted(row, key=lambda e: -float(e[0] or 0.0))[:k]
        lps[p - 1] = [float(e[0] or 0.0) for e in best]
        ids[p - 1] = [int(e[1] or 0) for e in best]
    return ScoreResult(ids, lps, sampled)


class SGLangTeacher(HTTPTeacher):
    """``TeacherBackend`` over one or more SGLang servers. ``max_k`` = ``config.k`` unless given."""

    kind = "sglang"
    endpoint = "/generate"

    def __init__(self, config: HTTPTeacherConfig, *, max_k: int | None = None, **kw: Any) -> None:
        super().__init__(config, **kw)
        self._cap = max_k or config.k

    def body(self, req: ScoreRequest) -> dict[str, Any]:
        return {
            "input_ids": req.tokens.tolist(),
            "sampling_params": {"max_new_tokens": 0, "temperature": 0.0},
            "return_logprob": True,
            "logprob_start_len": 0,
            "top_logprobs_num": req.k,
        }

    def parse(self, content: bytes, req: ScoreRequest) -> ScoreOutcome:
        return parse_meta_info(_GENERATE.decode(content).meta_info, req.tokens, req.k)

    async def _check_model(self, url: str) -> None:
        info = await self._get_json(url + "/get_model_info")
        name = str(info.get("model_path", ""))
        if self._model is None:
            self._model = name
        elif name and name != self._model:
            raise TeacherConfigError(f"{url} serves {name!r}, not {self._model!r}")

    async def _probe_cap(self, url: str) -> int:
        return self._cap
