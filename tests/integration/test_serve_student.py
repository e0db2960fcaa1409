"""``distillq serve student`` over HTTP with the tiny HF student: response shapes, per-session tracking,
groups pushed onto a real redis-server, session bounds, streaming chat, the process itself."""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
import numpy as np
import pytest
import redis.asyncio as aioredis
import torch
from prometheus_client import REGISTRY
from pydantic import ValidationError
from structlog.testing import capture_logs

from pipeline.cli.commands.serve_student import add_student_arguments, run_student
from pipeline.cli.commands.serve_student import main as serve_student
from pipeline.demo.tinymodels import ensure_tiny_models
from pipeline.models.weights import load_causal_lm
from pipeline.rollout.students.hf import HFStudent
from pipeline.serve.student.app import create_app
from pipeline.serve.student.service import StudentServeConfig, StudentService
from pipeline.serve.student.sessions import GroupAssembler, SessionStore
from pipeline.stages.exits import CliError
from pipeline.transport.keys import Keys
from pipeline.transport.producer import F_DATA
from pipeline.transport.sdk import AsyncGroupProducer
from schemas import RolloutGroup, decode
from schemas.validate import Limits, validate

pytestmark = pytest.mark.redis
MODEL = "tiny-student"
EOS = 2
TURN = [EOS, 3, 50, 51, 4]  # end of the reply, a user turn, the assistant prompt (tiny template ids)


async def read_groups(r: aioredis.Redis, keys: Keys) -> list[RolloutGroup]:
    """Every group on the (unsharded) rollouts stream, decoded."""
    return [decode(f[F_DATA], expect=RolloutGroup) for _id, f in await r.xrange(keys.stream("rollouts"))]


class StudentProcess:
    """``python -m pipeline.cli.commands.serve_student`` on a free port of 127.0.0.1, stopped by its pid."""

    def __init__(self, redis_url: str, namespace: str, workdir: Path, *extra: str) -> None:
        self.port_file = workdir / "port"
        self.log = workdir / "student.log"
        self.args = [
            sys.executable, "-m", "pipeline.cli.commands.serve_student", "--backend", "hf",
            "--model", str(ensure_tiny_models().student), "--served-model-name", MODEL,
            "--host", "127.0.0.1", "--port", "0", "--port-file", str(self.port_file),
            "--redis-url", redis_url, "--namespace", namespace, *extra,
        ]  # fmt: skip
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self) -> StudentProcess:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "DISTILLQ_LOG_JSON": "1"}
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(self.args, stdout=out, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 90
        while not self.port_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"student server did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.1)
        self.port = int(self.port_file.read_text())
        return self

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


@pytest.fixture(scope="module")
def hf_student() -> HFStudent:
    return HFStudent.from_pretrained(ensure_tiny_models().student)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


Sink = Callable[[RolloutGroup], Awaitable[object]]


def make_service(student: HFStudent, sink: Sink, clock: Clock | None = None, **cfg: Any) -> StudentService:
    c = clock or Clock()
    sessions = SessionStore(max_sessions=cfg.pop("max_sessions", 64), ttl_s=cfg.pop("ttl_s", 60.0), clock=c)
    config = StudentServeConfig(served_names=(MODEL,), max_model_len=cfg.pop("max_model_len", 1024), vocab_size=512,
                                **cfg)
    return StudentService(
        student, config, sink, sessions=sessions, groups=GroupAssembler(ttl_s=sessions.ttl_s, clock=c)
    )


@pytest.fixture
async def producer(r: aioredis.Redis, keys: Keys) -> AsyncIterator[AsyncGroupProducer]:
    async with AsyncGroupProducer(namespace=keys.namespace, redis=r) as p:
        yield p


def http(service: StudentService, api_key: str | None = None) -> httpx.AsyncClient:
    app = create_app(service, api_key=api_key)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://student")


def prompt_ids(student: HFStudent, text: str = "12+3=") -> list[int]:
    rendered = student.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                     add_generation_prompt=True)  # fmt: skip
    return list(student.tokenizer.encode(rendered, add_special_tokens=False))


def generate_body(prompt: list[int], **sampling: Any) -> dict[str, Any]:
    params = {"temperature": 1.0, "max_tokens": 6, "stop_token_ids": [EOS], "logprobs": 1,
              "skip_special_tokens": False, **sampling}  # fmt: skip
    return {"model": MODEL, "token_ids": prompt, "sampling_params": params}


async def test_models_and_generate_in_the_shapes_verifiers_reads(hf_student: HFStudent) -> None:
    ref = load_causal_lm(ensure_tiny_models().student)
    async with http(make_service(hf_student, _never)) as c:
        models = (await c.get("/v1/models")).json()
        assert models["object"] == "list"
        assert [(m["id"], m["max_model_len"]) for m in models["data"]] == [(MODEL, 1024)]
        prompt = prompt_ids(hf_student)
        resp = await c.post("/inference/v1/generate", json=generate_body(prompt, n=2, seed=3, max_tokens=8))
    assert resp.status_code == 200, resp.text
    data = resp.json()
    assert data["prompt_token_ids"] == prompt and len(data["choices"]) == 2
    for i, ch in enumerate(data["choices"]):
        ids, content = ch["token_ids"], ch["logprobs"]["content"]
        assert ch["index"] == i and 1 <= len(ids) <= 8 and ch["finish_reason"] in ("stop", "length")
        assert [e["token"] for e in content] == [f"token_id:{t}" for t in ids]  # the strict check verifiers runs
        lps = np.array([e["logprob"] for e in content])
        assert np.array_equal(lps, lps.astype(np.float32).astype(np.float64))  # float32 values, exactly
        with torch.inference_mode():
            logits = ref(input_ids=torch.tensor([prompt + ids])).logits[0]
        want = torch.log_softmax(logits[len(prompt) - 1 : -1], -1).gather(1, torch.tensor(ids)[:, None])[:, 0]
        np.testing.assert_allclose(lps, want.numpy(), atol=1e-5, rtol=0)
    assert data["usage"]["prompt_tokens"] == len(prompt)


async def _never(g: RolloutGroup) -> None:
    raise AssertionError(f"unexpected push of {g.group_id}")


@pytest.mark.parametrize(
    ("change", "status", "words"),
    [
        ({"model": "other"}, 404, "does not exist"),
        ({"token_ids": [1] * 1024}, 400, "maximum context length"),
        ({"token_ids": [1, 900]}, 400, "[0, 512)"),
        ({"sampling_params": {"top_k": 5}}, 400, "top_k"),
        ({"sampling_params": {"max_tokens": -1}}, 400, "sampling_params.max_tokens: Input should be greater"),
        ({"token_ids": []}, 400, "token_ids: List should have at least 1 item"),
        ({"token_ids": "abc"}, 400, "token_ids: Input should be a valid list"),
    ],
)
async def test_generate_rejects_bad_requests_with_a_reason(
    hf_student: HFStudent, change: dict[str, Any], status: int, words: str
) -> None:
    body = {**generate_body(prompt_ids(hf_student)), **change}
    async with http(make_service(hf_student, _never)) as c:
        resp = await c.post("/inference/v1/generate", json=body)
        ok = await c.post("/inference/v1/generate", json=generate_body([1, 3], top_k=-1, max_tokens=2))
    assert resp.status_code == status and words in resp.json()["error"]["message"]  # the OpenAI error shape
    assert resp.json()["error"]["code"] == status and set(resp.json()) == {"error"}
    assert ok.status_code == 200  # neutral values of unsupported options are accepted


async def test_a_malformed_body_is_a_400_in_the_openai_shape_naming_the_field(hf_student: HFStudent) -> None:
    """As vLLM answers it: an OpenAI client (verifiers') raises BadRequestError with the field and the reason."""
    async with http(make_service(hf_student, _never)) as c:
        bad = {"content": b"{nope", "headers": {"content-type": "application/json"}}
        not_json = await c.post("/inference/v1/generate", **bad)  # type: ignore[arg-type]
        many = await c.post("/inference/v1/generate", json={"token_ids": [1, "x", 2], "sampling_params": {"n": 0}})
        finish = await c.post("/sessions/s/finish", json={"reward": "high"})
        huge = await c.post("/inference/v1/generate", json={"model": MODEL, "token_ids": ["x" * 1000] * 5000})
    assert not_json.status_code == 400 and not_json.json()["error"]["type"] == "BadRequestError"
    assert "JSON decode error" in not_json.json()["error"]["message"]
    err = many.json()["error"]
    assert many.status_code == 400 and err["code"] == 400 and err["param"] == "model"
    for words in ("model: Field required", "token_ids.1: Input should be a valid integer", "sampling_params.n: Input"):
        assert words in err["message"]
    assert finish.status_code == 400 and "task: Field required" in finish.json()["error"]["message"]
    assert "reward: Input should be a valid number" in finish.json()["error"]["message"]
    huge_message = huge.json()["error"]["message"]  # bounded: ten errors listed, the values never echoed
    assert huge.status_code == 400 and huge_message.endswith("; and 4990 more") and len(huge_message) < 1000


async def two_turns(c: httpx.AsyncClient, prompt: list[int], sid: str, seed: int) -> list[dict[str, Any]]:
    """A rollout of two turns: the second prompt is the first prompt, the reply and a new user turn."""
    h = {"X-Session-ID": sid}
    r1 = (await c.post("/inference/v1/generate", json=generate_body(prompt, seed=seed), headers=h)).json()
    reply = r1["choices"][0]["token_ids"]
    prompt2 = [*prompt, *reply, *(TURN if reply[-1] != EOS else TURN[1:])]
    r2 = (await c.post("/inference/v1/generate", json=generate_body(prompt2, seed=seed + 1), headers=h)).json()
    return [r1, r2]


async def test_each_session_is_one_rollout_and_finished_groups_reach_redis(
    hf_student: HFStudent, producer: AsyncGroupProducer, r: aioredis.Redis, keys: Keys
) -> None:
    service = make_service(hf_student, producer.push, group_size=2)
    prompt = prompt_ids(hf_student)
    async with http(service) as c:
        turns = {sid: await two_turns(c, prompt, sid, seed) for sid, seed in (("a", 1), ("b", 7))}
        view = (await c.get("/sessions/a")).json()
        first = (await c.post("/sessions/a/finish", json={"task": "t1", "reward": 0.5})).json()
        second = (await c.post("/sessions/b/finish", json={"task": "t1", "reward": 1.5})).json()
    assert view["requests"] == 2 and len(view["branches"]) == 1 and view["branches"][0]["turns"] == 2
    assert first["group"] is None and first["waiting"] == 1
    assert second["group"]["pushed"] and second["group"]["sequences"] == 2
    [group] = await read_groups(r, keys)
    validate(group, Limits(vocab_size=512))
    assert group.group_id == second["group"]["id"] and group.task_id == "t1"
    assert group.metadata == {"sessions": ["a", "b"], "sequence_sessions": ["a", "b"], "partial": False}
    assert group.generation_params is not None and group.generation_params["max_tokens"] == 6
    for seq, (sid, reward) in zip(group.sequences, (("a", 0.5), ("b", 1.5)), strict=True):
        r1, r2 = turns[sid]
        prompt2, c1, c2 = r2["prompt_token_ids"], r1["choices"][0], r2["choices"][0]
        assert seq.tokens.numpy().tolist() == prompt2 + c2["token_ids"]
        mask = np.zeros(seq.length, np.uint8)
        lps = np.zeros(seq.length, np.float32)
        for start, ch in ((len(prompt), c1), (len(prompt2), c2)):
            mask[start : start + len(ch["token_ids"])] = 1
            lps[start : start + len(ch["token_ids"])] = [e["logprob"] for e in ch["logprobs"]["content"]]
        assert seq.loss_mask.numpy().tolist() == mask.tolist()  # both replies trainable, the user turn not
        assert np.array_equal(seq.logprobs.numpy(), lps) and seq.score == reward


@pytest.mark.slow
async def test_real_vocabulary_and_thousands_of_tokens(
    producer: AsyncGroupProducer, r: aioredis.Redis, keys: Keys
) -> None:
    """A Qwen-sized vocabulary (151,936) and a 4,000-token, two-turn rollout, through to Redis."""
    from pipeline.demo.tinymodels import REAL_VOCAB_SIZE, ensure_real_vocab_model

    real = HFStudent.from_pretrained(ensure_real_vocab_model())
    config = StudentServeConfig(served_names=(MODEL,), max_model_len=32_768, vocab_size=REAL_VOCAB_SIZE)
    service = StudentService(real, config, producer.push)
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, REAL_VOCAB_SIZE, 3000).tolist()
    h = {"X-Session-ID": "long"}
    async with http(service) as c:
        r1 = (
            await c.post("/inference/v1/generate", json=generate_body(prompt, seed=1, max_tokens=16), headers=h)
        ).json()
        reply = r1["choices"][0]["token_ids"]
        prompt2 = [
            *prompt,
            *reply,
            *([] if reply[-1] == EOS else [EOS]),
            *rng.integers(3, REAL_VOCAB_SIZE, 1000).tolist(),
        ]
        r2 = (
            await c.post("/inference/v1/generate", json=generate_body(prompt2, seed=2, max_tokens=16), headers=h)
        ).json()
        too_big = await c.post("/inference/v1/generate", json=generate_body([1, REAL_VOCAB_SIZE]))
        await c.post("/sessions/long/finish", json={"task": "long", "reward": 1.0})
    assert too_big.status_code == 400
    [group] = await read_groups(r, keys)
    validate(group, Limits(vocab_size=REAL_VOCAB_SIZE))
    [seq] = group.sequences
    ids2 = r2["choices"][0]["token_ids"]
    assert seq.length == len(prompt2) + len(ids2) > 4000
    assert seq.spans == [(len(prompt), len(prompt) + len(reply)), (len(prompt2), seq.length)]
    want = [e["logprob"] for ch in (r1, r2) for e in ch["choices"][0]["logprobs"]["content"]]
    assert seq.logprobs.numpy()[seq.loss_mask.numpy().astype(bool)].tolist() == want


async def test_finish_answers_unknown_evicted_and_untrainable_rollouts(hf_student: HFStudent) -> None:
    clock = Clock()
    service = make_service(hf_student, _never, clock, ttl_s=10.0)
    body = generate_body([1, 3], max_tokens=2)
    async with http(service) as c:
        for sid in ("old", "skip", "gone"):
            await c.post("/inference/v1/generate", json=body, headers={"X-Session-ID": sid})
        await c.post("/inference/v1/generate", json=body)  # no session: served, not tracked
        assert (await c.delete("/sessions/gone")).status_code == 204
        clock.now += 5
        await c.post("/inference/v1/generate", json=body, headers={"X-Session-ID": "skip"})
        clock.now += 6
        await service.maintain()  # "old" idle 11 s: evicted; "skip" idle 6 s: kept
        unknown = await c.post("/sessions/nope/finish", json={"task": "t"})
        evicted = await c.post("/sessions/old/finish", json={"task": "t"})
        skipped = await c.post("/sessions/skip/finish", json={"task": "t", "trainable": False})
        missing_task = await c.post("/sessions/skip/finish", json={"reward": 1.0})
        health = (await c.get("/health")).json()
    assert unknown.status_code == 404 and "no session" in unknown.json()["error"]["message"]
    assert evicted.status_code == 410 and "evicted (ttl)" in evicted.json()["error"]["message"]
    assert skipped.status_code == 200 and skipped.json()["skipped"] == "not trainable"
    assert missing_task.status_code == 400 and missing_task.json()["error"]["param"] == "task"
    assert health["sessions"] == 0 and health["untracked_requests"] == 1


async def test_unfinished_sessions_are_bounded_by_ttl_and_count_with_a_metric(hf_student: HFStudent) -> None:
    def evicted(reason: str) -> float:
        return REGISTRY.get_sample_value("distillq_student_sessions_evicted_total", {"reason": reason}) or 0.0

    clock = Clock()
    store = SessionStore(max_sessions=3, ttl_s=30.0, clock=clock)
    before = evicted("ttl"), evicted("capacity")
    with capture_logs() as logs:
        for sid in ("s1", "s2", "s3"):
            store.touch(sid)
            clock.now += 10
        store.touch("s1")  # s1 is now the most recently used
        store.touch("s4")  # over capacity: the least recently used (s2) goes
        clock.now += 25
        expired = store.sweep()  # s3 idle 35 s; s1 and s4 idle 25 s
    assert expired == ["s3"] and sorted(s for s in ("s1", "s2", "s3", "s4") if store.get(s)) == ["s1", "s4"]
    assert store.eviction_reason("s2") == "capacity" and store.eviction_reason("s3") == "ttl"
    assert (evicted("ttl"), evicted("capacity")) == (before[0] + 1, before[1] + 1)
    assert [(e["session"], e["reason"]) for e in logs if e["event"] == "student.session_evicted"] == [
        ("s2", "capacity"),
        ("s3", "ttl"),
    ]


async def test_incomplete_groups_are_flushed_and_failed_pushes_retried(hf_student: HFStudent) -> None:
    pushed: list[RolloutGroup] = []
    failures = [ConnectionError("redis down")]

    async def flaky(g: RolloutGroup) -> None:
        if failures:
            raise failures.pop()
        pushed.append(g)

    clock = Clock()
    service = make_service(hf_student, flaky, clock, ttl_s=10.0)
    async with http(service) as c:
        await c.post("/inference/v1/generate", json=generate_body([1, 3], max_tokens=2), headers={"X-Session-ID": "x"})
        done = (await c.post("/sessions/x/finish", json={"task": "t", "group_size": 4})).json()
        await service.maintain()
        assert done["waiting"] == 1 and pushed == [] and len(service.groups) == 1
        clock.now += 11
        with capture_logs() as logs:
            await service.maintain()  # flushed as a partial group; its push fails and is kept
        assert pushed == [] and len(service.unsent) == 1
        assert {e["event"] for e in logs} >= {"student.partial_group", "student.push_failed"}
        await service.maintain()  # retried
    assert len(pushed) == 1 and not service.unsent
    assert pushed[0].metadata is not None and pushed[0].metadata["partial"] is True


async def test_groups_whose_push_is_cancelled_at_shutdown_are_pushed_by_close(hf_student: HFStudent) -> None:
    """The app stopping cancels the maintenance pass mid-push: the group being pushed and the groups flushed
    with it are still pushed when the service closes."""
    pushed: list[RolloutGroup] = []
    entered = asyncio.Event()

    async def sink(g: RolloutGroup) -> None:
        if not entered.is_set():  # the first push hangs (a slow Redis) until the shutdown cancels it
            entered.set()
            await asyncio.Event().wait()
        pushed.append(g)

    clock = Clock()
    service = make_service(hf_student, sink, clock, ttl_s=10.0)
    app = create_app(service, maintain_every_s=0.01)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://student") as c:
        for sid, task in (("a", "t1"), ("b", "t2"), ("c", "t3")):
            body = generate_body([1, 3], max_tokens=2)
            await c.post("/inference/v1/generate", json=body, headers={"X-Session-ID": sid})
            await c.post(f"/sessions/{sid}/finish", json={"task": task, "group_size": 4})
    async with app.router.lifespan_context(app):
        assert len(service.groups) == 3
        clock.now += 11  # the three groups expire: the next pass flushes them as partial groups
        await asyncio.wait_for(entered.wait(), 30)
    assert sorted(g.task_id for g in pushed) == ["t1", "t2", "t3"] and not service.unsent
    assert all(g.metadata is not None and g.metadata["partial"] for g in pushed)


def sse(text: str) -> list[Any]:
    events = [line.removeprefix("data: ") for line in text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


async def test_chat_completions_stream_with_usage_and_are_tracked(
    hf_student: HFStudent, producer: AsyncGroupProducer, r: aioredis.Redis, keys: Keys
) -> None:
    service = make_service(hf_student, producer.push)
    msgs = [{"role": "user", "content": "12+3="}]
    base = {"model": MODEL, "messages": msgs, "max_tokens": 6, "seed": 5}
    async with http(service) as c:
        plain = (await c.post("/v1/chat/completions", json=base)).json()
        h = {"X-Session-ID": "chat"}
        streamed = await c.post(
            "/v1/chat/completions", json={**base, "stream": True, "stream_options": {"include_usage": True}}, headers=h
        )
        quiet = await c.post("/v1/chat/completions", json={**base, "stream": True})
        bad = await c.post("/v1/chat/completions", json={**base, "messages": "hi"})
        long = await c.post(
            "/v1/chat/completions", json={**base, "messages": [{"role": "user", "content": "7+8=" * 600}]}
        )
        stop = await c.post("/v1/chat/completions", json={**base, "stop": ["\n"], "presence_penalty": 0})
        done = (await c.post("/sessions/chat/finish", json={"task": "c", "reward": 1.0})).json()
    assert streamed.headers["content-type"].startswith("text/event-stream")
    chunks = sse(streamed.text)
    assert [ch["object"] for ch in chunks] == ["chat.completion.chunk"] * 4
    role, content, finish, usage = chunks
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert content["choices"][0]["delta"]["content"] == plain["choices"][0]["message"]["content"]  # same seed
    assert finish["choices"][0]["finish_reason"] == plain["choices"][0]["finish_reason"]
    assert usage["choices"] == [] and usage["usage"] == plain["usage"]
    assert all(ch["usage"] is None for ch in chunks[:3])
    assert "usage" not in [k for ch in sse(quiet.text) for k, v in ch.items() if v is not None]
    assert bad.status_code == 400 and "messages" in bad.json()["error"]["message"]
    assert long.status_code == 400 and "maximum context length is 1024" in long.json()["error"]["message"]
    assert stop.status_code == 200
    [group] = await read_groups(r, keys)
    assert group.group_id == done["group"]["id"]
    [seq] = group.sequences
    ids = content["choices"][0]["token_ids"]
    assert seq.tokens.numpy().tolist() == prompt_ids(hf_student) + ids
    assert seq.logprobs.numpy()[-len(ids) :].tolist() == [
        e["logprob"] for e in content["choices"][0]["logprobs"]["content"]
    ]


async def test_a_vllm_backend_is_served_with_float32_logprobs(hf_student: HFStudent) -> None:
    """The vLLM student client behind the server: its float64 logprobs reach the client and the tracker as
    the same float32 values."""
    from pipeline.rollout.students.vllm import VLLMStudent

    seen: list[dict[str, Any]] = []

    def completions(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        tokens = ["token_id:40", "token_id:41", "token_id:2"]
        logprobs = {"token_logprobs": [-0.1, -0.2, -0.3], "tokens": tokens}
        choice = {"index": 0, "token_ids": [40, 41, EOS], "finish_reason": "stop", "logprobs": logprobs}
        return httpx.Response(200, json={"choices": [choice]})

    pushed: list[RolloutGroup] = []

    async def sink(g: RolloutGroup) -> None:
        pushed.append(g)

    backend = VLLMStudent(
        "http://vllm:8000", "student", hf_student.tokenizer, transport=httpx.MockTransport(completions)
    )
    async with http(make_service(backend, sink)) as c:  # type: ignore[arg-type]
        resp = await c.post("/inference/v1/generate", json=generate_body([1, 3, 4]), headers={"X-Session-ID": "v"})
        await c.post("/sessions/v/finish", json={"task": "t"})
    await backend.aclose()
    assert seen[0]["prompt"] == [1, 3, 4] and seen[0]["stop_token_ids"] == [EOS] and seen[0]["max_tokens"] == 6
    lps = [e["logprob"] for e in resp.json()["choices"][0]["logprobs"]["content"]]
    assert lps == np.float32([-0.1, -0.2, -0.3]).tolist() and lps != [-0.1, -0.2, -0.3]
    assert pushed[0].sequences[0].logprobs.numpy()[-3:].tolist() == lps


async def test_an_api_key_is_required_when_configured(
    hf_student: HFStudent, monkeypatch: pytest.MonkeyPatch
) -> None:
    compared: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def compare_digest(a: bytes, b: bytes) -> bool:  # the constant-time comparison, watched
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr("pipeline.serve.student.app.hmac.compare_digest", compare_digest)
    async with http(make_service(hf_student, _never), api_key="sk-1") as c:
        missing = await c.get("/v1/models")
        wrong = await c.get("/v1/models", headers={"Authorization": "Bearer sk-2"})
        odd = await c.get("/v1/models", headers={"Authorization": "Bearer sk-\u00e9".encode()})  # not ASCII
        right = await c.get("/v1/models", headers={"Authorization": "Bearer sk-1"})
        health = await c.get("/health")
    assert missing.status_code == wrong.status_code == odd.status_code == 401
    assert missing.json()["error"]["code"] == 401 and odd.json()["error"]["type"] == "AuthenticationError"
    assert right.status_code == 200 and health.status_code == 200
    assert compared == [(b"", b"Bearer sk-1"), (b"Bearer sk-2", b"Bearer sk-1"),
                        ("Bearer sk-\u00e9".encode(), b"Bearer sk-1"), (b"Bearer sk-1", b"Bearer sk-1")]  # fmt: skip


def student_args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_student_arguments(p)
    return p.parse_args(list(argv))


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--backend", "vllm"], "--backend vllm needs --url and --tokenizer"),
        (["--backend", "hf"], "--backend hf needs --model DIR"),
        (["--model", "x", "--group-size", "0"], "--group-size must be >= 1"),
        (["--model", "x", "--max-sessions", "0"], "--max-sessions must be >= 1"),
        (["--model", "x", "--session-ttl", "0"], "--session-ttl must be a number of seconds > 0"),
        (["--model", "x", "--session-ttl", "-5"], "--session-ttl must be a number of seconds > 0"),
        (["--model", "x", "--session-ttl", "nan"], "--session-ttl must be a number of seconds > 0"),
        (["--model", "x", "--port", "70000"], "--port must be in 0..65535, got 70000"),
        (["--model", "x", "--metrics-port", "-1"], "--metrics-port must be in 0..65535, got -1"),
        (["--model", "x", "--default-max-tokens", "0"], "--default-max-tokens must be >= 1"),
        (["--model", "x", "--api-key-var", "DISTILLQ_TEST_UNSET_VARIABLE"], "DISTILLQ_TEST_UNSET_VARIABLE: the"),
        (["--model", "x", "--redis-url", "http://nope"], "invalid setting redis_url"),
    ],
)
def test_cli_configuration_errors_are_one_line_and_exit_2(
    argv: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Checked before a model loads or Redis is contacted (the redis URL here is never reachable)."""
    from pipeline.cli.main import main as distillq

    url = [] if "--redis-url" in argv else ["--redis-url", "redis://127.0.0.1:9/0"]
    assert serve_student([*argv, *url]) == 2
    assert distillq(["serve", "student", *argv, *url]) == 2
    direct, via_distillq = capsys.readouterr().err.splitlines()  # one line each, the same line
    assert direct == via_distillq and direct.startswith("distillq: ") and words in direct
    with pytest.raises((CliError, ValidationError)):  # raised, not printed: the entry points print it
        run_student(student_args(*argv, *url))
    assert capsys.readouterr().err == ""


def test_cli_backend_errors_exit_2_and_an_unreachable_redis_exits_3(
    redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    tok = str(ensure_tiny_models().tokenizer)
    vllm = ["--backend", "vllm", "--url", "http://127.0.0.1:9/v1", "--tokenizer", tok, "--redis-url", redis_url]
    assert serve_student(vllm) == 2
    assert serve_student(["--model", "/nonexistent/model", "--redis-url", redis_url]) == 2
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    model = str(ensure_tiny_models().student)
    assert serve_student(["--model", model, "--redis-url", f"redis://:secret@127.0.0.1:{closed}/0"]) == 3
    listing, missing, redis_down = capsys.readouterr().err.splitlines()
    assert listing.startswith("distillq: cannot list the models of http://127.0.0.1:9")
    assert missing.startswith("distillq: ") and "/nonexistent/model" in missing
    assert redis_down == f"distillq: cannot reach Redis at redis://:***@127.0.0.1:{closed}/0: Connection refused"


async def test_the_vllm_client_is_closed_when_the_server_stops(
    hf_student: HFStudent, redis_url: str, keys: Keys
) -> None:
    from pipeline.cli.commands.serve_student import _serve
    from pipeline.rollout.students.vllm import VLLMStudent

    failing = httpx.MockTransport(lambda _: httpx.Response(500))
    backend = VLLMStudent("http://vllm:8000", "student", hf_student.tokenizer, transport=failing)
    args = student_args("--backend", "vllm", "--url", "http://vllm:8000", "--tokenizer", "tok", "--port", "0",
                        "--redis-url", redis_url, "--namespace", keys.namespace)  # fmt: skip
    listening: list[int] = []

    def stop(server: Any) -> None:  # what a SIGTERM does, without signalling the test process
        listening.append(server.servers[0].sockets[0].getsockname()[1])
        server.should_exit = True

    config = StudentServeConfig(served_names=(MODEL,), max_model_len=64)
    assert await asyncio.wait_for(_serve(args, backend, config, started=stop), 60) == 0
    assert listening and listening[0] > 0
    with pytest.raises(RuntimeError, match="client has been closed"):
        await backend.models()


@pytest.mark.slow
def test_the_process_serves_on_loopback_and_stops_on_sigterm(redis_url: str, tmp_path: Path) -> None:
    with StudentProcess(redis_url, f"cli{uuid.uuid4().hex[:8]}", tmp_path) as proc:
        models = httpx.get(f"{proc.base_url}/models", timeout=30).json()
        assert models["data"][0]["id"] == MODEL and models["data"][0]["max_model_len"] == 1024
        code = proc.stop()
    assert code == 0
    events = [json.loads(line) for line in proc.log.read_text().splitlines() if line.startswith("{")]
    serving = [e for e in events if e.get("event") == "student.serving"]
    assert serving and serving[0]["url"] == proc.base_url


def record(tid: str, task: str, nodes: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """A verifiers trace record (``Trace.to_record()`` keys this module reads)."""
    base = {"id": tid, "task": {"type": "T", "key": task}, "agent": {"trainable": True}, "ok": True, "nodes": nodes}
    return {**base, "rewards": {"a": {"score": 1.0, "weight": 0.5}, "b": None}, **extra}


def node(parent: int | None, ids: list[int], mask: list[bool], lps: list[float], **extra: Any) -> dict[str, Any]:
    return {"parent": parent, "token_ids": ids, "mask": mask, "logprobs": lps, **extra}


def test_trace_records_become_groups_by_task_with_verifiers_branch_rules() -> None:
    from pipeline.serve.student.verifiers import finish_body, groups_from_traces

    f, t = False, True
    nodes = [
        node(None, [1, 3, 40], [f, f, f], []),
        node(0, [4, 10, 11], [f, t, t], [-0.1, -0.2]),
        node(1, [2, 3, 50], [f, f, f], []),
        node(2, [4, 20], [f, t], [-0.3]),
        node(0, [4, 30], [f, t], [-0.4], semantic_parents=[{"type": "compaction_attempt", "node": 1}]),
        node(0, [4, 31], [f, t], [-0.5], semantic_parents=[{"type": "compaction_attempt", "node": 1}]),
        node(0, [9], [f], [], semantic_parents=[{"type": "compaction", "node": 5}]),  # resumes from node 5
    ]
    a = record("a", "k", nodes)
    failed = record("f", "k", nodes, ok=False)
    user_sim = record("u", "k", nodes, agent={"trainable": False})
    b = record("b", "k", nodes[:2])
    other = record("o", "k2", nodes[:2], rewards={})
    groups = groups_from_traces([a, failed, user_sim, b, other], group_size=1)
    assert [(g.task_id, g.metadata["sessions"]) for g in groups] == [("k", ["a"]), ("k", ["b"]), ("k2", ["o"])]  # type: ignore[index]
    seqs = groups[0].sequences  # leaves 3 and 5 (node 4 is an abandoned compaction attempt, node 6 has no samples)
    assert [s.tokens.numpy().tolist() for s in seqs] == [[1, 3, 40, 4, 10, 11, 2, 3, 50, 4, 20], [1, 3, 40, 4, 31]]
    assert seqs[0].loss_mask.numpy().tolist() == [0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 1]
    np.testing.assert_array_equal(seqs[0].logprobs.numpy(), np.float32([0, 0, 0, 0, -0.1, -0.2, 0, 0, 0, 0, -0.3]))
    assert {s.score for s in seqs} == {0.5} and groups[2].sequences[0].score == 0.0
    assert groups_from_traces([a, failed], include_failed=True)[0].metadata["sessions"] == ["a", "f"]  # type: ignore[index]
    assert finish_body(failed) == {"task": "k", "reward": 0.5, "trainable": False}
    with pytest.raises(ValueError, match="no task key"):
        groups_from_traces([record("x", "", nodes)])


def test_trace_groups_are_the_groups_the_server_builds() -> None:
    """Same group id and metadata as the server's ``build_group`` for the same rollouts; a remainder smaller
    than the group size is a partial group, as the server flushes it."""
    from pipeline.serve.student.sessions import FinishedRollout, GroupSpec, build_group, group_id_for
    from pipeline.serve.student.verifiers import groups_from_traces, trace_sequences

    nodes = [node(None, [1, 3, 40], [False] * 3, []), node(0, [4, 10, 11], [False, True, True], [-0.1, -0.2])]
    traces = [record(tid, "k", nodes) for tid in ("b", "a", "c")]
    full, rest = groups_from_traces(traces, group_size=2, env_id=3, policy_version=7)
    server = build_group(GroupSpec("k", 2, 3, 7), [FinishedRollout(t["id"], trace_sequences(t)) for t in traces[:2]])
    assert full.group_id == server.group_id == group_id_for(["a", "b"])
    assert full.metadata == server.metadata == {"sessions": ["b", "a"], "sequence_sessions": ["b", "a"],
                                                "partial": False}  # fmt: skip
    assert (full.env_id, full.policy_version, full.task_id) == (server.env_id, server.policy_version, "k")
    assert rest.group_id == group_id_for(["c"]) and rest.metadata == {
        "sessions": ["c"], "sequence_sessions": ["c"], "partial": True
    }
    [whole] = groups_from_traces(traces)
    assert whole.metadata is not None and whole.metadata["partial"] is False
