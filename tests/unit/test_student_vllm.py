"""vLLM HTTP backend against an httpx.MockTransport replaying vLLM's /v1/completions response shape."""

from __future__ import annotations

import copy
import json
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from pipeline.demo.tinymodels import ensure_tiny_models
from pipeline.rollout.openai_facade import TrackedClient
from pipeline.rollout.students.base import GenParams, StudentBackendError
from pipeline.rollout.students.vllm import VLLMStudent, default_timeout, parse_choice

PROMPT = [3, 310, 16, 24, 34, 4]


def vllm_choice(index: int, ids: list[int], lps: list[float], finish: str = "stop") -> dict[str, Any]:
    """One choice as vLLM serves it with logprobs=1, return_token_ids and return_tokens_as_token_ids."""
    tokens = [f"token_id:{i}" for i in ids]
    top = [{t: lp} for t, lp in zip(tokens, lps, strict=True)]
    if top:
        top[0]["token_id:7"] = min(lps) - 1.0  # logprobs=1 may add the top alternative
    return {
        "index": index,
        "text": "15",
        "logprobs": {
            "text_offset": list(range(len(ids))),
            "token_logprobs": lps,
            "tokens": tokens,
            "top_logprobs": top,
        },
        "finish_reason": finish,
        "stop_reason": None,
        "token_ids": ids,
        "prompt_logprobs": None,
        "prompt_token_ids": PROMPT,
    }


def vllm_response(choices: list[dict[str, Any]]) -> dict[str, Any]:
    n = sum(len(c["logprobs"]["tokens"]) for c in choices)
    return {
        "id": "cmpl-9f0b2c1e6a4d4f1b8c3e2d1a0b9c8d7e",
        "object": "text_completion",
        "created": 1763790000,
        "model": "student",
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": None,
        "usage": {"prompt_tokens": len(PROMPT), "total_tokens": len(PROMPT) + n, "completion_tokens": n},
        "kv_transfer_params": None,
    }


@pytest.fixture(scope="module")
def tok() -> Any:
    return AutoTokenizer.from_pretrained(str(ensure_tiny_models().tokenizer))


def backend(tok: Any, handler: Any) -> VLLMStudent:
    return VLLMStudent("http://vllm:8000/", "student", tok, transport=httpx.MockTransport(handler))


async def test_request_body_and_parsed_completions(tok: Any) -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        body = json.loads(request.content)
        choices = [vllm_choice(1, [26, 2], [-2.0, -0.25]), vllm_choice(0, [314, 40, 41], [-0.5, -1.5, -3.0], "length")]
        assert body["n"] == 2
        return httpx.Response(200, json=vllm_response(choices))

    student = backend(tok, handler)
    params = GenParams(max_tokens=3, temperature=0.8, top_p=0.95, stop_token_ids=(9,), seed=4)
    out = await student.generate(PROMPT, params, n=2)
    await student.aclose()
    [req] = seen
    assert req.method == "POST" and str(req.url) == "http://vllm:8000/v1/completions"
    body = json.loads(req.content)
    assert body == {
        "model": "student",
        "prompt": PROMPT,
        "n": 2,
        "max_tokens": 3,
        "temperature": 0.8,
        "top_p": 0.95,
        "logprobs": 1,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "stop_token_ids": [9],
        "seed": 4,
    }
    assert [c.token_ids for c in out] == [[314, 40, 41], [26, 2]]  # sorted by choice index
    assert out[0].logprobs == [-0.5, -1.5, -3.0] and out[1].logprobs == [-2.0, -0.25]
    assert [c.finish_reason for c in out] == ["length", "stop"]


async def test_stop_strings_in_the_params_go_into_the_body(tok: Any) -> None:
    student = VLLMStudent("http://vllm:8000", "student", tok)
    await student.aclose()
    params = GenParams(max_tokens=3, stop=("\n", ""), include_stop_str_in_output=True, skip_special_tokens=False)
    body = student.request_body(PROMPT, params, 1)
    assert (body["stop"], body["include_stop_str_in_output"], body["skip_special_tokens"]) == (["\n"], True, False)
    assert "stop" not in student.request_body(PROMPT, GenParams(max_tokens=3), 1)  # none: vLLM's defaults apply


def test_parse_choice_variants() -> None:
    old = vllm_choice(0, [5, 6], [-1.0, -2.0])
    del old["token_ids"]  # servers before return_token_ids: ids only in "token_id:N" strings
    assert parse_choice(old).token_ids == [5, 6]
    bad = copy.deepcopy(old)
    bad["logprobs"]["tokens"] = ["a", "b"]
    with pytest.raises(StudentBackendError, match="neither"):
        parse_choice(bad)
    clash = vllm_choice(0, [5, 6], [-1.0, -2.0])
    clash["token_ids"] = [5, 7]
    with pytest.raises(StudentBackendError, match="disagree"):
        parse_choice(clash)
    short = vllm_choice(0, [5, 6], [-1.0, -2.0])
    short["logprobs"]["token_logprobs"] = [-1.0]
    short["logprobs"]["tokens"] = ["x"]
    with pytest.raises(StudentBackendError, match="2 token ids but 1 logprobs"):
        parse_choice(short)
    null = vllm_choice(0, [5], [-1.0])
    null["logprobs"]["token_logprobs"] = [None]
    with pytest.raises(StudentBackendError, match="null"):
        parse_choice(null)
    none = vllm_choice(0, [5], [-1.0])
    none["logprobs"] = None
    with pytest.raises(StudentBackendError, match="no logprobs"):
        parse_choice(none)


@pytest.mark.parametrize(
    ("respond", "match"),
    [
        (
            lambda r: httpx.Response(400, json={"object": "error", "message": "max_tokens too large"}),
            "HTTP 400.*too large",
        ),
        (lambda r: httpx.Response(200, text="not json"), "invalid JSON"),
        (lambda r: httpx.Response(200, json=[1]), "expected an object"),
        (lambda r: httpx.Response(200, json=vllm_response([])), "returned 0"),
        (
            lambda r: httpx.Response(
                200, json=vllm_response([{**vllm_choice(0, [1], [-1.0]), "prompt_token_ids": [9]}])
            ),
            "prompt_token_ids differ",
        ),
    ],
)
async def test_server_errors_become_backend_errors(tok: Any, respond: Any, match: str) -> None:
    student = backend(tok, respond)
    with pytest.raises(StudentBackendError, match=match):
        await student.generate(PROMPT, GenParams(max_tokens=1))


@pytest.mark.parametrize("exc", [httpx.ConnectError("refused"), httpx.ReadTimeout("slow")])
async def test_transport_failures_become_backend_errors(tok: Any, exc: Exception) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise exc

    with pytest.raises(StudentBackendError, match=type(exc).__name__):
        await backend(tok, handler).generate(PROMPT, GenParams())


async def test_timeouts_models_and_validation(tok: Any) -> None:
    t = default_timeout(120.0)
    assert (t.connect, t.read, t.write, t.pool) == (10.0, 120.0, 120.0, 30.0)

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/models"
        return httpx.Response(200, json={"object": "list", "data": [{"id": "student", "object": "model"}]})

    student = backend(tok, handler)
    assert student._client.timeout.connect == 10.0
    assert await student.models() == ["student"]
    with pytest.raises(ValueError, match="n must be"):
        await student.generate(PROMPT, GenParams(), n=0)


async def test_facade_over_vllm_tracks_server_ids(tok: Any) -> None:
    """The facade sends the chat-template ids and tracks exactly the ids the server returned."""
    prompts: list[list[int]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        prompts.append(body["prompt"])
        ids = [314, 2] if len(prompts) == 1 else [26, 2]
        choice = {**vllm_choice(0, ids, [-0.5, -0.75]), "prompt_token_ids": body["prompt"]}
        return httpx.Response(200, json=vllm_response([choice]))

    client = TrackedClient(backend(tok, handler))
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "12+3="}]
    r1 = await client.chat.completions.create(model="student", messages=msgs, logprobs=True)
    assert r1.choices[0].message.content == "15" and r1.choices[0].token_ids == [314, 2]
    msgs += [{"role": "assistant", "content": "15"}, {"role": "user", "content": "x"}]
    r2 = await client.chat.completions.create(model="student", messages=msgs, logprobs=True)
    assert prompts[0] == PROMPT and prompts[1][: len(PROMPT) + 2] == [*PROMPT, 314, 2]
    [node] = client.tracker.nodes()
    assert node.tokens == (*r2.prompt_token_ids, 26, 2)
    assert node.spans == ((len(PROMPT), len(PROMPT) + 2), (len(r2.prompt_token_ids), len(node.tokens)))
    assert client.tracker.stats.divergences == 0
