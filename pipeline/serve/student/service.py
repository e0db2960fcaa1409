"""What the student server does, apart from HTTP: sample, track each rollout, build and push groups.

``generate`` serves the token-in/token-out request verifiers' train client sends to
``/inference/v1/generate``; ``chat`` serves ``/v1/chat/completions`` through the tracked OpenAI facade
(the server renders the chat template); both record every completion in the tree-mode tracker of the
request's ``X-Session-ID``. ``finish`` turns a finished rollout into sequences (one per branch, each
with the rollout's reward) and hands full groups to the sink (the producer SDK's ``push``).

Logprobs are rounded to float32 before they are returned or recorded: the wire format stores float32,
so what the client records and what distillq pushes are the same numbers, bit for bit.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import msgspec
import numpy as np
import structlog
from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator

from pipeline.errors import ApiError
from pipeline.metrics import UNATTRIBUTED_SAMPLES
from pipeline.rollout.openai_facade import TrackedClient
from pipeline.rollout.openai_types import ChatCompletion, ChatCompletionChunk, Stream
from pipeline.rollout.students.base import Completion, GenParams, StudentBackend, StudentBackendError
from pipeline.rollout.tracker import Tracker
from pipeline.rollout.weight_sync import attribute, attribution
from pipeline.serve.student.sessions import FinishedRollout, GroupAssembler, GroupSpec, SessionStore
from pipeline.serve.student.validation import (
    MAX_N,
    RequestError,
    check_chat,
    check_max_tokens,
    check_stop,
    requested_max_tokens,
)
from schemas import DecodeError, RolloutGroup

log = structlog.get_logger(__name__)
TOKEN_ID_PREFIX = "token_id:"
Sink = Callable[[RolloutGroup], Awaitable[object]]

#: Sampling options the backends do not implement, with the values that mean "off" (anything else: 400).
NEUTRAL_OPTIONS: dict[str, tuple[Any, ...]] = {
    "top_k": (None, -1, 0),
    "min_p": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "min_tokens": (None, 0),
    "best_of": (None, 1),
    "use_beam_search": (None, False),
    "prompt_logprobs": (None, 0),
}


try:  # chat templates render with jinja2 (the hf extra brings it); without it no template error can arise
    from jinja2 import TemplateError

    _BAD_CHAT: tuple[type[Exception], ...] = (ValueError, TypeError, KeyError, TemplateError)
except ModuleNotFoundError:
    _BAD_CHAT = (ValueError, TypeError, KeyError)


class ServeError(ApiError):
    """An error answered in the OpenAI shape: ``{"error": {"message", "type", "code"}}``."""

    def __init__(self, status: int, message: str, kind: str = "BadRequestError", param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


class SamplingParams(BaseModel):
    """``sampling_params`` of a generate request (vLLM's names); unknown keys are ignored."""

    model_config = ConfigDict(extra="allow")
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_tokens: StrictInt | None = Field(None, ge=0)  # integers as JSON writes them: not 3.0, not true
    n: StrictInt = Field(1, ge=1, le=MAX_N)
    seed: StrictInt | None = None
    stop_token_ids: list[StrictInt] = Field(default_factory=list)
    stop: str | list[str] | None = None  # applied as vLLM does (pipeline.rollout.stop_strings)
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # the sampled token's logprob is always returned; no top candidates
    skip_special_tokens: bool = True  # the text stop strings are matched against


class GenerateRequest(BaseModel):
    model: str
    token_ids: list[StrictInt] = Field(min_length=1)  # JSON integers: 3.0 and true are refused, not read as 3, 1
    sampling_params: SamplingParams = Field(default_factory=SamplingParams)


class FinishRequest(BaseModel):
    """A finished rollout: which task it solved (the group key), its reward, whether to train on it."""

    task: str = Field(min_length=1)
    reward: float = 0.0
    trainable: bool = True
    group_size: int | None = Field(None, ge=1, le=4096)
    env_id: int | None = None
    policy_version: int | None = None
    group_overrides: dict[str, Any] | None = None

    @field_validator("reward")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError("reward must be finite")
        return v


@dataclass(frozen=True)
class StudentServeConfig:
    """What ``serve student`` serves (names, context, vocabulary) and stamps on the groups it pushes."""

    served_names: tuple[str, ...]
    max_model_len: int
    vocab_size: int | None = None
    default_max_tokens: int = 256
    group_size: int = 1
    env_id: int = 0
    policy_version: int = 0
    versions_from_server: bool = False  # synced servers: each group carries the version its requests ran on


class ServedBackend:
    """The backend as served: prompts within the context, ``max_tokens`` checked against it as vLLM checks it
    when the request set it (``validation.requested_max_tokens``: prompt + max_tokens above the context is a
    400 naming the field) and otherwise (the server's default) clamped to what is left; logprobs rounded to
    float32 (what the wire format stores)."""

    def __init__(self, backend: StudentBackend, max_model_len: int) -> None:
        self.backend = backend
        self.max_model_len = max_model_len

    @property
    def tokenizer(self) -> Any:
        return self.backend.tokenizer

    async def generate(self, prompt_ids: list[int], params: GenParams, n: int = 1) -> list[Completion]:
        limit = self.max_model_len
        if len(prompt_ids) >= limit:
            raise ValueError(
                f"This model's maximum context length is {limit} tokens. However, your request has "
                f"{len(prompt_ids)} input tokens."
            )
        check_max_tokens(len(prompt_ids), params.max_tokens, limit)
        clamped = replace(params, max_tokens=min(params.max_tokens, limit - len(prompt_ids)))
        out = await self.backend.generate(prompt_ids, clamped, n)
        return [Completion(c.token_ids, np.asarray(c.logprobs, np.float32).tolist(), c.finish_reason, c.stop_reason)
                for c in out]


def _unsupported(extra: dict[str, Any] | None, *, allowed: tuple[str, ...] = ()) -> list[str]:
    return [
        k for k, v in (extra or {}).items() if k in NEUTRAL_OPTIONS and k not in allowed and v not in NEUTRAL_OPTIONS[k]
    ]


class StudentService:
    def __init__(
        self,
        backend: StudentBackend,
        config: StudentServeConfig,
        sink: Sink,
        *,
        sessions: SessionStore | None = None,
        groups: GroupAssembler | None = None,
    ) -> None:
        self.backend = ServedBackend(backend, config.max_model_len)
        self.config = config
        self.sink = sink
        self.sessions = sessions if sessions is not None else SessionStore()
        self.groups = (
            groups if groups is not None else GroupAssembler(ttl_s=self.sessions.ttl_s, clock=self.sessions.clock)
        )
        self.unsent: dict[str, RolloutGroup] = {}  # built groups whose push is not confirmed yet
        self._delivering: set[str] = set()  # ids of groups whose push is under way
        self.untracked = 0  # requests without an X-Session-ID
        self.started = int(time.time())

    # -- inference ---------------------------------------------------------------------------------

    def models(self) -> dict[str, Any]:
        data = [
            {"id": n, "object": "model", "created": self.started, "owned_by": "distillq", "root": n,
             "max_model_len": self.config.max_model_len}
            for n in self.config.served_names
        ]  # fmt: skip
        return {"object": "list", "data": data}

    def _check_model(self, model: object) -> None:
        if model not in self.config.served_names:
            raise ServeError(404, f"The model `{model}` does not exist.", "NotFoundError")

    async def generate(self, req: GenerateRequest, session_id: str | None) -> dict[str, Any]:
        """Sample ``n`` continuations of ``req.token_ids``; the response verifiers' train client parses."""
        self._check_model(req.model)
        sp = req.sampling_params
        bad = _unsupported(sp.model_extra)
        if bad:
            raise ServeError(400, f"unsupported sampling options: {', '.join(sorted(bad))}")
        prompt = list(req.token_ids)
        vocab = self.config.vocab_size
        if vocab is not None and not all(0 <= t < vocab for t in prompt):
            raise ServeError(400, f"token_ids must lie in [0, {vocab})")
        max_tokens = self.config.default_max_tokens if sp.max_tokens is None else sp.max_tokens
        try:
            stop = check_stop(sp.stop, "sampling_params.stop")
        except RequestError as e:
            raise ServeError(400, e.message, param=e.param) from e
        params = GenParams(
            max_tokens=max_tokens, temperature=sp.temperature, top_p=sp.top_p, stop_token_ids=tuple(sp.stop_token_ids),
            seed=sp.seed, stop=tuple(stop), include_stop_str_in_output=sp.include_stop_str_in_output,
            skip_special_tokens=sp.skip_special_tokens,
        )  # fmt: skip
        asked = "sampling_params.max_tokens" if sp.max_tokens is not None else None
        try:
            with attribution() as seen, requested_max_tokens(asked):
                comps = await self.backend.generate(prompt, params, sp.n)
        except RequestError as e:
            raise ServeError(400, e.message, param=e.param) from e
        except ValueError as e:
            raise ServeError(400, str(e)) from e
        except StudentBackendError as e:
            raise ServeError(502, str(e), "BackendError") from e
        self._record(session_id, prompt, comps, {"n": sp.n, **params.as_dict()})
        self._versions(session_id, seen)
        return {
            "request_id": f"gen-{uuid.uuid4().hex}",
            "prompt_token_ids": prompt,
            "choices": [
                {
                    "index": i,
                    "token_ids": c.token_ids,
                    "logprobs": {
                        "content": [
                            {"token": f"{TOKEN_ID_PREFIX}{t}", "logprob": lp}
                            for t, lp in zip(c.token_ids, c.logprobs, strict=True)
                        ]
                    },
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
                for i, c in enumerate(comps)
            ],
            "usage": _usage(len(prompt), sum(len(c.token_ids) for c in comps)),
        }

    def _record(
        self, session_id: str | None, prompt: list[int], comps: list[Completion], params: dict[str, Any]
    ) -> None:
        if not session_id:
            self.untracked += 1
            log.debug("student.untracked_request", reason="no X-Session-ID header")
            return
        s = self.sessions.touch(session_id)
        s.requests += 1
        if s.generation_params is None:
            s.generation_params = {k: v for k, v in params.items() if v not in (None, [])}
        eos = getattr(self.backend.tokenizer, "eos_token_id", None)
        stops = [*params.get("stop_token_ids", []), *([eos] if isinstance(eos, int) else [])]
        s.tracker.record(prompt, comps, stop_token_ids=stops)

    async def chat(self, body: dict[str, Any], session_id: str | None) -> ChatCompletion | Stream[ChatCompletionChunk]:
        """An OpenAI chat completion (``stream`` honoured), rendered with the model's chat template."""
        self._check_model(body.get("model"))
        try:
            check_chat(body)
        except RequestError as e:
            raise ServeError(400, e.message, param=e.param) from e
        messages = body["messages"]
        kwargs = {k: v for k, v in body.items() if k not in ("messages", "model", "stream")}
        bad = _unsupported(kwargs)  # stop strings: the facade cuts at them
        if bad:
            raise ServeError(400, f"unsupported sampling options: {', '.join(sorted(bad))}")
        client = self._chat_client(session_id)
        n_before = client.tracker.stats.requests
        asked = next((k for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None), None)
        try:
            with attribution() as seen, requested_max_tokens(asked):
                out = await client.chat.completions.create(
                    messages=messages, model=str(body["model"]), stream=bool(body.get("stream")), **kwargs
                )
            self._versions(session_id, seen)
        except RequestError as e:
            raise ServeError(400, e.message, param=e.param) from e
        except StudentBackendError as e:
            raise ServeError(502, str(e), "BackendError") from e
        except _BAD_CHAT as e:
            raise ServeError(400, f"{type(e).__name__}: {e}") from e
        s = self.sessions.get(session_id) if session_id else None
        if s is not None and client.tracker.stats.requests > n_before:
            s.requests += 1
        return out

    def _versions(self, session_id: str | None, seen: list[int | None]) -> None:
        s = self.sessions.get(session_id) if session_id and seen else None
        if s is not None:
            s.versions.extend(seen)

    def _chat_client(self, session_id: str | None) -> TrackedClient:
        if not session_id:
            self.untracked += 1
            return TrackedClient(self.backend, Tracker(), default_max_tokens=self.config.default_max_tokens)
        s = self.sessions.touch(session_id)
        if s.chat is None:
            s.chat = TrackedClient(self.backend, s.tracker, default_max_tokens=self.config.default_max_tokens)
        return s.chat

    # -- rollouts and groups -----------------------------------------------------------------------

    async def finish(self, session_id: str, req: FinishRequest) -> dict[str, Any]:
        """Close a rollout: its branches become sequences scored ``req.reward``, grouped by ``req.task``."""
        s = self.sessions.pop(session_id)
        if s is None:
            reason = self.sessions.eviction_reason(session_id)
            if reason is not None:
                raise ServeError(410, f"session {session_id!r} was evicted ({reason}) before it was finished", "Gone")
            raise ServeError(404, f"no session {session_id!r} (no request carried this X-Session-ID)", "NotFoundError")
        cfg = self.config
        version = cfg.policy_version if req.policy_version is None else req.policy_version
        leaves = s.tracker.leaves()
        out: dict[str, Any] = {"session": session_id, "task": req.task, "sequences": len(leaves), "group": None}
        if cfg.versions_from_server and leaves and req.trainable:
            got = attribute(s.versions)
            if got is None:  # the weights changed between its requests: no one version sampled it
                UNATTRIBUTED_SAMPLES.labels("dropped").inc()
                log.warning("student.rollout_not_attributable", session=session_id, versions=s.versions)
                out["skipped"] = "the student's weights changed during the rollout"
                return out
            version = got
        spec = GroupSpec(
            task=req.task,
            group_size=req.group_size or cfg.group_size,
            env_id=cfg.env_id if req.env_id is None else req.env_id,
            policy_version=version,
            group_overrides=req.group_overrides,
        )
        if not req.trainable or not leaves:
            out["skipped"] = "not trainable" if not req.trainable else "no completions"
            return out
        seqs = s.tracker.sequences([req.reward] * len(leaves))
        group = self.groups.add(spec, FinishedRollout(session_id, seqs, s.generation_params))
        out["waiting"] = self.groups.waiting(spec.task, spec.env_id, spec.policy_version)
        if group is not None:
            out["group"] = await self._deliver(group)
        return out

    def discard(self, session_id: str) -> bool:
        return self.sessions.pop(session_id) is not None

    async def _deliver(self, group: RolloutGroup) -> dict[str, Any]:
        """Push ``group``. It stays in ``unsent`` until the sink confirms, so a push that fails, or is cancelled
        mid-way (the server stopping), is retried by ``maintain`` or ``close`` (the producer drops a repeat)."""
        gid = group.group_id
        info: dict[str, Any] = {"id": gid, "sequences": len(group.sequences), "pushed": False}
        self.unsent[gid] = group
        self._delivering.add(gid)
        try:
            await self.sink(group)
        except DecodeError as e:  # a bad group is dropped, with the reason
            self.unsent.pop(gid, None)
            log.error("student.group_invalid", group=gid, error=str(e))
            info["error"] = f"invalid group, dropped: {e}"
            return info
        except Exception as e:  # Redis down, backpressure timeout: kept and retried by maintain()
            log.warning("student.push_failed", group=gid, error=f"{type(e).__name__}: {e}")
            info["error"], info["retrying"] = f"{type(e).__name__}: {e}", True
            return info
        finally:
            self._delivering.discard(gid)
        self.unsent.pop(gid, None)
        log.info("student.group_pushed", group=gid, task=group.task_id, sequences=len(group.sequences))
        info["pushed"] = True
        return info

    def _hold(self, groups: list[RolloutGroup]) -> None:
        """Record groups taken out of the assembler as unsent before any is pushed: if the pushes are
        cancelled, none of them is lost."""
        for g in groups:
            self.unsent[g.group_id] = g

    async def maintain(self) -> None:
        """Evict idle sessions, flush groups open too long, retry groups whose push failed."""
        self.sessions.sweep()
        self._hold(self.groups.expired())
        for g in [g for gid, g in self.unsent.items() if gid not in self._delivering]:
            await self._deliver(g)

    async def close(self) -> None:
        """At shutdown: push open groups as partial groups, and every unsent group; report rollouts never
        finished."""
        self._hold(self.groups.drain())
        for g in list(self.unsent.values()):
            await self._deliver(g)
        if len(self.sessions):
            log.warning("student.unfinished_sessions", sessions=len(self.sessions))
        if self.unsent:
            log.error("student.groups_lost", groups=sorted(self.unsent))


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def sse_events(chunks: Sequence[Any]) -> list[bytes]:
    """Server-sent events for ``chunks`` (msgspec structs), ending with ``data: [DONE]``."""
    return [*(b"data: " + msgspec.json.encode(c) + b"\n\n" for c in chunks), b"data: [DONE]\n\n"]
