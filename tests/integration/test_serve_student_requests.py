"""``distillq serve student`` against hostile and unusual requests, through the real openai client and
httpx: one ``n`` cap on both endpoints, messages without a role, request bodies above the cap, candidates
asked for with ``top_logprobs``, fields of the wrong type, and ``stop`` strings on the generate endpoint cut
as vLLM cuts them (the tokens returned are the tokens recorded)."""

from __future__ import annotations

import asyncio
import socket
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import openai
import pytest

from pipeline.rollout.students.hf import HFStudent
from pipeline.serve.student.validation import MAX_N
from tests.integration.test_serve_student import (
    MODEL,
    StudentProcess,
    _never,
    generate_body,
    hf_student,
    http,
    make_service,
    prompt_ids,
)
from tests.redis_server import RedisServer

pytestmark = pytest.mark.redis
__all__ = ["hf_student"]  # the module-scoped fixture, shared
MESSAGES = [{"role": "user", "content": "1+2="}]


@pytest.fixture(scope="module")
def student(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[StudentProcess]:
    ns = f"req{uuid.uuid4().hex[:8]}"
    with StudentProcess(redis_server.url, ns, tmp_path_factory.mktemp("student"), "--max-body-bytes", "1048576") as p:
        yield p


@pytest.fixture
async def client(student: StudentProcess) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=student.base_url, api_key="none", max_retries=0) as c:
        yield c


async def bad_request(client: openai.AsyncOpenAI, **kw: Any) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(model=MODEL, **{"messages": MESSAGES, "max_tokens": 2, **kw})
    return info.value


def param_of(e: openai.BadRequestError) -> str:
    body = e.body
    assert isinstance(body, dict)
    return str(body.get("param"))


async def test_n_has_one_cap_on_both_endpoints(client: openai.AsyncOpenAI, student: StudentProcess) -> None:
    for n in (0, MAX_N + 1, 1000):
        e = await bad_request(client, n=n)
        assert e.status_code == 400 and param_of(e) == "n" and f"from 1 to {MAX_N}" in e.message
    ok = await client.chat.completions.create(model=MODEL, messages=MESSAGES, n=MAX_N, max_tokens=1)  # type: ignore[arg-type]
    assert len(ok.choices) == MAX_N
    async with httpx.AsyncClient(base_url=student.base_url.removesuffix("/v1"), timeout=60) as c:
        for n in (0, MAX_N + 1):
            resp = await c.post("/inference/v1/generate", json=generate_body([1, 3], n=n))
            err = resp.json()["error"]
            assert resp.status_code == 400 and "sampling_params.n" in err["message"]
        resp = await c.post("/inference/v1/generate", json=generate_body([1, 3], n=MAX_N, max_tokens=1))
        assert resp.status_code == 200 and len(resp.json()["choices"]) == MAX_N


async def test_a_message_without_a_role_is_a_400(client: openai.AsyncOpenAI) -> None:
    for messages, param in (
        ([{"content": "hi"}], "messages[0].role"),
        ([{"role": "user", "content": "a"}, {"content": "b"}], "messages[1].role"),
        ([{"role": 3, "content": "a"}], "messages[0].role"),
        (["hi"], "messages[0]"),
    ):
        e = await bad_request(client, messages=messages)
        assert e.status_code == 400 and param_of(e) == param, e.message


async def test_top_logprobs_asking_for_candidates_is_a_400(client: openai.AsyncOpenAI) -> None:
    e = await bad_request(client, logprobs=True, top_logprobs=3)
    assert e.status_code == 400 and param_of(e) == "top_logprobs" and "candidates are not returned" in e.message
    ok = await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2,  # type: ignore[arg-type]
                                              logprobs=True, top_logprobs=0)
    assert ok.choices[0].logprobs is not None and len(ok.choices[0].logprobs.content or []) >= 1


@pytest.mark.parametrize(
    ("field", "value"),
    [("temperature", "hot"), ("temperature", -1), ("top_p", 0), ("top_p", "x"), ("max_tokens", 1.5),
     ("max_tokens", -3), ("seed", "s"), ("stop", 5), ("stop", ["a", 1]), ("logprobs", "yes"),
     ("stop_token_ids", ["x"]), ("max_completion_tokens", "many")],
)
async def test_a_field_of_the_wrong_type_is_a_400_naming_it(client: openai.AsyncOpenAI, field: str, value: Any) -> None:
    e = await bad_request(client, extra_body={field: value})
    body = e.body
    assert isinstance(body, dict)
    message = str(body["message"])
    assert e.status_code == 400 and param_of(e) == field and message.startswith(f"{field}: "), message
    assert "ValueError" not in message and "could not convert" not in message


def test_a_body_above_the_cap_is_a_413_and_is_never_read_in_full(student: StudentProcess) -> None:
    """1 MiB cap (``--max-body-bytes``); a 300 MB body streamed to it is answered 413 long before it ends."""
    sent = 0

    def chunks() -> Iterator[bytes]:
        nonlocal sent
        block = b"[" + b"1," * (1 << 19)
        while sent < 300 << 20:
            sent += len(block)
            yield block

    url = student.base_url.removesuffix("/v1")
    t0 = time.monotonic()
    try:
        resp = httpx.post(f"{url}/inference/v1/generate", content=chunks(), timeout=120,
                          headers={"content-type": "application/json"})
        status, body = resp.status_code, resp.json()
    except httpx.HTTPError:  # the server answered and closed while we were still sending: ask what it said
        status, body = 413, None
    assert status == 413
    if body is not None:
        assert body["error"]["code"] == 413 and "more than 1048576 bytes" in body["error"]["message"]
    small = httpx.post(f"{url}/inference/v1/generate", json=generate_body([1, 3], max_tokens=1), timeout=60)
    assert small.status_code == 200  # the server keeps serving
    with socket.create_connection(("127.0.0.1", student.port), timeout=30) as s:  # as sent, without streaming
        s.sendall(b"POST /inference/v1/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 2000000\r\n\r\n" + b" " * 2_000_000)
        head = s.recv(4096)
    assert head.startswith(b"HTTP/1.1 413"), head[:200]
    assert time.monotonic() - t0 < 100


# ---- stop strings on /inference/v1/generate, as vLLM applies them ----------------------------------------------


def stop_strings_in(text: str) -> list[str] | None:
    """Two stop strings taken from ``text`` (the later-starting one listed first), avoiding U+FFFD: a byte
    sequence that is not yet a whole character decodes to it in a full decode, while an incremental
    detokenizer (vLLM's) holds such bytes back, so only clean strings have one answer either way."""
    clean = [i for i in range(len(text) - 2) if "\ufffd" not in text[i : i + 3]]
    if len(clean) < 2:
        return None
    a, b = clean[len(clean) // 2], clean[len(clean) // 4]
    return [text[a : a + 2], text[b : b + 3]]


def reference_cut(tok: Any, ids: list[int], stops: list[str], skip: bool = True) -> tuple[int, str] | None:
    """Where vLLM's rule ends a completion sampled as ``ids``: the first token after which the decoded text
    (specials skipped) holds a stop string (the one ending earliest), computed the slow way."""
    for k in range(1, len(ids) + 1):
        text = tok.decode(ids[:k], skip_special_tokens=skip)
        prev = tok.decode(ids[: k - 1], skip_special_tokens=skip)
        found = [(text.find(s, max(0, len(prev) - len(s) + 1)) + len(s), i, s) for i, s in enumerate(stops)
                 if text.find(s, max(0, len(prev) - len(s) + 1)) >= 0]
        if found:
            return k, min(found)[2]
    return None


async def test_stop_strings_end_a_generate_completion_at_the_token_that_completes_them(
    hf_student: HFStudent,
) -> None:
    tok = hf_student.tokenizer
    prompt = prompt_ids(hf_student)
    async with http(make_service(hf_student, _never)) as c:
        checked = 0
        for seed in range(12):
            plain = await c.post("/inference/v1/generate", json=generate_body(prompt, seed=seed, max_tokens=40,
                                                                              stop_token_ids=[]))
            ids = plain.json()["choices"][0]["token_ids"]
            stops = stop_strings_in(tok.decode(ids, skip_special_tokens=True))  # the first completed wins
            if stops is None:
                continue
            want = reference_cut(tok, ids, stops)
            assert want is not None
            k, which = want
            for include in (False, True):
                sid = f"stop-{seed}-{include}"
                resp = await c.post(
                    "/inference/v1/generate", headers={"X-Session-ID": sid},
                    json=generate_body(prompt, seed=seed, max_tokens=40, stop_token_ids=[], stop=stops,
                                       include_stop_str_in_output=include, skip_special_tokens=True),
                )  # fmt: skip
                assert resp.status_code == 200, resp.text
                ch = resp.json()["choices"][0]
                assert ch["token_ids"] == ids[:k]  # token-exact: up to and including the completing token
                assert [e["logprob"] for e in ch["logprobs"]["content"]] == [
                    e["logprob"] for e in plain.json()["choices"][0]["logprobs"]["content"][:k]
                ]
                assert ch["finish_reason"] == "stop" and ch["stop_reason"] == which
                tracked = (await c.get(f"/sessions/{sid}")).json()
                assert tracked["branches"] == [{"tokens": len(prompt) + k, "sampled": k, "turns": 1}]
            checked += 1
        bad = await c.post("/inference/v1/generate", json=generate_body(prompt, stop=[1]))
    assert checked >= 6
    assert bad.status_code == 400 and "sampling_params.stop" in bad.json()["error"]["message"]


async def test_a_stop_string_across_a_multi_byte_character_and_specials(hf_student: HFStudent) -> None:
    """The checker sees text as vLLM's detokenizer does: specials skipped unless asked, incomplete characters
    held back; an end-of-sequence token completes no stop string unless include_stop_str_in_output."""
    from pipeline.rollout.stop_strings import StopStringChecker

    tok = hf_student.tokenizer
    ids = tok.encode("ab cd ef", add_special_tokens=False)
    c = StopStringChecker(tok, [1], ["d e"])
    hits = [c.step(t) for t in ids]
    k = next(i for i, h in enumerate(hits) if h is not None)
    assert hits[k] == "d e" and tok.decode(ids[: k + 1]).endswith("d e")
    eos_text = tok.decode([2], skip_special_tokens=False)
    if eos_text:
        off = StopStringChecker(tok, [1], [eos_text], skip_special_tokens=False)
        on = StopStringChecker(tok, [1], [eos_text], skip_special_tokens=False, include_stop_str_in_output=True)
        assert off.step(2, stop_token=True) is None and on.step(2, stop_token=True) == eos_text


async def test_many_concurrent_stop_requests_keep_tokens_and_records_equal(hf_student: HFStudent) -> None:
    prompt = prompt_ids(hf_student)
    async with http(make_service(hf_student, _never)) as c:
        async def one(i: int) -> tuple[dict[str, Any], dict[str, Any]]:
            sid = f"conc-{i}"
            r = await c.post("/inference/v1/generate", headers={"X-Session-ID": sid},
                             json=generate_body(prompt, seed=i, n=2, max_tokens=30, stop=["a", "e"]))
            return r.json(), (await c.get(f"/sessions/{sid}")).json()

        results = await asyncio.gather(*(one(i) for i in range(8)))
    stopped = 0
    for data, tracked in results:
        chs = data["choices"]
        if chs[0]["token_ids"] != chs[1]["token_ids"]:  # two branches of one prompt, recorded as returned
            assert sorted(b["sampled"] for b in tracked["branches"]) == sorted(len(ch["token_ids"]) for ch in chs)
        for ch in chs:
            text = hf_student.tokenizer.decode(ch["token_ids"], skip_special_tokens=False)  # as requested
            before = tok_prefix(hf_student, ch["token_ids"])
            assert "a" not in before and "e" not in before  # nothing completed a stop string earlier
            if ch["stop_reason"] is not None:
                stopped += 1
                assert ch["finish_reason"] == "stop" and ch["stop_reason"] in text
    assert stopped >= 4


def tok_prefix(student: HFStudent, ids: list[int]) -> str:
    """The text of every token but the last: no stop string may be complete before it."""
    return str(student.tokenizer.decode(ids[:-1], skip_special_tokens=False))

