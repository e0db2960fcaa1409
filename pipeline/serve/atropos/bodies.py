"""Request bodies of the Atropos API, field for field as atroposlib 0.4.0's server declares them, so the
same requests get the same 422s (FastAPI's ``{"detail": [...]}``). Two changes, both 422s where the
reference answers 500: a null message, and a message list that is not a list. ``ScoredData`` also takes
an optional ``group_id`` (the reference ignores unknown keys): the client's idempotency key for the group, so
a retried post of it is queued once.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, field_validator


class Registration(BaseModel):
    wandb_group: str
    wandb_project: str
    batch_size: int
    max_token_len: int
    checkpoint_dir: str
    save_checkpoint_interval: int
    starting_step: int
    num_steps: int


class RegisterEnv(BaseModel):
    max_token_length: int
    desired_name: str
    weight: float
    group_size: int
    min_batch_allocation: float | None = None  # smallest share of a batch this env gets (0.0-1.0)


class EnvIdentifier(BaseModel):
    env_id: int


class BatchAck(BaseModel):
    batch_id: str


class ScoredData(BaseModel):
    tokens: list[list[int]]
    masks: list[list[int]]
    scores: list[float]
    advantages: list[list[float]] | None = None
    ref_logprobs: list[list[float]] | None = None
    messages: list[list[dict[str, Any]]] | None = None
    generation_params: dict[str, Any] | None = None
    inference_logprobs: list[list[float]] | None = None
    overrides: list[dict[str, Any]] | None = None
    group_overrides: dict[str, Any] | None = None
    images: Any | None = None
    env_id: int | None = None
    distill_token_ids: list[list[list[int]]] | None = None
    distill_logprobs: list[list[list[float]]] | None = None
    group_id: str | None = None  # not in the reference: an idempotency key, the same id posted twice is queued once

    @field_validator("messages", mode="before")
    @classmethod
    def _role_and_content(cls, v: Any) -> Any:
        """Every message needs ``role`` and ``content`` (the reference's rule and wording)."""
        if v is None:
            return None
        for message_list in v if isinstance(v, list) else ():
            for msg in message_list if isinstance(message_list, list) else ():
                if not isinstance(msg, dict) or "role" not in msg or "content" not in msg:
                    raise ValueError("Message must have 'role' and 'content' fields")
        return v

    def reference_dict(self) -> dict[str, Any]:
        """The 14 keys the reference server stores and hands out (``schemas.atropos.ATROPOS_KEYS``)."""
        return {
            "tokens": self.tokens,
            "masks": self.masks,
            "scores": self.scores,
            "advantages": self.advantages,
            "ref_logprobs": self.ref_logprobs,
            "messages": self.messages,
            "generation_params": self.generation_params,
            "inference_logprobs": self.inference_logprobs,
            "overrides": self.overrides,
            "group_overrides": self.group_overrides,
            "images": self.images,
            "env_id": self.env_id,
            "distill_token_ids": self.distill_token_ids,
            "distill_logprobs": self.distill_logprobs,
        }
