"""Sample one group: G completions of one prompt, tracked token by token, scored, as a ``RolloutGroup``.

A string prompt goes through ``completions.create``, a message list through ``chat.completions.create``;
both ask for ``n = G`` in one request, so the G sequences branch from one prompt. Each call uses its own
tracker unless a client is passed (then only this call's choices are read from it).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Sequence
from typing import Any

from pipeline.rollout.openai_facade import TrackedClient
from pipeline.rollout.rewards import RewardFn, no_reward, score
from pipeline.rollout.students.base import GenParams, StudentBackend
from pipeline.rollout.tracker import Tracker
from schemas.messages import RolloutGroup
from schemas.messages import Sequence as WireSequence

Prompt = str | Sequence[dict[str, Any]]


async def sample_group(
    backend: StudentBackend | TrackedClient,
    prompt: Prompt,
    *,
    group_size: int,
    params: GenParams | None = None,
    reward_fn: RewardFn = no_reward,
    answer: str | None = None,
    group_id: str | None = None,
    env_id: int = 0,
    task_id: str = "",
    policy_version: int = 0,
    group_overrides: dict[str, Any] | None = None,
    metadata: dict[str, Any] | None = None,
    keep_messages: bool = False,
) -> RolloutGroup:
    """Sample ``group_size`` completions of ``prompt``, score them with ``reward_fn`` against ``answer``."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    p = params or GenParams()
    client = backend if isinstance(backend, TrackedClient) else TrackedClient(backend, Tracker())
    if isinstance(prompt, str):
        tr = await client.completions.create(
            prompt=prompt, stream=False, n=group_size, max_tokens=p.max_tokens, temperature=p.temperature,
            top_p=p.top_p, seed=p.seed, stop_token_ids=list(p.stop_token_ids), logprobs=True,
        )  # fmt: skip
        texts, node_ids = [c.text for c in tr.choices], [c.node_id for c in tr.choices]
    else:
        chat = await client.chat.completions.create(
            messages=[dict(m) for m in prompt], stream=False, n=group_size, max_tokens=p.max_tokens,
            temperature=p.temperature, top_p=p.top_p, seed=p.seed, stop_token_ids=list(p.stop_token_ids), logprobs=True,
        )  # fmt: skip
        texts = [c.message.content or "" for c in chat.choices]
        node_ids = [c.node_id for c in chat.choices]
    scores = await asyncio.gather(*(score(reward_fn, t, answer) for t in texts))
    sequences: list[WireSequence] = []
    for node_id, text, s in zip(node_ids, texts, scores, strict=True):
        msgs = None
        if keep_messages:
            msgs = (
                [{"role": "user", "content": prompt}, {"role": "assistant", "content": text}]
                if isinstance(prompt, str)
                else [*(dict(m) for m in prompt), {"role": "assistant", "content": text}]
            )
        sequences.append(client.tracker.to_sequence(node_id, s, messages=msgs))
    return RolloutGroup(
        group_id=group_id or uuid.uuid4().hex,
        sequences=sequences,
        env_id=env_id,
        task_id=task_id,
        policy_version=policy_version,
        created_at=time.time(),
        group_overrides=group_overrides,
        generation_params={"n": group_size, **p.as_dict()},
        metadata=metadata,
    )


def group_from_tracker(
    tracker: Tracker,
    scores: Sequence[float],
    *,
    group_id: str | None = None,
    env_id: int = 0,
    task_id: str = "",
    policy_version: int = 0,
    generation_params: dict[str, Any] | None = None,
    group_overrides: dict[str, Any] | None = None,
    metadata: dict[str, Any] | None = None,
) -> RolloutGroup:
    """A group from a tracker's leaves (multi-turn rollouts driven elsewhere), one score per leaf."""
    return RolloutGroup(
        group_id=group_id or uuid.uuid4().hex,
        sequences=tracker.sequences(scores),
        env_id=env_id,
        task_id=task_id,
        policy_version=policy_version,
        created_at=time.time(),
        group_overrides=group_overrides,
        generation_params=generation_params,
        metadata=metadata,
    )
