"""A vLLM-compatible teacher that can be switched off: ``up``, ``refuse`` (the port is closed: connection
refused), ``hang`` (connections are accepted, requests read, and never answered) and ``sentinel`` (answers
as ``up``, with vLLM's -9999.0, its logprob of -inf, as the value of each row's last top-k entry).

Answers are the synthetic teacher's (row r's top-k is ``tokens[r+1] + j`` with logprob ``-0.1 - j``) in
vLLM's ``prompt_logprobs`` layout: entry 0 null, string token-id keys, the prompt token first; ids modulo
``vocab``. Runs in
the test's event loop; the worker under test is a separate process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from typing import Any

from tests.stubs.http import read_request

MODEL = "stub-teacher"
VOCAB = 32000
#: What vLLM's server sends for a logprob of -inf.
SENTINEL = -9999.0


class SwitchableTeacher:
    def __init__(self, *, cap: int = 20, vocab: int = VOCAB) -> None:
        self.cap, self.vocab = cap, vocab
        self.mode = "up"
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._mode_changed = asyncio.Event()
        self.ok_times: list[float] = []  # time.time() of each 200 /v1/completions answer
        self.hang_durations: list[float] = []  # accepted -> the client gave up, per hung request
        self.attempts: Counter[tuple[int, ...]] = Counter()  # completions requests per prompt, up or hang
        self.hung: Counter[tuple[int, ...]] = Counter()  # of which left unanswered
        self.sentinel_answers = 0  # 200 answers carrying SENTINEL

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.url

    async def set_mode(self, mode: str) -> None:
        """Switch to ``up``, ``refuse``, ``hang`` or ``sentinel``; refusing closes the port and every open
        connection."""
        assert mode in ("up", "refuse", "hang", "sentinel")
        if mode == "refuse" and self._server is not None:
            self._server.close()
            for w in list(self._writers):
                w.close()
            await self._server.wait_closed()
            self._server = None
        elif mode != "refuse" and self._server is None:
            await self.start()
        self.mode = mode
        self._mode_changed.set()
        self._mode_changed = asyncio.Event()

    async def close(self) -> None:
        await self.set_mode("refuse")

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            while True:
                request = await read_request(reader)
                if request is None:
                    break
                method, path, body = request
                prompt = tuple(json.loads(body).get("prompt") or ()) if path == "/v1/completions" else ()
                self.attempts[prompt] += 1
                if self.mode == "hang":
                    self.hung[prompt] += 1
                    await self._hang(reader)
                    break
                status, payload = self._route(method, path, body)
                data = json.dumps(payload).encode()
                writer.write(f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\n"
                             f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def _hang(self, reader: asyncio.StreamReader) -> None:
        """Never answer; return when the client closes the connection (its timeout fired)."""
        t0 = time.monotonic()
        with contextlib.suppress(ConnectionError):
            await reader.read()  # EOF when the client gives up
        self.hang_durations.append(time.monotonic() - t0)

    def _route(self, method: str, path: str, body: bytes) -> tuple[int, Any]:
        if method == "GET" and path == "/v1/models":
            return 200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]}
        if method == "POST" and path == "/v1/completions":
            return self._completions(json.loads(body))
        return 404, {"error": {"message": f"no route {method} {path}"}}

    def _completions(self, req: dict[str, Any]) -> tuple[int, Any]:
        k = int(req["prompt_logprobs"])
        if k > self.cap:
            msg = f"Requested prompt logprobs of {k}, which is greater than max allowed: {self.cap}"
            return 400, {"error": {"message": msg, "type": "BadRequestError", "code": 400}}
        tokens = [int(t) for t in req["prompt"]]
        sentinel = self.mode == "sentinel"
        entries: list[dict[str, Any] | None] = [None]
        for p in range(1, len(tokens)):
            entries.append({str((tokens[p] + j) % self.vocab): {
                "logprob": SENTINEL if sentinel and j == k - 1 else -0.1 - j, "rank": j + 1, "decoded_token": "x"}
                for j in range(k)})
        self.ok_times.append(time.time())
        self.sentinel_answers += sentinel
        choice = {"index": 0, "text": "x", "finish_reason": "length", "prompt_logprobs": entries}
        return 200, {"id": "cmpl-stub", "object": "text_completion", "model": MODEL, "choices": [choice]}
