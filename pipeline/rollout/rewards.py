"""Reward functions: a small protocol, a math-answer checker, a no-reward default and a registry.

A reward function takes the completion text and the expected answer (``None`` when the task has none)
and returns a float, or an awaitable of one (for judges that call out); ``score`` handles both.
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Awaitable
from fractions import Fraction
from typing import Protocol

__all__ = [
    "RewardFn",
    "exact_match",
    "extract_answer",
    "get_reward",
    "math_answer",
    "no_reward",
    "parse_number",
    "register_reward",
    "reward_names",
    "score",
]


class RewardFn(Protocol):
    def __call__(self, completion: str, answer: str | None, /) -> float | Awaitable[float]: ...


_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_FRAC = re.compile(r"^\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}$")
_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (nested braces allowed), or None."""
    starts = [m.end() for m in _BOX.finditer(text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                return text[start:i].strip()
    return None


def extract_answer(text: str) -> str | None:
    """The final answer in ``text``: the last boxed expression, else the text after the last ``####``
    (GSM8K style), else the last number. None when there is none."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip()
        if tail:
            return tail
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def parse_number(s: str) -> Fraction | None:
    """``s`` as an exact rational: integers, decimals, ``a/b``, ``\\frac{a}{b}``, ``1,000``, ``50%``."""
    t = s.strip().strip("$").replace(" ", "").replace("\\!", "").replace(",", "")
    t = t.removesuffix(".").removesuffix("\\%").removesuffix("%")
    m = _FRAC.match(t)
    if m:
        num, den = parse_number(m.group(1)), parse_number(m.group(2))
        return num / den if num is not None and den else None
    try:
        value = Fraction(t)
    except (ValueError, ZeroDivisionError):
        return None
    return value


def _normalise(s: str) -> str:
    return s.strip().strip("$").replace(" ", "").removesuffix(".").lower()


def _reference(answer: str) -> str:
    """The expected answer: its boxed part or GSM8K ``#### x`` tail if present, else all of it."""
    boxed = _last_boxed(answer)
    if boxed is not None:
        return boxed
    tail = answer.rsplit("####", 1)[1].strip() if "####" in answer else ""
    return tail or answer.strip()


def math_answer(completion: str, answer: str | None, /) -> float:
    """1.0 when the completion's final answer equals the expected one (numerically when both parse)."""
    if answer is None:
        return 0.0
    got = extract_answer(completion)
    if got is None:
        return 0.0
    want = _reference(answer)
    a, b = parse_number(got), parse_number(want)
    if a is not None and b is not None:
        if a == b:
            return 1.0
        return 1.0 if math.isclose(float(a), float(b), rel_tol=1e-6, abs_tol=1e-9) else 0.0
    return 1.0 if _normalise(got) == _normalise(want) else 0.0


def exact_match(completion: str, answer: str | None, /) -> float:
    """1.0 when the stripped completion equals the stripped answer."""
    return 1.0 if answer is not None and completion.strip() == answer.strip() else 0.0


def no_reward(completion: str, answer: str | None, /) -> float:
    """The default: every completion scores 0.0 (pure distillation needs no reward)."""
    return 0.0


_REGISTRY: dict[str, RewardFn] = {"none": no_reward, "math": math_answer, "exact": exact_match}


def register_reward(name: str, fn: RewardFn, *, replace: bool = False) -> None:
    if name in _REGISTRY and not replace:
        raise ValueError(f"reward {name!r} is already registered (pass replace=True)")
    _REGISTRY[name] = fn


def reward_names() -> list[str]:
    return sorted(_REGISTRY)


def get_reward(name: str | None) -> RewardFn:
    """The reward registered as ``name`` (``None`` or ``""`` means ``"none"``)."""
    key = name or "none"
    try:
        return _REGISTRY[key]
    except KeyError:
        raise KeyError(f"unknown reward {key!r}; registered: {', '.join(reward_names())}") from None


async def score(fn: RewardFn, completion: str, answer: str | None) -> float:
    """Call ``fn`` (sync or async) and return a finite float."""
    result = fn(completion, answer)
    value = float(await result) if inspect.isawaitable(result) else float(result)
    if not math.isfinite(value):
        raise ValueError(f"reward function returned {value}")
    return value
