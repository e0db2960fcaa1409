"""verifiers 0.4.0 against ``distillq serve student``: what verifiers records is what distillq pushes.

verifiers runs in its train client mode (``TrainClientConfig``: it renders token ids itself and calls
``/inference/v1/generate``) against the server started on 127.0.0.1 with the tiny HF student, an
``null`` harness in a local subprocess runtime (no sandbox, no hosted inference, nothing uploaded). After
each rollout the adapter posts ``/sessions/{trace.id}/finish`` with the trace's task key and reward; the
groups the server pushes onto ``rollouts`` are read back from a private redis-server and compared with
verifiers' own ``Trace.branches``: same token ids, same sampled masks, logprobs equal to the last bit.
"""

from __future__ import annotations

import random
import shutil
import textwrap
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import redis.asyncio as aioredis
from transformers import AutoTokenizer

from pipeline.demo.tinymodels import ensure_tiny_models
from pipeline.serve.student.verifiers import finish_body, groups_from_traces
from pipeline.transport.keys import Keys
from schemas import RolloutGroup
from tests.integration.test_serve_student import MODEL, StudentProcess, read_groups
from tests.redis_server import RedisServer

vf = pytest.importorskip("verifiers.v1", reason="verifiers 0.4 is not installed (pip install verifiers==0.4.0)")
if shutil.which("uv") is None:
    pytest.skip("verifiers runs its harness program with `uv` (pip install uv)", allow_module_level=True)

from renderers.configs import DefaultRendererConfig  # noqa: E402
from verifiers.v1 import graph  # noqa: E402
from verifiers.v1.clients.train import TrainClient  # noqa: E402
from verifiers.v1.dialects.chat import ChatDialect  # noqa: E402
from verifiers.v1.trace import AgentInfo, Reward, Trace, TraceTask  # noqa: E402

pytestmark = [pytest.mark.redis, pytest.mark.slow]
KEY_VAR = "DISTILLQ_TEST_STUDENT_KEY"
KEY = "sk-local"

TASKSET = """
import verifiers.v1 as vf


class SumTask(vf.Task):
    @vf.reward
    async def reply_length(self, trace) -> float:
        return float(len(trace.last_reply or ""))


class SumTaskset(vf.Taskset[SumTask]):
    def load(self):
        for a, b in ((1, 2), (3, 4)):
            yield SumTask(vf.TaskData(prompt=f"{a}+{b}=", id=f"q{a}{b}"), self.config.task)


__all__ = ["SumTaskset"]
"""


@pytest.fixture(scope="module")
def namespace() -> str:
    return f"vf{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="module")
def student(redis_server: RedisServer, namespace: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``distillq serve student`` as a process, wanting the key verifiers sends; yields its base URL."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(KEY_VAR, KEY)
        with StudentProcess(
            redis_server.url, namespace, tmp_path_factory.mktemp("student"), "--api-key-var", KEY_VAR
        ) as p:
            yield p.base_url


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv(KEY_VAR, KEY)
    (tmp_path / "distillq_vf_tasks.py").write_text(textwrap.dedent(TASKSET))
    monkeypatch.syspath_prepend(str(tmp_path))


@pytest.fixture
async def r(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_server.url)
    yield client
    await client.aclose()


def client_config(base_url: str) -> Any:
    return vf.TrainClientConfig(
        base_url=base_url,
        api_key_var=KEY_VAR,
        renderer=DefaultRendererConfig(),  # no hub probing
        renderer_model_name=str(ensure_tiny_models().student),  # the student's own tokenizer
    )


def env_config(base_url: str, sampling: Any) -> Any:
    agent = vf.AgentConfig(
        model=MODEL,
        client=client_config(base_url),
        harness={"id": "null"},
        runtime=vf.SubprocessConfig(),  # the default is a remote sandbox
        sampling=sampling,
    )
    return vf.SingleAgentEnvConfig(taskset={"id": "distillq_vf_tasks"}, agent=agent)


async def finish(base_url: str, traces: list[Any], group_size: int) -> list[dict[str, Any]]:
    """The adapter: one finish per rollout, with verifiers' task key and reward."""
    root = base_url.removesuffix("/v1")
    async with httpx.AsyncClient(base_url=root, timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as http:
        out = []
        for t in traces:
            resp = await http.post(f"/sessions/{t.id}/finish", json={**finish_body(t), "group_size": group_size})
            assert resp.status_code == 200, resp.text
            out.append(resp.json())
        return out


def assert_same(traces: list[Any], groups: list[RolloutGroup]) -> int:
    """Every trainable branch verifiers recorded is the pushed sequence of its rollout; returns branches."""
    by_session: dict[str, list[Any]] = {}
    for g in groups:
        for sid, seq in zip(g.metadata["sequence_sessions"], g.sequences, strict=True):  # type: ignore[index]
            by_session.setdefault(sid, []).append(seq)
    n = 0
    for t in traces:
        assert t.ok, t.errors
        branches = [b for b in t.branches if b.trainable]
        seqs = by_session[t.id]
        assert len(seqs) == len(branches)
        for b, s in zip(branches, seqs, strict=True):
            assert s.tokens.numpy().tolist() == b.token_ids
            assert s.loss_mask.numpy().astype(bool).tolist() == list(b.sampled_mask)
            diff = np.abs(np.asarray(b.logprobs, np.float64) - s.logprobs.numpy().astype(np.float64))
            assert diff.max() == 0.0
            assert s.score == t.reward
            n += 1
    return n


async def test_single_turn_environment(student: str, r: aioredis.Redis, namespace: str) -> None:
    env = vf.load_environment(env_config(student, vf.SamplingConfig(temperature=1.0, max_tokens=6)))
    ctx = vf.ModelContext(model=MODEL, client=client_config(student), sampling=vf.SamplingConfig(max_tokens=6))
    task = next(iter(env.taskset))
    async with env.serving():
        episodes = [await env.run_episode(task, ctx) for _ in range(2)]
    traces = [t for ep in episodes for t in ep.traces]
    assert len(traces) == 2 and len({t.task.key for t in traces}) == 1
    first, second = await finish(student, traces, group_size=2)
    assert first["group"] is None and first["waiting"] == 1  # the group waits for its second rollout
    assert second["group"]["pushed"] and second["group"]["sequences"] == 2
    [group] = [g for g in await read_groups(r, Keys(namespace)) if g.group_id == second["group"]["id"]]
    assert group.task_id == task.key and group.metadata["sessions"] == [t.id for t in traces]  # type: ignore[index]
    assert assert_same(traces, [group]) == 2
    [converted] = groups_from_traces(traces)  # verifiers' records, converted without the server
    assert converted.group_id == group.group_id and converted.metadata == group.metadata  # partial too
    for a, b in zip(converted.sequences, group.sequences, strict=True):
        assert a.tokens == b.tokens and a.loss_mask == b.loss_mask and a.logprobs == b.logprobs


class ScriptedUserEnv(vf.Env[vf.SingleAgentEnvConfig]):  # type: ignore[misc]
    """A multi-turn environment: a scripted user answers the agent twice."""

    async def run(self, task: Any, agents: Any) -> None:
        async with agents.agent.interaction(task) as conv:
            seg = await conv.turn()
            for follow_up in ("and 4+4=", "and 5+5="):
                if seg.terminated:
                    break
                seg = await conv.turn(follow_up)


async def test_multi_turn_environment(student: str, r: aioredis.Redis, namespace: str) -> None:
    sampling = vf.SamplingConfig(temperature=0.0, max_tokens=2)  # greedy, short: replies survive re-rendering
    env = ScriptedUserEnv(env_config(student, sampling))
    ctx = vf.ModelContext(model=MODEL, client=client_config(student), sampling=sampling)
    tasks = list(env.taskset)
    async with env.serving():
        episodes = [await env.run_episode(t, ctx) for t in tasks]
    traces = [t for ep in episodes for t in ep.traces]
    assert len(traces) == 2 and all(t.num_turns == 3 for t in traces)
    results = await finish(student, traces, group_size=1)
    groups = [g for g in await read_groups(r, Keys(namespace)) if g.group_id in {x["group"]["id"] for x in results}]
    assert assert_same(traces, groups) >= 2
    spans = [
        sum(1 for i, m in enumerate(b.sampled_mask) if m and not (i and b.sampled_mask[i - 1]))
        for t in traces
        for b in t.branches
    ]
    assert max(spans) == 3  # a branch carries all three turns' sampled tokens, all trainable


async def test_tree_tracking_matches_verifiers_graph_on_branching_histories(
    student: str, r: aioredis.Redis, namespace: str
) -> None:
    """verifiers' own train client and message graph, fed conversations that continue the latest turn,
    branch from an earlier one, retry, edit a reply, or drop history; the pushed sequences equal
    ``trace.branches`` each time, through extensions and splits alike."""
    client = TrainClient(client_config(student))
    dialect = ChatDialect()
    agent = vf.AgentConfig(model=MODEL, client=client_config(student))
    rng = random.Random(0)
    seen = {"extended": 0, "split": 0, "edited": 0}
    traces = []
    for conv in range(12):
        trace = Trace(
            task=TraceTask(type="Scripted", data={"conv": conv}, key=f"conv{conv}"), agent=AgentInfo(config=agent)
        )
        history: list[list[dict[str, Any]]] = []
        msgs: list[dict[str, Any]] = [{"role": "user", "content": f"{conv}+{conv}="}]
        for turn in range(4):
            body = {"model": MODEL, "messages": msgs}
            req = dialect.parse_request(body)
            pending = graph.prepare_turn(trace, req.messages, req.tools)
            max_tokens, seed = rng.choice([1, 2, 3, 6]), 100 * conv + turn  # the seed reaches the server
            sampling = vf.SamplingConfig(temperature=1.0, max_tokens=max_tokens, seed=seed)
            resp = await client.get_response(dialect, body, sampling, session_id=trace.id, turn=pending)
            pending.commit(resp)
            full = [*msgs, {"role": "assistant", "content": resp.message.content or ""}]
            history.append(full)
            op = rng.choice(["continue", "continue", "earlier", "retry", "edit", "drop"])
            if op == "edit":  # the reply comes back changed, its sampled tokens still a prefix
                seen["edited"] += 1
                msgs = [
                    *msgs,
                    {"role": "assistant", "content": full[-1]["content"] + "!"},
                    {"role": "user", "content": "x"},
                ]
            elif op == "earlier" and len(history) > 1:
                msgs = [*rng.choice(history[:-1]), {"role": "user", "content": f"e{turn}"}]
            elif op == "drop" and len(history) > 1:
                msgs = [{"role": "user", "content": "summary"}, full[-1], {"role": "user", "content": "go"}]
            elif op != "retry":
                msgs = [*full, {"role": "user", "content": f"t{turn}?"}]
        trace.rewards = {"r": Reward(score=float(conv))}
        trace.ok = True
        traces.append(trace)
        branches = trace.branches
        seen["split"] += len(branches) > 1
        seen["extended"] += sum(
            sum(1 for i, m in enumerate(b.sampled_mask) if m and not (i and b.sampled_mask[i - 1])) > 1
            for b in branches
        )
    await client.close()
    await finish(student, traces, group_size=1)
    groups = [g for g in await read_groups(r, Keys(namespace)) if g.task_id.startswith("conv")]
    assert assert_same(traces, groups) >= 12
    records = [t.to_record(float_decimals=None) for t in traces]  # the JSON a traces.jsonl line holds
    from_records, from_traces = groups_from_traces(records), groups_from_traces(traces)
    assert [g.group_id for g in from_records] == [g.group_id for g in from_traces] == [g.group_id for g in groups]
    for a, b, c in zip(from_records, from_traces, groups, strict=True):
        assert a.task_id == b.task_id == c.task_id and len(a.sequences) == len(c.sequences)
        for x, y, z in zip(a.sequences, b.sequences, c.sequences, strict=True):
            assert x.tokens == y.tokens == z.tokens and x.loss_mask == y.loss_mask == z.loss_mask
            assert x.logprobs == y.logprobs == z.logprobs and x.score == y.score == z.score
    assert seen["extended"] >= 3 and seen["split"] >= 3 and seen["edited"] >= 3  # every case was exercised


async def test_train_mode_with_stop_strings_records_what_the_server_returned(
    student: str, r: aioredis.Redis, namespace: str
) -> None:
    """``SamplingConfig(stop=[...])`` reaches ``/inference/v1/generate`` as given; the server ends each reply at
    the token completing a stop string, and what verifiers records equals what is pushed."""
    client = TrainClient(client_config(student))
    dialect = ChatDialect()
    agent = vf.AgentConfig(model=MODEL, client=client_config(student))
    traces, finishes = [], []
    for conv in range(6):
        task = TraceTask(type="Stop", data={"conv": conv}, key=f"stop{conv}")
        trace = Trace(task=task, agent=AgentInfo(config=agent))
        msgs: list[dict[str, Any]] = [{"role": "user", "content": f"{conv}*{conv}="}]
        for turn in range(2):
            body = {"model": MODEL, "messages": msgs}
            req = dialect.parse_request(body)
            pending = graph.prepare_turn(trace, req.messages, req.tools)
            sampling = vf.SamplingConfig(temperature=1.0, max_tokens=24, seed=10 * conv + turn, stop=["a", "e", "1"])
            resp = await client.get_response(dialect, body, sampling, session_id=trace.id, turn=pending)
            pending.commit(resp)
            finishes.append(resp.finish_reason)
            msgs = [*msgs, {"role": "assistant", "content": resp.message.content or ""},
                    {"role": "user", "content": "more"}]
        trace.rewards = {"r": Reward(score=1.0)}
        trace.ok = True
        traces.append(trace)
    await client.close()
    await finish(student, traces, group_size=1)
    groups = [g for g in await read_groups(r, Keys(namespace)) if g.task_id.startswith("stop")]
    assert assert_same(traces, groups) >= 6
    assert finishes.count("stop") >= 4  # replies ended by a stop string (or the end-of-sequence token)


async def test_eval_mode_streams_chat_completions(student: str, r: aioredis.Redis, namespace: str) -> None:
    """verifiers' eval client relays the harness's streaming chat request (``stream_options.include_usage``)
    and parses the server-sent events; the server tracks the rollout by rendering the chat template."""
    import distillq_vf_tasks  # written by the ``offline`` fixture

    agent = vf.make_agent(
        vf.AgentConfig(
            model=MODEL,
            client=vf.EvalClientConfig(base_url=student, api_key_var=KEY_VAR),
            harness={"id": "null"},
            runtime=vf.SubprocessConfig(),
            sampling=vf.SamplingConfig(temperature=1.0, max_tokens=6),
        )
    )
    trace = await agent.run(distillq_vf_tasks.SumTask(vf.TaskData(prompt="2+2=")))
    assert trace.ok, trace.errors
    [call] = trace.calls
    assert call.usage is not None and call.usage.completion_tokens >= 1  # the usage chunk was read
    [result] = await finish(student, [trace], group_size=1)
    [group] = [g for g in await read_groups(r, Keys(namespace)) if g.group_id == result["group"]["id"]]
    [seq] = group.sequences
    sampled = seq.tokens.numpy()[seq.loss_mask.numpy().astype(bool)].tolist()
    assert len(sampled) == call.usage.completion_tokens
    tok = AutoTokenizer.from_pretrained(str(ensure_tiny_models().student))
    assert tok.decode(sampled, skip_special_tokens=True) == (trace.last_reply or "")
    assert not any(b.token_ids for b in trace.branches)  # eval mode records no tokens; the server did
