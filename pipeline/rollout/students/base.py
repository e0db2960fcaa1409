"""The student inference backend protocol: token ids in, sampled token ids and their logprobs out.

``StudentBackend``: ``generate(prompt_ids, params, n)``, every sampling parameter (stop strings included) in one
``GenParams``. ``WeightReloader``: a student that also loads the weights a learner publishes (``HFStudent``).

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
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

from pipeline.errors import BackendError
from pipeline.rollout.refusals import CheckpointRefusals

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
    """What a ``generate`` call samples with, every backend the same: length, temperature, top-p, stop token ids,
    seed, and stop strings with vLLM's meaning (``pipeline.rollout.stop_strings``): a completion ends at the token
    that completes one of ``stop``, that token included, its ``stop_reason`` the string;
    ``include_stop_str_in_output`` and ``skip_special_tokens`` as vLLM's (the text the strings are matched in)."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    extra: dict[str, Any] = field(default_factory=dict)  # recorded in RolloutGroup.generation_params

    def as_dict(self) -> dict[str, Any]:
        """The parameters a group records (``RolloutGroup.generation_params``): the ones set, then ``extra``."""
        d: dict[str, Any] = {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
        }
        if self.stop_token_ids:
            d["stop_token_ids"] = list(self.stop_token_ids)
        if self.seed is not None:
            d["seed"] = self.seed
        if self.stop:
            d.update(stop=list(self.stop), include_stop_str_in_output=self.include_stop_str_in_output)
        d.update(self.extra)
        return d


@runtime_checkable
class StudentBackend(Protocol):
    """A student inference server. ``tokenizer`` is a Hugging Face tokenizer (chat template, decode)."""

    @property
    def tokenizer(self) -> Any: ...

    async def generate(self, prompt_ids: list[int], params: GenParams, n: int = 1) -> list[Completion]:
        """Sample ``n`` continuations of ``prompt_ids`` with ``params``, in choice order (``check_request``'s
        ``ValueError`` for a request no backend can serve, ``StudentBackendError`` when the backend fails)."""
        ...


@runtime_checkable
class WeightReloader(Protocol):
    """A student that loads the versions a learner publishes itself (a local model; servers kept on the newest
    version are ``pipeline.rollout.synced.SyncedStudent``'s job). ``checkpoint_refusals``: the folders it refused
    (``pipeline.rollout.refusals``)."""

    checkpoint_refusals: CheckpointRefusals

    async def load_weights(self, directory: str | Path) -> int | None:
        """Load the newest version published in ``directory``; its version, or None when none was loaded (nothing
        published, or the folder refused: recorded in ``checkpoint_refusals``, the weights kept)."""
        ...


def check_request(prompt_ids: Sequence[int], params: GenParams, n: int) -> None:
    """Reject requests every backend would mishandle (raises ``ValueError``)."""
    if not prompt_ids:
        raise ValueError("prompt_ids is empty (position 0 has no prefix; send at least one token)")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if params.max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0, got {params.max_tokens}")
    if params.temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {params.temperature}")
    if not 0 < params.top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {params.top_p}")
