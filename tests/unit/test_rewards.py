"""Reward functions: answer extraction, the math checker, the default, the registry."""

from __future__ import annotations

from fractions import Fraction

import pytest

from pipeline.rollout.rewards import (
    exact_match,
    extract_answer,
    get_reward,
    math_answer,
    no_reward,
    parse_number,
    register_reward,
    reward_names,
    score,
)


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("12+3=15", "15"),
        ("First 3 then 4, so the answer is 1,234.", "1,234"),
        ("so x = \\boxed{\\frac{3}{4}} and 7 more", "\\frac{3}{4}"),
        ("\\boxed{1} then \\boxed{{2}+1}", "{2}+1"),
        ("The total is -2.5 degrees", "-2.5"),
        ("reasoning...\n#### 72", "72"),
        ("no digits here", None),
        ("\\boxed{unclosed 5", "5"),
    ],
)
def test_extract_answer(text: str, want: str | None) -> None:
    assert extract_answer(text) == want


@pytest.mark.parametrize(
    ("s", "want"),
    [
        ("42", Fraction(42)),
        ("1,000", Fraction(1000)),
        ("0.5", Fraction(1, 2)),
        ("3/4", Fraction(3, 4)),
        ("\\frac{3}{4}", Fraction(3, 4)),
        ("\\dfrac{-1}{2}", Fraction(-1, 2)),
        ("$12.$", Fraction(12)),
        ("50%", Fraction(50)),
        ("x+1", None),
        ("1/0", None),
        ("\\frac{1}{0}", None),
    ],
)
def test_parse_number(s: str, want: Fraction | None) -> None:
    assert parse_number(s) == want


@pytest.mark.parametrize(
    ("completion", "answer", "want"),
    [
        ("12+3=15", "15", 1.0),
        ("12+3=16", "15", 0.0),
        ("The answer is \\boxed{0.75}.", "3/4", 1.0),
        ("so \\boxed{\\frac{3}{4}}", "0.75", 1.0),
        ("We get 1,000 apples", "#### 1000", 1.0),
        ("0.3333333", "1/3", 1.0),
        ("0.33", "1/3", 0.0),
        ("\\boxed{x + 1}", "x+1", 1.0),
        ("\\boxed{x + 2}", "x+1", 0.0),
        ("I do not know", "15", 0.0),
        ("15", None, 0.0),
    ],
)
def test_math_answer(completion: str, answer: str | None, want: float) -> None:
    assert math_answer(completion, answer) == want


def test_defaults_and_registry() -> None:
    assert no_reward("anything", "15") == 0.0
    assert exact_match(" 15\n", "15") == 1.0 and exact_match("15 ", "16") == 0.0
    assert get_reward(None) is no_reward and get_reward("") is no_reward
    assert get_reward("math") is math_answer
    with pytest.raises(KeyError, match=r"unknown reward 'nope'.*math"):
        get_reward("nope")
    with pytest.raises(ValueError, match="already registered"):
        register_reward("math", no_reward)

    def length_reward(completion: str, answer: str | None, /) -> float:
        return float(len(completion))

    register_reward("test_length", length_reward)
    assert "test_length" in reward_names() and get_reward("test_length")("abc", None) == 3.0
    register_reward("test_length", no_reward, replace=True)
    assert get_reward("test_length") is no_reward


async def test_score_accepts_sync_and_async_and_rejects_non_finite() -> None:
    async def judge(completion: str, answer: str | None, /) -> float:
        return 0.25 if completion == answer else -1.0

    assert await score(judge, "a", "a") == 0.25
    assert await score(math_answer, "=15", "15") == 1.0
    with pytest.raises(ValueError, match="nan"):
        await score(lambda c, a: float("nan"), "a", None)
