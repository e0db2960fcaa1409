"""``distillq demo --cross-tokenizer``: a tiny student distilled from a tiny teacher of another tokenizer.

Both tokenizers are byte-level BPEs over all 256 bytes trained in well under a second on the demo's arithmetic
corpus, with the same special tokens and chat template (so the chat markup maps by content) and other merges: the
student is the plain demo's (``distillq demo``: the shared tiny tokenizer, 416 ids, untrained model), the teacher's
has ``TEACHER_VOCAB_SIZE`` ids (``68`` is one student token and two teacher tokens, ``6`` ``8``). The untrained
student samples bytes above 127 that do not form characters in most of its first completions: the teacher worker
reads them on the byte fallback (its single-byte tokens, ``pipeline.teacher.crosstok``), gives them a low
probability, and so teaches the student to stop writing them. The teacher model is the tiny teacher's shape on its
vocabulary, pretrained on the task like the demo's usual one (``pretrain.train_teacher``), cached under
``.cache/tiny/crosstok-<hash>``. The teacher worker runs with ``--cross-tokenizer``: it scores its own tokenization
of each sequence's text and ships the signal in the student's positions (aligned chunks,
``pipeline.teacher.crossscore``).

The two models' tokens differ, so the held-out reverse KL is measured on text. For each held-out prompt the student
samples a completion; the figure of that sequence is the student's log-likelihood of its sample minus the teacher's
log-likelihood of the same text: the teacher scores its own tokenization of the same prompt text (its own chat
template over the same turn) and of the completion's text (``retokenize``), and its log-likelihood of exactly the
completion's bytes is the sum of its aligned chunks' log-probabilities (``align``, ``chunk_logprobs``). Averaged over
the prompts this is a Monte Carlo estimate of the sequence-level KL(student || teacher), in nats per completion
(``per_sequence``, ``report.json``'s ``heldout_reverse_kl_*``); ``per_byte`` divides the same sum by the completions'
text bytes (the end-of-sequence token is markup with no bytes, its log-probabilities count in the numerator).

``sequence_kl`` takes any student: where a completion is not UTF-8 text (a byte that does not form a character) the
teacher reads those bytes as its single-byte tokens (the library's byte
fallback, ``pipeline.teacher.crosstok.retokenize``, as the teacher worker does): the log-likelihood of one
tokenization of the bytes; such completions are counted (``byte_fallback``).
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pipeline.cli.supervisor import ProcSpec, distillq_argv
from pipeline.demo.plots import new_axes, save
from pipeline.demo.tinymodels import (
    DEFAULT_CACHE,
    SIZES,
    VOCAB_SIZE,
    TinyModels,
    arithmetic_problem,
    build_model,
    build_tokenizer,
    ensure_tiny_models,
)

#: The teacher's vocabulary: all 256 bytes and fewer merges than the corpus has pairs for (384 ids).
TEACHER_VOCAB_SIZE = 384
#: The student's: the plain demo's tokenizer (all 256 bytes and every merge the corpus has: 416 ids of the 512 asked).
STUDENT_VOCAB_SIZE = VOCAB_SIZE
#: Held-out prompts for the start and end reverse KL, and tokens the student samples for each.
HELDOUT_PROMPTS = 96
HELDOUT_MAX_NEW = 8
#: The unit of ``report.json``'s ``heldout_reverse_kl_start`` and ``_end`` in this variant.
UNIT = "nats per completion (text level: student log-likelihood of its sample minus the teacher's of the same text)"


def _key(seed: int) -> str:
    spec = json.dumps({"v": 2, "teacher_vocab": TEACHER_VOCAB_SIZE, "student_vocab": STUDENT_VOCAB_SIZE,
                       "sizes": SIZES, "seed": seed}, sort_keys=True)
    return hashlib.sha256(spec.encode()).hexdigest()[:12]


def ensure_cross_models(cache: Path | None = None, seed: int = 0) -> TinyModels:
    """The teacher's tokenizer (``tokenizer``) and untrained model (``teacher``, its folder carrying the tokenizer),
    cached, and the plain demo's untrained ``student`` (``tinymodels.ensure_tiny_models``) on its own tokenizer.
    ``pretrain.train_teacher`` trains ``teacher``."""
    root = (cache or DEFAULT_CACHE) / f"crosstok-{_key(seed)}"
    student = ensure_tiny_models(cache, seed).student
    tm = TinyModels(root, root / "tokenizer", root / "teacher", student)
    if (root / "DONE").exists():
        return tm
    from transformers import AutoTokenizer

    root.mkdir(parents=True, exist_ok=True)
    build_tokenizer(tm.tokenizer, TEACHER_VOCAB_SIZE)
    tok = AutoTokenizer.from_pretrained(str(tm.tokenizer))
    build_model(tm.teacher, "teacher", len(tok), seed + 10)
    tok.save_pretrained(str(tm.teacher))
    (root / "DONE").write_text("ok\n")
    return tm


def train_cross_teacher(cache: Path | None = None, progress: Callable[[int, float], None] | None = None) -> Path:
    """The teacher of its own tokenizer, pretrained on the task (cached); returns its folder (model + tokenizer)."""
    from pipeline.demo.pretrain import train_teacher  # torch: only where a model is trained

    return train_teacher(ensure_cross_models(cache), progress=progress)


def teacher_spec(teacher: Path, student: Path, top_k: int) -> ProcSpec:
    """The teacher worker, scoring its own tokenization of the student's text."""
    return ProcSpec("teacher", distillq_argv(
        "worker", "teacher", "--backend", "hf", "--model", str(teacher), "--student-tokenizer", str(student),
        "--cross-tokenizer", "--top-k", str(top_k), "--consumer-name", "teacher-0"))


def vocab_summary(path: Path) -> dict[str, Any]:
    """A tokenizer's name (its folder) and vocabulary size, for ``report.json``."""
    from transformers import AutoTokenizer

    return {"name": str(path), "vocab_size": len(AutoTokenizer.from_pretrained(str(path)))}


@dataclass(frozen=True)
class TextKL:
    """The text-level reverse KL over held-out completions."""

    per_sequence: float  # nats per completion
    per_byte: float  # nats per byte of completion text
    sequences: int
    text_bytes: int
    byte_fallback: int  # completions not UTF-8 text, their invalid bytes scored as the teacher's single-byte tokens


@dataclass(frozen=True)
class Side:
    """A model and its tokenizer, with the tokenizer's byte table."""

    model: Any
    tokenizer: Any
    vocab: Any  # pipeline.teacher.crosstok.VocabBytes

    @classmethod
    def load(cls, path: Path) -> Side:
        from transformers import AutoTokenizer

        from pipeline.models.weights import load_causal_lm
        from pipeline.teacher.crosstok import VocabBytes

        tok = AutoTokenizer.from_pretrained(str(path))
        return cls(load_causal_lm(path).eval(), tok, VocabBytes.of(tok))


def token_logprobs(model: Any, prompt: Sequence[int], completion: Sequence[int]) -> Any:
    """``model``'s log-probability of each completion token after ``prompt`` (a float64 numpy array)."""
    import torch

    with torch.inference_mode():
        ids = torch.tensor([list(prompt) + list(completion)], device=next(model.parameters()).device)
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, ids[0, len(prompt):, None])[:, 0]
    return lp.double().cpu().numpy()


def sequence_kl(student: Side, teacher: Side, question: str, completion: Sequence[int]) -> tuple[float, int, bool]:
    """One completion's text-level figure: the student's log-likelihood of ``completion`` after ``question``'s chat
    prompt minus the teacher's of the same text after its own prompt; with the completion's text bytes and whether
    the teacher read some of its bytes on the byte fallback (``retokenize``: bytes that are not UTF-8 text as its
    single-byte tokens; ``RoundTripError`` where the teacher has no token for such a byte)."""
    import numpy as np

    from pipeline.demo.pretrain import chat_ids
    from pipeline.teacher.crosstok import align, chunk_logprobs, retokenize

    s_lp = token_logprobs(student.model, chat_ids(student.tokenizer, question), completion)
    t_prompt = chat_ids(teacher.tokenizer, question)
    text_bytes = sum(len(student.vocab.pieces[t] or b"") for t in completion)
    r = retokenize(completion, student.vocab, teacher.tokenizer, teacher.vocab)
    a = align(r)
    chunks = chunk_logprobs(a, token_logprobs(teacher.model, t_prompt, r.teacher_ids.tolist()))
    signal = np.isfinite(chunks)  # a chunk the teacher has no token for (never here: the same specials) is left out
    s_chunks = [float(s_lp[s0:s1].sum()) for s0, s1 in a.student.tolist()]
    kl = float(sum(s for s, ok in zip(s_chunks, signal, strict=True) if ok) - chunks[signal].sum())
    return kl, text_bytes, r.fallback_bytes > 0


def text_reverse_kl(student: Side, teacher: Side, questions: Sequence[str], *, max_new: int = HELDOUT_MAX_NEW,
                    seed: int = 0) -> TextKL:
    """The student samples a completion of each question (temperature 1, from ``seed``: start and end are compared
    on common random numbers); the mean of ``sequence_kl`` over them, per completion and per text byte."""
    import torch

    from pipeline.demo.pretrain import chat_ids
    from pipeline.models.evaluation import sample_completion

    gen = torch.Generator().manual_seed(seed)
    eos = {int(student.tokenizer.eos_token_id)}
    total, nbytes, n, fallback = 0.0, 0, 0, 0
    for q in questions:
        completion = sample_completion(student.model, chat_ids(student.tokenizer, q), max_new, eos, gen)
        if not completion:
            continue
        kl, b, fell_back = sequence_kl(student, teacher, q, completion)
        total, nbytes, n, fallback = total + kl, nbytes + b, n + 1, fallback + fell_back
    return TextKL(total / max(n, 1), total / max(nbytes, 1), n, nbytes, fallback)


def heldout_questions(n: int = HELDOUT_PROMPTS, seed: int = 12345) -> list[str]:
    """Held-out ``a+b=`` problems (never in rollouts)."""
    rng = random.Random(seed)
    return [arithmetic_problem(rng, "heldout")[0] for _ in range(n)]


def heldout_text_kl(student: Path, teacher: Path, *, n: int = HELDOUT_PROMPTS, seed: int = 0) -> TextKL:
    """``text_reverse_kl`` of the student in ``student`` (a folder of weights and tokenizer) to ``teacher``."""
    return text_reverse_kl(Side.load(student), Side.load(teacher), heldout_questions(n), seed=seed)


def cross_stats(history: Sequence[dict[str, float]]) -> dict[str, float]:
    """Over the run, from the batches' ``cross.*`` stats where the learner's records carry them (empty where not),
    weighted by the batches' tokens: ``aligned_token_share``, the share of trained tokens in aligned chunks with
    teacher signal, and ``topk_mapped_mass``, the teacher probability mass the mapped top-k slots carry (mean over
    the trained rows that have one)."""
    rows = [r for r in history if "cross.aligned_share" in r and r.get("tokens", 0) > 0]
    tokens = sum(r["tokens"] for r in rows)
    if not tokens:
        return {}
    out = {"aligned_token_share": sum(r["cross.aligned_share"] * r["tokens"] for r in rows) / tokens}
    mass = [r for r in rows if "cross.topk_mapped_mass" in r]
    if mass:
        out["topk_mapped_mass"] = sum(r["cross.topk_mapped_mass"] * r["tokens"] for r in mass) / sum(
            r["tokens"] for r in mass)
    return {k: round(v, 4) for k, v in out.items()}


def summary(start: TextKL, end: TextKL, student_tok: Path, teacher_tok: Path) -> dict[str, Any]:
    """``report.json``'s additions: the tokenizers, the text-level held-out reverse KL at start and end (per
    completion as ``heldout_reverse_kl_*``, and per byte), and the evaluation's counts."""
    return {
        "student_tokenizer": vocab_summary(student_tok), "teacher_tokenizer": vocab_summary(teacher_tok),
        "heldout_reverse_kl_unit": UNIT,
        "heldout_reverse_kl_start": round(start.per_sequence, 5), "heldout_reverse_kl_end": round(end.per_sequence, 5),
        "heldout_reverse_kl_per_byte_start": round(start.per_byte, 5),
        "heldout_reverse_kl_per_byte_end": round(end.per_byte, 5),
        "heldout_text_kl": {"start": asdict(start), "end": asdict(end)},
    }


def plot(history: Sequence[dict[str, float]], start: TextKL, end: TextKL, path: Path) -> Path | None:
    """The batches' sampled reverse KL (teacher chunks) per step, and the text-level held-out figure, start and end."""
    axes = new_axes()
    if axes is None:
        return None
    fig, ax = axes
    steps = [r for r in history if not math.isnan(r.get("batch_reverse_kl", math.nan))]
    ax.plot([r["step"] for r in steps], [r["batch_reverse_kl"] for r in steps], lw=1, alpha=0.6,
            label="batch (sampled-token estimate, per token)")
    first, last = (history[0]["step"], history[-1]["step"]) if history else (0.0, 1.0)
    ax.plot([first, last], [start.per_byte, end.per_byte], "o-", lw=2,
            label=f"held-out, text level, per byte ({start.per_byte:.3f} -> {end.per_byte:.3f})")
    ax.set_xlabel("learner step")
    ax.set_ylabel("reverse KL(student || teacher), nats")
    ax.set_title("distillq demo --cross-tokenizer: a teacher of another tokenizer")
    return save(fig, ax, path)


__all__ = ["STUDENT_VOCAB_SIZE", "TEACHER_VOCAB_SIZE", "UNIT", "Side", "TextKL", "cross_stats",
           "ensure_cross_models", "heldout_questions", "heldout_text_kl", "plot", "sequence_kl", "summary",
           "teacher_spec", "text_reverse_kl", "train_cross_teacher", "vocab_summary"]
