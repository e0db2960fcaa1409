"""Student backend on a vLLM OpenAI-compatible server (``/v1/completions`` with token-id prompts).

The prompt goes as a list of token ids (no server-side tokenisation); the response's completion ids
come from ``choices[i].token_ids`` (``return_token_ids``, vLLM >= 0.10.2) or, on older servers, from
``logprobs.tokens`` rendered as ``"token_id:N"`` (``return_tokens_as_token_ids``); when both are present
they must agree. Logprobs are ``logprobs.token_logprobs``: the raw model logprobs under vLLM V1's
default ``--logprobs-mode raw_logprobs`` (temperature-free, like ``HFStudent``); a server started with
``processed_logprobs`` (or vLLM V0) reports the temperature/top-p processed distribution instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import httpx

from pipeline.rollout.students.base import Completion, GenParams, StudentBackendError, check_request
from pipeline.urls import server_root

TOKEN_ID_PREFIX = "token_id:"


def default_timeout(request_s: float = 300.0) -> httpx.Timeout:
    """Short connect/pool timeouts, a long read timeout (a completion may take minutes)."""
    return httpx.Timeout(request_s, connect=10.0, pool=30.0)


def _ids_from_tokens(tokens: Sequence[str]) -> list[int]:
    ids = []
    for t in tokens:
        if not t.startswith(TOKEN_ID_PREFIX):
            raise StudentBackendError(f"logprobs token {t!r} is not 'token_id:N' (return_tokens_as_token_ids off?)")
        ids.append(int(t[len(TOKEN_ID_PREFIX) :]))
    return ids


def parse_choice(choice: dict[str, Any]) -> Completion:
    """One ``/v1/completions`` choice as a ``Completion``; raises ``StudentBackendError`` if untrackable."""
    lp = choice.get("logprobs") or {}
    logprobs = lp.get("token_logprobs")
    if logprobs is None:
        raise StudentBackendError("choice has no logprobs.token_logprobs (request logprobs >= 0)")
    ids = choice.get("token_ids")
    tokens = lp.get("tokens")
    from_tokens = _ids_from_tokens(tokens) if tokens and tokens[0].startswith(TOKEN_ID_PREFIX) else None
    if ids is None:
        if from_tokens is None:
            raise StudentBackendError("choice has neither token_ids nor 'token_id:N' logprob tokens")
        ids = from_tokens
    elif from_tokens is not None and from_tokens != list(ids):
        raise StudentBackendError("choice token_ids disagree with its logprob tokens")
    if any(x is None for x in logprobs):
        raise StudentBackendError("choice has a null logprob for a sampled token")
    finish = choice.get("finish_reason") or "length"
    reason = choice.get("stop_reason")
    reason = reason if isinstance(reason, int | str) and not isinstance(reason, bool) else None
    return Completion([int(i) for i in ids], [float(x) for x in logprobs], str(finish), reason)


class VLLMStudent:
    """Async client of one vLLM server. ``tokenizer`` must be the served model's (for chat templates).

    ``base_url``: ``http://host:port`` or the OpenAI-style ``http://host:port/v1`` (``server_root``);
    ``ValueError`` for anything else.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        tokenizer: Any,
        *,
        timeout: httpx.Timeout | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        api_key: str | None = None,
        extra_body: dict[str, Any] | None = None,
    ) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.model = model
        self.extra_body = dict(extra_body or {})
        self._tokenizer = tokenizer
        self._client = httpx.AsyncClient(
            base_url=server_root(base_url), timeout=timeout or default_timeout(), transport=transport, headers=headers
        )

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    async def aclose(self) -> None:
        await self._client.aclose()

    async def models(self) -> list[str]:
        """Model names the server serves (a cheap startup check)."""
        data = await self._request("GET", "/v1/models")
        return [str(m["id"]) for m in data.get("data", [])]

    def request_body(self, prompt_ids: list[int], params: GenParams, n: int) -> dict[str, Any]:
        """The ``/v1/completions`` body: ``params`` as vLLM's sampling fields, then ``extra_body``."""
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": list(prompt_ids),
            "n": n,
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "logprobs": 1,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
        }
        if params.stop_token_ids:
            body["stop_token_ids"] = [int(t) for t in params.stop_token_ids]
        if params.seed is not None:
            body["seed"] = params.seed
        if any(params.stop):  # vLLM applies them; the completion's token ids are recorded as returned
            body.update(stop=[s for s in params.stop if s], skip_special_tokens=params.skip_special_tokens,
                        include_stop_str_in_output=params.include_stop_str_in_output)
        body.update(self.extra_body)
        return body

    async def generate(self, prompt_ids: list[int], params: GenParams, n: int = 1) -> list[Completion]:
        check_request(prompt_ids, params, n)
        body = self.request_body(prompt_ids, params, n)
        data = await self._request("POST", "/v1/completions", json=body)
        choices = sorted(data.get("choices") or [], key=lambda c: int(c.get("index", 0)))
        if len(choices) != n:
            raise StudentBackendError(f"asked for {n} completions, server returned {len(choices)}")
        for c in choices:
            echoed = c.get("prompt_token_ids")
            if echoed is not None and list(echoed) != list(prompt_ids):
                raise StudentBackendError("server's prompt_token_ids differ from the ids sent")
        return [parse_choice(c) for c in choices]

    async def _request(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        try:
            resp = await self._client.request(method, path, **kwargs)
        except httpx.HTTPError as e:
            raise StudentBackendError(f"{method} {path} failed: {type(e).__name__}: {e}") from e
        if resp.status_code != 200:
            raise StudentBackendError(f"{method} {path} returned HTTP {resp.status_code}: {resp.text[:500]}")
        try:
            data = resp.json()
        except ValueError as e:
            raise StudentBackendError(f"{method} {path} returned invalid JSON: {e}") from e
        if not isinstance(data, dict):
            raise StudentBackendError(f"{method} {path} returned {type(data).__name__}, expected an object")
        return data
