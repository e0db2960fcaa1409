"""Forward math of the transformers teacher, never ``[tokens, V]``.

The base model (``model.get_decoder()``) runs to final hidden states; the hidden states of the wanted
rows only are gathered, and lm_head + float32 log-softmax + top-k + the sampled-token gather run over
them ``chunk`` rows at a time into two reused ``[chunk, V]`` buffers (logits in the model's dtype, float32
log-probabilities): memory O(chunk x V) whatever the sequence lengths.

Prefix sharing: requests that share a prefix (``hf_prefix``) run it once with ``use_cache=True``; their
continuations then run batched, right-padded, from position ``len(prefix)`` over the prefix KV cache
expanded along the batch. Rows inside the prefix read the prefix's hidden states.

Models whose logits are not ``lm_head(base(...))`` (a softcap or scale after lm_head) take the fallback
path: the full model's logits, rows gathered before the chunked log-softmax. ``probe_split`` tells which.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from pipeline.models.kvcache import output_cache, with_cache
from pipeline.teacher.base import ScoreResult
from pipeline.teacher.hf_pack import VARLEN_ATTENTION, pack

#: Per-layer (keys, values) of a prefix, ``[1, heads, p, head_dim]`` each.
KV = list[tuple[torch.Tensor, torch.Tensor]]
Scores = tuple[npt.NDArray[np.float32], npt.NDArray[np.int32], npt.NDArray[np.float32]]


@dataclass(frozen=True, slots=True)
class Job:
    """One request as the forward sees it. ``tokens``: what the base model needs (through the last wanted
    row); ``rows``: the wanted rows, int64, ascending; ``targets``: ``full_tokens[rows + 1]``."""

    tokens: npt.NDArray[np.int32]
    rows: npt.NDArray[np.int64]
    targets: npt.NDArray[np.int64]
    k: int


@dataclass
class Counters:
    """Work done: real (unpadded) tokens through the base model, rows through lm_head, base-model calls."""

    tokens_computed: int = 0
    rows_computed: int = 0
    forward_calls: int = 0


class ChunkedHead:
    """lm_head + float32 log-softmax + top-k + sampled gather, ``chunk`` rows at a time."""

    def __init__(self, head: Any, vocab: int, chunk: int) -> None:
        self.head = head
        self.vocab = vocab
        self.chunk = chunk

    def _logits(self, h: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        head = self.head
        if isinstance(head, torch.nn.Linear):  # straight into the reused buffer
            torch.matmul(h, head.weight.t(), out=out)
            if head.bias is not None:
                out.add_(head.bias)
            return out
        logits: torch.Tensor = head(h)
        return logits

    def score(
        self, hidden: torch.Tensor | None, logits: torch.Tensor | None, targets: torch.Tensor, kmax: int
    ) -> Scores:
        """Top-``kmax`` logprobs (desc) and ids, and the logprob of ``targets``, for each row of ``hidden``
        ``[R, H]`` (through lm_head) or of ``logits`` ``[R, V]`` (already computed)."""
        src = hidden if hidden is not None else logits
        assert src is not None
        rows = int(src.shape[0])
        top_v = np.empty((rows, kmax), np.float32)
        top_i = np.empty((rows, kmax), np.int32)
        sampled = np.empty(rows, np.float32)
        if rows == 0:
            return top_v, top_i, sampled
        c = min(self.chunk, rows)
        lg_buf = None if hidden is None else torch.empty((c, self.vocab), dtype=src.dtype, device=src.device)
        lp_buf = torch.empty((c, self.vocab), dtype=torch.float32, device=src.device)
        for s in range(0, rows, c):
            e = min(s + c, rows)
            if hidden is not None and lg_buf is not None:
                lg = self._logits(hidden[s:e], lg_buf[: e - s])
            else:
                assert logits is not None
                lg = logits[s:e]
            lp = torch.log_softmax(lg, dim=-1, dtype=torch.float32, out=lp_buf[: e - s])
            top = torch.topk(lp, kmax, dim=-1, sorted=True)
            top_v[s:e] = top.values.cpu().numpy()
            top_i[s:e] = top.indices.to(torch.int32).cpu().numpy()
            sampled[s:e] = lp.gather(-1, targets[s:e, None]).squeeze(-1).cpu().numpy()
        return top_v, top_i, sampled


def _pad(seqs: list[npt.NDArray[np.int32]]) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], bool]:
    """Right-padded ids, the mask, and whether any padding was needed."""
    lens = [int(s.shape[0]) for s in seqs]
    width = max(lens)
    ids = np.zeros((len(seqs), width), np.int64)
    mask = np.zeros((len(seqs), width), np.int64)
    for j, s in enumerate(seqs):
        ids[j, : lens[j]] = s
        mask[j, : lens[j]] = 1
    return ids, mask, min(lens) < width


def _kv_pairs(cache: Any) -> KV | None:
    """The per-layer (keys, values) of a prefix cache, or None if it is not a plain full-attention
    ``DynamicCache`` (sliding-window, linear-attention or quantized layers are not expanded here)."""
    from transformers.cache_utils import DynamicCache, DynamicLayer

    if type(cache) is not DynamicCache or not all(type(layer) is DynamicLayer for layer in cache.layers):
        return None
    layers: list[Any] = list(cache.layers)
    return [(layer.keys, layer.values) for layer in layers]


@dataclass
class Forward:
    """Runs jobs through a causal LM. ``split``: base model + chunked lm_head (else the fallback)."""

    model: Any
    head: ChunkedHead
    device: str
    split: bool
    counters: Counters = field(default_factory=Counters)

    def _to(self, a: npt.NDArray[Any]) -> torch.Tensor:
        return torch.from_numpy(a).to(self.device)

    def _finish(self, jobs: list[Job], hidden: torch.Tensor | None, logits: torch.Tensor | None) -> list[ScoreResult]:
        """Score the gathered rows (``[sum R, H]`` hidden or ``[sum R, V]`` logits) and split them per job."""
        targets = self._to(np.concatenate([j.targets for j in jobs]))
        kmax = max(j.k for j in jobs)
        top_v, top_i, sampled = self.head.score(hidden, logits, targets, kmax)
        self.counters.rows_computed += int(targets.shape[0])
        out: list[ScoreResult] = []
        s = 0
        for j in jobs:
            e = s + int(j.rows.shape[0])
            out.append(ScoreResult(top_i[s:e, : j.k].copy(), top_v[s:e, : j.k].copy(), sampled[s:e]))
            s = e
        return out

    def plain(self, jobs: list[Job]) -> list[ScoreResult]:
        """One batched forward, no cache."""
        ids, mask, padded = _pad([j.tokens for j in jobs])
        t_ids = self._to(ids)
        t_mask = self._to(mask) if padded else None
        self.counters.tokens_computed += int(mask.sum())
        self.counters.forward_calls += 1
        if not self.split:  # fallback: the model's own logits, rows gathered first
            logits = self.model(input_ids=t_ids, attention_mask=t_mask, use_cache=False).logits
            picked = torch.cat([logits[b, self._to(j.rows)] for b, j in enumerate(jobs)])
            del logits
            return self._finish(jobs, None, picked)
        hidden = self.model.get_decoder()(input_ids=t_ids, attention_mask=t_mask, use_cache=False).last_hidden_state
        picked = torch.cat([hidden[b, self._to(j.rows)] for b, j in enumerate(jobs)])
        del hidden
        return self._finish(jobs, picked, None)

    @property
    def varlen(self) -> bool:
        """True when the model's attention runs packed rows varlen (flash-attention): pack into one row."""
        return getattr(self.model.config, "_attn_implementation", None) in VARLEN_ATTENTION

    def packed(self, jobs: list[Job]) -> list[ScoreResult]:
        """One forward over the jobs packed into rows (``hf_pack``): position ids restart per sequence, no
        attention mask, no padding computed beyond the unused tails of rows. Split models only."""
        pk = pack([j.tokens for j in jobs], self.varlen)
        width = int(pk.ids.shape[1])
        self.counters.tokens_computed += sum(int(j.tokens.shape[0]) for j in jobs)
        self.counters.forward_calls += 1
        out = self.model.get_decoder()(input_ids=self._to(pk.ids), position_ids=self._to(pk.positions), use_cache=False)
        hidden = out.last_hidden_state
        flat = hidden.reshape(-1, hidden.shape[-1])
        at = np.concatenate([r * width + c + j.rows for j, (r, c) in zip(jobs, pk.where, strict=True)])
        picked = flat[self._to(at)]
        del out, hidden, flat
        return self._finish(jobs, picked, None)

    def prefix(self, tokens: npt.NDArray[np.int32]) -> tuple[torch.Tensor, KV] | None:
        """Hidden states ``[p, H]`` and per-layer KV of a shared prefix, or None if its cache cannot be shared."""
        out = self.model.get_decoder()(input_ids=self._to(tokens.astype(np.int64))[None], use_cache=True)
        self.counters.tokens_computed += int(tokens.shape[0])
        self.counters.forward_calls += 1
        kv = _kv_pairs(output_cache(out))
        return None if kv is None else (out.last_hidden_state[0], kv)

    def continuation(self, jobs: list[Job], p: int, prefix_hidden: torch.Tensor, kv: KV) -> list[ScoreResult]:
        """The jobs' tokens after the shared ``p``-token prefix, batched over the prefix cache."""
        from transformers.cache_utils import DynamicCache

        b = len(jobs)
        ids, mask, _ = _pad([j.tokens[p:] for j in jobs])
        width = ids.shape[1]
        full_mask = np.concatenate([np.ones((b, p), np.int64), mask], axis=1)
        positions = self._to(np.broadcast_to(np.arange(p, p + width, dtype=np.int64), (b, width)).copy())
        cache = DynamicCache([(k.expand(b, -1, -1, -1), v.expand(b, -1, -1, -1)) for k, v in kv],
                             config=self.model.config)  # fmt: skip
        decoder = self.model.get_decoder()
        out = decoder(
            input_ids=self._to(ids),
            attention_mask=self._to(full_mask),
            position_ids=positions,
            **with_cache(decoder, cache),
            use_cache=True,
        )
        self.counters.tokens_computed += int(mask.sum())
        self.counters.forward_calls += 1
        hidden = out.last_hidden_state
        del out, cache
        parts: list[torch.Tensor] = []
        for bi, j in enumerate(jobs):
            inside = int(np.searchsorted(j.rows, p))  # rows < p read the prefix's hidden states
            parts.append(prefix_hidden[self._to(j.rows[:inside])])
            parts.append(hidden[bi, self._to(j.rows[inside:] - p)])
        picked = torch.cat(parts)
        del hidden
        return self._finish(jobs, picked, None)


def probe_split(model: Any, vocab: int, device: str) -> bool:
    """Whether ``lm_head(get_decoder()(x))`` reproduces ``model(x).logits`` (no softcap, scale or other
    step after lm_head), checked on a short fixed sequence."""
    ids = torch.tensor([[(7 * i + 3) % min(vocab, 64) for i in range(8)]], device=device)
    try:
        base, head = model.get_decoder(), model.get_output_embeddings()
        if base is None or head is None or base is model:
            return False
        with torch.inference_mode():
            want = model(input_ids=ids, use_cache=False).logits.float()
            got = head(base(input_ids=ids, use_cache=False).last_hidden_state).float()
    except Exception as e:  # no separable base model / lm_head: the fallback path
        _log_off("hf_split_head_off", e)
        return False
    if got.shape != want.shape:
        return False
    tol = 1e-6 + 1e-5 * float(want.abs().max())
    return bool((got - want).abs().max() <= tol)


def probe_sharing(fw: Forward, vocab: int) -> bool:
    """Whether prefix sharing reproduces independent forwards for this model (two sequences sharing 8 tokens)."""
    seqs = [np.array([(5 * i + 1 + (i >= 8) * s) % min(vocab, 64) for i in range(10 + s)], np.int32) for s in (1, 3)]
    jobs = [Job(t[:-1], np.arange(t.shape[0] - 1, dtype=np.int64), t[1:].astype(np.int64), 1) for t in seqs]
    saved = Counters(**vars(fw.counters))
    try:
        with torch.inference_mode():
            want = fw.plain(jobs)
            pre = fw.prefix(jobs[0].tokens[:8])
            if pre is None:
                return False
            got = fw.continuation(jobs, 8, *pre)
    except Exception as e:  # a cache API this model or transformers version does not support: no sharing
        _log_off("hf_prefix_sharing_off", e)
        return False
    finally:
        fw.counters = saved
    return all(
        np.allclose(a.sampled_logprobs, b.sampled_logprobs, atol=1e-4, rtol=0) for a, b in zip(want, got, strict=True)
    )


def probe_packing(fw: Forward, vocab: int) -> bool:
    """Whether packed rows reproduce separate forwards for this model (three sequences of 5, 9 and 12
    tokens; sdpa packs the two shorter into one row)."""
    seqs = [np.array([(3 * i + 2 * n) % min(vocab, 64) for i in range(n)], np.int32) for n in (12, 5, 9)]
    jobs = [Job(t[:-1], np.arange(t.shape[0] - 1, dtype=np.int64), t[1:].astype(np.int64), 2) for t in seqs]
    saved = Counters(**vars(fw.counters))
    try:
        with torch.inference_mode():
            want = [fw.plain([j])[0] for j in jobs]
            got = fw.packed(jobs)
    except Exception as e:  # a model whose attention ignores position-id packing: pad instead
        _log_off("hf_packing_off", e)
        return False
    finally:
        fw.counters = saved
    # half-precision weights round differently in a packed row than in a padded one; a wrong mask is off by far more
    weight = getattr(fw.head.head, "weight", None)
    tol = 5e-2 if weight is not None and weight.dtype in (torch.bfloat16, torch.float16) else 1e-4
    return all(
        np.allclose(a.sampled_logprobs, b.sampled_logprobs, atol=tol, rtol=0) for a, b in zip(want, got, strict=True)
    )


def auto_chunk_positions(device: str, vocab: int, logit_bytes: int) -> int:
    """Rows per lm_head/log-softmax chunk from the free memory of ``device``: a quarter of the free GPU
    memory, or a tenth of the available host memory (at most 1 GiB) on CPU, over the ``[chunk, V]``
    logits and float32 log-probabilities; between 16 and 8192."""
    per_row = vocab * (logit_bytes + 4)
    if device.startswith("cuda") and torch.cuda.is_available():
        free, _total = torch.cuda.mem_get_info(torch.device(device))
        budget = free // 4
    else:
        budget = min(host_available() // 10, 1 << 30)
    return int(max(16, min(8192, budget // max(per_row, 1))))


def host_available() -> int:
    """MemAvailable from /proc/meminfo in bytes (2 GiB where it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 2 << 30


def _log_off(event: str, e: Exception) -> None:
    import structlog

    structlog.get_logger(__name__).warning(event, error=f"{type(e).__name__}: {e}")
