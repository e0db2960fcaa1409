"""OpenAI-compatible facade, called the way rollout code calls ``openai.AsyncOpenAI``: chat and text
completions, multi-turn tracking by token ids, stop strings, and ``stream=True`` chunks."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import torch
from structlog.testing import capture_logs
from transformers import AutoTokenizer

from pipeline.demo.tinymodels import ensure_tiny_models
from pipeline.models.weights import load_causal_lm
from pipeline.rollout.openai_facade import TrackedClient
from pipeline.rollout.rewards import get_reward
from pipeline.rollout.sampler import sample_group
from pipeline.rollout.students.base import Completion, GenParams
from pipeline.rollout.students.hf import HFStudent
from pipeline.rollout.tracker import Tracker
from schemas.validate import Limits, validate_rollout, validate_sequence

EOS = 2


class Scripted:
    """A backend that replies with scripted token ids (so tests control tokenisation exactly)."""

    def __init__(self, tokenizer: Any, replies: list[list[int]]) -> None:
        self._tokenizer = tokenizer
        self.replies = list(replies)
        self.prompts: list[list[int]] = []

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    async def generate(self, prompt_ids: list[int], params: GenParams, n: int = 1) -> list[Completion]:
        self.prompts.append(list(prompt_ids))
        out = []
        for _ in range(n):
            ids = self.replies.pop(0)[: params.max_tokens]
            lps = [-0.1 * len(self.prompts) - 0.01 * j for j in range(len(ids))]
            out.append(Completion(ids, lps, "stop" if ids and ids[-1] == EOS else "length"))
        return out


@pytest.fixture(scope="module")
def tok() -> Any:
    return AutoTokenizer.from_pretrained(str(ensure_tiny_models().tokenizer))


def canon(tok: Any, text: str, eos: bool = True) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False)) + ([EOS] if eos else [])


async def test_multi_turn_chat_with_a_tool_turn(tok: Any) -> None:
    backend = Scripted(tok, [canon(tok, "15"), canon(tok, "<think>ok</think>call"), canon(tok, "done")])
    client = TrackedClient(backend)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "12+3="}]
    responses = []
    for follow_up in ({"role": "tool", "content": "Tool output: 42"}, {"role": "user", "content": "and?"}, None):
        r = await client.chat.completions.create(
            model="student", messages=messages, n=1, temperature=1.0, max_tokens=32, logprobs=True
        )
        responses.append(r)
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
        if follow_up is not None:
            messages.append(follow_up)
    r1, r2, r3 = responses
    assert [r.choices[0].message.content for r in responses] == ["15", "<think>ok</think>call", "done"]
    assert backend.prompts == [r.prompt_token_ids for r in responses]  # what the server saw
    for earlier, later in ((r1, r2), (r2, r3)):
        stored = earlier.prompt_token_ids + earlier.choices[0].token_ids
        assert later.prompt_token_ids[: len(stored)] == stored  # extended by ids, nothing re-tokenised

    [node] = client.tracker.nodes()
    seq = client.tracker.to_sequence(node.id)
    tokens = seq.tokens.numpy().tolist()
    assert tokens == r3.prompt_token_ids + r3.choices[0].token_ids
    mask = np.zeros(len(tokens), np.uint8)
    lps = np.zeros(len(tokens), np.float32)
    spans = []
    for r in responses:
        start, c = len(r.prompt_token_ids), r.choices[0]
        mask[start : start + len(c.token_ids)] = 1
        lps[start : start + len(c.token_ids)] = [x.logprob for x in c.logprobs.content]
        spans.append((start, start + len(c.token_ids)))
    assert seq.loss_mask.numpy().tolist() == mask.tolist()  # tool and user turns masked
    assert np.array_equal(seq.logprobs.numpy(), lps)
    assert seq.spans == spans and seq.prompt_len == len(r1.prompt_token_ids)
    validate_sequence(seq, "seq", Limits(vocab_size=len(tok)))
    assert client.tracker.stats.divergences == 0 and client.tracker.stats.extended == 2


async def test_n_choices_branch_and_each_rollout_continues_its_own(tok: Any) -> None:
    replies = [canon(tok, a) for a in ("15", "16", "17")] + [canon(tok, f"ok{i}") for i in range(3)]
    client = TrackedClient(Scripted(tok, replies))
    base = [{"role": "user", "content": "12+3="}]
    r = await client.chat.completions.create(model="m", messages=base, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2] and len(client.tracker.nodes()) == 3
    for c in reversed(r.choices):
        msgs = [*base, {"role": "assistant", "content": c.message.content}, {"role": "user", "content": "sure?"}]
        r2 = await client.chat.completions.create(model="m", messages=msgs)
        assert client.tracker.get(r2.choices[0].node_id).parent == c.node_id
    assert len(client.tracker.nodes()) == 3 and client.tracker.stats.divergences == 0
    assert all(n.turns == 2 for n in client.tracker.nodes())


async def test_retokenised_history_is_reported_not_misaligned(tok: Any) -> None:
    one, five = tok.encode("1", add_special_tokens=False), tok.encode("5", add_special_tokens=False)
    assert len(tok.encode("15", add_special_tokens=False)) == 1  # the template will merge "1" "5"
    client = TrackedClient(Scripted(tok, [[*one, *five, EOS], canon(tok, "x")]))
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "12+3="}]
    r1 = await client.chat.completions.create(model="m", messages=msgs)
    msgs += [{"role": "assistant", "content": r1.choices[0].message.content}, {"role": "user", "content": "?"}]
    with capture_logs() as logs:
        r2 = await client.chat.completions.create(model="m", messages=msgs)
    assert client.tracker.stats.divergences == 1
    [ev] = [e for e in logs if e["event"] == "tracker.prefix_divergence"]
    assert ev["reason"] == "expected_parent" and ev["node"] == r1.choices[0].node_id
    new = client.tracker.get(r2.choices[0].node_id)
    assert new.parent is None and new.tokens == (*r2.prompt_token_ids, *r2.choices[0].token_ids)
    assert sum(new.mask) == len(r2.choices[0].token_ids)  # the re-tokenised turn is not trainable
    assert len(client.tracker.nodes()) == 2


async def test_template_that_strips_reasoning_is_detected(tok: Any) -> None:
    stripping = AutoTokenizer.from_pretrained(str(ensure_tiny_models().tokenizer))
    stripping.chat_template = stripping.chat_template.replace(
        "<|assistant|>{{ m['content'] }}", "<|assistant|>{{ m['content'].split('</think>')[-1] }}"
    )
    client = TrackedClient(Scripted(stripping, [canon(tok, "<think>hm</think>15"), canon(tok, "y")]))
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "12+3="}]
    r1 = await client.chat.completions.create(model="m", messages=msgs)
    msgs += [{"role": "assistant", "content": r1.choices[0].message.content}, {"role": "user", "content": "?"}]
    with capture_logs():
        await client.chat.completions.create(model="m", messages=msgs)
    assert client.tracker.stats.divergences == 1 and client.tracker.stats.extended == 0


async def test_response_shape_and_token_id_strings(tok: Any) -> None:
    client = TrackedClient(Scripted(tok, [canon(tok, "15"), canon(tok, "15")]), model="tiny")
    msgs = [{"role": "user", "content": "12+3="}]
    r = await client.chat.completions.create(model="student", messages=msgs, logprobs=True, top_logprobs=0)
    c = r.choices[0]
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == "student"
    assert c.message.role == "assistant" and c.finish_reason == "stop" and c.token_ids == [314, EOS]
    assert [x.token for x in c.logprobs.content] == ["15", "</s>"]
    assert [x.logprob for x in c.logprobs.content] == pytest.approx([-0.1, -0.11])
    assert r.usage.prompt_tokens == len(r.prompt_token_ids) and r.usage.completion_tokens == 2
    assert r.usage.total_tokens == r.usage.prompt_tokens + 2
    dumped = json.loads(json.dumps(r.model_dump()))
    assert dumped["choices"][0]["message"]["content"] == "15" and dumped["prompt_token_ids"] == r.prompt_token_ids
    r2 = await client.chat.completions.create(
        model="student", messages=msgs, extra_body={"return_tokens_as_token_ids": True}
    )
    parsed = [int(x.token.split(":")[-1]) for x in r2.choices[0].logprobs.content]  # vLLM's "token_id:N" strings
    assert parsed == r2.choices[0].token_ids


async def test_stop_strings_cut_text_and_tokens(tok: Any) -> None:
    client = TrackedClient(Scripted(tok, [canon(tok, "15\nfoo", eos=False)]))
    r = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}], stop=["\n"])
    c = r.choices[0]
    assert c.message.content == "15" and c.finish_reason == "stop"
    assert c.token_ids == canon(tok, "15\n", eos=False)
    assert client.tracker.get(c.node_id).tokens[-len(c.token_ids) :] == tuple(c.token_ids)


async def test_completions_api_multi_turn_and_unsupported_options(tok: Any) -> None:
    client = TrackedClient(Scripted(tok, [canon(tok, "15", eos=False), canon(tok, "8")]))
    r1 = await client.completions.create(model="m", prompt="12+3=", max_tokens=8, logprobs=1)
    c1 = r1.choices[0]
    assert r1.object == "text_completion" and c1.text == "15" and c1.finish_reason == "length"
    assert c1.logprobs.tokens == ["15"] and c1.logprobs.token_logprobs == pytest.approx([-0.1])
    r2 = await client.completions.create(model="m", prompt="12+3=" + c1.text + " and 4+4=")
    node = client.tracker.get(r2.choices[0].node_id)
    assert node.parent == c1.node_id and client.tracker.stats.divergences == 0
    assert node.spans == ((4, 5), (len(r2.prompt_token_ids), len(r2.prompt_token_ids) + 2))
    with pytest.raises(NotImplementedError):
        await client.completions.create(model="m", prompt="a", echo=True)
    assert client.copy() is client
    client.reset()
    assert client.tracker.nodes() == []


async def collect(stream: Any) -> list[Any]:
    async with stream:
        return [chunk async for chunk in stream]


async def test_chat_stream_yields_role_content_finish_per_choice_then_usage(tok: Any) -> None:
    replies = [canon(tok, "15"), canon(tok, "16", eos=False)]
    client = TrackedClient(Scripted(tok, [*replies, *replies]))
    msgs = [{"role": "user", "content": "12+3="}]
    whole = await client.chat.completions.create(model="m", messages=msgs, n=2, max_tokens=8)
    stream = await client.chat.completions.create(
        model="m", messages=msgs, n=2, max_tokens=8, stream=True, stream_options={"include_usage": True}
    )
    chunks = await collect(stream)
    assert len(chunks) == 2 * 3 + 1 and {c.id for c in chunks} == {stream.response.id}
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].prompt_token_ids == whole.prompt_token_ids and chunks[1].prompt_token_ids is None
    for i, (w, same) in enumerate(zip(whole.choices, stream.response.choices, strict=True)):
        role, content, finish = (c.choices[0] for c in chunks[3 * i : 3 * i + 3])
        assert (role.index, content.index, finish.index) == (i, i, i)
        assert role.delta.model_dump() == {"role": "assistant", "content": ""}
        assert content.delta.content == w.message.content and content.token_ids == w.token_ids
        assert content.logprobs == same.logprobs
        want = [-0.2 - 0.01 * j for j in range(len(same.token_ids))]  # the scripted backend's second call
        assert [x.logprob for x in same.logprobs.content] == pytest.approx(want)
        assert finish.delta.model_dump() == {} and finish.finish_reason == w.finish_reason
        assert role.finish_reason is None and content.finish_reason is None
    last = chunks[-1]
    assert last.choices == [] and last.usage == whole.usage
    assert all(c.usage is None for c in chunks[:-1])
    nodes = [c.node_id for c in stream.response.choices]
    assert all(client.tracker.get(n).tokens[-len(r) :] == tuple(r) for n, r in zip(nodes, replies, strict=True))
    assert client.tracker.stats.requests == 2  # a streamed request is tracked like any other


async def test_stream_without_include_usage_has_no_usage_chunk_and_text_streams_too(tok: Any) -> None:
    client = TrackedClient(Scripted(tok, [canon(tok, "15"), canon(tok, "8")]))
    chat = await collect(
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}], stream=True)
    )
    assert len(chat) == 3 and all(c.usage is None and c.choices for c in chat)
    text = await collect(
        await client.completions.create(model="m", prompt="12+3=", stream=True, stream_options={"include_usage": True})
    )
    assert [c.object for c in text] == ["text_completion"] * 2
    assert text[0].choices[0].text == "8" and text[0].choices[0].finish_reason == "stop"
    assert text[0].choices[0].token_ids == canon(tok, "8") and text[1].usage.completion_tokens == 2
    with pytest.raises(TypeError, match="stream_options"):
        await client.chat.completions.create(model="m", messages=[], stream=True, stream_options="yes")


async def test_stream_chunks_parse_as_the_openai_sdk_types(tok: Any) -> None:
    types = pytest.importorskip("openai.types.chat", reason="the openai SDK is not installed")
    client = TrackedClient(Scripted(tok, [canon(tok, "15")]))
    stream = await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "a"}], stream=True, stream_options={"include_usage": True}
    )
    parsed = [types.ChatCompletionChunk.model_validate(json.loads(json.dumps(c.model_dump()))) for c in stream.chunks]
    assert "".join(p.choices[0].delta.content or "" for p in parsed if p.choices) == "15"
    assert parsed[-1].usage is not None and parsed[-1].usage.completion_tokens == 2
    assert parsed[2].choices[0].finish_reason == "stop"


async def test_sample_group_scores_each_completion(tok: Any) -> None:
    backend = Scripted(tok, [canon(tok, "15"), canon(tok, "16"), canon(tok, "\\boxed{15}")])
    group = await sample_group(
        backend, "12+3=", group_size=3, params=GenParams(max_tokens=8), reward_fn=get_reward("math"), answer="15"
    )
    validate_rollout(group, Limits(vocab_size=len(tok)))
    assert [s.score for s in group.sequences] == [1.0, 0.0, 1.0]
    prompt = canon(tok, "12+3=", eos=False)
    assert all(s.tokens.numpy().tolist()[: len(prompt)] == prompt for s in group.sequences)
    shared = TrackedClient(Scripted(tok, [canon(tok, "1"), canon(tok, "2")]), Tracker())
    await shared.completions.create(prompt="x")  # other traffic on a shared client is not mixed in
    g2 = await sample_group(shared, [{"role": "user", "content": "q"}], group_size=1)
    assert len(g2.sequences) == 1 and g2.sequences[0].score == 0.0


@pytest.fixture(scope="module")
def hf_student() -> HFStudent:
    return HFStudent.from_pretrained(ensure_tiny_models().student)


async def test_real_student_multi_turn_sequences_match_recomputation(hf_student: HFStudent) -> None:
    """Extended or diverged, every trainable position holds the student's logprob of that token."""
    ref = load_causal_lm(ensure_tiny_models().student)
    client = TrackedClient(hf_student)
    for g in range(2):
        msgs: list[dict[str, Any]] = [{"role": "user", "content": "3+4="}]
        for turn in range(3):
            r = await client.chat.completions.create(model="m", messages=msgs, max_tokens=6, seed=10 * g + turn)
            msgs += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "tool", "content": "7"}]
    stats = client.tracker.stats
    assert stats.requests == 6 and stats.extended + stats.new_sequences == 6
    assert len(client.tracker.nodes()) == 6 - stats.extended
    for seq in client.tracker.sequences():
        tokens = seq.tokens.numpy().tolist()
        with torch.inference_mode():
            logits = ref(input_ids=torch.tensor([tokens])).logits[0]
        want = torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]
        mask = seq.loss_mask.numpy()[1:].astype(bool)
        got = seq.logprobs.numpy()[1:]
        assert mask.any()
        np.testing.assert_allclose(got[mask], want.numpy()[mask], atol=1e-5, rtol=0)
