"""``distillq serve atropos``: the Atropos API over distillq's streams, checked against atroposlib's own server.

Each test runs the server (uvicorn, in process, on a free 127.0.0.1 port) on a fresh namespace of the test
Redis, with a synthetic teacher worker (the real stage runner) scoring what is posted. Where atroposlib is
installed, the same requests go to its server (``uvicorn atroposlib.api.server:app`` in a subprocess) and
the answers are compared. The restart test runs the server through its CLI in a subprocess and kills it.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import redis
import uvicorn

from pipeline.config import RedisSettings, StreamSettings
from pipeline.serve.atropos.app import create_app
from pipeline.serve.atropos.packing import Queued, pick_batch, pick_exact
from pipeline.serve.atropos.startup import ServeConfig
from pipeline.stages.runloop import StageRunner
from pipeline.stages.scoring import Scorer, ScoringConfig
from pipeline.stages.teacher_stage import TeacherStage
from pipeline.teacher.synthetic import SyntheticTeacher
from pipeline.transport.connection import connect
from pipeline.transport.keys import Keys
from schemas import RolloutGroup
from schemas.atropos import ATROPOS_KEYS
from tests.redis_server import free_port
from tests.slowloris import check_heads_time_out
from tests.streams import fast

pytestmark = pytest.mark.redis
ROOT = Path(__file__).resolve().parents[2]
FAST = fast(claim_idle_ms=2000, claim_interval_ms=200, heartbeat_interval_s=0.5)
REGISTRATION = {"wandb_group": "g", "wandb_project": "p", "batch_size": 4, "max_token_len": 512,
                "checkpoint_dir": "/tmp/ckpt", "save_checkpoint_interval": 10, "starting_step": 0, "num_steps": 100}
ENV = {"max_token_length": 512, "desired_name": "env", "weight": 1.0, "group_size": 2}
#: The answer to one group posted and kept.
RECEIVED = {"status": "received", "kept": 1, "repeated": 0}


# ---- servers, teacher, requests (test_atropos_clients.py uses them too) ---------------------------------------


class ThreadedServer:
    """An ASGI app under uvicorn in a thread, on a free loopback port."""

    def __init__(self, app: Any) -> None:
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_config=None, lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ThreadedServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        return self

    @property
    def url(self) -> str:
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(15)


class TeacherThread:
    """The teacher stage (``StageRunner`` + ``TeacherStage``, as ``distillq worker teacher`` runs it) with the
    synthetic backend, in a thread."""

    def __init__(self, redis_url: str, namespace: str, k: int = 3, vocab: int = 32_000) -> None:
        self.redis_url, self.namespace, self.k, self.vocab = redis_url, namespace, k, vocab
        self.ready = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _run(self) -> None:
        self.loop, self.stop = asyncio.get_running_loop(), asyncio.Event()
        client = connect(RedisSettings(redis_url=self.redis_url, namespace=self.namespace))
        scorer = Scorer(SyntheticTeacher(vocab_size=self.vocab), ScoringConfig(default_k=self.k))
        runner = StageRunner(client, Keys(self.namespace), TeacherStage(scorer), RolloutGroup, "rollouts", "scored",
                             FAST, consumer_name="teacher-test")
        self.ready.set()
        try:
            await runner.run(self.stop)
        finally:
            await client.aclose()

    def __enter__(self) -> TeacherThread:
        self.thread.start()
        self.ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(15)


def wait_for(cond: Callable[[], bool], timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def queued(r: redis.Redis, keys: Keys, n: int) -> Callable[[], bool]:
    """True once nothing is left to score and ``n`` groups wait on the server's queue."""
    return lambda: (r.xlen(keys.stream("rollouts")) == 0 and r.xlen(keys.stream("scored")) == 0
                    and r.xlen(keys.atropos("queue")) == n)


def group(n: int = 2, length: int = 6, seed: int = 0, **extra: Any) -> dict[str, Any]:
    """A ScoredDataGroup as BaseEnv sends it: prompt masked -100, token ids where trained, 1.0 placeholders."""
    tokens = [[(seed * 31 + s * 7 + p * 3) % 500 + 3 for p in range(length)] for s in range(n)]
    masks = [[-100, -100, *t[2:]] for t in tokens]
    lps = [[1.0, 1.0, *[-0.1 * (p + 1) for p in range(length - 2)]] for _ in range(n)]
    return {"tokens": tokens, "masks": masks, "scores": [float(s) / 10 + 0.1 for s in range(n)],
            "inference_logprobs": lps, "overrides": [{} for _ in range(n)], "generation_params": {"temperature": 1.0},
            **extra}


class Stack:
    """Our server and a teacher on one namespace; ``r`` reads Redis directly."""

    def __init__(self, redis_url: str, keys: Keys, streams: StreamSettings = FAST, *, k: int = 3,
                 vocab: int = 32_000) -> None:
        cfg = ServeConfig(redis=RedisSettings(redis_url=redis_url, namespace=keys.namespace), streams=streams)
        self.server = ThreadedServer(create_app(cfg))
        self.teacher = TeacherThread(redis_url, keys.namespace, k, vocab)
        self.r, self.keys, self.redis_url = redis.Redis.from_url(redis_url), keys, redis_url

    def __enter__(self) -> Stack:
        self.server.__enter__()
        self.teacher.__enter__()
        self.url = self.server.url
        return self

    def __exit__(self, *exc: object) -> None:
        self.teacher.__exit__()
        self.server.__exit__()
        self.r.close()

    def get(self, path: str, **kw: Any) -> httpx.Response:
        return http("GET", self.url + path, **kw)

    def post(self, path: str, body: Any = None, **kw: Any) -> httpx.Response:
        return http("POST", self.url + path, **({"json": body} if body is not None else {}), **kw)

    def wait_queued(self, n: int) -> None:
        wait_for(queued(self.r, self.keys, n), what=f"{n} groups queued")

    def start_trainer(self, **reg: Any) -> None:
        assert self.post("/register", {**REGISTRATION, **reg}).status_code == 200
        assert self.get("/batch").json() == {"batch": None}


class AtroposServer:
    """atroposlib 0.4.0's own server (``uvicorn atroposlib.api.server:app``), in a subprocess stopped by pid."""

    def __init__(self) -> None:
        pytest.importorskip("atroposlib", reason="atroposlib 0.4.0 not installed: pip install atroposlib==0.4.0")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> AtroposServer:
        argv = [sys.executable, "-m", "uvicorn", "atroposlib.api.server:app", "--host", "127.0.0.1", "--port",
                str(self.port), "--log-level", "warning"]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(lambda: _up(self.url), 30, "atroposlib's server")
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        self.proc.wait(15)

    def get(self, path: str, **kw: Any) -> httpx.Response:
        return http("GET", self.url + path, **kw)

    def post(self, path: str, body: Any = None, **kw: Any) -> httpx.Response:
        return http("POST", self.url + path, **({"json": body} if body is not None else {}), **kw)


def http(method: str, url: str, **kw: Any) -> httpx.Response:
    """One request; a JSON body on a GET too (``/status-env`` takes one, as BaseEnv sends it)."""
    if "data" in kw:
        kw["content"] = kw.pop("data")
    return httpx.request(method, url, timeout=60, **kw)


def http_raw(url: str, **kw: Any) -> tuple[httpx.Response, bytes]:
    """A GET and its body as it came over the wire (still gzipped if the server gzipped it)."""
    with httpx.stream("GET", url, timeout=60, **kw) as r:
        return r, b"".join(r.iter_raw())


def _up(url: str) -> bool:
    try:
        return http("GET", url + "/info").status_code == 200
    except httpx.TransportError:
        return False


def answer(resp: httpx.Response) -> tuple[int, Any]:
    try:
        return resp.status_code, resp.json()
    except ValueError:
        return resp.status_code, resp.text


def without_distill(item: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in item.items() if k not in ("distill_token_ids", "distill_logprobs", "teacher")}


def check_distill(item: dict[str, Any]) -> None:
    """Distill arrays in the reference layout: one entry per token, entry 0 and untrained positions empty,
    every trained position the actual token first and k (3) or k + 1 items with logprobs <= 0."""
    assert tuple(item) == (*ATROPOS_KEYS, "teacher")  # the reference's 14 keys, in its order, and who scored it
    assert item["teacher"]["pool"] == "default" and item["teacher"]["k"] == 3 and item["teacher"]["model"]
    for s, tok in enumerate(item["tokens"]):
        ids, lps = item["distill_token_ids"][s], item["distill_logprobs"][s]
        assert len(ids) == len(lps) == len(tok) and ids[0] == [] == lps[0]
        for p in range(1, len(tok)):
            trained = item["masks"][s][p] != -100
            assert bool(ids[p]) == trained and len(ids[p]) == len(lps[p])
            if trained:
                assert ids[p][0] == tok[p] and len(ids[p]) in (3, 4) and max(lps[p]) <= 0


@pytest.fixture
def stack(redis_url: str, keys: Keys) -> Iterator[Stack]:
    with Stack(redis_url, keys) as s:
        yield s


# ---- the same requests to atroposlib's server and ours -------------------------------------------------------


def test_protocol_answers_match_atroposlib(stack: Stack) -> None:
    """Registration, env registration, info, status, validation errors and reset answer as the reference."""
    script: list[tuple[str, str, Any]] = [
        ("GET", "/", None), ("GET", "/info", None), ("GET", "/wandb_info", None), ("GET", "/batch", None),
        ("GET", "/status", None), ("GET", "/latest_example", None),
        ("POST", "/register", REGISTRATION), ("POST", "/register", {**REGISTRATION, "batch_size": 64}),
        ("POST", "/register-env", ENV), ("GET", "/batch", None), ("POST", "/register-env", ENV),
        ("POST", "/register-env", {**ENV, "desired_name": "other", "min_batch_allocation": 0.25}),
        ("POST", "/register-env", ENV), ("GET", "/info", None), ("GET", "/wandb_info", None), ("GET", "/status", None),
        ("GET", "/status-env", {"env_id": 0}), ("GET", "/status-env", {"env_id": 1}),
        ("POST", "/disconnect-env", {"env_id": 2}), ("POST", "/disconnect-env", {"env_id": 99}),
        ("GET", "/status-env", {"env_id": 0}), ("GET", "/status-env", None), ("POST", "/register", {"batch_size": 4}),
        ("POST", "/register-env", {**ENV, "weight": "heavy"}),
        ("POST", "/scored_data", {"tokens": [[1]], "masks": [[1]]}),
        ("POST", "/scored_data", {"tokens": [[1]], "masks": [[1]], "scores": [1], "messages": [[{"role": "user"}]]}),
        ("POST", "/scored_data", {"tokens": "x", "masks": [[1]], "scores": [1]}),
        ("POST", "/scored_data_list", [{"tokens": [[1]], "masks": [[1]]}]),
        ("GET", "/reset_data", None), ("GET", "/info", None), ("GET", "/wandb_info", None), ("GET", "/status", None),
        ("POST", "/register-env", ENV), ("GET", "/latest_example", None),
    ]
    with AtroposServer() as ref:
        for method, path, body in script:
            kw = {"json": body} if body is not None else {}
            ours, theirs = answer(http(method, stack.url + path, **kw)), answer(http(method, ref.url + path, **kw))
            if path == "/register" and ours[0] == 200:
                assert isinstance(ours[1]["uuid"], int) and ours[1]["uuid"] > 2**64  # a uuid4 as an integer
                continue
            assert ours == theirs, (method, path, body)
        for server in (stack, ref):
            r = http("POST", server.url + "/scored_data", data=b"not gzip", headers={"Content-Encoding": "gzip"})
            assert (r.status_code, r.text) == (400, "Invalid gzip payload")
        truncated = {"data": gzip.compress(b"{}")[:-3], "headers": {"Content-Encoding": "gzip"}}
        assert http("POST", ref.url + "/scored_data", **truncated).status_code == 500  # EOFError, uncaught
        assert answer(http("POST", stack.url + "/scored_data", **truncated)) == (400, "Invalid gzip payload")


def test_data_flow_matches_atroposlib_and_adds_the_teacher(stack: Stack) -> None:
    """Posting, buffering off-size groups, the latest example (values echoed exactly), batches of whole groups
    counted in sequences, and the step: as the reference, plus distill arrays from the teacher."""
    g = [group(seed=i, env_id=0, advantages=[[0.1, 0.2, 0.3, 0.4, 0.5, 0.6]] * 2) for i in range(5)]
    single, more = group(n=1, seed=9, env_id=0), [group(n=1, seed=10, env_id=0), group(n=1, seed=11, env_id=0)]
    with AtroposServer() as ref:
        for server in (stack, ref):
            server.post("/register", REGISTRATION)
            server.get("/batch")
            assert server.post("/register-env", ENV).json()["env_id"] == 0
        for body, path in [(g[0], "/scored_data"), (single, "/scored_data"), ([g[1], g[2]], "/scored_data_list"),
                           (more, "/scored_data_list")]:
            (status_code, ours), theirs = answer(stack.post(path, body)), answer(ref.post(path, body))
            kept = len(body) if isinstance(body, list) else 1
            assert (ours.pop("kept"), ours.pop("repeated")) == (kept, 0)  # ours adds what it kept
            assert (status_code, ours) == theirs, body
        assert answer(stack.get("/latest_example")) == answer(ref.get("/latest_example"))
        # g0, g1, g2 and the first two singles (released together): groups in flight to the teacher count too
        assert answer(stack.get("/status")) == answer(ref.get("/status")) == (200, {"current_step": 0, "queue_size": 5})
        status = [answer(s.get("/status-env", json={"env_id": 0})) for s in (stack, ref)]
        assert status[0] == status[1] and status[0][1]["self_queue_size"] == 4
        stack.wait_queued(5)
        ours = [stack.get("/batch").json()["batch"] for _ in range(2)]
        theirs = [ref.get("/batch").json()["batch"] for _ in range(2)]
        plain = [[without_distill(i) for i in b] for b in ours]
        assert plain == [[without_distill(i) for i in b] for b in theirs[::-1]]  # the reference: newest first
        assert [sum(len(i["tokens"]) for i in b) for b in ours] == [4, 4]  # g0 g1, then g2 and the singles
        for item in ours[0] + ours[1]:
            check_distill(item)
        assert answer(stack.get("/status")) == answer(ref.get("/status")) == (200, {"current_step": 2, "queue_size": 0})
        status = [answer(s.get("/status-env", json={"env_id": 0})) for s in (stack, ref)]
        assert status[0] == status[1]


def test_batches_come_oldest_first_and_the_step_counts_handouts(stack: Stack) -> None:
    """The reference forms every batch it can at once, serves the newest first and advances the step by
    all of them; the server serves them oldest first, one step each."""
    groups = [group(seed=i) for i in range(3)]
    with AtroposServer() as ref:
        for server in (stack, ref):
            server.post("/register", {**REGISTRATION, "batch_size": 2})
            server.get("/batch")
            for g in groups:
                server.post("/scored_data", g)
        stack.wait_queued(3)
        theirs = [ref.get("/batch").json()["batch"][0]["tokens"] for _ in range(3)]
        assert theirs == [groups[2]["tokens"], groups[1]["tokens"], groups[0]["tokens"]]
        ours, steps = [], []
        for _ in range(3):
            ours.append(stack.get("/batch").json()["batch"][0]["tokens"])
            steps.append(stack.get("/status").json()["current_step"])
        assert ours == [g["tokens"] for g in groups] and steps == [1, 2, 3]
        assert stack.get("/batch").json() == ref.get("/batch").json() == {"batch": None}


# ---- beyond the reference -----------------------------------------------------------------------------------


def test_lease_redelivers_an_unacked_batch_and_ack_settles_it(redis_url: str, keys: Keys) -> None:
    with Stack(redis_url, keys, FAST.model_copy(update={"max_deliveries": 3})) as s:
        s.start_trainer(batch_size=2)
        for i in range(3):
            s.post("/scored_data", group(seed=i))
        s.wait_queued(3)
        first = s.get("/batch", params={"lease": 1, "lease_s": 0.5}).json()
        assert first["deliveries"] == 1 and first["lease_s"] == 0.5
        payload_keys = s.r.keys(f"{{{keys.namespace}:scored}}:payload:*")
        assert len(payload_keys) == 3  # a leased batch keeps its payload until acknowledged
        second = s.get("/batch", params={"lease": 1}).json()  # not expired yet: the next batch
        assert second["batch"][0]["tokens"] != first["batch"][0]["tokens"]
        assert s.post("/batch/ack", {"batch_id": second["batch_id"]}).json()["status"] == "acked"
        time.sleep(0.6)
        again = s.get("/batch", params={"lease": 1, "lease_s": 0.3}).json()  # the trainer died: same batch back
        assert (again["batch_id"], again["batch"], again["deliveries"]) == (first["batch_id"], first["batch"], 2)
        assert s.get("/status").json()["current_step"] == 2  # a redelivery is not a new step
        assert s.post("/batch/ack", {"batch_id": again["batch_id"]}).status_code == 200
        assert s.post("/batch/ack", {"batch_id": again["batch_id"]}).status_code == 404
        assert len(s.r.keys(f"{{{keys.namespace}:scored}}:payload:*")) == 1  # the third group's, still queued
        time.sleep(0.4)
        third = s.get("/batch", params={"lease_s": 0.2}).json()  # acked batches never come back
        assert third["deliveries"] == 1 and third["batch"][0]["tokens"] == group(seed=2)["tokens"]
        for deliveries in (2, 3):
            time.sleep(0.3)
            assert s.get("/batch", params={"lease_s": 0.2}).json()["deliveries"] == deliveries
        time.sleep(0.3)
        assert s.get("/batch").json() == {"batch": None}  # handed out max_deliveries times: dead-lettered
        dlq = s.r.xrange(keys.dlq)
        assert len(dlq) == 1 and dlq[0][1][b"reason"].startswith(b"lease_expired: batch " + third["batch_id"].encode())
        assert dlq[0][1][b"stage"] == b"atropos" and dlq[0][1][b"orig_d"]  # the payload, replayable onto scored


def test_the_server_heartbeats_while_it_runs_and_not_after_it_stopped(redis_url: str, keys: Keys) -> None:
    """The mover writes the replica's heartbeat (``distillq stats``, ``--check`` read it); shutdown removes it."""

    def beats(r: redis.Redis) -> list[bytes]:
        return list(r.scan_iter(match=keys.heartbeat_pattern("atropos")))

    with Stack(redis_url, keys) as s:
        wait_for(lambda: bool(beats(s.r)), what="the server's heartbeat")
        (key,) = beats(s.r)
        info = json.loads(s.r.get(key))
        assert info["pid"] == os.getpid() and info["handled"] == 0 and info["outcomes"] == {}
        assert 0 < s.r.pttl(key) <= FAST.heartbeat_interval_s * 3000
    r = redis.Redis.from_url(redis_url)
    assert beats(r) == []
    r.close()


def test_oversize_groups_are_dead_lettered_instead_of_blocking(stack: Stack) -> None:
    stack.post("/scored_data", group(n=3, seed=1))  # before the trainer registers: queued
    stack.wait_queued(1)
    stack.start_trainer(batch_size=2)
    assert stack.post("/scored_data", group(n=4, seed=2)).json()["status"] == "dead_lettered"  # never scored
    stack.post("/scored_data", group(n=2, seed=3))
    stack.wait_queued(1)
    batch = stack.get("/batch").json()["batch"]
    assert [b["tokens"] for b in batch] == [group(n=2, seed=3)["tokens"]]
    reasons = sorted(f[b"reason"].decode() for _, f in stack.r.xrange(stack.keys.dlq))
    assert reasons == ["oversize_group: 3 sequences > batch_size 2; it can never be part of a batch",
                       "oversize_group: 4 sequences > batch_size 2; it can never be part of a batch"]
    sources = sorted(f[b"source"] for _, f in stack.r.xrange(stack.keys.dlq))
    assert sources == [b"rollouts", b"scored"]  # each replayable onto the stream it came from
    assert stack.get("/status").json()["queue_size"] == 0  # the dead-lettered group left the running count


def test_teacher_top_k_minus_one_means_no_teacher(stack: Stack) -> None:
    stack.start_trainer(batch_size=2)
    stack.post("/scored_data", group(seed=1, group_overrides={"teacher_top_k": -1}))
    stack.wait_queued(1)
    item = stack.get("/batch").json()["batch"][0]
    assert item["group_overrides"] == {"teacher_top_k": -1}
    assert item["distill_token_ids"] is None and item["distill_logprobs"] is None


def test_real_shapes_through_the_server(redis_url: str, keys: Keys) -> None:
    """One group of 8 x 4,096 tokens (1,024 prompt), vocabulary 151,936, k = 20: posted gzipped as BaseEnv
    does, scored, handed out gzipped; the figures are printed (``-s``)."""
    vocab, n, length, prompt = 151_936, 8, 4096, 1024
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, (n, length)).tolist()
    body = {"tokens": tokens, "masks": [[-100] * prompt + t[prompt:] for t in tokens], "scores": [0.5] * n,
            "inference_logprobs": [[1.0] * prompt + (-rng.exponential(1.0, length - prompt)).tolist() for _ in tokens],
            "overrides": [{}] * n, "generation_params": {"temperature": 1.0}}
    raw = json.dumps(body).encode()
    with Stack(redis_url, keys, k=20, vocab=vocab) as s:
        s.start_trainer(batch_size=n)
        t0 = time.perf_counter()
        posted = s.post("/scored_data", data=gzip.compress(raw, 1),
                        headers={"Content-Encoding": "gzip", "Content-Type": "application/json"})
        t_post = time.perf_counter() - t0
        assert posted.json() == RECEIVED
        s.wait_queued(1)
        t0 = time.perf_counter()
        _, wire = http_raw(s.url + "/batch", headers={"Accept-Encoding": "gzip"})
        t_batch = time.perf_counter() - t0
        plain = gzip.decompress(wire)
        item = json.loads(plain)["batch"][0]
    for key in ("tokens", "masks", "scores", "inference_logprobs", "overrides", "generation_params"):
        assert item[key] == body[key], key
    ids = item["distill_token_ids"]
    assert [len(e) for e in ids[0][:prompt]] == [0] * prompt and all(len(e) in (20, 21) for e in ids[0][prompt:])
    print(f"\nATROPOS real shapes: POST {len(raw) / 1e6:.1f} MB JSON in {t_post:.2f} s; GET /batch "
          f"{len(plain) / 1e6:.1f} MB JSON as {len(wire) / 1e6:.1f} MB gzip in {t_batch:.2f} s")


def test_gzip_both_ways(stack: Stack) -> None:
    stack.start_trainer(batch_size=2)
    body = gzip.compress(json.dumps(group(length=300)).encode())
    r = stack.post("/scored_data", data=body, headers={"Content-Encoding": "gzip", "Content-Type": "application/json"})
    assert r.json() == RECEIVED
    stack.wait_queued(1)
    raw = stack.get("/latest_example", headers={"Accept-Encoding": "identity"})
    assert "content-encoding" not in raw.headers and raw.json()["tokens"] == group(length=300)["tokens"]
    r, wire = http_raw(stack.url + "/batch", headers={"Accept-Encoding": "gzip"})
    assert r.headers["content-encoding"] == "gzip"
    assert json.loads(gzip.decompress(wire))["batch"][0]["tokens"] == group(length=300)["tokens"]
    small = stack.get("/info", headers={"Accept-Encoding": "gzip"})
    assert "content-encoding" not in small.headers  # under 1,000 bytes: as the reference
    bomb = gzip.compress(b"[" + b" " * (2 << 20) + b"]")
    small_cap = ServeConfig(redis=RedisSettings(redis_url=stack.redis_url, namespace=f"{stack.keys.namespace}-cap"),
                            streams=FAST, max_body_bytes=1 << 20)
    with ThreadedServer(create_app(small_cap)) as big:
        r = http("POST", big.url + "/scored_data_list", data=bomb, headers={"Content-Encoding": "gzip"})
        assert r.status_code == 413


@pytest.mark.parametrize(("path", "body", "code", "field"), [
    ("/scored_data", {"tokens": [[1, 2, 3]], "masks": [[-100, 2]], "scores": [1.0]}, 422, ["body", "masks", 0]),
    ("/scored_data", {"tokens": [[1, -2]], "masks": [[-100, 1]], "scores": [1.0]}, 422, ["body", "tokens", 0]),
    ("/scored_data", {"tokens": [[1, 2]], "masks": [[-100, 1]], "scores": [1.0, 2.0]}, 422, ["body", "scores"]),
    ("/scored_data", {"tokens": [[]], "masks": [[]], "scores": [1.0]}, 422, ["body", "tokens", 0]),
    ("/scored_data", {"tokens": [[1]], "masks": [[1]], "scores": [1], "messages": [[None]]}, 422, ["body", "messages"]),
    ("/scored_data_list", [group(seed=1), {"tokens": [[1, 2]], "masks": [[-100]], "scores": [0.5]}], 422,
     ["body", 1, "masks", 0]),
])
def test_bad_groups_get_a_4xx_naming_the_field_and_nothing_is_queued(
    stack: Stack, path: str, body: Any, code: int, field: list[Any]
) -> None:
    r = stack.post(path, body)
    assert r.status_code == code, r.text
    assert r.json()["detail"][0]["loc"][: len(field)] == field
    assert stack.r.xlen(stack.keys.stream("rollouts")) == 0 and stack.get("/status").json()["queue_size"] == 0


def test_other_bad_requests_get_a_4xx(stack: Stack) -> None:
    assert stack.get("/status-env", json={"env_id": 0}).status_code == 404  # the reference: 500
    stack.start_trainer()
    stack.post("/register-env", ENV)
    r = stack.get("/status-env", json={"env_id": 7})
    assert r.status_code == 404 and "unknown env_id 7" in r.json()["detail"]
    assert stack.post("/batch/ack", {"batch_id": "nope"}).status_code == 404
    assert stack.get("/batch", params={"lease_s": 0}).status_code == 422
    assert stack.post("/batch/ack", {}).status_code == 422
    assert stack.get("/reset_data").text == "Reset successful"
    assert stack.get("/batch").json()["status"] == "error"  # the reference: 500 until /register


def test_reset_clears_everything_including_groups_in_flight(stack: Stack) -> None:
    stack.start_trainer(batch_size=2)
    stack.post("/register-env", ENV)
    stack.post("/scored_data", group(seed=1))
    stack.post("/scored_data", group(n=1, seed=2, env_id=0))  # buffered
    stack.wait_queued(1)
    stack.teacher.__exit__()  # the next group stays in flight across the reset
    stack.post("/scored_data", group(seed=3))
    assert stack.get("/reset_data").status_code == 200
    stack.teacher = TeacherThread(stack.redis_url, stack.keys.namespace).__enter__()
    stack.start_trainer(batch_size=2)
    wait_for(lambda: stack.r.xlen(stack.keys.stream("scored")) + stack.r.xlen(stack.keys.stream("rollouts")) == 0)
    time.sleep(0.3)
    assert stack.get("/batch").json() == {"batch": None}  # neither the queued nor the in-flight group
    assert stack.r.keys(f"{{{stack.keys.namespace}:scored}}:payload:*") == []
    assert stack.post("/register-env", ENV).json()["env_id"] == 0


@pytest.mark.slow
def test_state_survives_a_server_restart(redis_url: str, keys: Keys, tmp_path: Path) -> None:
    """Registration, envs, step, buffers, the queue and leases live in Redis: a server killed with SIGKILL and
    started again (through its CLI) carries on."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "pipeline.cli.main", "serve", "atropos", "--port", str(port),
            "--redis-url", redis_url, "--namespace", keys.namespace, "--lease-s", "1"]
    env = {**os.environ, "DISTILLQ_BLOCK_MS": "100"}

    def start() -> subprocess.Popen[bytes]:
        with open(tmp_path / "server.log", "ab") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        wait_for(lambda: _up(url), 60, "the server")
        return proc

    r = redis.Redis.from_url(redis_url)
    with TeacherThread(redis_url, keys.namespace):
        proc = start()
        http("POST", url + "/register", json={**REGISTRATION, "batch_size": 2})
        http("GET", url + "/batch")
        assert http("POST", url + "/register-env", json=ENV).json()["env_id"] == 0
        for i in range(3):
            http("POST", url + "/scored_data", json=group(seed=i, env_id=0))
        http("POST", url + "/scored_data", json=group(n=1, seed=7, env_id=0))  # buffered
        wait_for(queued(r, keys, 3))
        leased = http("GET", url + "/batch", params={"lease": 1}).json()
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        proc = start()
        try:
            assert http("GET", url + "/info").json() == {"batch_size": 2, "max_token_len": 512}
            assert http("GET", url + "/status").json() == {"current_step": 1, "queue_size": 2}
            assert http("GET", url + "/status-env", json={"env_id": 0}).json()["self_queue_size"] == 2
            assert http("POST", url + "/register-env", json=ENV).json()["env_id"] == 1  # no re-wait
            time.sleep(1.1)
            again = http("GET", url + "/batch", params={"lease": 1}).json()
            assert (again["batch_id"], again["batch"]) == (leased["batch_id"], leased["batch"])
            rest = [http("GET", url + "/batch").json()["batch"][0]["tokens"] for _ in range(2)]
            assert rest == [group(seed=1)["tokens"], group(seed=2)["tokens"]]
            r2 = http("POST", url + "/scored_data", json=group(n=1, seed=8, env_id=0)).json()
            assert r2 == {"status": "buffered", "buffer_size": 0, "kept": 1,
                          "repeated": 0}  # with the single buffered before the crash
        finally:
            proc.terminate()
            proc.wait(15)
    r.close()


# ---- batch selection (pure) --------------------------------------------------------------------------------


def _q(sizes: list[int], envs: list[int | None] | None = None) -> list[Queued]:
    envs = envs or [None] * len(sizes)
    return [Queued(str(i), f"g{i}", f"k{i}", n, e) for i, (n, e) in enumerate(zip(sizes, envs, strict=True))]


@pytest.mark.parametrize(("sizes", "target", "want"), [
    ([2, 2, 2], 4, [0, 1]), ([3, 2, 2], 4, [1, 2]), ([3, 1, 2], 4, [0, 1]), ([1, 2, 1], 4, [0, 1, 2]),
    ([3, 3], 4, None), ([], 4, None), ([5], 4, None), ([4, 1, 1, 1, 1], 4, [0]), ([1, 3, 2, 2], 4, [0, 1]),
])
def test_pick_exact_takes_the_earliest_groups_that_fill_the_batch(sizes: list[int], target: int,
                                                                  want: list[int] | None) -> None:
    assert pick_exact(sizes, target) == want


def test_pick_exact_at_queue_scale() -> None:
    sizes = [7] * 5000 + [3, 4]
    t0 = time.perf_counter()
    assert pick_exact(sizes, 1024) is None  # 1024 = 2 (mod 7): no mix of 7s, a 3 and a 4 makes it
    assert pick_exact(sizes, 1025) == [*range(146), 5000] and pick_exact(sizes, 1026) == [*range(146), 5001]
    assert time.perf_counter() - t0 < 2.0


def test_pick_batch_fills_minimum_allocations_first() -> None:
    queue = _q([2, 2, 2, 2], [0, 0, 1, None])
    assert pick_batch(queue, 4, {1: 2}) == [0, 2]  # env 1's group first, then the oldest that fits
    assert pick_batch(queue, 4, {5: 2}) is None  # an env with a minimum and nothing queued: no batch
    assert pick_batch(queue, 4, None) == [0, 1]


async def test_in_flight_records_leave_when_a_dead_letter_names_the_group_or_after_the_ttl(r: Any, keys: Keys) -> None:
    """A group dead-lettered between ``rollouts`` and the queue would count in ``/status`` forever: its record
    goes when a dead letter names it (read once), or after the dedupe TTL; a group that is merely slow stays,
    whatever the streams hold, and its env marker with it."""
    from pipeline.serve.atropos.state import AtroposState

    state = AtroposState(r, keys, ttl_s=3600)
    await r.xadd(keys.dlq, {"stage": "teacher", "reason": "decode_error: x", "orig_gid": "lost"})  # before its post
    assert await state.reconcile_inflight() == 0  # nothing in flight: the cursor moves to now (Redis' clock)
    for gid in ("lost", "slow", "old"):
        assert await state.track(gid, 0, 2)
    assert not await state.track("slow", 0, 2)  # posted twice: one record
    await r.zadd(keys.atropos("inflight_at"), {"old": time.time() - 3601})
    await r.xadd(keys.dlq, {"stage": "teacher", "reason": "decode_error: x", "orig_gid": "lost"})
    await r.xadd(keys.dlq, {"stage": "teacher", "reason": "decode_error: x", "orig_gid": "not-in-flight"})
    assert await state.reconcile_inflight() == 2
    assert [k.decode() for k in await r.hkeys(keys.atropos("inflight"))] == ["slow"]
    assert await r.get(keys.atropos_env("slow")) == b"0" and await r.get(keys.atropos_env("lost")) is None
    assert await state.reconcile_inflight() == 0  # each dead letter is read once
    await state.track("new", 1, 4)
    await r.xadd(keys.dlq, {"stage": "teacher", "reason": "decode_error: x", "orig_gid": "slow"})
    assert await state.reconcile_inflight() == 1
    assert await state.inflight() == [(1, 4)]


async def test_the_mover_dead_letters_a_scored_entry_without_a_header(r: Any, keys: Keys) -> None:
    """Only claim-checked entries are queued: one carrying its payload inline goes to the DLQ whole."""
    from pipeline.serve.atropos.queue import AtroposQueue
    from pipeline.serve.atropos.state import AtroposState
    from schemas import encode
    from schemas.build import synthetic_rollout, synthetic_scored

    queue = AtroposQueue(r, keys, AtroposState(r, keys, ttl_s=3600), StreamSettings())
    await queue.consumer.ensure_group()
    g = synthetic_scored(synthetic_rollout(2, 16, group_id="inline", seed=3), k=4, seed=3)
    await r.xadd(keys.stream("scored"), {b"t": b"scored", b"gid": b"inline", b"d": encode(g)})
    (d,) = await queue.consumer.read(10, block=False)
    assert await queue.move(d) == "dead_letter"
    ((_, letter),) = await r.xrange(keys.dlq)
    assert letter[b"stage"] == b"atropos" and letter[b"reason"].startswith(b"decode_error: h: missing")
    assert letter[b"orig_d"] == encode(g)
    assert await r.xlen(queue.k_queue) == 0


def test_the_env_id_travels_with_the_group_not_the_in_flight_record(stack: Stack) -> None:
    """A group that waits behind a slow teacher keeps its env, even if its in-flight record is gone."""
    stack.start_trainer(batch_size=2)
    stack.post("/register-env", ENV)
    stack.teacher.__exit__()
    assert stack.post("/scored_data", group(seed=1, env_id=0)).json() == RECEIVED
    stack.r.delete(stack.keys.atropos("inflight"), stack.keys.atropos("inflight_at"))
    stack.teacher = TeacherThread(stack.redis_url, stack.keys.namespace).__enter__()
    stack.wait_queued(1)
    ((_, fields),) = stack.r.xrange(stack.keys.atropos("queue"))
    assert fields[b"env"] == b"0"
    assert stack.get("/status-env", json={"env_id": 0}).json()["self_queue_size"] == 1
    assert stack.r.keys(stack.keys.atropos_env("*")) == []  # the marker went with the move


def test_queue_counts_follow_the_queue(stack: Stack) -> None:
    """``/status`` and ``/status-env`` read running counts (``env|sequences`` -> groups), not the queue."""
    from pipeline.serve.atropos.queue_scripts import RECOUNT

    stack.start_trainer(batch_size=2)
    for i in range(3):
        stack.post("/scored_data", group(seed=i))
    stack.post("/scored_data", group(n=1, seed=9))
    stack.wait_queued(4)
    counts = stack.keys.atropos("counts")
    assert stack.r.hgetall(counts) == {b"|2": b"3", b"|1": b"1"}
    assert stack.get("/batch").json()["batch"][0]["tokens"] == group(seed=0)["tokens"]
    assert stack.r.hgetall(counts) == {b"|2": b"2", b"|1": b"1"}
    assert stack.get("/status").json()["queue_size"] == 3
    stack.r.delete(counts)  # a queue written before the counts existed: counted once, at the mover's start
    recount = stack.r.register_script(RECOUNT)
    keys = [counts, stack.keys.atropos("queue"), stack.keys.atropos("front")]
    assert recount(keys=keys) == 3 and recount(keys=keys) == 0
    assert stack.r.hgetall(counts) == {b"|2": b"2", b"|1": b"1"}


def test_an_expired_batch_missing_a_group_is_never_handed_out_short(stack: Stack) -> None:
    """The trainer expects exactly batch_size sequences: the kept groups go back in front of the queue and
    a new batch is formed, oldest first."""
    stack.start_trainer(batch_size=4)
    for i in range(3):
        stack.post("/scored_data", group(seed=i))
    stack.wait_queued(3)

    def lease_and_lose_the_first(expected: list[int]) -> str:
        first = stack.get("/batch", params={"lease_s": 0.3}).json()
        assert [b["tokens"] for b in first["batch"]] == [group(seed=i)["tokens"] for i in expected]
        lease = json.loads(stack.r.hget(stack.keys.atropos("leases"), first["batch_id"]))  # type: ignore[arg-type]
        stack.r.delete(lease["groups"][0][2])  # the first group's payload is gone
        time.sleep(0.4)
        return str(first["batch_id"])

    first_id = lease_and_lose_the_first([0, 1])
    again = stack.get("/batch", params={"lease_s": 30}).json()
    assert [b["tokens"] for b in again["batch"]] == [group(seed=1)["tokens"], group(seed=2)["tokens"]]
    assert again["deliveries"] == 1 and again["batch_id"] != first_id
    assert stack.post("/batch/ack", {"batch_id": first_id}).status_code == 404
    assert stack.post("/batch/ack", {"batch_id": again["batch_id"]}).status_code == 200
    for i in (3, 4):
        stack.post("/scored_data", group(seed=i))
    stack.wait_queued(2)
    lease_and_lose_the_first([3, 4])
    assert stack.get("/batch").json() == {"batch": None}  # 2 sequences left: not enough, and not handed out short
    assert stack.get("/status").json()["queue_size"] == 1
    stack.post("/scored_data", group(seed=5))
    stack.wait_queued(1)
    last = stack.get("/batch").json()["batch"]
    assert [b["tokens"] for b in last] == [group(seed=4)["tokens"], group(seed=5)["tokens"]]  # the kept one first
    reasons = [f[b"reason"].decode() for _, f in stack.r.xrange(stack.keys.dlq)]
    assert len(reasons) == 2 and all(x.startswith("payload_missing: ") for x in reasons)
    assert stack.get("/status").json()["queue_size"] == 0 and not stack.r.exists(stack.keys.atropos("front"))


def test_identical_groups_without_a_key_are_all_kept_as_atroposlib_posts_them(stack: Stack) -> None:
    """atroposlib's own API test (``test_scored_data_list_compression``): four identical groups of 8 sequences
    in one ``/scored_data_list`` (sent by ``requests``, as there), then a batch of 32 sequences. Identical groups
    are data (greedy sampling, a repeated prompt): all four are kept, and the answer says so."""
    import requests

    reg = {**REGISTRATION, "batch_size": 32, "max_token_len": 2048}
    assert requests.post(stack.url + "/register", json=reg, timeout=60).status_code == 200
    items = [{"tokens": [list(range(512)) for _ in range(8)], "masks": [[1] * 512 for _ in range(8)],
              "scores": [0.5] * 8} for _ in range(4)]
    resp = requests.post(stack.url + "/scored_data_list", json=items, timeout=60)
    assert resp.status_code == 200
    assert resp.json() == {"status": "received", "groups_processed": 4, "kept": 4, "repeated": 0}
    stack.wait_queued(4)
    batch = requests.get(stack.url + "/batch", timeout=60).json()["batch"]
    assert batch is not None and sum(len(item["tokens"]) for item in batch) == 32
    assert len(batch) == 4 and all(item["tokens"] == items[0]["tokens"] for item in batch)
    one = {"tokens": [[5, 6, 7]], "masks": [[-100, 6, 7]], "scores": [1.0]}
    assert [requests.post(stack.url + "/scored_data", json=one, timeout=60).json() for _ in range(2)] == [
        {"status": "received", "kept": 1, "repeated": 0}] * 2  # the same group twice, no key: two groups
    stack.wait_queued(2)


def test_a_repeated_idempotency_key_is_dropped_and_reported(stack: Stack) -> None:
    """A client retrying a post with the same key (``Idempotency-Key``, ``key#i`` per group of a list, or a
    group's ``group_id``) posts each group once, and the answer counts the repeats; identical content under
    another key is another group."""
    stack.start_trainer(batch_size=2)
    items = [group(seed=1), group(seed=1)]  # identical, both kept: the key numbers them
    first = stack.post("/scored_data_list", items, headers={"Idempotency-Key": "post-1"}).json()
    again = stack.post("/scored_data_list", items, headers={"Idempotency-Key": "post-1"}).json()
    assert first == {"status": "received", "groups_processed": 2, "kept": 2, "repeated": 0}
    assert again == {"status": "received", "groups_processed": 2, "kept": 0, "repeated": 2}
    single = [stack.post("/scored_data", group(seed=2), headers={"Idempotency-Key": "one"}).json() for _ in range(2)]
    assert single == [{"status": "received", "kept": 1, "repeated": 0},
                      {"status": "received", "kept": 0, "repeated": 1}]
    by_id = [stack.post("/scored_data", group(seed=3, group_id="g-3")).json() for _ in range(2)]
    assert [(b["kept"], b["repeated"]) for b in by_id] == [(1, 0), (0, 1)]
    other = stack.post("/scored_data", group(seed=3), headers={"Idempotency-Key": "two"}).json()
    assert (other["kept"], other["repeated"]) == (1, 0)
    stack.wait_queued(5)
    time.sleep(0.5)  # a repeat that slipped through would reach the queue by now
    assert stack.r.xlen(stack.keys.atropos("queue")) == 5 and stack.get("/status").json()["queue_size"] == 5
    gids = {f[b"gid"].decode() for _, f in stack.r.xrange(stack.keys.atropos("queue"))}
    assert gids == {"post-1#0", "post-1#1", "one", "g-3", "two"}


def test_a_repeated_key_of_a_buffered_group_is_dropped(stack: Stack) -> None:
    """An env's off-size group waits in its buffer: a retry of it is a repeat there too, and after release."""
    stack.start_trainer(batch_size=2)
    assert stack.post("/register-env", ENV).json()["env_id"] == 0
    one = group(n=1, seed=4, env_id=0)
    answers = [stack.post("/scored_data", one, headers={"Idempotency-Key": "b1"}).json() for _ in range(2)]
    assert answers == [{"status": "buffered", "buffer_size": 1, "kept": 1, "repeated": 0},
                       {"status": "received", "kept": 0, "repeated": 1}]
    two = stack.post("/scored_data", group(n=1, seed=5, env_id=0), headers={"Idempotency-Key": "b2"}).json()
    assert two == {"status": "buffered", "buffer_size": 0, "kept": 1, "repeated": 0}  # both released
    late = stack.post("/scored_data", one, headers={"Idempotency-Key": "b1"}).json()
    assert (late["kept"], late["repeated"]) == (0, 1)  # released already: still a repeat
    stack.wait_queued(2)
    time.sleep(0.5)
    assert {f[b"gid"].decode() for _, f in stack.r.xrange(stack.keys.atropos("queue"))} == {"b1", "b2"}


async def test_the_sdk_pushes_a_group_without_group_id_once(r: Any, keys: Keys) -> None:
    from pipeline.transport.producer import AddResult
    from pipeline.transport.sdk import AsyncGroupProducer
    from schemas.atropos import content_group_id

    async with AsyncGroupProducer(namespace=keys.namespace, redis=r) as producer:
        first, again = [await producer.push_atropos(group(seed=3)) for _ in range(2)]
    assert (first.result, again.result) == (AddResult.ADDED, AddResult.DUPLICATE)
    assert await r.xlen(keys.stream("rollouts")) == 1
    ((_, fields),) = await r.xrange(keys.stream("rollouts"))
    assert fields[b"gid"].decode() == content_group_id(group(seed=3))


def test_inflate_never_runs_past_the_cap() -> None:
    """A first gzip member of exactly cap + 1 bytes used to leave the next member no output limit at all."""
    import tracemalloc

    from pipeline.serve.atropos.app import _inflate

    cap = 1 << 20
    bomb = gzip.compress(b"a" * (cap + 1), 1) + gzip.compress(bytes(64 << 20), 9)
    tracemalloc.start()
    try:
        with pytest.raises(OverflowError):
            _inflate(bomb, cap)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, f"{peak} bytes allocated"
    with pytest.raises(OverflowError):
        _inflate(gzip.compress(b"a" * cap) + gzip.compress(b"b"), cap)
    assert _inflate(gzip.compress(b"x" * 10) + gzip.compress(b"y" * (cap - 10)), cap) == b"x" * 10 + b"y" * (cap - 10)


def test_request_bodies_above_the_cap_get_413_and_the_server_keeps_serving(redis_url: str, keys: Keys) -> None:
    cap = 1 << 20
    cfg = ServeConfig(redis=RedisSettings(redis_url=redis_url, namespace=keys.namespace), streams=FAST,
                      max_body_bytes=cap)
    two_members = gzip.compress(b" " * (cap + 1), 1) + gzip.compress(bytes(64 << 20), 9)
    noise = gzip.compress(np.random.default_rng(0).bytes(cap + 4096), 1)  # more than the cap as sent
    gz = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
    with ThreadedServer(create_app(cfg)) as srv:
        plain = {"Content-Type": "application/json"}
        for body, headers in ((two_members, gz), (noise, gz), (b"[" + b" " * cap + b"]", plain)):
            r = http("POST", srv.url + "/scored_data_list", data=body, headers=headers)
            assert r.status_code == 413 and "more than 1048576 bytes" in r.text, (r.status_code, r.text[:200])
            assert http("GET", srv.url + "/info").status_code == 200
        at_cap = json.dumps(group(seed=1)).encode().ljust(cap, b" ")
        assert http("POST", srv.url + "/scored_data", data=at_cap, headers=plain).json() == RECEIVED
        at_cap_gz = gzip.compress(json.dumps(group(seed=2)).encode().ljust(cap, b" "))
        assert http("POST", srv.url + "/scored_data", data=at_cap_gz, headers=gz).json() == RECEIVED


@pytest.mark.timeout(90)
def test_slow_request_heads_get_408_from_the_cli_server(redis_url: str, keys: Keys, tmp_path: Path) -> None:
    """``distillq serve atropos --body-timeout-s 1``: 50 heads begun and left, one sent a byte at a time and one
    stalled after a kept-alive request, each answered 408 and closed; the server keeps serving."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "pipeline.cli.main", "serve", "atropos", "--port", str(port), "--body-timeout-s",
            "1", "--redis-url", redis_url, "--namespace", keys.namespace]
    with open(tmp_path / "server.log", "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        wait_for(lambda: _up(url), 60, "the server")
        check_heads_time_out(port, 1.0, "/info")
        assert http("GET", url + "/info").status_code == 200
        assert b"request_head_timeout" in (tmp_path / "server.log").read_bytes()
    finally:
        proc.terminate()
        proc.wait(15)


@pytest.mark.timeout(60)
def test_a_stalled_request_body_gets_408_and_the_server_keeps_serving(redis_url: str, keys: Keys) -> None:
    """Headers and part of a body, then nothing (plain and gzip): 408 once ``body_timeout_s`` passes, and the
    server closes the connection; a deeply nested body is a 400, as the reference answers it."""
    cfg = ServeConfig(redis=RedisSettings(redis_url=redis_url, namespace=keys.namespace), streams=FAST,
                      body_timeout_s=1.0)
    body = json.dumps([group(seed=1)]).encode()
    with ThreadedServer(create_app(cfg)) as srv:
        port = int(srv.url.rsplit(":", 1)[1])
        for extra, data in ((b"", body), (b"Content-Encoding: gzip\r\n", gzip.compress(body))):
            with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
                s.sendall(b"POST /scored_data_list HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          + extra + b"Content-Length: %d\r\n\r\n" % len(data) + data[:20])
                t0 = time.monotonic()
                answer = b""
                while chunk := s.recv(65536):  # until the server closes it
                    answer += chunk
                waited = time.monotonic() - t0
            assert answer.startswith(b"HTTP/1.1 408") and b"no bytes of it came for 1 s" in answer, answer[:300]
            assert 0.5 < waited < 10, waited
        assert http("POST", srv.url + "/scored_data_list", data=body,
                    headers={"Content-Type": "application/json"}).status_code == 200
        nested = b"[" * 100_000 + b"]" * 100_000
        deep = b'[{"tokens": [[1]], "masks": [[1]], "scores": [1], "messages": ' + nested + b"}]"
        assert http("POST", srv.url + "/scored_data_list", data=deep,
                    headers={"Content-Type": "application/json"}).status_code == 400


async def test_a_reset_waits_for_posts_under_way_and_holds_new_ones() -> None:
    from pipeline.serve.atropos.startup import PostGate

    gate, events, release = PostGate(), [], asyncio.Event()

    async def post(name: str, hold: bool) -> None:
        async with gate.post():
            events.append(f"{name} in")
            if hold:
                await release.wait()
            events.append(f"{name} out")

    async def reset() -> None:
        async with gate.reset():
            events.append("reset")

    first = asyncio.create_task(post("a", True))
    await asyncio.sleep(0.01)
    resetting = asyncio.create_task(reset())
    await asyncio.sleep(0.01)
    second = asyncio.create_task(post("b", False))
    await asyncio.sleep(0.01)
    assert events == ["a in"]
    release.set()
    await asyncio.gather(first, resetting, second)
    assert events == ["a in", "a out", "reset", "b in", "b out"]


def test_unreachable_redis_at_startup_is_one_line_and_exit_3() -> None:
    argv = [sys.executable, "-m", "pipeline.cli.main", "serve", "atropos", "--port", str(free_port()),
            "--redis-url", "redis://127.0.0.1:1/0"]
    t0 = time.monotonic()
    res = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=30, cwd=ROOT)
    assert res.returncode == 3, res.stderr[-2000:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot reach Redis at redis://127.0.0.1:1/0" in lines[0], res.stderr[-2000:]
    assert time.monotonic() - t0 < 15
