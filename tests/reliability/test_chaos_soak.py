"""The chaos soak, CI's 5-minute variant (seed fixed): the whole pipeline, every fault kind of
``tests.reliability.chaos.KINDS`` injected at least once, and the soak's invariant asserted (every prompt
trained exactly once or dead-lettered with its reason, the Redis reset's loss named and covered, no group
trained twice, no bad teacher value in a batch). ``python -m bench.soak --minutes 60`` runs the long one."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.reliability.chaos import KINDS, Soak, SoakConfig
from tests.reliability.harness import report

pytestmark = [pytest.mark.reliability, pytest.mark.redis, pytest.mark.slow, pytest.mark.timeout(420)]

SEED = 20261126


async def test_chaos_soak_keeps_its_invariant(tmp_path: Path) -> None:
    result = await Soak(SoakConfig(seconds=300, seed=SEED, workdir=tmp_path)).run()
    report("chaos_soak", **result.figures)
    injected = {f.kind for f in result.faults}
    assert injected == set(KINDS), f"fault kinds not injected: {set(KINDS) - injected}"
    assert result.figures["trained"] > 0
    assert not result.violations, result.summary()
    assert not result.exits, result.summary()
