"""Weight sync without a real server: the decisions (``weight_sync``), and ``SyncedStudent`` against
stand-in HTTP servers (tests/stubs/sync_stub.py: vLLM 0.32's shapes, and SGLang's documented shapes;
SGLang itself does not run here)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from pipeline import metrics
from pipeline.demo.tinymodels import ensure_tiny_models
from pipeline.learner.publish import publish_weights
from pipeline.models.weights import load_causal_lm
from pipeline.rollout.students.base import GenParams, StudentBackendError
from pipeline.rollout.students.vllm import VLLMStudent
from pipeline.rollout.sync_engines import SGLangEngine, VLLMEngine, VLLMLoraEngine
from pipeline.rollout.synced import SyncedStudent
from pipeline.rollout.weight_sync import (
    ServerState,
    attribute,
    attribution,
    needs_sync,
    parse_version,
    record,
    request_version,
    retry_delay_s,
)  # fmt: skip
from pipeline.stages.rollout_stage import RESAMPLES, sample_attributed
from tests.stubs.sync_stub import SGLangSyncStub, VLLMSyncStub

NAME = "tiny-student"


def test_versions_come_from_the_server_label() -> None:
    assert parse_version("7", anything_published=True) == 7
    assert parse_version("default", anything_published=False) == 0  # the weights it started with
    assert parse_version("default", anything_published=True) is None  # must be synced first
    assert parse_version("unsynced", anything_published=False) is None
    assert needs_sync(None, 3) and needs_sync(2, 3)
    assert not needs_sync(3, 3) and not needs_sync(4, 3) and not needs_sync(None, None)  # never backwards
    assert request_version(2, 2) == 2 and request_version(2, 3) is None and request_version(None, None) is None
    assert attribute([2, 2]) == 2 and attribute([2, 3]) is None and attribute([]) is None
    assert attribute([2, None]) is None
    with attribution() as seen:
        record(4)
        with attribution() as inner:
            record(5)
    assert seen == [4] and inner == [5]
    record(6)  # outside any attribution: ignored


def test_failed_server_backs_off_and_comes_back() -> None:
    s = ServerState("u", in_rotation=True)
    assert s.failed("boom", now=100.0) and not s.in_rotation and 100.0 <= s.retry_at <= 100.5
    assert not s.failed("boom", now=100.0) and 100.0 <= s.retry_at <= 101.0  # the ceiling doubles
    assert all(0.0 <= retry_delay_s(n) <= 30.0 for n in (50, 10**6))  # capped, however many failures
    assert len({retry_delay_s(5) for _ in range(20)}) > 1  # jittered: workers do not come back together
    s.synced(3)
    assert s.usable() and s.version == 3 and s.failures == 0


@pytest.fixture
def weights(tmp_path: Path) -> Path:
    return tmp_path / "weights"


def publish(version: int, weights: Path, which: str = "student") -> None:
    tiny = ensure_tiny_models()
    model = load_causal_lm(tiny.student if which == "student" else tiny.teacher)
    publish_weights(model, version, weights, publish=lambda v: None)


@pytest.fixture
async def stubs() -> AsyncIterator[list[VLLMSyncStub]]:
    root = str(ensure_tiny_models().student.resolve())
    servers = [VLLMSyncStub(NAME, root), VLLMSyncStub(NAME, root)]
    for s in servers:
        await s.start()
    yield servers
    for s in servers:
        await s.stop()


def synced(urls: list[str], weights: Path, engines: list[Any] | None = None) -> SyncedStudent:
    tok = AutoTokenizer.from_pretrained(str(ensure_tiny_models().student))
    students = [VLLMStudent(u, NAME, tok) for u in urls]
    return SyncedStudent(students, engines or [VLLMEngine(u) for u in urls], str(weights), poll_s=0.05, wait_s=2)


def count(outcome: str) -> float:
    return metrics.WEIGHT_SYNCS.labels(outcome)._value.get()


async def test_each_server_paused_reloaded_labelled_resumed(stubs: list[VLLMSyncStub], weights: Path) -> None:
    student = synced([s.url for s in stubs], weights)
    await student.start()
    assert all(st.usable() and st.version == 0 for st in student.states)
    assert all("/pause?mode=wait" not in s.paths() for s in stubs)  # nothing published: not touched
    publish(1, weights)
    await student.sync_once()
    for s in stubs:
        sync = [(m, p, b) for m, p, b in s.calls if p not in ("/weight_info", "/v1/models")]
        assert [p for _, p, _ in sync] == ["/pause?mode=wait", "/collective_rpc", "/update_weight_version", "/resume"]
        assert sync[1][2] == {"method": "reload_weights", "kwargs": {"weights_path": str(weights / "v00000001")}}
        assert sync[2][2] == {"new_version": "1"} and s.label == "1" and not s.paused
    with attribution() as seen:
        for _ in range(4):
            await student.generate([1, 2, 3], GenParams(max_tokens=3), n=2)
    assert seen == [1, 1, 1, 1]
    assert [len([c for c in s.calls if c[1] == "/v1/completions"]) for s in stubs] == [2, 2]  # round-robin
    await student.aclose()


async def test_failed_reload_leaves_rotation_unsynced_and_paused_then_retried(
    stubs: list[VLLMSyncStub], weights: Path
) -> None:
    student = synced([s.url for s in stubs], weights)
    await student.start()
    publish(1, weights)
    bad, good = stubs
    bad.fail_reload = 1
    failed = count("failed")
    await student.sync_once()
    assert count("failed") == failed + 1
    assert not student.states[0].in_rotation and "reload of v1 failed" in student.states[0].error
    assert bad.label == "unsynced" and bad.paused  # never serves weights that are not a published version
    assert student.states[1].usable() and good.label == "1"  # the other one is synced on its own
    for _ in range(3):
        await student.generate([1, 2], GenParams(max_tokens=2))
    assert not any(p == "/v1/completions" for p in bad.paths())
    student.states[0].retry_at = 0.0  # the retry delay elapsed
    await student.sync_once()
    assert student.states[0].usable() and bad.label == "1" and not bad.paused
    await student.aclose()


async def test_dead_server_leaves_rotation_and_requests_go_elsewhere(stubs: list[VLLMSyncStub], weights: Path) -> None:
    student = synced([s.url for s in stubs], weights)
    await student.start()
    await stubs[0].stop()
    for _ in range(3):  # the first request to the dead one fails over to the other
        await student.generate([1, 2], GenParams(max_tokens=2))
    assert not student.states[0].in_rotation and student.states[1].usable()
    await stubs[1].stop()
    with pytest.raises(StudentBackendError):
        await student.generate([1, 2], GenParams(max_tokens=2))
    await student.aclose()


async def test_checkpoint_of_another_shape_refused_before_touching_the_server(
    stubs: list[VLLMSyncStub], weights: Path
) -> None:
    student = synced([stubs[0].url], weights)
    await student.start()
    publish(1, weights, which="teacher")
    refused = count("refused")
    await student.sync_once()
    await student.sync_once()
    assert count("refused") == refused + 1  # one error per version, not one per poll
    assert "/pause?mode=wait" not in stubs[0].paths() and "/collective_rpc" not in stubs[0].paths()
    assert student.states[0].usable() and stubs[0].label == "default"
    await student.aclose()


async def test_weights_changing_under_a_group_resample_then_drop(stubs: list[VLLMSyncStub], weights: Path) -> None:
    student = synced([stubs[0].url], weights)
    await student.start()
    publish(1, weights)
    await student.sync_once()
    bumps = [2]  # the first request sees the label change while it runs (another worker's reload)

    async def bump(stub: VLLMSyncStub) -> None:
        if bumps:
            stub.label = str(bumps.pop())

    stubs[0].during_request = bump

    async def once() -> Any:
        from pipeline.rollout.sampler import sample_group

        return await sample_group(student, "1+1=", group_size=2)

    before = metrics.UNATTRIBUTED_SAMPLES.labels("resampled")._value.get()
    group = await sample_attributed(once)
    assert group is not None and group.policy_version == 2  # the second sample ran on version 2 alone
    assert metrics.UNATTRIBUTED_SAMPLES.labels("resampled")._value.get() == before + 1

    async def always(stub: VLLMSyncStub) -> None:
        stub.label = str(int(stub.label) + 1)

    stubs[0].during_request = always
    dropped = metrics.UNATTRIBUTED_SAMPLES.labels("dropped")._value.get()
    assert await sample_attributed(once) is None
    assert metrics.UNATTRIBUTED_SAMPLES.labels("dropped")._value.get() == dropped + 1
    assert len([p for p in stubs[0].paths() if p == "/v1/completions"]) == 2 + RESAMPLES + 1
    await student.aclose()


async def test_lora_adapter_per_version_newest_used_old_unloaded(stubs: list[VLLMSyncStub], tmp_path: Path) -> None:
    peft = pytest.importorskip("peft")
    stub = stubs[0]
    weights = tmp_path / "w"
    student = synced([stub.url], weights, [VLLMLoraEngine(stub.url, NAME, keep=2)])
    base = load_causal_lm(ensure_tiny_models().student)
    with pytest.warns(FutureWarning):  # peft 0.21 calls a transformers 5 API that warns of its renaming
        model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    await student.start()
    for v in (1, 2, 3):
        publish_weights(model, v, weights, publish=lambda v: None)
        await student.sync_once()
        with attribution() as seen:
            await student.generate([1, 2], GenParams(max_tokens=2))
        assert seen == [v] and stub.models_seen[-1] == f"{NAME}-v{v}"
    assert sorted(stub.adapters) == [f"{NAME}-v2", f"{NAME}-v3"]  # the one before the newest stays loaded
    assert stub.adapters[f"{NAME}-v3"] == str(weights / "v00000003")
    assert "/collective_rpc" not in stub.paths()
    await student.aclose()


async def test_sglang_update_weights_from_disk(weights: Path) -> None:
    stub = SGLangSyncStub(str(ensure_tiny_models().student.resolve()))
    await stub.start()
    tok = AutoTokenizer.from_pretrained(str(ensure_tiny_models().student))
    student = SyncedStudent([VLLMStudent(stub.url, NAME, tok)], [SGLangEngine(stub.url)], str(weights), wait_s=1)
    await student.start()
    publish(1, weights)
    stub.fail = 1
    await student.sync_once()
    assert not student.states[0].in_rotation and "success" in student.states[0].error
    student.states[0].retry_at = 0.0
    await student.sync_once()
    assert student.states[0].usable() and stub.label == "1"
    update = [b for _, p, b in stub.calls if p == "/update_weights_from_disk"][-1]
    assert update == {"model_path": str(weights / "v00000001"), "weight_version": "1", "flush_cache": True,
                      "abort_all_requests": False}
    publish(2, weights, which="teacher")  # does not fit the served model: refused, not sent
    await student.sync_once()
    assert len([p for p in stub.paths() if p == "/update_weights_from_disk"]) == 2 and stub.label == "1"
    await student.aclose()
    await stub.stop()


async def test_serve_student_tags_each_group_with_its_servers_version(
    stubs: list[VLLMSyncStub], weights: Path
) -> None:
    """``serve student --weights-dir``: a rollout's requests all ran on one version -> its group carries it;
    a rollout whose requests straddle a reload is dropped and counted; groups never mix versions."""
    from pipeline.serve.student.service import FinishRequest, GenerateRequest, StudentServeConfig, StudentService

    student = synced([stubs[0].url], weights)
    await student.start()
    publish(1, weights)
    await student.sync_once()
    pushed: list[Any] = []

    async def sink(group: Any) -> None:
        pushed.append(group)

    config = StudentServeConfig(served_names=(NAME,), max_model_len=256, group_size=2, versions_from_server=True)
    service = StudentService(student, config, sink)

    async def rollout(session: str, turns: int = 1) -> dict[str, Any]:
        for _ in range(turns):
            await service.generate(GenerateRequest(model=NAME, token_ids=[1, 2, 3]), session)
        return await service.finish(session, FinishRequest(task="t", reward=1.0, policy_version=99))

    assert (await rollout("a"))["group"] is None  # waits for a second rollout of version 1
    stubs[0].label = "2"  # the server reloaded (another worker synced it)
    assert (await rollout("b"))["group"] is None  # version 2: another group, never mixed with "a"
    assert (await rollout("c"))["group"]["pushed"]
    assert [g.policy_version for g in pushed] == [2]
    dropped = metrics.UNATTRIBUTED_SAMPLES.labels("dropped")._value.get()
    bumps = ["3"]

    async def bump(stub: VLLMSyncStub) -> None:
        if bumps:
            stub.label = bumps.pop()

    stubs[0].during_request = bump
    out = await rollout("d", turns=2)
    assert "weights changed" in out["skipped"] and out["group"] is None
    assert metrics.UNATTRIBUTED_SAMPLES.labels("dropped")._value.get() == dropped + 1
    await student.aclose()


def test_demo_with_a_vllm_student_needs_the_venv() -> None:
    import os
    import subprocess
    import sys

    env = {**os.environ, "DISTILLQ_VLLM_PYTHON": "/nonexistent/python"}
    p = subprocess.run([sys.executable, "-m", "pipeline.cli.main", "demo", "--student", "vllm"], env=env,
                       capture_output=True, text=True, timeout=60, check=False)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and ".venv-vllm" in p.stderr, p.stderr
