"""A published version that cannot be loaded is refused by name and the student keeps sampling with the version
it has: a torn folder (``LATEST`` names it, its ``distillq-checkpoint.json`` is missing), a corrupt safetensors
header, a tensor holding NaN. For a local transformers student (``HFStudent.load_weights``, through the rollout
stage) and for servers kept in sync (``SyncedStudent``: the server is never told to load it)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from pipeline import metrics
from pipeline.cli.attention import attention
from pipeline.cli.streamstats import Snapshot, worker_of
from pipeline.demo.tinymodels import ensure_tiny_models
from pipeline.learner.publish import publish_weights
from pipeline.models.weights import MARKER, CheckpointError, folder_name, load_causal_lm, load_weights
from pipeline.rollout.rewards import exact_match
from pipeline.rollout.students.base import GenParams
from pipeline.rollout.students.hf import HFStudent
from pipeline.rollout.students.vllm import VLLMStudent
from pipeline.rollout.sync_engines import VLLMEngine
from pipeline.rollout.synced import SyncedStudent
from pipeline.stages.liveness import Beat
from pipeline.stages.rollout_stage import RolloutConfig, RolloutStage
from pipeline.transport.prompts import PromptJob
from tests.stubs.sync_stub import VLLMSyncStub

NAME = "tiny-student"
PARAM = "model.embed_tokens.weight"


def model(scale: float = 1.0, nan: bool = False) -> Any:
    m = load_causal_lm(ensure_tiny_models().student)
    with torch.no_grad():
        p = dict(m.named_parameters())[PARAM]
        p.mul_(scale)
        if nan:
            p[3, 1] = float("nan")
    return m


def publish(version: int, weights: Path, m: Any | None = None) -> Path:
    publish_weights(m if m is not None else model(1.0 + version / 100), version, weights, keep=10,
                    publish=lambda v: None)
    return weights / folder_name(version)


def torn(version: int, weights: Path) -> None:
    (publish(version, weights) / MARKER).unlink()  # LATEST names a folder whose marker never came


def corrupt_header(version: int, weights: Path) -> None:
    f = publish(version, weights) / "model.safetensors"
    with f.open("r+b") as fh:  # same size (the marker's check passes), unreadable header
        fh.seek(8)
        fh.write(b"\xff\x00not json")


def with_nan(version: int, weights: Path) -> None:
    publish(version, weights, model(nan=True))


BREAK: dict[str, tuple[Callable[[int, Path], None], str, str]] = {
    "torn": (torn, "incomplete", f"has no {MARKER}"),
    "corrupt_header": (corrupt_header, "corrupt", "unreadable safetensors header"),
    "nan_tensor": (with_nan, "non_finite", f"tensor {PARAM} holds 1 NaN or infinite value(s)"),
}


def refused_count(kind: str) -> float:
    return float(metrics.CHECKPOINTS_NOT_LOADABLE.labels(kind)._value.get())


def test_each_fault_is_a_checkpoint_error_of_its_kind(tmp_path: Path) -> None:
    for i, (name, (breaks, kind, words)) in enumerate(BREAK.items()):
        weights = tmp_path / name
        breaks(2 + i, weights)
        m = model()
        before = dict(m.named_parameters())[PARAM].detach().clone()
        with pytest.raises(CheckpointError) as info:
            load_weights(m, weights)
        assert info.value.kind == kind and info.value.version == 2 + i and words in str(info.value)
        assert torch.equal(dict(m.named_parameters())[PARAM], before)  # nothing copied before the refusal


@pytest.fixture
def student() -> HFStudent:
    return HFStudent.from_pretrained(ensure_tiny_models().student)


@pytest.mark.parametrize("fault", list(BREAK))
async def test_local_student_refuses_and_keeps_sampling_with_its_version(
    student: HFStudent, tmp_path: Path, fault: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    weights = tmp_path / "weights"
    publish(1, weights)
    assert await student.load_weights(weights) == 1
    kept = dict(student.model.named_parameters())[PARAM].detach().clone()
    breaks, kind, words = BREAK[fault]
    breaks(2, weights)
    counted = refused_count(kind)
    versions = iter([2, 2, 2])

    async def published() -> int:
        return next(versions)

    stage = RolloutStage(student, exact_match, RolloutConfig(group_size=2, weights_dir=str(weights)), published)
    stage.loaded = 1
    group = await stage.sample(PromptJob(id="p", prompt="1+2="), epoch=0)  # a job: sampled with v1
    assert group is not None and group.policy_version == 1
    assert all(s.logprobs is not None and np.isfinite(s.logprobs.numpy()).all() for s in group.sequences)
    refusals = student.checkpoint_refusals
    assert refusals.last is not None and refusals.last.version == 2 and refusals.last.kind == kind
    assert words in refusals.last.error and refusals.last.kept == 1
    report = refusals.report()
    assert report is not None and report.startswith(f"checkpoint_not_loadable: v2 refused ({kind}: ")
    assert report.endswith("sampling with v1")
    # the rollout worker's heartbeat carries it
    assert stage.report() == {"checkpoint_not_loadable": report, "weights_version": 1}
    shown = attention(Snapshot(namespace="ns", time=0.0, streams={}, dead_letters=0, max_backlog=1,
                               workers=[worker_of(Beat("rollout", "r1", {"pid": 1, **stage.report()}, 0.5))]))
    assert shown == [f"rollout r1: {report} (the published folder is torn or holds bad tensors; publish the version "
                     "again)"]
    assert torch.equal(dict(student.model.named_parameters())[PARAM], kept) and student.version == 1

    reads: list[str] = []
    import safetensors.torch

    real = safetensors.torch.load_file
    monkeypatch.setattr(safetensors.torch, "load_file", lambda f, *a, **k: reads.append(f) or real(f, *a, **k))
    assert await stage.sample(PromptJob(id="q", prompt="2+2="), epoch=0) is not None  # the next job: same folder
    assert reads == [] and refusals.count == 1 and refused_count(kind) == counted + 1  # once, not per job

    publish(3, weights)  # the learner publishes a good version: loaded, the refusal is over
    assert await student.load_weights(weights) == 3
    assert refusals.report() is None and student.version == 3
    assert stage.report()["checkpoint_not_loadable"] is None


# --- servers kept in sync -----------------------------------------------------------------------------------


@pytest.fixture
async def stub() -> AsyncIterator[VLLMSyncStub]:
    server = VLLMSyncStub(NAME, str(ensure_tiny_models().student.resolve()))
    await server.start()
    yield server
    await server.stop()


@pytest.mark.parametrize("fault", list(BREAK))
async def test_servers_are_never_told_to_load_a_refused_version(stub: VLLMSyncStub, tmp_path: Path,
                                                                 fault: str) -> None:
    weights = tmp_path / "weights"
    tok = AutoTokenizer.from_pretrained(str(ensure_tiny_models().student))
    student = SyncedStudent([VLLMStudent(stub.url, NAME, tok)], [VLLMEngine(stub.url)], str(weights), poll_s=0.05,
                            wait_s=2)
    publish(1, weights)
    await student.start()
    assert stub.label == "1" and student.states[0].usable()
    reloads = len([p for p in stub.paths() if p == "/collective_rpc"])
    breaks, kind, words = BREAK[fault]
    breaks(2, weights)
    counted, bad = refused_count(kind), float(metrics.WEIGHT_SYNCS.labels("bad_checkpoint")._value.get())
    for _ in range(3):
        await student.sync_once()
    assert len([p for p in stub.paths() if p == "/collective_rpc"]) == reloads  # never told to reload
    assert stub.label == "1" and not stub.paused and student.states[0].usable()
    await student.generate([1, 2, 3], GenParams(max_tokens=2))  # it keeps serving v1
    refusals = student.checkpoint_refusals
    assert refusals.last is not None and refusals.last.kind == kind and words in refusals.last.error
    assert refusals.report() == refusals.last.line() and (refusals.report() or "").endswith("sampling with v1")
    assert refused_count(kind) == counted + 1  # one per version, not one per poll
    assert metrics.WEIGHT_SYNCS.labels("bad_checkpoint")._value.get() == bad + 1
    publish(3, weights)
    await student.sync_once()
    assert stub.label == "3" and refusals.report() is None
    await student.aclose()
