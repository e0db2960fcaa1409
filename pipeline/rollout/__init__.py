"""Student rollouts: inference backends, the token tracker, the OpenAI-compatible facade, rewards.

The HF and vLLM backends are not imported here (``torch`` / ``httpx`` stay optional at import time):
import ``pipeline.rollout.students.hf`` or ``pipeline.rollout.students.vllm`` directly.
"""

from pipeline.rollout.openai_facade import TrackedClient
from pipeline.rollout.openai_types import ChatCompletion, ChatCompletionChunk, Stream, TextCompletion
from pipeline.rollout.rewards import RewardFn, get_reward, register_reward
from pipeline.rollout.sampler import group_from_tracker, sample_group
from pipeline.rollout.students.base import Completion, GenParams, StudentBackend, StudentBackendError
from pipeline.rollout.tracker import Node, Tracker, TrackerState, TrackerStats

__all__ = [
    "ChatCompletion",
    "ChatCompletionChunk",
    "Completion",
    "GenParams",
    "Node",
    "RewardFn",
    "Stream",
    "StudentBackend",
    "StudentBackendError",
    "TextCompletion",
    "TrackedClient",
    "Tracker",
    "TrackerState",
    "TrackerStats",
    "get_reward",
    "group_from_tracker",
    "register_reward",
    "sample_group",
]
