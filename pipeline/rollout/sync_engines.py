"""The HTTP side of weight sync: how each inference server loads a published version and names its own.

- ``VLLMEngine``: stock vLLM >= 0.32 started with ``VLLM_SERVER_DEV_MODE=1``: ``POST /pause?mode=wait``
  (in-flight requests finish, new ones wait), ``POST /collective_rpc`` ``reload_weights`` from the
  version's folder, ``POST /update_weight_version``, ``POST /resume``; ``GET /weight_info`` names the version.
- ``VLLMLoraEngine``: a vLLM server started with ``--enable-lora`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``:
  each version is loaded as its own adapter ``NAME-vN`` (``/v1/load_lora_adapter``), requests go to the
  newest, adapters older than the previous one are unloaded (``/v1/unload_lora_adapter``).
- ``SGLangEngine``: ``POST /update_weights_from_disk`` with ``weight_version`` (SGLang drains in-flight
  requests itself), ``GET /get_weight_version``.

The path sent is the folder as this process sees it: a server on another machine must see the weights
folder at the same path (a shared volume mounted at the same place).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import httpx

from pipeline.errors import BackendError
from pipeline.models.weights import CONFIG, Checkpoint, model_folder_shapes, read_config
from pipeline.rollout.weight_sync import UNSYNCED, parse_version
from pipeline.urls import server_root


class EngineError(BackendError, RuntimeError):
    """The server did not do what was asked (unreachable, an error status, an unexpected answer)."""


class _HTTP:
    def __init__(self, url: str, *, timeout_s: float = 600.0, api_key: str | None = None,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.url = server_root(url)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(base_url=self.url, timeout=httpx.Timeout(timeout_s, connect=5.0),
                                         headers=headers, transport=transport)

    async def aclose(self) -> None:
        await self._client.aclose()

    async def call(self, method: str, path: str, body: dict[str, Any] | None = None,
                   timeout_s: float | None = None) -> Any:
        timeout: Any = httpx.USE_CLIENT_DEFAULT if timeout_s is None else timeout_s
        try:
            resp = await self._client.request(method, path, json=body, timeout=timeout)
        except httpx.HTTPError as e:
            raise EngineError(f"{method} {self.url}{path}: {type(e).__name__}: {e}") from e
        if resp.status_code != 200:
            raise EngineError(f"{method} {self.url}{path}: HTTP {resp.status_code}: {resp.text[:300]}")
        try:
            return resp.json() if resp.content else None
        except json.JSONDecodeError:
            return resp.text  # vLLM's LoRA endpoints answer 200 with a sentence, not JSON

    async def served_root(self) -> str | None:
        """The served model's path as the server was given it (``root`` in vLLM's ``/v1/models``)."""
        data = await self.call("GET", "/v1/models", timeout_s=10.0)
        models = data.get("data") if isinstance(data, dict) else None
        if not models:
            return None
        root = models[0].get("root")
        return str(root) if root else None


def reference_of(root: str | None) -> tuple[dict[str, Any], dict[str, tuple[int, ...]] | None] | None:
    """The served model's config and tensor shapes when its folder is readable here, else ``None``."""
    if not root or not (Path(root) / CONFIG).is_file():
        return None
    return read_config(Path(root) / CONFIG), model_folder_shapes(Path(root))


class VLLMEngine(_HTTP):
    lora = False

    async def version(self, *, anything_published: bool) -> int | None:
        data = await self.call("GET", "/weight_info", timeout_s=10.0)
        if not isinstance(data, dict) or "weight_version" not in data:
            raise EngineError(f"GET {self.url}/weight_info answered {data!r} (VLLM_SERVER_DEV_MODE=1 unset?)")
        return parse_version(data["weight_version"], anything_published=anything_published)

    async def sync(self, ckpt: Checkpoint) -> None:
        """Pause (in-flight requests finish), reload, label, resume. On a failure after the pause the server
        is labelled ``unsynced`` and left paused: it serves nothing until a later sync succeeds."""
        await self.call("POST", "/pause?mode=wait")
        try:
            await self.call("POST", "/collective_rpc",
                            {"method": "reload_weights", "kwargs": {"weights_path": str(ckpt.path)}})
            got = await self.call("POST", "/update_weight_version", {"new_version": str(ckpt.version)})
            if not (isinstance(got, dict) and got.get("success") is True):
                raise EngineError(f"POST {self.url}/update_weight_version answered {got!r}")
        except EngineError:
            with contextlib.suppress(EngineError):  # unreachable: it comes back at "default", synced before use
                await self.call("POST", "/update_weight_version", {"new_version": UNSYNCED}, timeout_s=10.0)
            raise
        await self.call("POST", "/resume")

    def model_for(self, version: int | None) -> str | None:
        return None


class VLLMLoraEngine(_HTTP):
    """Adapters named ``{prefix}-v{version}``; the served base model's own name stays untouched."""

    lora = True

    def __init__(self, url: str, prefix: str, *, keep: int = 2, **kw: Any) -> None:
        super().__init__(url, **kw)
        self.prefix, self.keep = prefix, keep

    def model_for(self, version: int | None) -> str | None:
        if version is None:
            return None
        return self.prefix if version == 0 else f"{self.prefix}-v{version}"  # 0: the base model, nothing published

    def _loaded(self, data: Any) -> list[int]:
        out = []
        for m in (data or {}).get("data", []):
            name = str(m.get("id", ""))
            tail = name.removeprefix(f"{self.prefix}-v")
            if name != tail and tail.isdigit():
                out.append(int(tail))
        return sorted(out)

    async def version(self, *, anything_published: bool) -> int | None:
        loaded = self._loaded(await self.call("GET", "/v1/models", timeout_s=10.0))
        if loaded:
            return loaded[-1]
        return None if anything_published else 0

    async def served_root(self) -> str | None:
        return None  # adapters are checked by vLLM itself (rank, target modules)

    async def sync(self, ckpt: Checkpoint) -> None:
        name = self.model_for(ckpt.version)
        await self.call("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(ckpt.path)})
        loaded = self._loaded(await self.call("GET", "/v1/models", timeout_s=10.0))
        if ckpt.version not in loaded:
            raise EngineError(f"{self.url}: adapter {name} loaded but not listed by /v1/models")
        for v in loaded[: -self.keep]:  # requests may still run on the previous one: it stays
            with contextlib.suppress(EngineError):  # unloaded next time
                await self.call("POST", "/v1/unload_lora_adapter", {"lora_name": self.model_for(v)})


class SGLangEngine(_HTTP):
    lora = False

    async def version(self, *, anything_published: bool) -> int | None:
        data = await self.call("GET", "/get_weight_version", timeout_s=10.0)
        if not isinstance(data, dict) or "weight_version" not in data:
            raise EngineError(f"GET {self.url}/get_weight_version answered {data!r}")
        return parse_version(data["weight_version"], anything_published=anything_published)

    async def served_root(self) -> str | None:
        data = await self.call("GET", "/get_model_info", timeout_s=10.0)
        path = data.get("model_path") if isinstance(data, dict) else None
        return str(path) if path else None

    async def sync(self, ckpt: Checkpoint) -> None:
        body = {"model_path": str(ckpt.path), "weight_version": str(ckpt.version), "flush_cache": True,
                "abort_all_requests": False}
        got = await self.call("POST", "/update_weights_from_disk", body)
        if not (isinstance(got, dict) and got.get("success") is True):
            raise EngineError(f"POST {self.url}/update_weights_from_disk answered {got!r}")

    def model_for(self, version: int | None) -> str | None:
        return None


Engine = VLLMEngine | VLLMLoraEngine | SGLangEngine
ENGINES = ("vllm", "vllm-lora", "sglang")


def make_engine(kind: str, url: str, *, served_name: str, **kw: Any) -> Engine:
    if kind == "vllm":
        return VLLMEngine(url, **kw)
    if kind == "vllm-lora":
        return VLLMLoraEngine(url, served_name, **kw)
    if kind == "sglang":
        return SGLangEngine(url, **kw)
    raise ValueError(f"unknown weight sync engine {kind!r} (one of {', '.join(ENGINES)})")
