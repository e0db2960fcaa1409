"""KL coefficient controllers: update rule, clipping, persistence round trip, validation."""

from __future__ import annotations

import json
import math
from collections.abc import Callable

import pytest

from pipeline.stages.kl_control import AdaptiveKL, ConstantKL, KLController, load_controller


def test_constant_never_changes() -> None:
    c = ConstantKL(0.05)
    for kl in (0.0, 1.0, 100.0):
        assert c.update(kl, 3) == 0.05
    assert c.value == 0.05
    assert isinstance(c, KLController)


def test_adaptive_matches_ziegler_rule() -> None:
    c = AdaptiveKL(0.1, target=6.0, horizon=10_000)
    kl, n = 6.6, 256  # error 0.1, inside the clip
    expected = 0.1 * (1 + (6.6 / 6.0 - 1) * n / 10_000)
    assert c.update(kl, n) == pytest.approx(expected, rel=1e-12)
    assert c.value == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(("kl", "direction"), [(12.0, 1), (9.0, 1), (3.0, -1), (0.0, -1), (6.0, 0)])
def test_adaptive_direction(kl: float, direction: int) -> None:
    c = AdaptiveKL(0.2, target=6.0, horizon=100)
    before = c.value
    after = c.update(kl, 10)
    if direction:
        assert math.copysign(1, after - before) == direction
    else:
        assert after == before


def test_error_is_clipped_to_0_2() -> None:
    hi, lo = AdaptiveKL(1.0, 1.0, 100), AdaptiveKL(1.0, 1.0, 100)
    assert hi.update(1000.0, 10) == pytest.approx(1.0 + 0.2 * 10 / 100)
    assert lo.update(0.0, 10) == pytest.approx(1.0 - 0.2 * 10 / 100)
    # Just past the clip behaves exactly like far past it.
    assert AdaptiveKL(1.0, 1.0, 100).update(1.25, 10) == hi.value


def test_closed_loop_converges_toward_target() -> None:
    # Toy plant: observed KL falls as the penalty coefficient rises (KL = 1 / coef).
    c = AdaptiveKL(0.1, target=2.0, horizon=50)
    for _ in range(400):
        c.update(1.0 / c.value, 5)
    assert 1.0 / c.value == pytest.approx(2.0, rel=0.02)


def test_coefficient_stays_positive_on_huge_steps() -> None:
    c = AdaptiveKL(1.0, 1.0, 1.0)
    assert c.update(0.0, 100) > 0


@pytest.mark.parametrize("make", [lambda: ConstantKL(0.3), lambda: AdaptiveKL(0.1, 4.0, 300)])
def test_state_round_trip_continues_identically(make: Callable[[], ConstantKL | AdaptiveKL]) -> None:
    a = make()
    observations = [(5.0, 4), (1.0, 2), (8.0, 7), (4.1, 1)]
    for kl, n in observations[:2]:
        a.update(kl, n)
    b = load_controller(a.to_json())
    c = type(a).from_state(a.state())
    assert type(b) is type(a) and b.state() == a.state() == c.state()
    for kl, n in observations[2:]:
        assert a.update(kl, n) == b.update(kl, n) == c.update(kl, n)
    assert b.state() == a.state()
    assert type(a).from_json(a.to_json().encode()).state() == a.state()


def test_from_json_of_wrong_class_is_rejected() -> None:
    with pytest.raises(ValueError, match="not a AdaptiveKL"):
        AdaptiveKL.from_json(ConstantKL(1.0).to_json())


@pytest.mark.parametrize(
    "text",
    [
        "",
        "not json",
        b"\xff\xfe",
        "[]",
        '{"kind": "adaptive"}',
        '{"kind": "pid", "state": {"coef": 1}}',
        '{"kind": "constant", "state": []}',
        '{"kind": "constant", "state": {}}',
        '{"kind": "constant", "state": {"coef": "1"}}',
        '{"kind": "constant", "state": {"coef": true}}',
        '{"kind": "constant", "state": {"coef": -1}}',
        '{"kind": "constant", "state": {"coef": NaN}}',
        '{"kind": "adaptive", "state": {"coef": 1, "target": 0, "horizon": 10}}',
        '{"kind": "adaptive", "state": {"coef": 1, "target": 1, "horizon": Infinity}}',
        '{"kind": "adaptive", "state": {"coef": 0, "target": 1, "horizon": 10}}',
        '{"kind": "adaptive", "state": {"coef": 1, "target": 1}}',
        '{"kind": "constant", "state": {"coef": 1}, "extra": 2}',
    ],
)
def test_garbage_json_raises_value_error(text: str | bytes) -> None:
    with pytest.raises(ValueError):
        load_controller(text)


def test_constructor_and_update_validation() -> None:
    with pytest.raises(ValueError):
        AdaptiveKL(0.1, target=-1.0, horizon=10)
    with pytest.raises(ValueError):
        ConstantKL(float("inf"))
    c = AdaptiveKL(0.1, 1.0, 10)
    for kl, n in ((float("nan"), 1), (1.0, -1)):
        with pytest.raises(ValueError):
            c.update(kl, n)
    assert c.value == 0.1  # a rejected observation leaves the state alone


def test_json_is_plain_and_stable() -> None:
    obj = json.loads(AdaptiveKL(0.1, 6.0, 10_000).to_json())
    assert obj == {
        "kind": "adaptive",
        "state": {"coef": 0.1, "target": 6.0, "horizon": 10_000.0, "steps": 0.0},
    }
