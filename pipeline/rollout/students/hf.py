"""Student backend on a local transformers model (``worker rollout --backend hf`` on a CPU or a GPU, the demo, tests).

Sampling runs a manual KV-cached decode loop in a worker thread (``asyncio.to_thread``), batched over
the ``n`` completions. Tokens are drawn from the processed distribution (``logits / temperature``,
then top-p), but the recorded logprob is the model's *raw* ``log_softmax(logits)`` of the sampled token,
computed from the same forward pass: temperature-free, equal to a teacher-forced recomputation and to
vLLM V1's default ``raw_logprobs``. Generation calls are serialised by a lock (CPU cores are shared). The weights
may be bfloat16 or float16 (``from_pretrained``'s ``dtype``); logits are cast to float32 before sampling and the
log-softmax.

``load_weights`` loads the version a learner published; a folder that cannot be loaded (torn, corrupt, a NaN or
an infinity in a tensor, another model's shape) is refused, recorded in ``checkpoint_refusals``
(``pipeline.rollout.refusals``: logged and counted once, shown by the worker's heartbeat) and the model keeps the
weights it has; the same folder is not read again.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from pipeline.models.kvcache import output_cache, with_cache
from pipeline.rollout.refusals import CheckpointRefusals, folder_key
from pipeline.rollout.stop_strings import StopStringChecker
from pipeline.rollout.students.base import Completion, GenParams, check_request


def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
    ids: set[int] = set()
    cfg = getattr(model, "generation_config", None)
    eos = getattr(cfg, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, list | tuple):
        ids.update(int(e) for e in eos)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def sample_next(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator) -> torch.Tensor:
    """Sample one token per row of ``logits`` [B, V] (greedy when ``temperature`` is 0)."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(dim=-1) - sorted_p  # mass of strictly more likely tokens
        sorted_p = sorted_p.masked_fill(before >= top_p, 0.0)  # the top token always survives
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)


class HFStudent:
    """A transformers causal LM behind the ``StudentBackend`` and ``WeightReloader`` protocols."""

    def __init__(self, model: Any, tokenizer: Any, *, eos_token_ids: Sequence[int] | None = None) -> None:
        self.model = model
        self._tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids) if eos_token_ids is not None else _eos_ids(model, tokenizer)
        self._lock = threading.Lock()
        self.version: int | None = None  # the published version loaded (None: the weights it started with)
        self.checkpoint_refusals = CheckpointRefusals()

    @classmethod
    def from_pretrained(cls, path: str | Path, *, device: str = "cpu", dtype: str = "auto") -> HFStudent:
        """Load the model (weights in ``dtype`` on ``device``, in eval mode: ``pipeline.models.weights.load_causal_lm``;
        ``auto``: bfloat16 on a GPU, float32 elsewhere) and the tokenizer from one directory."""
        from transformers import AutoTokenizer

        from pipeline.models.weights import load_causal_lm

        return cls(load_causal_lm(path, dtype=dtype, device=device), AutoTokenizer.from_pretrained(str(path)))

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    async def load_weights(self, directory: str | Path) -> int | None:
        """Load the newest version a learner published (``pipeline.models.weights``) between samples; its version,
        or None when none was loaded: nothing published, or the folder refused (``checkpoint_refusals``; the
        model keeps its weights). Never raises ``CheckpointError``."""
        return await asyncio.to_thread(self._load, directory)

    def _load(self, directory: str | Path) -> int | None:
        from pipeline.models.weights import CheckpointError, latest, load_into

        refusals = self.checkpoint_refusals
        with self._lock:
            try:
                ckpt = latest(directory)  # LATEST, the folder's marker, sizes and headers
            except CheckpointError as e:
                refusals.refuse(e, kept=self.version)
                return None
            if ckpt is None:
                return None
            folder = folder_key(ckpt)
            if refusals.known(folder):
                return None
            try:
                load_into(self.model, ckpt)  # the tensors: readable, finite, the model's names and shapes
            except CheckpointError as e:
                refusals.refuse(e, kept=self.version, folder=folder)
                return None
            self.version = ckpt.version
            refusals.loaded()
            return ckpt.version

    async def generate(self, prompt_ids: list[int], params: GenParams, n: int = 1) -> list[Completion]:
        """``params.stop`` strings end a completion as vLLM ends it (``pipeline.rollout.stop_strings``): at the
        token that completes one, that token included, ``stop_reason`` the string."""
        check_request(prompt_ids, params, n)
        checkers = [
            StopStringChecker(self._tokenizer, prompt_ids, params.stop,
                              include_stop_str_in_output=params.include_stop_str_in_output,
                              skip_special_tokens=params.skip_special_tokens)
            for _ in range(n)
        ] if any(params.stop) else None  # fmt: skip
        return await asyncio.to_thread(self._generate, list(prompt_ids), params, n, checkers)

    def _generate(
        self, prompt_ids: list[int], params: GenParams, n: int, checkers: list[StopStringChecker] | None
    ) -> list[Completion]:
        max_tokens = params.max_tokens
        stop_ids = {int(t) for t in params.stop_token_ids} - self.eos_token_ids  # reported as the stop_reason
        stops = self.eos_token_ids | stop_ids
        gen = torch.Generator()
        if params.seed is None:
            gen.seed()
        else:
            gen.manual_seed(params.seed)
        tokens: list[list[int]] = [[] for _ in range(n)]
        lps: list[list[float]] = [[] for _ in range(n)]
        finish = ["length"] * n
        reason: list[int | str | None] = [None] * n
        if max_tokens == 0:
            return [Completion([], [], "length") for _ in range(n)]
        with self._lock, torch.inference_mode():
            device = next(self.model.parameters()).device
            out = self.model(input_ids=torch.tensor([prompt_ids] * n, device=device), use_cache=True)
            active = set(range(n))
            for step in range(max_tokens):
                logits = out.logits[:, -1, :].float().cpu()  # sampled on the CPU: one generator, any device
                nxt = sample_next(logits, params.temperature, params.top_p, gen)
                chosen = torch.log_softmax(logits, dim=-1).gather(1, nxt[:, None])[:, 0]
                for i in sorted(active):
                    tok = int(nxt[i])
                    tokens[i].append(tok)
                    lps[i].append(float(chosen[i]))
                    hit = checkers[i].step(tok, stop_token=tok in stops) if checkers else None
                    if tok in stops or hit is not None:
                        finish[i] = "stop"
                        reason[i] = hit if hit is not None else (tok if tok in stop_ids else None)
                        active.discard(i)
                if not active or step == max_tokens - 1:
                    break
                kv = with_cache(self.model, output_cache(out))
                out = self.model(input_ids=nxt[:, None].to(device), **kv, use_cache=True)
        return [Completion(t, lp, f, r) for t, lp, f, r in zip(tokens, lps, finish, reason, strict=True)]
