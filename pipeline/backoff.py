"""The one retry policy of distillq: capped exponential backoff with full jitter.

Every loop that waits before trying again (a Redis call, a full stream, a teacher call, a server start-up
probe, a weight sync, a crashed process's restart, learner ranks polling) takes its delays from here.
Before retry number ``attempt`` (1-based) the wait is drawn uniformly from ``[0, ceiling(attempt)]`` with
``ceiling(attempt) = min(cap, base * 2 ** (attempt - 1))`` ("full jitter": processes that failed together
do not retry together). The exponent stops growing at ``MAX_EXPONENT``, so an attempt counter of any size
(a wait of hours at a few milliseconds per try) gives a delay in ``[0, cap]`` and never overflows.

``BackoffPolicy`` is the value (base, cap, jitter); ``Backoff`` counts the attempts of one loop
(``next_delay`` after a failure, ``reset`` after a success).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Final

__all__ = ["MAX_EXPONENT", "Backoff", "BackoffPolicy"]

#: The exponent of ``2 ** (attempt - 1)`` stops here: 2**64 times any sane base is far above any cap, and
#: the float stays finite (``2.0 ** 1024`` would raise ``OverflowError``).
MAX_EXPONENT: Final = 64


@dataclass(frozen=True, slots=True)
class BackoffPolicy:
    """Delays in seconds: ``base`` before the first retry (its ceiling), doubling, at most ``cap``;
    ``jitter`` (default): drawn uniformly from ``[0, ceiling]``, else the ceiling itself."""

    base: float = 0.1
    cap: float = 5.0
    jitter: bool = True

    def __post_init__(self) -> None:
        if not (self.base >= 0 and self.cap >= 0):  # also refuses NaN
            raise ValueError(f"backoff base and cap must be >= 0, got base={self.base} cap={self.cap}")

    def ceiling(self, attempt: int) -> float:
        """The longest wait before retry number ``attempt`` (1-based; below 1 counts as 1)."""
        exponent = min(max(attempt - 1, 0), MAX_EXPONENT)
        return float(min(self.cap, self.base * 2.0**exponent))

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """The wait before retry number ``attempt``: in ``[0, ceiling(attempt)]`` (the ceiling without jitter)."""
        hi = self.ceiling(attempt)
        if not self.jitter:
            return hi
        return (rng or random).uniform(0.0, hi)


class Backoff:
    """The attempts of one retry loop under a ``BackoffPolicy``: ``next_delay`` after each failure,
    ``reset`` after a success."""

    def __init__(self, base: float = 0.1, cap: float = 5.0, *, jitter: bool = True,
                 policy: BackoffPolicy | None = None) -> None:
        self.policy = policy if policy is not None else BackoffPolicy(base, cap, jitter)
        self.attempt = 0

    @property
    def base(self) -> float:
        return self.policy.base

    @property
    def cap(self) -> float:
        return self.policy.cap

    def next_delay(self) -> float:
        """Count one more failure and return the wait before the next try."""
        self.attempt += 1
        return self.policy.delay(self.attempt)

    def reset(self) -> None:
        self.attempt = 0
