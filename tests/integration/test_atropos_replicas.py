"""Two ``distillq serve atropos`` replicas on one namespace behind a round-robin TCP proxy (the test's load
balancer): atroposlib 0.4.0 ``BaseEnv`` environments (posting with an ``Idempotency-Key``) and a leasing trainer
talk to the proxy, so their requests spread over both replicas; one replica is killed with SIGKILL mid-run and
started again. Nothing is lost or duplicated, the step counts the batches, the registrations stay as made, and
the environments keep running."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from pipeline.demo.tinymodels import TinyModels, ensure_tiny_models
from pipeline.transport.keys import Keys
from tests.integration.test_serve_atropos import REGISTRATION, TeacherThread
from tests.redis_server import free_port

pytest.importorskip("atroposlib", reason="atroposlib 0.4.0 not installed: pip install atroposlib==0.4.0")

pytestmark = [pytest.mark.redis, pytest.mark.slow, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[2]
ITEMS = 14  # groups per environment (2 sequences each, a batch each: batch_size 2)


class RoundRobinProxy:
    """A TCP load balancer in a thread: each connection goes to the next backend that accepts it."""

    def __init__(self, backends: list[int]) -> None:
        self.backends, self.port = backends, free_port()
        self.connections: Counter[int] = Counter()
        self._next = 0
        self._ready = threading.Event()
        self.thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _main(self) -> None:
        self.loop, self.stop = asyncio.get_running_loop(), asyncio.Event()
        server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        self._ready.set()
        async with server:
            await self.stop.wait()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream = None
        for _ in range(len(self.backends)):
            port = self.backends[self._next % len(self.backends)]
            self._next += 1
            try:
                upstream = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                continue
            self.connections[port] += 1
            break
        if upstream is None:
            writer.close()
            return
        up_reader, up_writer = upstream

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError, asyncio.CancelledError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            with contextlib.suppress(OSError):
                dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    def __enter__(self) -> RoundRobinProxy:
        self.thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(10)


class Replica:
    """``distillq serve atropos`` as a process on its own port, killed or stopped by its pid."""

    def __init__(self, redis_url: str, namespace: str, log: Path) -> None:
        self.log, self.port = log, 0
        self.argv = [sys.executable, "-m", "pipeline.cli.main", "serve", "atropos", "--redis-url", redis_url,
                     "--namespace", namespace, "--lease-s", "3"]
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """On a fresh port each time (a restarted replica's old port may meanwhile be some socket's own); a
        port taken by another process between its choice and the bind is given up for another."""
        env = {**os.environ, "DISTILLQ_BLOCK_MS": "100", "DISTILLQ_CLAIM_IDLE_MS": "2000",
               "DISTILLQ_CLAIM_INTERVAL_MS": "200"}
        for _ in range(5):
            self.port = free_port()
            with open(self.log, "ab") as out:
                self.proc = subprocess.Popen([*self.argv, "--port", str(self.port)], stdout=out,
                                             stderr=subprocess.STDOUT, env=env, cwd=ROOT)
            proc, deadline = self.proc, time.monotonic() + 90
            while proc.poll() is None and time.monotonic() < deadline:
                if _answers(self.port):
                    return
                time.sleep(0.1)
            self.stop()
        raise AssertionError(f"no replica started:\n{self.log.read_text()[-2000:]}")
    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(20)


def _answers(port: int) -> bool:
    """Whether an Atropos server answers on ``port`` (quickly: another kind of server may hold the port)."""
    try:
        resp = httpx.get(f"http://127.0.0.1:{port}/info", timeout=2)
    except httpx.HTTPError:
        return False
    return resp.status_code == 200 and set(resp.json()) == {"batch_size", "max_token_len"}


def make_env(url: str, tokenizer: Path, name: str) -> Any:
    """An unmodified-API BaseEnv: ``ITEMS`` groups of two sequences, content unique to ``name``.

    ``max_batches_offpolicy`` is set high: when the queue is full a BaseEnv cancels its workers, and one
    cancelled while its post is under way (retrying across the kill, say) has already left ``running_items``,
    so atroposlib 0.4.0 drops that group itself, whatever the server does."""
    from atroposlib.envs.base import APIServerConfig, BaseEnv, BaseEnvConfig, ScoredDataGroup

    class CountingEnv(BaseEnv):  # type: ignore[misc]
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **kw)
            self.i = 0
            self.made: list[list[list[int]]] = []

        async def setup(self) -> None:
            pass

        async def evaluate(self, *args: Any, **kwargs: Any) -> None:
            pass

        async def get_next_item(self) -> dict[str, str] | None:
            if self.i >= ITEMS:
                return None
            self.i += 1
            return {"question": f"{name} {self.i}+{self.i}="}

        async def collect_trajectories(self, item: dict[str, str]) -> tuple[Any, list[Any]]:
            p_ids = self.tokenizer(item["question"], add_special_tokens=False)["input_ids"]
            group = ScoredDataGroup(tokens=[], masks=[], scores=[], inference_logprobs=[], overrides=[])
            for text, score in (("4", 1.0), ("5", -1.0)):
                c_ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
                group["tokens"].append(p_ids + c_ids)
                group["masks"].append([-100] * len(p_ids) + c_ids)
                group["scores"].append(score)
                group["inference_logprobs"].append([1.0] * len(p_ids) + [-0.1] * len(c_ids))
                group["overrides"].append({})
            self.made.append(group["tokens"])
            return group, []

        def _post_json_with_compression(self, session: Any, url: str, payload: Any, *,
                                        minimum_size: int = 1024) -> Any:
            """BaseEnv's own post, with an ``Idempotency-Key`` of the payload's content: BaseEnv posts a group
            again when a post fails (a replica killed mid-post), and the server keeps a keyed group once."""
            key = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()
            return super()._post_json_with_compression(KeyedSession(session, key), url, payload,
                                                       minimum_size=minimum_size)

    cfg = BaseEnvConfig(group_size=2, tokenizer_name=str(tokenizer), rollout_server_url=url, use_wandb=False,
                        wandb_name=name, max_token_length=512, total_steps=1000, steps_per_eval=0,
                        max_num_workers=2, ensure_scores_are_not_same=True,
                        max_batches_offpolicy=1000)  # never cancels a worker: see below
    server = APIServerConfig(base_url="http://127.0.0.1:1/v1", model_name="none", api_key="x", health_check=False)
    return CountingEnv(cfg, [server])


class KeyedSession:
    """An aiohttp session whose ``post`` adds an ``Idempotency-Key`` header."""

    def __init__(self, session: Any, key: str) -> None:
        self.session, self.key = session, key

    def post(self, url: str, **kw: Any) -> Any:
        return self.session.post(url, **{**kw, "headers": {**(kw.get("headers") or {}), "Idempotency-Key": self.key}})


def request(method: str, url: str, **kw: Any) -> httpx.Response:
    """A trainer's request through the balancer, tried again while a replica is going down."""
    for attempt in range(40):
        try:
            return httpx.request(method, url, timeout=30, **kw)
        except httpx.TransportError:
            if attempt == 39:
                raise
            time.sleep(0.25)
    raise AssertionError("unreachable")


async def train(url: str, tasks: list[asyncio.Task[Any]], envs: list[Any], victim: Replica, proxy: RoundRobinProxy,
                diagnose: Any) -> tuple[dict[str, Any], int | None]:
    """A leasing trainer until every group is in: batches by id; after the third, ``victim`` is killed with
    SIGKILL and started again (the balancer then sends to its new port)."""
    batches: dict[str, list[dict[str, Any]]] = {}
    killed_at = None

    def take() -> dict[str, Any]:
        return request("GET", url + "/batch", params={"lease": 1}).json()

    deadline = time.monotonic() + 200
    def done() -> bool:  # every group the envs made (an item run again makes the same group) handed out
        handed = {json.dumps(g["tokens"]) for batch in batches.values() for g in batch}
        return all(e.i >= ITEMS for e in envs) and {json.dumps(t) for e in envs for t in e.made} <= handed

    while not done():
        if time.monotonic() > deadline:
            posted = [len({json.dumps(t) for t in e.made}) for e in envs]
            raise AssertionError(f"only {sum(len(x) for x in batches.values())} groups; made {posted}; "
                                 f"status {request('GET', url + '/status').json()}; {diagnose()}")
        assert not any(t.done() for t in tasks), [t.exception() for t in tasks if t.done()]
        got = await asyncio.to_thread(take)
        if got.get("batch") is None:
            await asyncio.sleep(0.1)
            continue
        bid = got["batch_id"]
        batches[bid] = got["batch"]  # a batch handed out again keeps its id
        ack = await asyncio.to_thread(request, "POST", url + "/batch/ack", json={"batch_id": bid})
        assert ack.status_code in (200, 404), ack.text  # 404: acked by a request whose answer was lost
        if killed_at is None and len(batches) >= 3:  # mid-run: kill one, then bring it back
            killed_at = len(batches)
            old = victim.port
            await asyncio.to_thread(victim.kill)
            await asyncio.sleep(1.0)
            await asyncio.to_thread(victim.start)
            proxy.backends = [victim.port if p == old else p for p in proxy.backends]
            proxy.connections[victim.port] += proxy.connections.pop(old, 0)
    return batches, killed_at


@pytest.fixture(scope="module")
def tiny() -> TinyModels:
    return ensure_tiny_models()


async def test_two_replicas_behind_a_balancer_survive_a_kill(
    redis_url: str, keys: Keys, tiny: TinyModels, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    a, b = (Replica(redis_url, keys.namespace, tmp_path / f"{n}.log") for n in "ab")
    a.start()
    b.start()
    r = redis.Redis.from_url(redis_url)
    try:
        with RoundRobinProxy([a.port, b.port]) as proxy, TeacherThread(redis_url, keys.namespace):
            url = f"http://127.0.0.1:{proxy.port}"
            assert (await asyncio.to_thread(request, "POST", url + "/register",
                                            json={**REGISTRATION, "batch_size": 2})).status_code == 200
            assert (await asyncio.to_thread(request, "GET", url + "/batch")).json() == {"batch": None}
            envs = [make_env(url, tiny.tokenizer, name) for name in ("alpha", "beta")]
            tasks = [asyncio.create_task(e.env_manager()) for e in envs]
            try:
                def diagnose() -> dict[str, Any]:
                    return {"rollouts": r.xlen(keys.stream("rollouts")), "scored": r.xlen(keys.stream("scored")),
                            "queue": r.xlen(keys.atropos("queue")), "inflight": r.hlen(keys.atropos("inflight")),
                            "leases": r.hlen(keys.atropos("leases")), "dlq": r.xlen(keys.dlq),
                            "pending": r.xpending(keys.stream("scored"), "feeder") if r.exists(
                                keys.stream("scored")) else None}

                batches, killed_at = await train(url, tasks, envs, a, proxy, diagnose)
                assert not any(t.done() for t in tasks)  # the environments are still running
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            status = (await asyncio.to_thread(request, "GET", url + "/status")).json()
            registered = [json.loads(v) for _, v in sorted(r.hgetall(keys.atropos("envs")).items())]
    finally:
        a.stop()
        b.stop()
        r.close()
    assert killed_at is not None
    assert proxy.connections[a.port] > 10 and proxy.connections[b.port] > 10  # spread over both replicas
    made = Counter(json.dumps(t) for e in envs for t in e.made)
    handed = Counter(json.dumps(g["tokens"]) for batch in batches.values() for g in batch)
    assert len(made) == 2 * ITEMS and set(handed) == set(made)  # none lost
    assert max(handed.values()) == 1  # none twice
    assert all(len(batch) == 1 and len(batch[0]["tokens"]) == 2 for batch in batches.values())
    assert status["current_step"] == len(batches)  # one step per batch, whichever replica handed it out
    assert {e["real_name"]: e["registered_id"] for e in registered} == {"alpha_0": envs[0].env_id,
                                                                         "beta_0": envs[1].env_id}
    assert sorted(e.env_id for e in envs) == [0, 1]  # registered once each, whichever came first
    for e in envs:
        mine = {json.dumps(t) for t in e.made}
        assert all(g["env_id"] == e.env_id for batch in batches.values() for g in batch
                   if json.dumps(g["tokens"]) in mine)


def test_concurrent_registrations_on_two_replicas_get_distinct_env_ids(redis_url: str, keys: Keys,
                                                                      tmp_path: Path) -> None:
    """The writers' lock is shared: envs registering at once on both replicas each get their own id."""
    a, b = (Replica(redis_url, keys.namespace, tmp_path / f"{n}.log") for n in "ab")
    a.start()
    b.start()
    try:
        urls = [f"http://127.0.0.1:{p.port}" for p in (a, b)]
        assert request("POST", urls[0] + "/register", json=REGISTRATION).status_code == 200
        assert request("GET", urls[1] + "/batch").json() == {"batch": None}

        async def register_all() -> list[dict[str, Any]]:
            async with httpx.AsyncClient(timeout=30) as c:
                env = {"max_token_length": 512, "desired_name": "e", "weight": 1.0, "group_size": 2}
                resps = await asyncio.gather(*(c.post(urls[i % 2] + "/register-env", json=env) for i in range(24)))
            return [x.json() for x in resps]

        out = asyncio.run(register_all())
    finally:
        a.stop()
        b.stop()
    assert sorted(o["env_id"] for o in out) == list(range(24))
    assert sorted(o["wandb_name"] for o in out) == sorted(f"e_{i}" for i in range(24))
