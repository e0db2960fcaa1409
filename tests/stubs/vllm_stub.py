"""A stub vLLM (and SGLang) server for tests: minimal HTTP/1.1 over ``asyncio.start_server``.

``/v1/completions`` answers with real prompt logprobs of the HF model it is given (the tiny teacher, or
the 151,936-token real-vocabulary model), in vLLM's layout and compact JSON (as vLLM's server writes it):
entry 0 null, string token-id keys, ``{logprob, rank, decoded_token}`` items, the prompt token first and
the rest shuffled; k items when the prompt token is in the top-k, else k+1 (``always_extra`` sends k+1
everywhere). ``prompt_logprobs`` above ``cap`` gets vLLM's 400 error. Behaviour per request is chosen by
the prompt's first token: ``errors`` (500, a count or -1 for always), ``hangs`` (never answers),
``short`` (one entry missing). ``/generate`` answers in SGLang's layout from the request's
``logprob_start_len`` on (each value is recorded in ``logprob_start_lens_seen``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from tests.stubs.http import read_request

_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 500: "Internal Server Error"}


def teacher_logprobs(model: Any, tokens: list[int]) -> npt.NDArray[np.float32]:
    """Full-vocabulary log-softmax rows ``[L-1, V]`` of one sequence (independent single forward)."""
    with torch.inference_mode():
        ids = torch.tensor([tokens], dtype=torch.long)
        logits = model(input_ids=ids).logits[0, :-1].float()
        out: npt.NDArray[np.float32] = torch.log_softmax(logits, dim=-1).numpy()
    return out


class VLLMStub:
    def __init__(
        self,
        model: Any,
        *,
        model_name: str = "tiny-teacher",
        cap: int = 20,
        cap_in_message: bool = True,
        always_extra: bool = False,
        seed: int = 0,
    ) -> None:
        self.model = model
        self.model_name = model_name
        self.cap = cap
        self.cap_in_message = cap_in_message
        self.always_extra = always_extra
        self.errors: dict[int, int] = {}
        self.hangs: set[int] = set()
        self.short: set[int] = set()
        self.requests = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.prompt_logprobs_seen: list[int] = []
        self.logprob_start_lens_seen: list[int] = []
        self._rng = random.Random(seed)
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._closing = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self.url = ""

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    async def close(self) -> None:
        """Stop listening, wake hung requests, close every connection and wait for the handlers."""
        if self._server is not None:
            self._server.close()
        self._closing.set()
        for w in list(self._writers):
            w.close()
        await self._idle.wait()
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        self._idle.clear()
        try:
            while True:
                request = await read_request(reader)
                if request is None:
                    break
                method, path, body = request
                status, payload = await self._route(method, path, body)
                data = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()
                head = f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: application/json\r\n"
                writer.write(f"{head}Content-Length: {len(data)}\r\n\r\n".encode() + data)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
            if not self._writers:
                self._idle.set()

    async def _route(self, method: str, path: str, body: bytes) -> tuple[int, Any]:
        if method == "GET" and path == "/v1/models":
            return 200, {"object": "list", "data": [{"id": self.model_name, "object": "model"}]}
        if method == "GET" and path == "/get_model_info":
            return 200, {"model_path": self.model_name}
        if method == "POST" and path in ("/v1/completions", "/generate"):
            self.requests += 1
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                await asyncio.sleep(0.001)  # let concurrent requests overlap
                req = json.loads(body)
                if path == "/generate":
                    return await self._generate(req)
                return await self._completions(req)
            finally:
                self.in_flight -= 1
        return 404, {"error": {"message": f"no route {method} {path}", "code": 404}}

    async def _misbehave(self, first: int) -> tuple[int, Any] | None:
        if first in self.hangs:
            await self._closing.wait()  # never answers while the server runs
            raise ConnectionResetError("stub closing")
        left = self.errors.get(first, 0)
        if left:
            self.errors[first] = left - 1 if left > 0 else left
            return 500, {"error": {"message": "EngineCore died", "type": "InternalServerError", "code": 500}}
        return None

    async def _completions(self, req: dict[str, Any]) -> tuple[int, Any]:
        if req.get("model") != self.model_name:
            return 404, {"error": {"message": f"The model `{req.get('model')}` does not exist.", "code": 404}}
        k = int(req["prompt_logprobs"])
        self.prompt_logprobs_seen.append(k)
        if k > self.cap:
            cap = f": {self.cap} (parameter=prompt_logprobs, value={k})" if self.cap_in_message else ""
            msg = f"Requested prompt logprobs of {k}, which is greater than max allowed{cap}"
            return 400, {"error": {"message": msg, "type": "BadRequestError", "param": "prompt_logprobs", "code": 400}}
        tokens = [int(t) for t in req["prompt"]]
        bad = await self._misbehave(tokens[0])
        if bad is not None:
            return bad
        entries: list[dict[str, Any] | None] = [None]
        if len(tokens) > 1:
            lp = teacher_logprobs(self.model, tokens)
            top = top_order(lp, k + 1)
            for p in range(1, len(tokens)):
                entries.append(self._entry(lp[p - 1], top[p - 1], tokens[p], k))
        if tokens[0] in self.short:
            entries.pop()
        choice = {"index": 0, "text": "x", "logprobs": None, "finish_reason": "length", "prompt_logprobs": entries}
        return 200, {"id": "cmpl-stub", "object": "text_completion", "model": self.model_name, "choices": [choice]}

    def _entry(self, row: npt.NDArray[np.float32], order: npt.NDArray[np.int64], token: int, k: int) -> dict[str, Any]:
        """vLLM's item dict: the prompt token first, then the rest of the top k (+1 with ``always_extra``),
        shuffled; ranks by place in ``order``, the prompt token's as 1 + the number of larger logprobs."""
        top = [int(i) for i in order[:k]]
        extra = [int(order[k])] if self.always_extra and token in top and k < order.shape[0] else []
        rest = [i for i in top + extra if i != token]
        self._rng.shuffle(rest)
        ranks = {i: r + 1 for r, i in enumerate(order.tolist())}
        ranks[token] = int((row > row[token]).sum()) + 1

        def item(i: int) -> dict[str, Any]:
            return {"logprob": float(row[i]), "rank": ranks.get(i, 0), "decoded_token": f"<{i}>"}

        return {str(i): item(i) for i in [token, *rest]}

    async def _generate(self, req: dict[str, Any]) -> tuple[int, Any]:
        """SGLang's answer from ``logprob_start_len`` s on: entry j is token s + j, entry 0 without logprobs."""
        tokens = [int(t) for t in req["input_ids"]]
        k = int(req["top_logprobs_num"])
        start = int(req.get("logprob_start_len", 0))
        self.logprob_start_lens_seen.append(start)
        bad = await self._misbehave(tokens[0])
        if bad is not None:
            return bad
        if not 0 <= start < len(tokens):
            return 400, {"error": {"message": f"logprob_start_len {start} outside [0, {len(tokens)})", "code": 400}}
        own: list[list[Any]] = [[None, tokens[start], None]]
        top: list[list[list[Any]] | None] = [None]
        if len(tokens) > 1:
            lp = teacher_logprobs(self.model, tokens)
            best = top_order(lp, k)
            for p in range(start + 1, len(tokens)):
                row = lp[p - 1]
                own.append([float(row[tokens[p]]), tokens[p], None])
                top.append([[float(row[i]), int(i), None] for i in best[p - 1]])
        if tokens[0] in self.short:
            top.pop()
        meta = {"input_token_logprobs": own, "input_top_logprobs": top, "prompt_tokens": len(tokens)}
        return 200, {"text": "", "meta_info": meta}


def top_order(lp: npt.NDArray[np.float32], k: int) -> npt.NDArray[np.int64]:
    """Ids of the ``k`` largest logprobs of each row ``[rows, V]``, largest first (ties by id), without a
    full sort of the vocabulary."""
    rows, vocab = lp.shape
    k = min(k, vocab)
    part = np.argpartition(-lp, k - 1, axis=1)[:, :k] if k < vocab else np.tile(np.arange(vocab), (rows, 1))
    vals = np.take_along_axis(lp, part, axis=1)
    order = np.lexsort((part, -vals), axis=1)
    out: npt.NDArray[np.int64] = np.take_along_axis(part, order, axis=1).astype(np.int64)
    return out


@contextlib.asynccontextmanager
async def running(stub: VLLMStub) -> Any:
    await stub.start()
    try:
        yield stub
    finally:
        await stub.close()


def assert_topk_matches(
    got_ids: npt.NDArray[np.integer[Any]],
    got_lps: npt.NDArray[np.floating[Any]],
    want_lps: npt.NDArray[np.floating[Any]],
    full: npt.NDArray[np.float32],
    tol: float,
) -> None:
    """Top-k equal up to near-ties: the values match ``want_lps``, and every reported id is distinct
    in its row and carries the logprob the full distribution ``full`` ``[rows, V]`` gives it."""
    assert got_ids.shape == got_lps.shape == want_lps.shape
    np.testing.assert_allclose(got_lps, want_lps, atol=tol, rtol=0)
    rows = np.arange(got_ids.shape[0])[:, None]
    np.testing.assert_allclose(full[rows, got_ids], got_lps, atol=tol, rtol=0)
    if got_ids.size:
        srt = np.sort(got_ids, axis=1)
        assert (srt[:, 1:] != srt[:, :-1]).all(), "duplicate ids in a top-k row"
