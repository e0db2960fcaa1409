"""Teacher behind SGLang servers (native ``/generate`` with ``input_ids``).

Request: ``sampling_params: {max_new_tokens: 0}``, ``return_logprob``, ``top_logprobs_num: k`` and
``logprob_start_len: s`` with ``s = ScoreRequest.first_row``, the first row the learner trains on: the
radix cache may then reuse the prompt (``s = 0`` defeats it), and SGLang computes and returns only
positions ``s`` onward. Response (``L - s`` entries each, entry ``j`` = token ``s + j``):
``meta_info.input_token_logprobs`` = ``[[logprob, id, text], ...]`` (entry 0's logprob null) and
``meta_info.input_top_logprobs`` = ``[null, [[logprob, id, text] x k], ...]`` (exactly k, sorted; the
prompt token's own logprob is in the first list). Our row ``r`` is entry ``r - s + 1``; only the rows the
request names are built, with the vectorised ``vllm_parse.topk_rows``. SGLang has no ``--max-logprobs``;
the cap is ``max_k`` from the configuration. Routing, timeouts, URLs and error classes are
``HTTPTeacher``'s.
"""

from __future__ import annotations

from itertools import chain
from operator import attrgetter
from typing import Any, Final, cast

import msgspec
import numpy as np
import numpy.typing as npt

from pipeline.teacher.base import ScoreOutcome, ScoreRequest, ScoreResult, TeacherConfigError, empty_result
from pipeline.teacher.vllm_http import HTTPTeacher, HTTPTeacherConfig
from pipeline.teacher.vllm_parse import SPARSE_BELOW, misaligned, topk_rows


class _Own(msgspec.Struct, array_like=True, gc=False):
    """``[logprob, id, text]`` of a prompt token (``text`` is skipped)."""

    logprob: float | None
    id: int


class _Top(msgspec.Struct, array_like=True, gc=False):
    """``[logprob, id, text]`` of a top-k entry (``text`` is skipped)."""

    logprob: float
    id: int


TopRow = list[_Top] | None


class _Meta(msgspec.Struct):
    input_token_logprobs: list[_Own] | None = None
    input_top_logprobs: list[TopRow] | None = None


class _RawMeta(msgspec.Struct):
    input_token_logprobs: list[_Own] | None = None
    input_top_logprobs: list[msgspec.Raw] | None = None


class _Generate(msgspec.Struct):
    meta_info: _Meta


class _RawGenerate(msgspec.Struct):
    meta_info: _RawMeta


_GENERATE: Final = msgspec.json.Decoder(_Generate)
_RAW_GENERATE: Final = msgspec.json.Decoder(_RawGenerate)
_TOP_ROW: Final = msgspec.json.Decoder(TopRow)
_LOGPROB: Final = attrgetter("logprob")
_ID: Final = attrgetter("id")


def parse_generate(content: bytes, req: ScoreRequest) -> ScoreOutcome:
    """A ``/generate`` body asked with ``logprob_start_len = req.first_row`` -> the rows ``req`` wants."""
    start, rows = req.first_row, req.row_index()
    idx = rows.astype(np.int64) - start + 1  # entry j is token start + j, i.e. row start + j - 1
    if req.rows is None or rows.shape[0] >= SPARSE_BELOW * max(int(req.tokens.shape[0]) - 1 - start, 1):
        meta = _GENERATE.decode(content).meta_info
        own, top = meta.input_token_logprobs, meta.input_top_logprobs
        problem = _length_problem(own, top, req)
        if problem or own is None or top is None:
            return misaligned(problem or "")
        wanted = [top[j] for j in idx.tolist()]
    else:
        raw = _RAW_GENERATE.decode(content).meta_info
        own, slices = raw.input_token_logprobs, raw.input_top_logprobs
        problem = _length_problem(own, slices, req)
        if problem or own is None or slices is None:
            return misaligned(problem or "")
        wanted = [_TOP_ROW.decode(slices[j]) for j in idx.tolist()]
    return _rows(own, wanted, idx, req)


def _length_problem(own: list[_Own] | None, top: list[Any] | None, req: ScoreRequest) -> str | None:
    n, start = int(req.tokens.shape[0]), req.first_row
    if own is None or top is None or len(own) != n - start or len(top) != n - start:
        got = (None if own is None else len(own), None if top is None else len(top))
        return f"input logprob lists of lengths {got} for {n} tokens from {start}"
    return None


def _rows(own: list[_Own], wanted: list[TopRow], idx: npt.NDArray[np.int64], req: ScoreRequest) -> ScoreOutcome:
    """Check the prompt-token list against the tokens sent, then build the wanted rows."""
    start, k = req.first_row, req.k
    if not wanted:
        return empty_result(k)
    echoed = np.fromiter(map(_ID, own), np.int64, len(own))
    off = np.flatnonzero(echoed != req.tokens[start:])
    if off.size:
        p = start + int(off[0])
        return misaligned(f"position {p}: token entry {int(echoed[off[0]])} for prompt token {int(req.tokens[p])}")
    sampled = [own[j].logprob for j in idx.tolist()]
    if None in sampled:
        return misaligned(f"position {start + int(idx[sampled.index(None)])}: null prompt-token logprob")
    if None in wanted:
        return misaligned(f"position {start + int(idx[wanted.index(None)])} has 0 top entries (k={k})")
    top_rows = cast(list[list[_Top]], wanted)  # no None left
    counts = np.fromiter(map(len, top_rows), np.int64, len(top_rows))
    bad = np.flatnonzero((counts < k) | (counts > k + 1))
    if bad.size:
        i = int(bad[0])
        return misaligned(f"position {start + int(idx[i])} has {int(counts[i])} top entries (k={k})")
    total = int(counts.sum())
    ids = np.fromiter(map(_ID, chain.from_iterable(top_rows)), np.int64, total)
    lps = np.fromiter(map(_LOGPROB, chain.from_iterable(top_rows)), np.float32, total)
    out = topk_rows(ids, lps, counts, k)
    if isinstance(out, str):
        return misaligned(out)
    return ScoreResult(out[0], out[1], np.array(sampled, np.float32))


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
            "logprob_start_len": req.first_row,
            "top_logprobs_num": req.k,
        }

    def parse(self, content: bytes, req: ScoreRequest) -> ScoreOutcome:
        return parse_generate(content, req)

    async def _check_model(self, url: str) -> None:
        info = await self._get_json(url + "/get_model_info")
        name = str(info.get("model_path", ""))
        if self._model is None:
            self._model = name
        elif name and name != self._model:
            raise TeacherConfigError(f"{url} serves {name!r}, not {self._model!r}")

    async def _probe_cap(self, url: str) -> int:
        return self._cap
