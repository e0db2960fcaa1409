"""The chaos soak, CI's 5-minute variant (seed fixed): the whole pipeline, every fault kind of
``tests.reliability.chaos.KINDS`` injected at least once, and the soak's invariant asserted (every prompt
trained exactly once or dead-lettered with its reason, the Redis reset's loss named and covered, no group
trained twice, no bad teacher value in a batch). ``python -m bench.soak --minutes 60`` runs the long one.
The driver's own parts (schedule, learner record) are checked first, quickly."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bench.soak import main as soak_main
from tests.reliability.chaos import KINDS, TORN, LearnerRecord, Soak, SoakConfig, schedule, tear_folder
from tests.reliability.harness import report

SEED = 20261126


def test_schedule_is_reproducible_and_has_every_kind_with_one_reset_in_the_middle() -> None:
    cfg = SoakConfig(seconds=300, seed=SEED)
    plan = schedule(cfg)
    assert plan == schedule(SoakConfig(seconds=300, seed=SEED)) != schedule(SoakConfig(seconds=300, seed=SEED + 1))
    kinds = [k for _, k in plan]
    assert set(kinds) == set(KINDS) and kinds.count("redis_wipe") == 1
    assert kinds.index("redis_wipe") == len(kinds) // 2
    times = [t for t, _ in plan]
    assert times == sorted(times) and times[0] > 0 and times[-1] < cfg.fault_phase_s
    long = [k for _, k in schedule(SoakConfig(seconds=3600, seed=SEED))]
    assert len(long) > 200 and long.count("redis_wipe") == 1


def test_learner_record_counts_only_steps_a_restart_kept(tmp_path: Path) -> None:
    """Step 3 was recorded, then the learner died before its checkpoint: the restart restored step 2, so
    step 3's group was trained once (by the step recorded after the restart), not twice."""
    lines = [{"t": 1, "event": "start", "step": 0}, {"t": 2, "event": "step", "step": 1, "groups": ["a"]},
             {"t": 3, "event": "step", "step": 2, "groups": ["b"]},
             {"t": 4, "event": "step", "step": 3, "groups": ["c"]},
             {"t": 5, "event": "start", "step": 2}, {"t": 6, "event": "step", "step": 3, "groups": ["c"]},
             {"t": 7, "event": "step", "step": 4, "groups": ["b"]}]
    path = tmp_path / "learner.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"t": 8, "event": "st')  # a torn last line
    rec = LearnerRecord(path)
    rec.poll()
    assert rec.trained() == {"a": [2], "b": [3, 7], "c": [6]}  # b twice: a duplicate the soak reports


def test_the_invariant_names_each_kind_of_violation(tmp_path: Path) -> None:
    """``Soak.analyse`` on a made-up run: one prompt trained twice, one lost, one dead-lettered by a kill, one
    with a -9999 in its batch, two lost in a reset that no incident names (one of them finished before it)."""
    soak = Soak(SoakConfig(seed=SEED, workdir=tmp_path))
    soak.enqueued = {f"1:p{i:05d}": 1.0 for i in range(8)}
    steps = [(2, ["1:p00000", "1:p00001"], {}), (3, ["1:p00001"], {}), (4, ["1:p00004"], {"1:p00004": "-9999"}),
             (5, ["1:p00005", "1:p00006"], {}), (6, ["1:p00007"], {})]
    soak.record.starts = [{"t": 0.0, "event": "start", "step": 0}]
    soak.record.steps = [{"t": float(t), "event": "step", "step": t - 1, "batch_id": f"b{t}", "groups": g,
                          "bad_teacher": bad} for t, g, bad in steps]
    soak.dead = {"1:p00003": ["max_deliveries: delivered 6 times"], "1:p00007": ["teacher_dropped: invalid_logprobs"]}
    soak.wipe_at, soak.at_risk = 4.5, {"1:p00005"}
    soak.reenqueued = ["1:p00005", "1:p00002"]
    result = soak.analyse(10.0, 8.0)
    text = "\n".join(result.violations)
    assert "trained twice or more: 1 groups" in text and "1:p00001" in text
    assert "lost (neither trained nor dead-lettered): 1, e.g. ['1:p00002']" in text
    assert "dead-lettered by faults that must lose nothing: {'max_deliveries': 1}" in text
    assert "bad teacher values reached 1 batches" in text
    assert "lost outside the reset" in text and "no incident names it" in text
    assert len(result.violations) == 6
    assert result.figures["duplicates"] == 1 and result.figures["dead_lettered"] == 1  # p00007 was trained


def test_the_invariant_counts_trims_and_their_resampled_groups(tmp_path: Path) -> None:
    """Three entries trimmed and an incident counting one; a trimmed group trained under its own id and again
    re-sampled (trained twice); another re-sampled and trained once (counted as its prompt); one refused."""
    soak = Soak(SoakConfig(seed=SEED, workdir=tmp_path))
    soak.enqueued = {f"1:p{i:05d}": 1.0 for i in range(3)}
    soak.trimmed = dict.fromkeys(soak.enqueued, 2.0)
    soak.trim_count = 3
    soak.incidents = [{"kind": "stream_trimmed", "text": "1 entries of stream {soak:rollouts} were removed"}]
    soak.resampled = {"1:p00000@v4": "1:p00000", "1:p00001@v4": "1:p00001"}
    soak.resample_refused = ["kept 1:p00002 neither stale nor lost: ..."]
    soak.record.starts = [{"t": 0.0, "event": "start", "step": 0}]
    soak.record.steps = [{"t": float(t), "event": "step", "step": t, "batch_id": f"b{t}", "groups": g,
                          "bad_teacher": {}} for t, g in ((1, ["1:p00000", "1:p00002"]), (2, ["1:p00000@v4"]),
                                                            (3, ["1:p00001@v4"]))]
    result = soak.analyse(10.0, 8.0)
    text = "\n".join(result.violations)
    assert "trained twice or more: 1 groups" in text and "1:p00000" in text
    assert "3 rollouts entries trimmed, stream_trimmed incidents count 1" in text
    assert "dlq resample refused trimmed groups left unfinished" in text
    assert len(result.violations) == 3, text
    assert result.figures["trained"] == 3 and result.figures["lost"] == 0 and result.figures["unknown"] == 0


def test_torn_versions_are_torn_as_named(tmp_path: Path) -> None:
    """Each way the soak tears a version: no marker; the marker with a shard shorter than it says; the marker
    and every size right, with one tensor all NaN."""
    from pipeline.demo.tinymodels import ensure_tiny_models
    from pipeline.learner.publish import write_checkpoint
    from pipeline.models.weights import MARKER, folder_name, load_causal_lm

    student = ensure_tiny_models().student
    good = write_checkpoint(load_causal_lm(student), 1, tmp_path, tokenizer_dir=student)
    folders = {v: tmp_path / folder_name(2 + i) for i, v in enumerate(TORN)}
    for variant, folder in folders.items():
        tear_folder(folder, student, good, variant)
    assert not (folders["no_marker"] / MARKER).exists()
    for variant in ("truncated", "nan"):
        marker = json.loads((folders[variant] / MARKER).read_text())
        assert marker["version"] == int(folders[variant].name[1:])
        size = (folders[variant] / "model.safetensors").stat().st_size
        assert (size == marker["files"]["model.safetensors"]) is (variant == "nan")
    from safetensors.numpy import load_file

    tensors = load_file(str(folders["nan"] / "model.safetensors"))
    assert sum(bool(np.isnan(t).all()) for t in tensors.values()) == 1


def test_bench_soak_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        soak_main(["--help"])
    assert e.value.code == 0 and "--minutes" in capsys.readouterr().out


@pytest.mark.reliability
@pytest.mark.redis
@pytest.mark.slow
@pytest.mark.timeout(420)
async def test_chaos_soak_keeps_its_invariant(tmp_path: Path) -> None:
    result = await Soak(SoakConfig(seconds=300, seed=SEED, workdir=tmp_path)).run()
    report("chaos_soak", **result.figures)
    print(result.summary(), flush=True)  # with the violations, findings and unexpected exits, if any
    injected = {f.kind for f in result.faults}
    assert injected == set(KINDS), f"fault kinds not injected: {set(KINDS) - injected}"
    assert result.figures["trained"] > 0
    assert not result.violations, result.summary()
    assert not result.exits, result.summary()
