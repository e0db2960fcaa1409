"""Weight sync against a real vLLM server (CPU build, its own venv; skipped without it).

A learner publishes (``publish_weights``), ``SyncedStudent`` reloads the server in place; the server then
names the new version and its prompt logprobs equal a transformers forward of the published weights. A
half-written folder and a checkpoint of another shape are never loaded; a server killed with SIGKILL in
the middle of a reload leaves the rotation and is synced again before it serves after a restart.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from pipeline import metrics
from pipeline.demo.tinymodels import ensure_tiny_models
from pipeline.learner.publish import publish_weights
from pipeline.models.weights import LATEST, MARKER, folder_name, load_causal_lm
from pipeline.rollout.students.base import GenParams
from pipeline.rollout.students.vllm import VLLMStudent
from pipeline.rollout.sync_engines import VLLMEngine
from pipeline.rollout.synced import SyncedStudent
from pipeline.rollout.weight_sync import attribute, attribution
from tests.redis_server import free_port
from tests.vllm_server import PIDS, START_TIMEOUT_S, needs_vllm, vllm_server

NAME = "tiny-student"
TOL = 1e-4
PROMPT = [3, 310, 16, 24, 34, 4, 40, 41, 42, 7]
DEV = {"VLLM_SERVER_DEV_MODE": "1"}
EXTRA = ("--max-model-len", "256", "--max-num-seqs", "8", "--gpu-memory-utilization", "0.1")

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(3 * START_TIMEOUT_S), needs_vllm]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("vllm-sync") / "server.log"
    with vllm_server(ensure_tiny_models().student.resolve(), NAME, log, *EXTRA, env=DEV) as url:
        yield url


def perturbed(seed: int) -> Any:
    model = load_causal_lm(ensure_tiny_models().student)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model


def prompt_logprobs(url: str, ids: list[int]) -> np.ndarray:
    """The server's logprob of ids[p] given ids[:p], p >= 1."""
    body = {"model": NAME, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 0.0}
    resp = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    entries = resp.json()["choices"][0]["prompt_logprobs"]
    return np.array([e[str(t)]["logprob"] for e, t in zip(entries[1:], ids[1:], strict=True)])


def reference_logprobs(model: Any, ids: list[int]) -> np.ndarray:
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0].numpy()


def weight_version(url: str) -> str:
    return str(httpx.get(f"{url}/weight_info", timeout=10).json()["weight_version"])


def synced_student(url: str, weights: Path) -> SyncedStudent:
    tok = AutoTokenizer.from_pretrained(str(ensure_tiny_models().student))
    return SyncedStudent([VLLMStudent(url, NAME, tok)], [VLLMEngine(url)], str(weights), poll_s=0.2, wait_s=60)


def publish(model: Any, version: int, weights: Path) -> Path:
    path = publish_weights(model, version, weights, keep=2, publish=lambda v: None,
                           tokenizer_dir=ensure_tiny_models().student)
    assert path is not None
    return path


def count(outcome: str) -> float:
    return metrics.WEIGHT_SYNCS.labels(outcome)._value.get()


async def test_publish_sync_logprobs_and_refusals(server: str, tmp_path: Path) -> None:
    weights = tmp_path / "weights"
    student = synced_student(server, weights)
    try:
        await student.start()  # nothing published: the served weights are version 0
        assert student.states[0].in_rotation and student.states[0].version == 0
        for version in (1, 2):
            model = perturbed(version)
            publish(model, version, weights)
            await student.sync_once()
            assert weight_version(server) == str(version)
            got = prompt_logprobs(server, PROMPT)
            np.testing.assert_allclose(got, reference_logprobs(model, PROMPT), atol=TOL, rtol=0)
            with attribution() as seen:
                comps = await student.generate(PROMPT, GenParams(max_tokens=4, temperature=1.0, seed=version), n=2)
            assert attribute(seen) == version and len(comps) == 2
        assert sorted(p.name for p in weights.iterdir()) == [LATEST, folder_name(1), folder_name(2)]
        good = prompt_logprobs(server, PROMPT)

        # A half-written version 3: the folder renamed in place by a writer that skipped the protocol, its
        # shard cut short, and LATEST already naming it. Refused before the server is touched.
        torn = publish(perturbed(3), 3, weights)
        shard = torn / "model.safetensors"
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
        (weights / ".tmp-v00000004-1").mkdir()  # a write that died before its rename: never looked at
        bad = count("bad_checkpoint")
        await student.sync_once()
        assert count("bad_checkpoint") == bad + 1
        assert weight_version(server) == "2" and student.states[0].usable()
        np.testing.assert_array_equal(prompt_logprobs(server, PROMPT), good)

        # A checkpoint of another shape (the teacher: hidden 128, 4 layers) is refused with one error.
        teacher = load_causal_lm(ensure_tiny_models().teacher)
        publish(teacher, 5, weights)
        refused = count("refused")
        await student.sync_once()
        await student.sync_once()  # refused once, logged once
        assert count("refused") == refused + 1
        assert weight_version(server) == "2" and student.states[0].usable()
        np.testing.assert_array_equal(prompt_logprobs(server, PROMPT), good)
    finally:
        await student.aclose()


class KillAfterPause(httpx.AsyncBaseTransport):
    """Kills the server's whole process group (SIGKILL) as soon as it answers the ``/pause`` of a reload."""

    def __init__(self, pid: int) -> None:
        self.inner, self.pid, self.killed = httpx.AsyncHTTPTransport(), pid, False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        resp = await self.inner.handle_async_request(request)
        if request.url.path == "/pause" and not self.killed:
            self.killed = True
            await resp.aread()
            os.killpg(self.pid, signal.SIGKILL)
        return resp


async def test_kill_during_reload_leaves_rotation_then_resyncs(tmp_path: Path) -> None:
    weights, port = tmp_path / "weights", free_port()
    model_dir = tmp_path / "served"
    shutil.copytree(ensure_tiny_models().student, model_dir)
    v1 = perturbed(11)
    with vllm_server(model_dir, NAME, tmp_path / "a.log", *EXTRA, port=port, env=DEV) as url:
        student = synced_student(url, weights)
        await student.start()
        killer = KillAfterPause(PIDS[url])
        await student.engines[0].aclose()
        student.engines[0] = VLLMEngine(url, transport=killer)
        publish(v1, 1, weights)
        failed = count("failed")
        await student.sync_once()
        assert killer.killed and count("failed") == failed + 1
        assert not student.states[0].in_rotation and "reload of v1 failed" in student.states[0].error
        with pytest.raises(Exception, match="no student server in the rotation"):
            student.wait_s = 1.0
            await student.generate(PROMPT, GenParams(max_tokens=2))
    await student.engines[0].aclose()
    student.engines[0] = VLLMEngine(url)
    with vllm_server(model_dir, NAME, tmp_path / "b.log", *EXTRA, port=port, env=DEV):
        assert weight_version(url) == "default"  # restarted on its original weights
        student.wait_s = 60.0
        for _ in range(200):
            await student.sync_once()
            if student.states[0].in_rotation:
                break
            await asyncio.sleep(0.5)
        assert student.states[0].usable() and weight_version(url) == "1"
        np.testing.assert_allclose(prompt_logprobs(url, PROMPT), reference_logprobs(v1, PROMPT), atol=TOL, rtol=0)
        with attribution() as seen:
            await student.generate(PROMPT, GenParams(max_tokens=2, seed=1))
        assert attribute(seen) == 1
        await student.aclose()
    assert (weights / folder_name(1) / MARKER).exists()


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # peft 0.21
async def test_lora_adapters_hot_loaded_newest_used_old_unloaded(tmp_path: Path) -> None:
    """A LoRA student: each published adapter is loaded as NAME-vN, requests go to the newest, and its prompt
    logprobs equal the merged transformers model; adapters older than the previous one are unloaded."""
    import copy

    peft = pytest.importorskip("peft")
    from pipeline.rollout.sync_engines import VLLMLoraEngine

    weights = tmp_path / "weights"
    env = {**DEV, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    lora = ("--enable-lora", "--max-lora-rank", "8", "--max-loras", "2")
    with vllm_server(ensure_tiny_models().student.resolve(), NAME, tmp_path / "lora.log", *EXTRA, *lora,
                     env=env) as url:
        tok = AutoTokenizer.from_pretrained(str(ensure_tiny_models().student))
        student = SyncedStudent([VLLMStudent(url, NAME, tok)], [VLLMLoraEngine(url, NAME)], str(weights), wait_s=60)
        await student.start()
        model = peft.get_peft_model(load_causal_lm(ensure_tiny_models().student),
                                    peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
        g = torch.Generator().manual_seed(0)
        for version in (1, 2, 3):
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if "lora_" in name:
                        p.copy_(0.2 * torch.randn(p.shape, generator=g))
            publish_weights(model, version, weights, publish=lambda v: None)
            await student.sync_once()
            merged = copy.deepcopy(model).merge_and_unload()
            with attribution() as seen:
                await student.generate(PROMPT, GenParams(max_tokens=2, seed=version))
            assert attribute(seen) == version and student.students[0].model == f"{NAME}-v{version}"
            body = {"model": f"{NAME}-v{version}", "prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 0}
            entries = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]["prompt_logprobs"]
            got = np.array([e[str(t)]["logprob"] for e, t in zip(entries[1:], PROMPT[1:], strict=True)])
            np.testing.assert_allclose(got, reference_logprobs(merged, PROMPT), atol=TOL, rtol=0)
        names = {m["id"] for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]}
        assert names == {NAME, f"{NAME}-v2", f"{NAME}-v3"}
        await student.aclose()
