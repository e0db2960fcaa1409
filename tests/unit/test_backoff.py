"""The one retry policy (``pipeline.backoff``): capped exponent, full jitter, never an overflow."""

from __future__ import annotations

import random

import pytest

from pipeline.backoff import MAX_EXPONENT, Backoff, BackoffPolicy


def test_a_million_attempts_never_overflow_and_stay_within_zero_and_cap() -> None:
    b = Backoff(base=0.01, cap=0.5)
    worst = 0.0
    for first in (0, 10**6 - 10**4):  # the first ten thousand attempts and the last ones up to the millionth
        b.attempt = first
        for _ in range(10**4):
            d = b.next_delay()
            assert 0.0 <= d <= 0.5
            worst = max(worst, d)
    assert b.attempt == 10**6 and worst > 0.45  # the cap is reached, not just never exceeded


def test_the_ceiling_doubles_from_base_up_to_cap_and_stays_there() -> None:
    p = BackoffPolicy(base=0.5, cap=30.0)
    assert [p.ceiling(n) for n in (1, 2, 3, 7, 8, 1031, 10**9)] == [0.5, 1.0, 2.0, 30.0, 30.0, 30.0, 30.0]
    assert p.ceiling(0) == p.ceiling(-5) == 0.5
    huge = BackoffPolicy(base=600.0, cap=float("inf"))  # no cap at all: the exponent still stops
    assert huge.ceiling(10**6) == 600.0 * 2.0**MAX_EXPONENT


def test_full_jitter_spreads_delays_over_zero_to_ceiling() -> None:
    p = BackoffPolicy(base=1.0, cap=8.0)
    rng = random.Random(7)
    delays = [p.delay(4, rng) for _ in range(2000)]
    assert 0.0 <= min(delays) < 0.5 and 7.5 < max(delays) <= 8.0
    assert 3.5 < sum(delays) / len(delays) < 4.5  # uniform over [0, 8]


def test_without_jitter_the_delay_is_the_ceiling() -> None:
    assert BackoffPolicy(0.25, 2.0, jitter=False).delay(3) == 1.0


def test_reset_starts_over() -> None:
    b = Backoff(base=1.0, cap=100.0)
    for _ in range(10):
        b.next_delay()
    b.reset()
    assert b.attempt == 0 and b.next_delay() <= 1.0 and (b.base, b.cap) == (1.0, 100.0)


def test_negative_or_nan_settings_are_refused() -> None:
    for base, cap in ((-1.0, 1.0), (0.1, -1.0), (float("nan"), 1.0)):
        with pytest.raises(ValueError, match="backoff"):
            BackoffPolicy(base, cap)
