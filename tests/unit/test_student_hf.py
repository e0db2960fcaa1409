"""Local transformers student: sampled ids and raw logprobs match an independent full forward pass; stop strings
come in ``GenParams``; the model loads in the dtype asked for (``load_causal_lm``, ``worker rollout --dtype``)."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeline.demo.tinymodels import ensure_tiny_models
from pipeline.models.weights import load_causal_lm
from pipeline.rollout.rewards import get_reward
from pipeline.rollout.sampler import sample_group
from pipeline.rollout.students.base import Completion, GenParams, StudentBackend, WeightReloader
from pipeline.rollout.students.hf import HFStudent, sample_next
from pipeline.rollout.students.vllm import VLLMStudent
from pipeline.rollout.tracker import Tracker
from schemas.codec import decode, encode
from schemas.messages import RolloutGroup
from workers import rollout

PROMPT_MESSAGES = [{"role": "user", "content": "12+3="}]


@pytest.fixture(scope="module")
def student() -> HFStudent:
    return HFStudent.from_pretrained(ensure_tiny_models().student)


@pytest.fixture(scope="module")
def reference_model() -> Any:
    return load_causal_lm(ensure_tiny_models().student)  # a separate copy: nothing shared with the backend


def prompt_ids(student: HFStudent) -> list[int]:
    text = student.tokenizer.apply_chat_template(PROMPT_MESSAGES, tokenize=False, add_generation_prompt=True)
    return list(student.tokenizer.encode(text, add_special_tokens=False))


def recompute(model: Any, tokens: list[int]) -> torch.Tensor:
    """logprob[p] = log pi(tokens[p] | tokens[:p]) for p >= 1, by one full forward pass (entry 0 is 0)."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([tokens])).logits[0].float()
    lp = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]
    return torch.cat([torch.zeros(1), lp])


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9), (0.0, 1.0)])
async def test_tracked_ids_and_logprobs_equal_a_full_forward(
    student: HFStudent, reference_model: Any, temperature: float, top_p: float
) -> None:
    prompt = prompt_ids(student)
    comps = await student.generate(prompt, GenParams(max_tokens=12, temperature=temperature, top_p=top_p, seed=1), n=3)
    assert len(comps) == 3
    tracker = Tracker()
    tracker.record(prompt, comps)
    for seq, c in zip(tracker.sequences(), comps, strict=True):
        tokens = seq.tokens.numpy().tolist()
        assert tokens == prompt + c.token_ids
        assert 1 <= len(c.token_ids) <= 12
        assert c.finish_reason == ("stop" if c.token_ids[-1] in student.eos_token_ids else "length")
        ref = recompute(reference_model, tokens)
        mask = torch.from_numpy(seq.loss_mask.numpy().astype(bool))
        got = torch.from_numpy(seq.logprobs.numpy().copy())
        assert mask.sum() == len(c.token_ids)
        torch.testing.assert_close(got[mask], ref[mask], atol=1e-5, rtol=0)  # raw, temperature-free
        assert not got[~mask].any()


async def test_seed_reproduces_and_greedy_equals_tiny_top_p(student: HFStudent) -> None:
    prompt = prompt_ids(student)
    a = await student.generate(prompt, GenParams(max_tokens=10, seed=7), n=2)
    b = await student.generate(prompt, GenParams(max_tokens=10, seed=7), n=2)
    c = await student.generate(prompt, GenParams(max_tokens=10, seed=8), n=2)
    assert [x.token_ids for x in a] == [x.token_ids for x in b]
    assert [x.token_ids for x in a] != [x.token_ids for x in c]
    greedy = await student.generate(prompt, GenParams(max_tokens=10, temperature=0.0), n=1)
    nucleus = await student.generate(prompt, GenParams(max_tokens=10, temperature=1.0, top_p=1e-6, seed=3), n=1)
    assert greedy[0].token_ids == nucleus[0].token_ids


async def test_stop_token_ends_the_completion_and_is_included(student: HFStudent) -> None:
    prompt = prompt_ids(student)
    [greedy] = await student.generate(prompt, GenParams(max_tokens=16, temperature=0.0))
    fresh = [i for i, t in enumerate(greedy.token_ids) if t not in greedy.token_ids[:i]]
    k = fresh[min(2, len(fresh) - 1)]
    stop = greedy.token_ids[k]
    [cut] = await student.generate(prompt, GenParams(max_tokens=16, temperature=0.0, stop_token_ids=(stop,)))
    assert cut.token_ids == greedy.token_ids[: k + 1]
    assert cut.finish_reason == "stop"
    assert cut.logprobs == pytest.approx(greedy.logprobs[: k + 1], abs=1e-6)


async def test_edge_requests(student: HFStudent) -> None:
    prompt = prompt_ids(student)
    assert await student.generate(prompt, GenParams(max_tokens=0), n=2) == [Completion([], [], "length")] * 2
    with pytest.raises(ValueError, match="empty"):
        await student.generate([], GenParams(max_tokens=2))
    with pytest.raises(ValueError, match="top_p"):
        await student.generate(prompt, GenParams(top_p=0.0))
    many = await asyncio.gather(*(student.generate(prompt, GenParams(max_tokens=4, seed=s)) for s in range(4)))
    assert all(len(m) == 1 and len(m[0].token_ids) >= 1 for m in many)


def test_sample_next_respects_top_p() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    gen = torch.Generator().manual_seed(0)
    draws = {int(sample_next(logits, 1.0, 0.7, gen)) for _ in range(300)}
    assert draws == {0, 1}  # 0.5 + 0.3 covers 0.7; the tail never appears
    assert int(sample_next(logits, 0.0, 1.0, gen)) == 0


async def test_sample_group_end_to_end(student: HFStudent, reference_model: Any) -> None:
    group = await sample_group(
        student,
        PROMPT_MESSAGES,
        group_size=4,
        params=GenParams(max_tokens=8, temperature=1.0, seed=11),
        reward_fn=get_reward("math"),
        answer="15",
        env_id=3,
        task_id="arith",
        policy_version=5,
        keep_messages=True,
    )
    back = decode(encode(group), expect=RolloutGroup)  # validates the wire contract too
    assert back.group_id == group.group_id and len(back.sequences) == 4
    assert back.policy_version == 5 and back.env_id == 3 and back.task_id == "arith"
    assert back.generation_params == {"n": 4, "max_tokens": 8, "temperature": 1.0, "top_p": 1.0, "seed": 11}
    prompt = prompt_ids(student)
    for seq in back.sequences:
        tokens = seq.tokens.numpy().tolist()
        assert tokens[: len(prompt)] == prompt and seq.prompt_len == len(prompt)
        text = student.tokenizer.decode(tokens[len(prompt) :], skip_special_tokens=True)
        assert seq.score == get_reward("math")(text, "15")
        assert seq.messages is not None and seq.messages[-1] == {"role": "assistant", "content": text}
        ref = recompute(reference_model, tokens)
        got = torch.from_numpy(seq.logprobs.numpy().copy())
        torch.testing.assert_close(got[len(prompt) :], ref[len(prompt) :], atol=1e-5, rtol=0)


async def test_stop_strings_in_the_params_end_the_completion(student: HFStudent) -> None:
    prompt = prompt_ids(student)
    [greedy] = await student.generate(prompt, GenParams(max_tokens=16, temperature=0.0))
    text = student.tokenizer.decode(greedy.token_ids, skip_special_tokens=True)
    stop = text[len(text) // 2 :][:2]
    assert stop.strip(), text
    [cut] = await student.generate(prompt, GenParams(max_tokens=16, temperature=0.0, stop=(stop,)))
    assert (cut.finish_reason, cut.stop_reason) == ("stop", stop)
    assert cut.token_ids == greedy.token_ids[: len(cut.token_ids)] and len(cut.token_ids) < len(greedy.token_ids)
    assert stop in student.tokenizer.decode(cut.token_ids, skip_special_tokens=True)
    assert stop not in student.tokenizer.decode(cut.token_ids[:-1], skip_special_tokens=True)


def test_backends_declare_the_protocols_they_implement(student: HFStudent) -> None:
    vllm = VLLMStudent("http://vllm:8000", "student", student.tokenizer)
    assert isinstance(student, StudentBackend) and isinstance(student, WeightReloader)
    assert isinstance(vllm, StudentBackend) and not isinstance(vllm, WeightReloader)  # servers reload on their own


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny student saved to a folder of its own (weights, config, tokenizer)."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("saved-student")
    load_causal_lm(ensure_tiny_models().student).save_pretrained(folder)
    AutoTokenizer.from_pretrained(str(ensure_tiny_models().student)).save_pretrained(folder)
    return folder


def test_load_causal_lm_in_bfloat16_is_close_to_float32(saved: Path) -> None:
    full = load_causal_lm(saved)
    half = load_causal_lm(saved, dtype="bfloat16", device="cpu")
    assert {p.dtype for p in full.parameters()} == {torch.float32}
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16} and not half.training
    assert {p.dtype for p in load_causal_lm(saved, dtype="auto").parameters()} == {torch.float32}  # auto on a CPU
    tokens = list(range(3, 40))
    ref, got = recompute(full, tokens), recompute(half, tokens)
    assert not torch.equal(ref, got)  # computed in bfloat16, not float32
    torch.testing.assert_close(got, ref, atol=0.05, rtol=0)
    with pytest.raises(ValueError, match="dtype"):
        load_causal_lm(saved, dtype="int8")


async def test_a_bfloat16_student_samples(saved: Path) -> None:
    student = HFStudent.from_pretrained(saved, dtype="bfloat16")
    assert {p.dtype for p in student.model.parameters()} == {torch.bfloat16}
    prompt = prompt_ids(student)
    comps = await student.generate(prompt, GenParams(max_tokens=8, seed=5), n=3)
    assert len(comps) == 3 and len({tuple(c.token_ids) for c in comps}) > 1
    full = load_causal_lm(saved)
    for c in comps:
        assert 1 <= len(c.token_ids) <= 8
        tokens = prompt + c.token_ids
        got = torch.tensor(c.logprobs)
        torch.testing.assert_close(got, recompute(full, tokens)[len(prompt) :], atol=0.05, rtol=0)


def test_worker_rollout_dtype_flag_sets_the_hf_students_weights(saved: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DISTILLQ_STUDENT_DTYPE", raising=False)
    p = argparse.ArgumentParser()
    rollout.add_arguments(p)
    for argv, dtype in (([], torch.float32), (["--dtype", "bfloat16"], torch.bfloat16)):
        backend = rollout.make_backend(p.parse_args(["--backend", "hf", "--model", str(saved), *argv]))
        assert isinstance(backend, HFStudent)
        assert {q.dtype for q in backend.model.parameters()} == {dtype}
