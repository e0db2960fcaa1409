"""The OpenAI response and stream-chunk shapes the student facade returns (``chat.completion``,
``text_completion`` and their ``.chunk`` forms), as msgspec Structs with attribute access and
``model_dump()``, and the conversion of a finished completion into stream chunks.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Generic, TypeVar

import msgspec


class _Obj(msgspec.Struct, kw_only=True):
    def model_dump(self) -> dict[str, Any]:
        out: dict[str, Any] = msgspec.to_builtins(self)
        return out


class TopLogprob(_Obj):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(_Obj):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = msgspec.field(default_factory=list)
    token_id: int = 0


class ChoiceLogprobs(_Obj):
    content: list[TokenLogprob]


class ChatMessage(_Obj):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[Any] | None = None
    refusal: str | None = None
    reasoning_content: str | None = None


class Usage(_Obj):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatChoice(_Obj):
    index: int
    message: ChatMessage
    finish_reason: str
    logprobs: ChoiceLogprobs | None
    token_ids: list[int]
    node_id: int  # tracker node holding the full sequence


class ChatCompletion(_Obj):
    id: str
    choices: list[ChatChoice]
    created: int
    model: str
    usage: Usage
    prompt_token_ids: list[int]
    object: str = "chat.completion"
    system_fingerprint: str | None = None


class CompletionLogprobs(_Obj):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(_Obj):
    index: int
    text: str
    finish_reason: str
    logprobs: CompletionLogprobs | None
    token_ids: list[int]
    node_id: int


class TextCompletion(_Obj):
    id: str
    choices: list[CompletionChoice]
    created: int
    model: str
    usage: Usage
    prompt_token_ids: list[int]
    object: str = "text_completion"
    system_fingerprint: str | None = None


class ChunkDelta(_Obj, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(_Obj):
    index: int
    delta: ChunkDelta
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None
    token_ids: list[int] | None = None


class TextChunkChoice(_Obj):
    index: int
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(_Obj):
    id: str
    choices: list[ChatChunkChoice]
    created: int
    model: str
    object: str = "chat.completion.chunk"
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None  # on the first chunk, as vLLM's return_token_ids
    system_fingerprint: str | None = None


class TextCompletionChunk(_Obj):
    id: str
    choices: list[TextChunkChoice]
    created: int
    model: str
    object: str = "text_completion"
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None
    system_fingerprint: str | None = None


ChunkT = TypeVar("ChunkT", ChatCompletionChunk, TextCompletionChunk)


class Stream(Generic[ChunkT]):
    """Chunks of one sampled response, consumed like the openai SDK's ``AsyncStream``."""

    def __init__(self, chunks: list[ChunkT], response: ChatCompletion | TextCompletion) -> None:
        self.chunks: list[ChunkT] = chunks
        self.response = response  # the same response, whole (tracker node ids included)

    def __aiter__(self) -> AsyncIterator[ChunkT]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[ChunkT]:
        for chunk in self.chunks:
            yield chunk

    async def close(self) -> None:
        return None

    async def __aenter__(self) -> Stream[ChunkT]:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None


def _include_usage(kwargs: dict[str, Any]) -> bool:
    """Pop ``stream_options``; whether it asks for a usage chunk."""
    options = kwargs.pop("stream_options", None) or {}
    if not isinstance(options, dict):
        raise TypeError(f"stream_options must be a mapping, got {type(options).__name__}")
    return bool(options.get("include_usage", False))


def chat_chunks(r: ChatCompletion, include_usage: bool) -> list[ChatCompletionChunk]:
    """``r`` as stream chunks: role, content (logprobs, token ids), finish per choice; then usage."""

    out: list[ChatCompletionChunk] = []

    def add(choices: list[ChatChunkChoice], usage: Usage | None = None) -> None:
        ids = None if out else r.prompt_token_ids
        out.append(
            ChatCompletionChunk(
                id=r.id, choices=choices, created=r.created, model=r.model, usage=usage, prompt_token_ids=ids
            )
        )

    for c in r.choices:
        add([ChatChunkChoice(index=c.index, delta=ChunkDelta(role="assistant", content=""))])
        content = ChunkDelta(content=c.message.content or "")
        add([ChatChunkChoice(index=c.index, delta=content, logprobs=c.logprobs, token_ids=c.token_ids)])
        add([ChatChunkChoice(index=c.index, delta=ChunkDelta(), finish_reason=c.finish_reason)])
    if include_usage:
        add([], r.usage)
    return out


def text_chunks(r: TextCompletion, include_usage: bool) -> list[TextCompletionChunk]:
    """``r`` as stream chunks: per choice its text (logprobs, token ids) and finish reason; then usage."""
    out: list[TextCompletionChunk] = []
    for c in r.choices:
        choice = TextChunkChoice(
            index=c.index, text=c.text, finish_reason=c.finish_reason, logprobs=c.logprobs, token_ids=c.token_ids
        )
        ids = None if out else r.prompt_token_ids
        out.append(
            TextCompletionChunk(id=r.id, choices=[choice], created=r.created, model=r.model, prompt_token_ids=ids)
        )
    if include_usage:
        out.append(TextCompletionChunk(id=r.id, choices=[], created=r.created, model=r.model, usage=r.usage))
    return out
