"""``distillq serve student`` against hostile and unusual requests, through the real openai client and
httpx: one ``n`` cap on both endpoints, messages without a role, request bodies above the cap, candidates
asked for with ``top_logprobs``, fields of the wrong type, and ``stop`` strings on the generate endpoint cut
as vLLM cuts them (the tokens returned are the tokens recorded)."""

from __future__ import annotations

import asyncio
import json
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
from tests.slowloris import check_heads_time_out

pytestmark = pytest.mark.redis
__all__ = ["hf_student"]  # the module-scoped fixture, shared
MESSAGES = [{"role": "user", "content": "1+2="}]
BODY_TIMEOUT_S = 2.0  # the module's server: --body-timeout-s


@pytest.fixture(scope="module")
def student(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[StudentProcess]:
    ns = f"req{uuid.uuid4().hex[:8]}"
    with StudentProcess(redis_server.url, ns, tmp_path_factory.mktemp("student"), "--max-body-bytes", "1048576",
                        "--body-timeout-s", str(BODY_TIMEOUT_S)) as p:
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
        ([{"role": "\u00e9\u2603\U0001f600" * 20, "content": "a"}], "messages[0].role"),  # unicode garbage
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


def raw_post(student: StudentProcess, path: str, body: bytes) -> httpx.Response:
    url = student.base_url.removesuffix("/v1")
    return httpx.post(url + path, content=body, headers={"content-type": "application/json"}, timeout=60)


def error_of(resp: httpx.Response) -> dict[str, Any]:
    err = resp.json()["error"]
    assert resp.status_code == 400 and err["code"] == 400 and err["type"] == "BadRequestError", resp.text
    assert f"{err['param']}: " in err["message"], err  # the field, in the message too
    return dict(err)


def test_json_nested_100000_deep_is_a_400_naming_the_field_on_every_route(student: StudentProcess) -> None:
    deep = "[" * 100_000 + '"x"' + "]" * 100_000
    chat = f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": {deep}}}], "max_tokens": 2}}'
    generate = f'{{"model": "{MODEL}", "token_ids": {deep}}}'
    finish = f'{{"task": "t", "group_overrides": {{"a": {deep}}}}}'
    for path, body, field in [("/v1/chat/completions", chat, "messages[0].content"),
                              ("/inference/v1/generate", generate, "token_ids"),
                              ("/sessions/s/finish", finish, "group_overrides.a")]:
        err = error_of(raw_post(student, path, body.encode()))
        assert err["param"] == field and "nested more than 64 levels deep" in err["message"], err
    nested_ok = {"model": MODEL, "messages": [{"role": "user", "content": "hi", "extra": [[[[1]]]]}], "max_tokens": 1}
    assert httpx.post(student.base_url + "/chat/completions", json=nested_ok, timeout=60).status_code == 200


async def test_max_tokens_beyond_the_context_is_a_400_as_vllm_answers_it(
    client: openai.AsyncOpenAI, student: StudentProcess
) -> None:
    limit = (await client.models.list()).data[0].model_extra["max_model_len"]  # type: ignore[index]
    for big in (10**9, 2**63):
        e = await bad_request(client, max_tokens=big)
        assert param_of(e) == "max_tokens" and f"'max_tokens' or 'max_completion_tokens' is too large: {big}" in (
            e.message) and f"maximum context length is {limit} tokens" in e.message
        e = await bad_request(client, extra_body={"max_completion_tokens": big})
        assert param_of(e) == "max_completion_tokens"
    prompt = [5] * (limit - 3)
    async with httpx.AsyncClient(base_url=student.base_url.removesuffix("/v1"), timeout=120) as c:
        for big in (10**9, 2**63):
            resp = await c.post("/inference/v1/generate", json=generate_body([1, 3], max_tokens=big))
            err = error_of(resp)
            assert err["param"] == "sampling_params.max_tokens" and f"too large: {big}" in err["message"]
        fits = await c.post("/inference/v1/generate", json=generate_body(prompt, max_tokens=3, stop_token_ids=[]))
        over = await c.post("/inference/v1/generate", json=generate_body(prompt, max_tokens=4))
        unset = await c.post("/inference/v1/generate", json={"model": MODEL, "token_ids": prompt})
    assert fits.status_code == 200 and len(fits.json()["choices"][0]["token_ids"]) == 3
    err = error_of(over)
    assert f"your request has {limit - 3} input tokens (4 > {limit} - {limit - 3})" in err["message"]
    assert unset.status_code == 200  # the server's default max_tokens is clamped to what the context leaves
    assert len(unset.json()["choices"][0]["token_ids"]) <= 3


def test_token_ids_must_be_json_integers(student: StudentProcess) -> None:
    for body, field in [(b'{"model": "%s", "token_ids": [3.0, true]}', "token_ids.0"),
                        (b'{"model": "%s", "token_ids": [3, true]}', "token_ids.1"),
                        (b'{"model": "%s", "token_ids": [3], "sampling_params": {"stop_token_ids": [2.0]}}',
                         "sampling_params.stop_token_ids.0"),
                        (b'{"model": "%s", "token_ids": [3], "sampling_params": {"n": true}}', "sampling_params.n")]:
        err = error_of(raw_post(student, "/inference/v1/generate", body % MODEL.encode()))
        assert err["param"] == field and "valid integer" in err["message"], err
    ok = raw_post(student, "/inference/v1/generate", b'{"model": "%s", "token_ids": [3, 1], "sampling_params": '
                                                     b'{"max_tokens": 1}}' % MODEL.encode())
    assert ok.status_code == 200 and ok.json()["prompt_token_ids"] == [3, 1]


def test_a_lone_surrogate_is_a_400_naming_the_field(student: StudentProcess) -> None:
    for path, body, field in [
        ("/v1/chat/completions", b'{"model": "%s", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}, '
                                 b'{"role": "user", "content": "a\\ud800b"}]}', "messages[1].content"),
        ("/v1/chat/completions", b'{"model": "%s", "max_tokens": 1, "stop": ["\\udfff"], "messages": [{"role": '
                                 b'"user", "content": "a"}]}', "stop[0]"),
        ("/inference/v1/generate", b'{"model": "%s", "token_ids": [3], "sampling_params": {"stop": "\\ud83d"}}',
         "sampling_params.stop"),
    ]:
        err = error_of(raw_post(student, path, body % MODEL.encode()))
        assert err["param"] == field and "lone surrogate" in err["message"], err
    pair = b'{"model": "%s", "max_tokens": 1, "messages": [{"role": "user", "content": "a\\ud83d\\ude00b"}]}'
    assert raw_post(student, "/v1/chat/completions", pair % MODEL.encode()).status_code == 200  # a pair is text


@pytest.mark.timeout(60)
def test_a_stalled_request_body_gets_408_and_the_connection_is_closed(student: StudentProcess) -> None:
    """Headers and part of the body, then nothing: after ``--body-timeout-s`` the answer is 408 and the server
    closes the connection; a body sent slowly but steadily is read; the server keeps serving."""
    body = json.dumps(generate_body([1, 3], max_tokens=1)).encode()
    head = (b"POST /inference/v1/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body))
    with socket.create_connection(("127.0.0.1", student.port), timeout=30) as s:
        s.sendall(head + body[:10])
        t0 = time.monotonic()
        answer = read_until_closed(s)
        waited = time.monotonic() - t0
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert BODY_TIMEOUT_S - 0.5 < waited < BODY_TIMEOUT_S + 10, waited  # closed by the server, not our timeout
    assert b'"code":408' in answer and b"no bytes of it came for 2 s" in answer
    with socket.create_connection(("127.0.0.1", student.port), timeout=30) as s:
        s.sendall(head)
        for i in range(0, len(body), len(body) // 3 + 1):  # each part well within the timeout: read whole
            time.sleep(BODY_TIMEOUT_S * 0.6)
            s.sendall(body[i : i + len(body) // 3 + 1])
        slow = s.recv(65536)
    assert slow.startswith(b"HTTP/1.1 200"), slow[:200]
    assert raw_post(student, "/inference/v1/generate", body).status_code == 200


@pytest.mark.timeout(60)
def test_slow_request_heads_get_408_and_the_connection_is_closed(student: StudentProcess) -> None:
    """50 heads begun and left, one sent a byte at a time and one stalled after a kept-alive request: each
    answered 408 and closed after ``--body-timeout-s``; the server keeps serving."""
    check_heads_time_out(student.port, BODY_TIMEOUT_S, "/health")
    assert raw_post(student, "/inference/v1/generate",
                    json.dumps(generate_body([1, 3], max_tokens=1)).encode()).status_code == 200


def read_until_closed(s: socket.socket) -> bytes:
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


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



@pytest.mark.timeout(60)
def test_a_huge_declared_body_or_header_is_refused_on_the_head_alone(student: StudentProcess) -> None:
    """A Content-Length of 10^12 with 60 bytes sent gets 413 at once (no wait for bytes that would be refused); a
    1 MB header gets 431; the server keeps serving."""
    head = (b"POST /inference/v1/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000000000000\r\n\r\n")
    with socket.create_connection(("127.0.0.1", student.port), timeout=30) as s:
        t0 = time.monotonic()
        s.sendall(head + b"x" * 60)
        answer = read_until_closed(s)
    assert answer.startswith(b"HTTP/1.1 413") and time.monotonic() - t0 < BODY_TIMEOUT_S, answer[:300]
    body = json.dumps(generate_body([1, 3], max_tokens=1)).encode()
    big = (b"POST /inference/v1/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nX-Session-ID: "
           + b"a" * (1 << 20) + b"\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    with socket.create_connection(("127.0.0.1", student.port), timeout=30) as s:
        s.sendall(big)
        answer = read_until_closed(s)
    assert answer.startswith(b"HTTP/1.1 431"), answer[:300]  # the HTTP parser's own limit: a head of 16 KiB
    assert raw_post(student, "/inference/v1/generate", body).status_code == 200
