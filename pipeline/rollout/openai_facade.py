"""An ``openai.AsyncOpenAI``-shaped client over a student backend; every call goes through a ``Tracker``.

``client.chat.completions.create(messages=..., n=..., temperature=..., max_tokens=..., logprobs=True)``
and ``client.completions.create(prompt=...)`` return standard-shaped objects (attribute access, plus
``model_dump()``) with the token data RL libraries read: ``response.prompt_token_ids``,
``choices[i].token_ids`` and ``choices[i].logprobs.content[j].logprob`` / ``.token`` (``"token_id:N"``
when ``extra_body={"return_tokens_as_token_ids": True}``, the vLLM option). Logprobs are always
filled in (the tracker has them anyway); ``top_logprobs`` lists stay empty.

``stream=True`` returns an async iterator of ``chat.completion.chunk`` (``text_completion``) objects, as
the openai SDK does: per choice a role chunk, one content chunk (with the choice's ``logprobs`` and
``token_ids``) and a chunk with its ``finish_reason``; with ``stream_options={"include_usage": True}``
a last chunk with no choices carries ``usage``. The backends return whole completions, so the chunks are
produced once sampling is done (the request is tracked exactly like a non-streaming one).

Chat prompts are rendered with the tokenizer's chat template (``tokenize=False``, then encoded without
extra special tokens). To tell the tracker which sequence a request continues, the client remembers the
message history behind every choice (role and text of each message, the reply included): a later request
whose messages start with such a history passes those node ids as ``expected_parents``, so a chat
template that re-tokenises the history is reported as a divergence instead of silently starting over.
"""

from __future__ import annotations

import hashlib
import itertools
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, overload

import msgspec
import structlog

from pipeline.rollout.openai_types import (
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatMessage,
    ChoiceLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    Stream,
    TextCompletion,
    TextCompletionChunk,
    TokenLogprob,
    Usage,
    _include_usage,
    chat_chunks,
    text_chunks,
)
from pipeline.rollout.students.base import Completion, GenParams, StudentBackend
from pipeline.rollout.tracker import Tracker

log = structlog.get_logger(__name__)
TOKEN_ID_PREFIX = "token_id:"


@dataclass(frozen=True, slots=True)
class _Sampled:
    completion: Completion
    text: str
    node_id: int
    token_strs: list[str]


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("text", "") if isinstance(p, dict) else getattr(p, "text", "") for p in content]
        return "".join(p for p in parts if isinstance(p, str))
    return str(content)


def _plain(message: Any) -> dict[str, Any]:
    if isinstance(message, dict):
        return dict(message)
    dump = getattr(message, "model_dump", None)
    if callable(dump):
        return dict(dump(exclude_none=True))
    raise TypeError(f"message must be a dict or a pydantic model, got {type(message).__name__}")


def history_key(messages: Sequence[dict[str, Any]]) -> bytes:
    """Digest of a conversation's roles and texts (identifies the sequence a request continues)."""
    flat = [[str(m.get("role", "")), _content_text(m.get("content"))] for m in messages]
    return hashlib.sha256(msgspec.json.encode(flat)).digest()


def _truncate_at_stop(
    c: Completion, stops: Sequence[str], decode: Callable[[list[int]], str]
) -> tuple[Completion, int]:
    """Cut ``c`` after the first token that completes a stop string; returns it and the cut text offset."""
    full = decode(c.token_ids)
    if not any(s in full for s in stops):
        return c, -1
    lo, hi = 1, len(c.token_ids)  # smallest t whose decoded prefix holds a stop string
    while lo < hi:
        mid = (lo + hi) // 2
        if any(s in decode(c.token_ids[:mid]) for s in stops):
            hi = mid
        else:
            lo = mid + 1
    text = decode(c.token_ids[:lo])
    cut = min(i for i in (text.find(s) for s in stops if s) if i >= 0)
    return Completion(c.token_ids[:lo], c.logprobs[:lo], "stop"), cut


class TrackedClient:
    """Drop-in for ``openai.AsyncOpenAI`` in rollout code; inspect ``tracker`` for the sequences."""

    def __init__(
        self,
        backend: StudentBackend,
        tracker: Tracker | None = None,
        *,
        model: str = "student",
        default_max_tokens: int = 256,
    ) -> None:
        self.backend = backend
        self.tracker = tracker if tracker is not None else Tracker()
        self.model = model
        self.default_max_tokens = default_max_tokens
        self.base_url = "http://distillq.tracked/v1"
        self.chat = _Chat(self)
        self.completions = _Completions(self)
        self._chat_history: dict[bytes, list[int]] = {}
        self._text_history: dict[str, list[int]] = {}

    @property
    def tokenizer(self) -> Any:
        return self.backend.tokenizer

    def reset(self) -> None:
        """Forget tracked sequences and remembered histories (between rollouts)."""
        self.tracker.reset()
        self._chat_history.clear()
        self._text_history.clear()

    def copy(self, **_: Any) -> TrackedClient:
        return self  # libraries copy clients to change options; tracking must stay shared

    async def close(self) -> None:
        return None

    def chat_prompt_ids(self, messages: list[dict[str, Any]], **template_kwargs: Any) -> list[int]:
        """Render with the chat template (generation prompt added) and encode without extra specials."""
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **template_kwargs
        )
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def expected_for_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        """Node ids behind the longest prefix of ``messages`` that ends with a tracked reply."""
        for k in range(len(messages) - 1, 0, -1):
            if messages[k - 1].get("role") == "assistant":
                ids = self._chat_history.get(history_key(messages[:k]))
                if ids:
                    return ids
        return []

    def remember_chat(self, messages: list[dict[str, Any]], node_id: int) -> None:
        self._chat_history.setdefault(history_key(messages), []).append(node_id)

    def remember_text(self, text: str, node_id: int) -> None:
        self._text_history.setdefault(text, []).append(node_id)

    def expected_for_text(self, prompt: str) -> list[int]:
        best = max((t for t in self._text_history if prompt.startswith(t)), key=len, default=None)
        return self._text_history[best] if best is not None else []

    async def sample(self, prompt_ids: list[int], expected: list[int], opts: dict[str, Any]) -> list[_Sampled]:
        """Generate, cut at stop strings, record in the tracker, decode."""
        extra = opts["extra_body"]
        skip = bool(extra.get("skip_special_tokens", True))
        as_ids = bool(extra.get("return_tokens_as_token_ids", False))
        tok = self.tokenizer

        def decode(ids: list[int]) -> str:
            return str(tok.decode(ids, skip_special_tokens=skip))

        stop_ids = [*opts["stop_token_ids"], *extra.get("stop_token_ids", [])]
        params = GenParams(max_tokens=opts["max_tokens"], temperature=opts["temperature"], top_p=opts["top_p"],
                           stop_token_ids=tuple(stop_ids), seed=opts["seed"])  # stop strings: cut here, below
        comps = await self.backend.generate(prompt_ids, params, opts["n"])
        cut_comps, texts = [], []
        for c in comps:
            c2, cut = _truncate_at_stop(c, opts["stop"], decode) if opts["stop"] else (c, -1)
            text = decode(c2.token_ids)
            cut_comps.append(c2)
            texts.append(text[:cut] if cut >= 0 else text)
        node_ids = self.tracker.record(prompt_ids, cut_comps, expected_parents=expected)
        out = []
        for c, text, nid in zip(cut_comps, texts, node_ids, strict=True):
            if as_ids:
                strs = [f"{TOKEN_ID_PREFIX}{t}" for t in c.token_ids]
            else:
                strs = [str(s) for s in tok.batch_decode([[t] for t in c.token_ids], skip_special_tokens=False)]
            out.append(_Sampled(c, text, nid, strs))
        return out

    def options(self, kw: dict[str, Any]) -> dict[str, Any]:
        """Normalise OpenAI request parameters; unsupported ones are ignored (logged at debug)."""
        stop = kw.pop("stop", None)
        max_tokens = kw.pop("max_completion_tokens", None)
        legacy_max = kw.pop("max_tokens", None)
        max_tokens = legacy_max if max_tokens is None else max_tokens
        opts = {
            "n": int(kw.pop("n", None) or 1),
            "temperature": float(t if (t := kw.pop("temperature", None)) is not None else 1.0),
            "top_p": float(p if (p := kw.pop("top_p", None)) is not None else 1.0),
            "max_tokens": int(max_tokens if max_tokens is not None else self.default_max_tokens),
            "seed": kw.pop("seed", None),
            "stop": [s for s in ([stop] if isinstance(stop, str) else list(stop or [])) if s],
            "stop_token_ids": list(kw.pop("stop_token_ids", None) or []),
            "extra_body": dict(kw.pop("extra_body", None) or {}),
        }
        for name in ("logprobs", "top_logprobs", "model", "timeout", "extra_headers", "user"):
            kw.pop(name, None)
        if kw:
            log.debug("tracked_client.ignored_params", params=sorted(kw))
        return opts

    def usage(self, prompt_ids: list[int], sampled: list[_Sampled]) -> Usage:
        done = sum(len(s.completion.token_ids) for s in sampled)
        return Usage(prompt_tokens=len(prompt_ids), completion_tokens=done, total_tokens=len(prompt_ids) + done)


def _token_logprobs(s: _Sampled) -> ChoiceLogprobs:
    content = [
        TokenLogprob(token=t, logprob=lp, bytes=list(t.encode()), token_id=i)
        for t, lp, i in zip(s.token_strs, s.completion.logprobs, s.completion.token_ids, strict=True)
    ]
    return ChoiceLogprobs(content=content)


class _ChatCompletions:
    def __init__(self, client: TrackedClient) -> None:
        self._client = client

    @overload
    async def create(
        self, *, messages: Sequence[Any], model: str | None = None, stream: Literal[False] = False, **kwargs: Any
    ) -> ChatCompletion: ...

    @overload
    async def create(
        self, *, messages: Sequence[Any], model: str | None = None, stream: Literal[True], **kwargs: Any
    ) -> Stream[ChatCompletionChunk]: ...

    @overload
    async def create(
        self, *, messages: Sequence[Any], model: str | None = None, stream: bool, **kwargs: Any
    ) -> ChatCompletion | Stream[ChatCompletionChunk]: ...

    async def create(
        self, *, messages: Sequence[Any], model: str | None = None, stream: bool = False, **kwargs: Any
    ) -> ChatCompletion | Stream[ChatCompletionChunk]:
        """Chat completion through the tracker (``n`` choices branch from one prompt)."""
        include_usage = _include_usage(kwargs)
        response = await self._create(list(messages), model, kwargs)
        return Stream(chat_chunks(response, include_usage), response) if stream else response

    async def _create(self, messages: list[Any], model: str | None, kwargs: dict[str, Any]) -> ChatCompletion:
        c = self._client
        tools = kwargs.pop("tools", None)
        kwargs.pop("tool_choice", None)
        opts = c.options(kwargs)
        msgs = [_plain(m) for m in messages]
        template_kwargs = dict(opts["extra_body"].get("chat_template_kwargs") or {})
        if tools:
            template_kwargs["tools"] = tools
        prompt_ids = c.chat_prompt_ids(msgs, **template_kwargs)
        sampled = await c.sample(prompt_ids, c.expected_for_chat(msgs), opts)
        choices = []
        for i, s in enumerate(sampled):
            c.remember_chat([*msgs, {"role": "assistant", "content": s.text}], s.node_id)
            choices.append(
                ChatChoice(
                    index=i,
                    message=ChatMessage(content=s.text),
                    finish_reason=s.completion.finish_reason,
                    logprobs=_token_logprobs(s),
                    token_ids=list(s.completion.token_ids),
                    node_id=s.node_id,
                )
            )
        return ChatCompletion(
            id=f"chatcmpl-{uuid.uuid4().hex}",
            choices=choices,
            created=int(time.time()),
            model=model or c.model,
            usage=c.usage(prompt_ids, sampled),
            prompt_token_ids=prompt_ids,
        )


class _Chat:
    def __init__(self, client: TrackedClient) -> None:
        self.completions = _ChatCompletions(client)


class _Completions:
    def __init__(self, client: TrackedClient) -> None:
        self._client = client

    @overload
    async def create(
        self, *, prompt: str | list[int], model: str | None = None, stream: Literal[False] = False, **kwargs: Any
    ) -> TextCompletion: ...

    @overload
    async def create(
        self, *, prompt: str | list[int], model: str | None = None, stream: Literal[True], **kwargs: Any
    ) -> Stream[TextCompletionChunk]: ...

    @overload
    async def create(
        self, *, prompt: str | list[int], model: str | None = None, stream: bool, **kwargs: Any
    ) -> TextCompletion | Stream[TextCompletionChunk]: ...

    async def create(
        self, *, prompt: str | list[int], model: str | None = None, stream: bool = False, **kwargs: Any
    ) -> TextCompletion | Stream[TextCompletionChunk]:
        """Text completion through the tracker; ``prompt`` may be a string or token ids."""
        include_usage = _include_usage(kwargs)
        response = await self._create(prompt, model, kwargs)
        return Stream(text_chunks(response, include_usage), response) if stream else response

    async def _create(self, prompt: str | list[int], model: str | None, kwargs: dict[str, Any]) -> TextCompletion:
        c = self._client
        if kwargs.pop("echo", False):
            raise NotImplementedError("echo=True is not supported by the tracked client")
        opts = c.options(kwargs)
        if isinstance(prompt, str):
            special = bool(opts["extra_body"].get("add_special_tokens", True))
            prompt_ids = list(c.tokenizer.encode(prompt, add_special_tokens=special))
            expected = c.expected_for_text(prompt)
        else:
            prompt_ids, expected = [int(t) for t in prompt], []
        sampled = await c.sample(prompt_ids, expected, opts)
        choices = []
        for i, s in enumerate(sampled):
            if isinstance(prompt, str):
                c.remember_text(prompt + s.text, s.node_id)
            offsets = [0, *itertools.accumulate(len(t) for t in s.token_strs)][:-1]
            lp = CompletionLogprobs(
                tokens=s.token_strs,
                token_logprobs=list(s.completion.logprobs),
                top_logprobs=[{} for _ in s.token_strs],
                text_offset=offsets,
            )
            choices.append(
                CompletionChoice(
                    index=i,
                    text=s.text,
                    finish_reason=s.completion.finish_reason,
                    logprobs=lp,
                    token_ids=list(s.completion.token_ids),
                    node_id=s.node_id,
                )
            )
        return TextCompletion(
            id=f"cmpl-{uuid.uuid4().hex}",
            choices=choices,
            created=int(time.time()),
            model=model or c.model,
            usage=c.usage(prompt_ids, sampled),
            prompt_token_ids=prompt_ids,
        )
