"""Local transformers teacher: batched forward passes on CPU (or any torch device).

Only the rows a request names are scored (``ScoreRequest.rows``; all ``L - 1`` when it names none), and
never through a ``[tokens, V]`` array: the base model runs to hidden states, and lm_head + log-softmax +
top-k run over the wanted rows in chunks of ``chunk_positions`` (``hf_forward``). Tokens after the last
wanted row are not computed. Requests of one call that share a prefix of at least ``min_shared_prefix``
tokens (the sequences of a group share their prompt) run it once and continue from its KV cache
(``hf_prefix``); ``tokens_computed`` and ``rows_computed`` count the work done.

Sequences without a shared prefix are packed (``hf_pack``): chunks of at most ``max_batch_tokens`` real
tokens, each sequence with its own position ids and no padding (flash-attention where the model was
loaded with it, sdpa or eager otherwise); ``probe_packing`` checks at start that the model honours packed
position ids, else they are padded. Padded batches (the fallback, and continuations over a shared prefix)
are sorted by length and chunked so that each forward holds at most ``max_batch_tokens`` padded tokens
(rows x longest row, counting a shared prefix in each row's length, as its keys and values are); right
padding with an attention mask keeps every real position exact under causal attention.

Weights may be bfloat16 or float16 (``dtype``; ``"auto"``: bfloat16 on a GPU, float32 on CPU); the
log-softmax is float32 whatever they are. ``chunk_positions=None`` picks the lm_head chunk from the
device's free memory (``hf_forward.auto_chunk_positions``). Forwards run under ``torch.inference_mode`` in
one dedicated worker thread (the event loop stays free; torch keeps a single intra-op thread team, and forwards never
compete with each other for the cores).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import structlog

from pipeline.models.weights import resolve_dtype
from pipeline.teacher.base import (
    K_OVER_CAP,
    ScoreFailure,
    ScoreOutcome,
    ScoreRequest,
    ScoreResult,
    empty_result,
    plan_chunks,
    rows_problem,
)
from pipeline.teacher.hf_pack import plan_packed_chunks
from pipeline.teacher.hf_prefix import plan_prefix_groups

if TYPE_CHECKING:  # torch is imported when the teacher starts, not when this module is
    from pipeline.teacher.hf_forward import Forward, Job

log = structlog.get_logger(__name__)


def load_model(path: str, dtype: str = "float32", attn_implementation: str | None = None) -> Any:
    """Load a causal LM from a local directory in ``dtype``, in eval mode (flash-attention 2 where the
    ``flash_attn`` package is installed and the weights are half precision, unless told otherwise)."""
    import importlib.util

    import torch
    from transformers import AutoModelForCausalLM

    if attn_implementation is None and dtype in ("bfloat16", "float16") and importlib.util.find_spec("flash_attn"):
        attn_implementation = "flash_attention_2"
    kw = {"attn_implementation": attn_implementation} if attn_implementation else {}
    model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), **kw)
    model.eval()
    return model


class HFTeacher:
    """A ``TeacherBackend`` running a transformers causal LM in-process. ``max_k`` is the vocabulary size.

    ``chunk_positions``: rows per lm_head/log-softmax chunk (memory about ``2 x chunk x V x 4`` bytes); None:
    chosen from free memory at start. ``min_shared_prefix``: the shortest common prefix run once for several
    requests; 0 turns sharing off. ``pack``: pack sequences without padding (when the model passes the probe).
    """

    def __init__(
        self,
        model_path: str | Path | None = None,
        *,
        model: Any = None,
        identity: str | None = None,
        max_batch_tokens: int = 16384,
        num_threads: int | None = None,
        device: str = "cpu",
        dtype: str = "float32",
        chunk_positions: int | None = 256,
        min_shared_prefix: int = 32,
        pack: bool = True,
    ) -> None:
        if model is None and model_path is None:
            raise ValueError("HFTeacher needs model_path or model")
        if max_batch_tokens < 1 or (chunk_positions is not None and chunk_positions < 1):
            raise ValueError("max_batch_tokens and chunk_positions must be >= 1")
        if min_shared_prefix < 0:
            raise ValueError("min_shared_prefix must be >= 0")
        self._path = model_path
        self._model = model
        self._identity = identity or (f"hf:{Path(model_path).name}" if model_path else "hf:model")
        self.max_batch_tokens = max_batch_tokens
        self.chunk_positions = chunk_positions
        self.min_shared_prefix = min_shared_prefix
        self.pack = pack
        self._packing = False
        self._num_threads = num_threads
        self._device = device
        self._dtype = dtype
        self._vocab = 0
        self._max_len: int | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._fw: Forward | None = None
        self._sharing = False

    @property
    def identity(self) -> str:
        return self._identity

    @property
    def max_k(self) -> int:
        return self._vocab

    @property
    def tokens_computed(self) -> int:
        """Real (unpadded) tokens run through the base model since start (a shared prefix counts once)."""
        return self._fw.counters.tokens_computed if self._fw else 0

    @property
    def rows_computed(self) -> int:
        """Rows run through lm_head + log-softmax since start."""
        return self._fw.counters.rows_computed if self._fw else 0

    @property
    def split_head(self) -> bool:
        """True when lm_head runs on gathered rows (False: the model's own logits, the fallback)."""
        return bool(self._fw and self._fw.split)

    @property
    def sharing(self) -> bool:
        """True when shared prefixes run once (``min_shared_prefix > 0`` and the model passed the probe)."""
        return self._sharing

    @property
    def packing(self) -> bool:
        """True when sequences run packed (``pack`` and the model passed the probe)."""
        return self._packing

    def _init_thread(self) -> None:
        import torch

        if self._num_threads:
            torch.set_num_threads(self._num_threads)

    async def start(self) -> None:
        from pipeline.teacher.hf_forward import (
            ChunkedHead,
            Forward,
            auto_chunk_positions,
            probe_packing,
            probe_sharing,
            probe_split,
        )

        self._init_thread()
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="hf-teacher", initializer=self._init_thread)
        if self._model is None:
            dtype = resolve_dtype(self._dtype, self._device)
            self._model = await asyncio.to_thread(load_model, str(self._path), dtype)
        self._model.to(self._device)
        self._model.eval()
        head = self._model.get_output_embeddings()
        self._vocab = int(head.out_features)
        max_pos = getattr(self._model.config, "max_position_embeddings", None)
        self._max_len = int(max_pos) if max_pos else None
        split = probe_split(self._model, self._vocab, self._device)
        chunk = self.chunk_positions or auto_chunk_positions(self._device, self._vocab, head.weight.element_size())
        fw = Forward(self._model, ChunkedHead(head, self._vocab, chunk), self._device, split)
        self._sharing = split and self.min_shared_prefix > 0 and probe_sharing(fw, self._vocab)
        self._packing = split and self.pack and probe_packing(fw, self._vocab)
        self._fw = fw
        log.info("hf_teacher_ready", identity=self._identity, vocab=self._vocab, split_head=split,
                 sharing=self._sharing, packing=self._packing, chunk_positions=chunk, device=self._device,
                 dtype=str(head.weight.dtype))  # fmt: skip

    async def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self._model = None
        self._fw = None

    async def score(self, reqs: list[ScoreRequest]) -> list[ScoreOutcome]:
        if not reqs:
            return []
        if self._executor is None:
            return [ScoreFailure("teacher not started", retryable=False) for _ in reqs]
        return await asyncio.get_running_loop().run_in_executor(self._executor, self.score_sync, reqs)

    def _reject(self, req: ScoreRequest) -> ScoreFailure | None:
        n = int(req.tokens.shape[0])
        if self._model is None or self._fw is None:
            return ScoreFailure("teacher not started", retryable=False)
        if req.k < 1 or req.k > self._vocab:
            return ScoreFailure(f"{K_OVER_CAP}: k={req.k} outside [1, {self._vocab}]", retryable=False)
        if n == 0:
            return ScoreFailure("empty sequence", retryable=False)
        if self._max_len is not None and n > self._max_len:
            return ScoreFailure(f"sequence of {n} tokens exceeds the model's {self._max_len}", retryable=False)
        lo, hi = int(req.tokens.min()), int(req.tokens.max())
        if lo < 0 or hi >= self._vocab:
            return ScoreFailure(f"token id outside [0, {self._vocab})", retryable=False)
        bad_rows = rows_problem(req)
        return None if bad_rows is None else ScoreFailure(bad_rows, retryable=False)

    def score_sync(self, reqs: list[ScoreRequest]) -> list[ScoreOutcome]:
        """Score ``reqs`` in the calling thread (blocking)."""
        import torch

        from pipeline.teacher.hf_forward import Job

        out: list[ScoreOutcome | None] = [None] * len(reqs)
        todo: list[int] = []
        jobs: list[Job] = []
        for i, req in enumerate(reqs):
            bad = self._reject(req)
            if bad is not None:
                out[i] = bad
            elif req.n_rows == 0:
                out[i] = empty_result(req.k)
            else:
                rows = req.row_index().astype(np.int64)
                tokens = req.tokens.astype(np.int32, copy=False)
                todo.append(i)
                jobs.append(Job(tokens[: int(rows[-1]) + 1], rows, tokens[rows + 1].astype(np.int64), req.k))
        with torch.inference_mode():
            for idx, res in self._run(jobs):
                out[todo[idx]] = res
        missing = [i for i, o in enumerate(out) if o is None]
        if missing:  # never shift later results onto the wrong requests
            raise RuntimeError(f"HF teacher produced no result for requests {missing[:8]}")
        return [o for o in out if o is not None]

    def _run(self, jobs: list[Job]) -> list[tuple[int, ScoreResult]]:
        """Results by index into ``jobs``: shared-prefix groups over their cache, the rest batched plainly."""
        fw = self._fw
        assert fw is not None
        groups = plan_prefix_groups([j.tokens for j in jobs], self.min_shared_prefix) if self._sharing else []
        alone = [m for g in groups if g.prefix == 0 for m in g.members] if groups else list(range(len(jobs)))
        done: list[tuple[int, ScoreResult]] = []
        lengths = [int(jobs[m].tokens.shape[0]) for m in alone]
        plan = plan_packed_chunks if self._packing else plan_chunks
        for chunk in plan(lengths, self.max_batch_tokens):
            idx = [alone[c] for c in chunk]
            batch = [jobs[i] for i in idx]
            done += zip(idx, fw.packed(batch) if self._packing else fw.plain(batch), strict=True)
        for g in groups:
            if g.prefix == 0:
                continue
            pre = fw.prefix(jobs[g.members[0]].tokens[: g.prefix])  # None: not a shareable cache after all
            for chunk in plan_chunks([int(jobs[m].tokens.shape[0]) for m in g.members], self.max_batch_tokens):
                idx = [g.members[c] for c in chunk]
                batch = [jobs[i] for i in idx]
                res = fw.plain(batch) if pre is None else fw.continuation(batch, g.prefix, *pre)
                done += zip(idx, res, strict=True)
        return done
