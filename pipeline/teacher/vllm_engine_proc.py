"""The engine process of the ``vllm-engine`` teacher: vLLM's ``LLMEngine`` scoring prompt logprobs, with
top-k ids and logprobs kept as arrays from the engine core to the pipe.

Run by ``vllm_engine.VLLMEngineTeacher`` under a Python that has vLLM (``--vllm-python``):
``python -m pipeline.teacher.vllm_engine_proc --model PATH ...``. Imports numpy, msgspec and vLLM only.
Requests arrive on stdin and answers leave on the original stdout as ``vllm_engine_wire`` frames; fd 1
is pointed at stderr before vLLM is imported, so nothing vLLM prints can corrupt the frames.

Every request runs as ``SamplingParams(max_tokens=1, prompt_logprobs=k, detokenize=False)`` with the
tokenizer skipped and ``logprobs_mode="raw_logprobs"``. The engine core already computes prompt logprobs
as ``[rows, k + 1]`` tensors (the prompt token's logprob in column 0, then the top-k, descending); stock
vLLM 0.32 turns them into one ``Logprob`` (or, with ``flat_logprobs``, one list entry) per entry in its
``LogprobsProcessor._update_prompt_logprobs``. ``install_array_prompt_logprobs`` replaces that one method
so that each prefill chunk's two arrays are kept as they are (the hook verl's GKD recipe patches too):
an internal of vLLM, verified on ``VERIFIED_VLLM``; ``tests/integration/test_vllm_engine.py`` guards it.

An item with ``k = 0`` is a bare prefill (no prompt logprobs, an empty answer): the limit ``bench.gpu``
measures the teacher against. Requests of all batches in flight share the engine (continuous batching);
a batch is answered when its last request finishes, with only the rows it asked for.
"""

from __future__ import annotations

import argparse
import os
import queue
import sys
import threading
from typing import Any, BinaryIO, Final

import numpy as np

from pipeline.errors import BackendError
from pipeline.teacher.vllm_engine_wire import (
    Batch,
    BatchResult,
    Fatal,
    ItemResult,
    Ready,
    as_i32,
    f32,
    frame,
    i32,
    read_frame,
    to_engine_decoder,
)

#: vLLM releases whose ``LogprobsProcessor._update_prompt_logprobs`` the array hook was verified on.
VERIFIED_VLLM: Final = (">=0.32.0", "<0.33")
HOOK: Final = "vllm.v1.engine.logprobs.LogprobsProcessor._update_prompt_logprobs"


class HookMissing(BackendError, RuntimeError):
    """The vLLM internal the array path replaces is not there (or changed shape)."""


def install_array_prompt_logprobs() -> None:
    """Make vLLM keep each prefill chunk's prompt logprobs as ``(ids, logprobs)`` numpy arrays, appended to
    the request's ``prompt_logprobs`` list after its leading ``None``, instead of per-entry objects."""
    import inspect

    from vllm.v1.engine import logprobs as mod

    proc = getattr(mod, "LogprobsProcessor", None)
    fn = getattr(proc, "_update_prompt_logprobs", None)
    if proc is None or fn is None or list(inspect.signature(fn).parameters) != ["self", "prompt_logprobs_tensors"]:
        raise HookMissing(f"{HOOK}(self, prompt_logprobs_tensors) not found: vLLM changed; verified on {VERIFIED_VLLM}")

    def keep_arrays(self: Any, prompt_logprobs_tensors: Any) -> None:
        ids, lps = prompt_logprobs_tensors[0], prompt_logprobs_tensors[1]
        self.prompt_logprobs.append((_np(ids).astype(np.int32, copy=True), _np(lps).astype(np.float32, copy=True)))

    proc._update_prompt_logprobs = keep_arrays


def _np(t: Any) -> np.ndarray[Any, Any]:
    return np.asarray(t.numpy() if hasattr(t, "numpy") else t)


def collect(prompt_logprobs: list[Any], rows: np.ndarray[Any, Any], k: int) -> ItemResult:
    """The wanted rows of a finished request's array chunks (``[None, (ids, lps), ...]``)."""
    chunks = [c for c in prompt_logprobs if c is not None]
    if not chunks:
        return ItemResult(error="misaligned: the engine returned no prompt logprobs")
    ids = np.concatenate([c[0] for c in chunks]) if len(chunks) > 1 else chunks[0][0]
    lps = np.concatenate([c[1] for c in chunks]) if len(chunks) > 1 else chunks[0][1]
    if ids.ndim != 2 or ids.shape[1] != k + 1 or (rows.shape[0] and int(rows[-1]) >= ids.shape[0]):
        return ItemResult(error=f"misaligned: engine prompt logprobs of shape {ids.shape} for k={k}")
    return ItemResult(ids=i32(ids[rows, 1:]), lps=f32(lps[rows, 1:]), sampled=f32(lps[rows, 0]))


class Pending:
    """A batch being scored: results by item, and how many are still running."""

    def __init__(self, batch: Batch) -> None:
        self.batch = batch
        self.results: list[ItemResult | None] = [None] * len(batch.items)
        self.left = len(batch.items)

    def done(self, i: int, res: ItemResult) -> None:
        if self.results[i] is None:
            self.left -= 1
        self.results[i] = res


def build_engine(a: argparse.Namespace) -> Any:
    from vllm import EngineArgs, LLMEngine

    args = EngineArgs(
        model=a.model, dtype=a.dtype, tensor_parallel_size=a.tensor_parallel_size,
        gpu_memory_utilization=a.gpu_memory_utilization, max_logprobs=a.max_logprobs,
        max_model_len=a.max_model_len, max_num_batched_tokens=a.max_num_batched_tokens,
        enforce_eager=a.enforce_eager, skip_tokenizer_init=True, logprobs_mode="raw_logprobs",
        disable_log_stats=True, seed=0,
    )  # fmt: skip
    return LLMEngine.from_engine_args(args)


Running = dict[str, tuple[Pending, int, "np.ndarray[Any, Any]", int]]


def admit(engine: Any, batch: Batch, running: Running) -> Pending:
    """Add ``batch``'s requests to the engine; the ones it cannot take are answered at once."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    vocab, cap = engine.model_config.get_vocab_size(), engine.model_config.max_logprobs
    p = Pending(batch)
    for i, item in enumerate(batch.items):
        tokens, rows = as_i32(item.tokens), as_i32(item.rows).astype(np.int64)
        if not 0 <= item.k <= cap:
            p.done(i, ItemResult(error=f"k_over_cap: k={item.k} outside [1, {cap}]"))
            continue
        if tokens.shape[0] < 2 or int(tokens.min()) < 0 or int(tokens.max()) >= vocab:
            p.done(i, ItemResult(error=f"bad request: fewer than 2 tokens or a token id outside [0, {vocab})"))
            continue
        sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=item.k or None, detokenize=False,
                            output_kind=RequestOutputKind.FINAL_ONLY)  # fmt: skip
        rid = f"{batch.id}:{i}"
        try:
            engine.add_request(rid, {"prompt_token_ids": tokens.tolist()}, sp)
        except Exception as e:  # the engine refused this request (length, k, ...): report, go on
            p.done(i, ItemResult(error=f"engine refused: {type(e).__name__}: {e}"))
            continue
        running[rid] = (p, i, rows, item.k)
    return p


def serve(engine: Any, inbox: queue.Queue[Batch | None], out: BinaryIO) -> None:
    """Add arriving batches' requests, step the engine, answer each batch when its last request finishes."""
    running: Running = {}
    open_batches: list[Pending] = []
    while True:
        block = not running
        while True:
            try:
                batch = inbox.get(block=block)
            except queue.Empty:
                break
            if batch is None:
                return
            block = False
            open_batches.append(admit(engine, batch, running))
        if running:
            for o in engine.step():
                if o.finished and o.request_id in running:
                    p, i, rows, k = running.pop(o.request_id)
                    p.done(i, collect(o.prompt_logprobs or [], rows, k) if k else ItemResult())
        for p in open_batches:
            if not p.left:
                out.write(frame(BatchResult(p.batch.id, [r for r in p.results if r is not None])))
                out.flush()
        open_batches = [p for p in open_batches if p.left]


def read_batches(src: BinaryIO, inbox: queue.Queue[Batch | None]) -> None:
    try:
        while (body := read_frame(src)) is not None:
            inbox.put(to_engine_decoder.decode(body))
    finally:
        inbox.put(None)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m pipeline.teacher.vllm_engine_proc")
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--max-logprobs", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--enforce-eager", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    out = os.fdopen(os.dup(1), "wb")  # the frame channel: the original stdout
    os.dup2(2, 1)  # anything printed from here on (vLLM's logs included) goes to stderr
    sys.stdout = sys.stderr
    try:
        install_array_prompt_logprobs()
        engine = build_engine(a)
        import vllm

        mc = engine.model_config
        out.write(frame(Ready(int(mc.get_vocab_size()), int(mc.max_logprobs), int(mc.max_model_len),
                              str(vllm.__version__), a.model)))  # fmt: skip
        out.flush()
    except Exception as e:
        out.write(frame(Fatal(f"engine start failed: {type(e).__name__}: {e}")))
        out.flush()
        return 1
    inbox: queue.Queue[Batch | None] = queue.Queue()
    threading.Thread(target=read_batches, args=(sys.stdin.buffer, inbox), daemon=True).start()
    try:
        serve(engine, inbox, out)
    except Exception as e:
        out.write(frame(Fatal(f"engine failed: {type(e).__name__}: {e}")))
        out.flush()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
