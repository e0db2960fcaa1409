"""What the student server accepts in a request, checked before anything is sampled: each rule is a 400
naming the field (``param``), as OpenAI and vLLM answer it, never an exception's text about a value.

* ``n``: an integer in ``[1, MAX_N]`` on both endpoints (``/inference/v1/generate`` and
  ``/v1/chat/completions``); ``n: 0`` is refused, not read as 1.
* chat messages: objects, each with a string ``role``.
* chat sampling fields: ``temperature`` a number >= 0, ``top_p`` in (0, 1], ``max_tokens`` /
  ``max_completion_tokens`` / ``seed`` integers, ``stop`` a string or a list of strings, ``logprobs`` and
  ``stream`` booleans, ``stop_token_ids`` a list of integers.
* ``top_logprobs``: only 0 (or none). The backends return the sampled token's logprob, not the
  candidates, so a request for candidates is refused rather than answered with empty lists.
* ``max_tokens`` (``max_completion_tokens``, ``sampling_params.max_tokens``) set by the request: prompt tokens
  plus ``max_tokens`` within the model's context, vLLM's rule and wording (``check_max_tokens``, once the
  prompt is tokenized; ``requested_max_tokens`` says which field the request set).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any, Final

from pipeline.errors import ApiError

#: The most completions one request may ask for (``n``), on every endpoint.
MAX_N: Final = 64
#: The most stop strings one request may carry.
MAX_STOP: Final = 16


class RequestError(ApiError, ValueError):
    """A request field the server does not accept: ``param`` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param, self.message = param, f"{param}: {message}"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, int | float) and not isinstance(v, bool)) and math.isfinite(v)


def check_n(v: Any, param: str = "n") -> int:
    """``n`` as an integer in ``[1, MAX_N]`` (None: 1)."""
    if v is None:
        return 1
    if not _is_int(v) or not 1 <= v <= MAX_N:
        raise RequestError(param, f"must be an integer from 1 to {MAX_N}, got {_shown(v)}")
    return int(v)


def check_stop(v: Any, param: str = "stop") -> list[str]:
    """Stop strings as a list (None, "" and [] are none)."""
    if v is None:
        return []
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise RequestError(param, "must be a string or a list of strings")
    if len(items) > MAX_STOP:
        raise RequestError(param, f"at most {MAX_STOP} stop strings, got {len(items)}")
    return [s for s in items if s]


#: The ``max_tokens`` field the request under way set itself (None: it set none, the server's default applies).
_REQUESTED_MAX_TOKENS: ContextVar[str | None] = ContextVar("requested_max_tokens", default=None)


@contextlib.contextmanager
def requested_max_tokens(param: str | None) -> Iterator[None]:
    """While sampling for a request: ``param``, the field that set ``max_tokens`` (None: the server's default,
    which ``check_max_tokens`` lets the caller clamp to what the context leaves)."""
    token = _REQUESTED_MAX_TOKENS.set(param)
    try:
        yield
    finally:
        _REQUESTED_MAX_TOKENS.reset(token)


def check_max_tokens(prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    """As vLLM: a ``max_tokens`` the request set that does not fit the context beside the prompt is a 400."""
    param = _REQUESTED_MAX_TOKENS.get()
    if param is not None and prompt_tokens + max_tokens > max_model_len:
        raise RequestError(param, f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's "
                                  f"maximum context length is {max_model_len} tokens and your request has "
                                  f"{prompt_tokens} input tokens ({max_tokens} > {max_model_len} - {prompt_tokens})")


#: The message roles chat templates take (OpenAI's, and ``ipython`` of Llama's tool calls).
ROLES: Final = frozenset({"system", "developer", "user", "assistant", "tool", "function", "ipython"})


def check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages", "must be a non-empty list of objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RequestError(f"messages[{i}]", "must be an object")
        role = m.get("role")
        if role is None:
            raise RequestError(f"messages[{i}].role", "field required")
        if not isinstance(role, str) or not role:
            raise RequestError(f"messages[{i}].role", "must be a non-empty string")
        if role not in ROLES:
            shown = role if len(role) <= 40 else role[:40] + "..."
            raise RequestError(f"messages[{i}].role", f"unknown role {shown!r}: one of {', '.join(sorted(ROLES))}")


def check_chat(body: dict[str, Any]) -> None:
    """Every field of a chat completion request the server reads (raises ``RequestError``)."""
    check_messages(body.get("messages"))
    check_n(body.get("n"))
    check_stop(body.get("stop"))

    def number(name: str, ok: Any, rule: str) -> None:
        v = body.get(name)
        if v is not None and not (_is_number(v) and ok(v)):
            raise RequestError(name, f"must be {rule}, got {_shown(v)}")

    number("temperature", lambda v: v >= 0, "a number >= 0")
    number("top_p", lambda v: 0 < v <= 1, "a number in (0, 1]")
    for name in ("max_tokens", "max_completion_tokens"):
        number(name, lambda v: _is_int(v) and v >= 0, "an integer >= 0")
    number("seed", _is_int, "an integer")
    for name in ("logprobs", "stream"):
        v = body.get(name)
        if v is not None and not isinstance(v, bool):
            raise RequestError(name, f"must be a boolean, got {_shown(v)}")
    ids = body.get("stop_token_ids")
    if ids is not None and not (isinstance(ids, list) and all(_is_int(t) and t >= 0 for t in ids)):
        raise RequestError("stop_token_ids", "must be a list of token ids (integers >= 0)")
    top = body.get("top_logprobs")
    if top is not None:
        if not _is_int(top) or not 0 <= top <= 20:
            raise RequestError("top_logprobs", f"must be an integer from 0 to 20, got {_shown(top)}")
        if top:
            raise RequestError("top_logprobs", "candidates are not returned by this server (only the sampled "
                                               "token's logprob, with logprobs: true); send 0 or leave it out")


def _shown(v: Any) -> str:
    """A value as an error message shows it: its JSON type and, for short scalars, itself."""
    if isinstance(v, bool | int | float) or v is None:
        return repr(v)
    if isinstance(v, str):
        return repr(v) if len(v) <= 20 else f"a string of {len(v)} characters"
    return f"a {type(v).__name__}"
