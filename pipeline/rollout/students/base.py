"""The student inference backend protocol: token ids in, sampled token ids and their logprobs out.

Backends never re-tokenise: the prompt is a list of token ids and the completion comes back as the
exact ids the server sampled, one logprob per id. A completion that ends on an end-of-sequence or stop
token includes that token (as vLLM does), so the trainer also learns to stop.

Logprob convention: ``logprobs[i]`` is the model's *raw* log-softmax of ``token_ids[i]`` (temperature 1,
no top-p truncation), i.e. ``log pi_student(token | prefix)``, the quantity importance ratios and
distillation losses use. vLLM V1 returns the same by default (``--logprobs-mode raw_logprobs``);
``processed_logprobs`` (and vLLM V0) report the temperature/top-p processed distribution instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from pipeline.errors import BackendError

FinishReason = Literal["stop", "length"]


class StudentBackendError(BackendError, RuntimeError):
    """The inference backend failed or answered something that cannot be tracked."""


@dataclass(frozen=True, slots=True)
class Completion:
    """One sampled continuation: exact token ids, one raw logprob per id, why it ended."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (end-of-sequence / stop token, which is included) or "length"
    stop_reason: int | str | None = None  # as vLLM: the stop string or stop token id that ended it (None on EOS)

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise StudentBackendError(
                f"completion has {len(self.token_ids)} token ids but {len(self.logprobs)} logprobs"
            )


@dataclass(frozen=True, slots=True)
class GenParams:
    """Sampling parameters shared by every backend."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # recorded in RolloutGroup.generation_params

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
        }
        if self.stop_token_ids:
            d["stop_token_ids"] = list(self.stop_token_ids)
        if self.seed is not None:
            d["seed"] = self.seed
        d.update(self.extra)
        return d


@runtime_checkable
class StudentBackend(Protocol):
    """A student inference server. ``tokenizer`` is a Hugging Face tokenizer (chat template, decode)."""

    @property
    def tokenizer(self) -> Any: ...

    async def generate(
        self,
        prompt_ids: list[int],
        *,
        n: int = 1,
        max_tokens: int = 256,
        temperature: float = 1.0,
        top_p: float = 1.0,
        stop_token_ids: Sequence[int] = (),
        seed: int | None = None,
    ) -> list[Completion]:
        """Sample ``n`` continuations of ``prompt_ids``, in choice order. Backends that take stop strings
        (``HFStudent``, ``VLLMStudent``) also accept ``stop``, ``include_stop_str_in_output`` and
        ``skip_special_tokens`` keywords, with vLLM's meaning (``pipeline.rollout.stop_strings``)."""
        ...


def check_request(prompt_ids: Sequence[int], n: int, max_tokens: int, temperature: float, top_p: float) -> None:
    """Reject requests every backend would mishandle (raises ``ValueError``)."""
    if not prompt_ids:
        raise ValueError("prompt_ids is empty (position 0 has no prefix; send at least one token)")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
