"""The real demo's pacing knob and the side-by-side bench's one-change-at-a-time flags reach the processes."""

from __future__ import annotations

from pathlib import Path

from bench.vs_trl import parse
from pipeline.demo.real import RealDemoConfig, process_specs


def _argv(cfg: RealDemoConfig, name: str) -> list[str]:
    (spec,) = [s for s in process_specs(cfg, Path("/s"), Path("/t")) if s.name == name]
    return list(spec.argv)


def test_rollout_is_unpaced_by_default_and_paced_on_request(tmp_path: Path) -> None:
    base = RealDemoConfig(redis_url="redis://x", out=tmp_path, groups_per_batch=3)
    assert "--max-ahead" not in _argv(base, "rollout-0")
    paced = _argv(RealDemoConfig(redis_url="redis://x", out=tmp_path, groups_per_batch=3, max_ahead=0), "rollout-0")
    i = paced.index("--max-ahead")
    assert paced[i + 1] == "0" and paced[paced.index("--groups-per-step") + 1] == "3"


def test_one_change_flags() -> None:
    setup, _ = parse(["--on-policy", "--top-k", "128", "--pg-weight", "0.5", "--checkpoint-every", "4"])
    assert (setup.max_staleness, setup.max_ahead, setup.top_k, setup.pg_weight, setup.checkpoint_every) == (
        0, 0, 128, 0.5, 4)
    default, _ = parse([])
    assert (default.max_staleness, default.max_ahead, default.top_k) == (3, None, 64)


def test_learner_threads_reach_the_learner_only(tmp_path: Path) -> None:
    specs = {s.name: s for s in process_specs(RealDemoConfig(redis_url="redis://x", out=tmp_path, learner_threads=2),
                                              Path("/s"), Path("/t"))}
    assert specs["learner"].env["OMP_NUM_THREADS"] == "2"
    assert "OMP_NUM_THREADS" not in specs["rollout-0"].env
    setup, _ = parse(["--learner-threads", "2", "--max-ahead", "1"])
    assert (setup.learner_threads, setup.max_ahead, setup.max_staleness) == (2, 1, 3)
