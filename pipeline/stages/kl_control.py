"""KL-penalty coefficient controllers (Ziegler et al. 2019; TorchRL's Constant/AdaptiveKLController).

Pure logic: the trainer feeder calls ``update`` once per learner step with the observed KL and persists
``to_json()`` (e.g. in Redis); ``load_controller`` restores it, continuing exactly where it left off.

Adaptive rule: ``error = clip(observed_kl / target - 1, -0.2, 0.2)`` and
``coef *= 1 + error * n_steps / horizon``. A KL above target raises the coefficient, one below lowers it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any, ClassVar, Final, Protocol, Self, runtime_checkable

#: Bound on the proportional error, as in Ziegler et al. and TorchRL.
ERROR_CLIP: Final = 0.2


@runtime_checkable
class KLController(Protocol):
    """A KL coefficient that may adapt to the KL observed during training."""

    value: float

    def update(self, observed_kl: float, n_steps: int) -> float:
        """Account for ``n_steps`` steps that observed mean KL ``observed_kl``; return the new value."""
        ...

    def state(self) -> dict[str, float]:
        """Everything needed to continue identically (see ``from_state``)."""
        ...

    @classmethod
    def from_state(cls, state: Mapping[str, float]) -> Self:
        """Rebuild from ``state()``; raises ``ValueError`` on missing or invalid entries."""
        ...

    def to_json(self) -> str:
        """``{"kind": ..., "state": state()}`` as JSON text."""
        ...


def _number(state: Mapping[str, Any], key: str, *, positive: bool = False) -> float:
    """Fetch a finite, non-negative (or strictly positive) number from ``state``."""
    if key not in state:
        raise ValueError(f"KL controller state: missing {key!r}")
    v = state[key]
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise ValueError(f"KL controller state: {key}={v!r} is not a number")
    f = float(v)
    if not math.isfinite(f) or f < 0 or (positive and f == 0):
        bound = "> 0" if positive else ">= 0"
        raise ValueError(f"KL controller state: {key}={v!r} must be finite and {bound}")
    return f


def _check_observation(observed_kl: float, n_steps: int) -> None:
    if not math.isfinite(observed_kl):
        raise ValueError(f"observed KL {observed_kl!r} is not finite")
    if isinstance(n_steps, bool) or not isinstance(n_steps, int) or n_steps < 0:
        raise ValueError(f"n_steps {n_steps!r} must be an integer >= 0")


class _JSONMixin:
    KIND: ClassVar[str]

    def state(self) -> dict[str, float]:
        raise NotImplementedError

    def to_json(self) -> str:
        return json.dumps({"kind": self.KIND, "state": self.state()}, allow_nan=False)

    @classmethod
    def from_json(cls, data: str | bytes) -> Self:
        """Restore a controller of this class from ``to_json`` output; ``ValueError`` on garbage."""
        ctrl = load_controller(data)
        if not isinstance(ctrl, cls):
            raise ValueError(f"KL controller JSON holds a {type(ctrl).__name__}, not a {cls.__name__}")
        return ctrl


class ConstantKL(_JSONMixin):
    """A fixed coefficient; ``update`` only validates its input."""

    KIND: ClassVar[str] = "constant"

    def __init__(self, coef: float) -> None:
        self.value = _number({"coef": coef}, "coef")

    def update(self, observed_kl: float, n_steps: int) -> float:
        _check_observation(observed_kl, n_steps)
        return self.value

    def state(self) -> dict[str, float]:
        return {"coef": self.value}

    @classmethod
    def from_state(cls, state: Mapping[str, float]) -> Self:
        return cls(_number(state, "coef"))

    def __repr__(self) -> str:
        return f"ConstantKL(coef={self.value!r})"


class AdaptiveKL(_JSONMixin):
    """Proportional controller steering the observed KL toward ``target`` over ``horizon`` steps."""

    KIND: ClassVar[str] = "adaptive"

    def __init__(self, init_coef: float, target: float, horizon: float) -> None:
        self.value = _number({"init_coef": init_coef}, "init_coef", positive=True)
        self.target = _number({"target": target}, "target", positive=True)
        self.horizon = _number({"horizon": horizon}, "horizon", positive=True)
        self.steps = 0.0  # total n_steps accounted for, informational

    def update(self, observed_kl: float, n_steps: int) -> float:
        _check_observation(observed_kl, n_steps)
        error = min(max(observed_kl / self.target - 1.0, -ERROR_CLIP), ERROR_CLIP)
        # Keep the coefficient strictly positive even if n_steps / horizon is large.
        self.value = max(self.value * (1.0 + error * n_steps / self.horizon), 1e-12)
        self.steps += n_steps
        return self.value

    def state(self) -> dict[str, float]:
        return {"coef": self.value, "target": self.target, "horizon": self.horizon, "steps": self.steps}

    @classmethod
    def from_state(cls, state: Mapping[str, float]) -> Self:
        ctrl = cls(
            _number(state, "coef", positive=True),
            _number(state, "target", positive=True),
            _number(state, "horizon", positive=True),
        )
        ctrl.steps = _number(state, "steps") if "steps" in state else 0.0
        return ctrl

    def __repr__(self) -> str:
        return f"AdaptiveKL(coef={self.value!r}, target={self.target!r}, horizon={self.horizon!r})"


_KINDS: Final[dict[str, type[ConstantKL] | type[AdaptiveKL]]] = {
    ConstantKL.KIND: ConstantKL,
    AdaptiveKL.KIND: AdaptiveKL,
}


def load_controller(data: str | bytes) -> ConstantKL | AdaptiveKL:
    """Restore any controller from ``to_json`` output; raises ``ValueError`` on anything else.

    Unknown keys inside ``state`` are ignored (forward compatibility); the envelope must be exact.
    """
    try:
        obj = json.loads(data)
    except (ValueError, UnicodeDecodeError, TypeError) as e:
        raise ValueError(f"KL controller JSON is not valid JSON: {e}") from None
    if not isinstance(obj, dict) or set(obj) != {"kind", "state"}:
        raise ValueError("KL controller JSON must be an object with exactly 'kind' and 'state'")
    kind, state = obj["kind"], obj["state"]
    if not isinstance(kind, str) or kind not in _KINDS:
        raise ValueError(f"KL controller kind {kind!r} unknown (known: {sorted(_KINDS)})")
    if not isinstance(state, dict):
        raise ValueError("KL controller state must be an object")
    return _KINDS[kind].from_state(state)
