"""Teacher/student vocabulary check and the teacher self-test checksum."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from pipeline.errors import ConfigurationError
from pipeline.teacher.base import ScoreFailure, ScoreRequest, TeacherBackend, TeacherConfigError, result_problem

#: The fixed sequence the self-test scores (ids below 64 exist in every real vocabulary).
SELF_TEST_TOKENS = np.array([(7 * i + 3) % 64 for i in range(24)], np.int32)


class VocabMismatchError(ConfigurationError, RuntimeError):
    """Teacher and student tokenizers disagree: teacher top-k ids would mean other tokens."""


def _vocab(path: str | Path) -> dict[str, int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    vocab: dict[str, int] = tok.get_vocab()
    return vocab


def check_same_vocab(teacher_tokenizer_path: str | Path, student_tokenizer_path: str | Path, *, show: int = 5) -> None:
    """Raise ``VocabMismatchError`` unless both tokenizers map the same token strings to the same ids."""
    t, s = _vocab(teacher_tokenizer_path), _vocab(student_tokenizer_path)
    if t == s:
        return
    t_by_id = {i: tok for tok, i in t.items()}
    s_by_id = {i: tok for tok, i in s.items()}
    diff = sorted(i for i in set(t_by_id) | set(s_by_id) if t_by_id.get(i) != s_by_id.get(i))
    examples = ", ".join(f"id {i}: teacher {t_by_id.get(i)!r} vs student {s_by_id.get(i)!r}" for i in diff[:show])
    raise VocabMismatchError(
        f"teacher and student vocabularies differ: teacher {len(t)} tokens "
        f"({teacher_tokenizer_path}), student {len(s)} tokens ({student_tokenizer_path}); "
        f"{len(diff)} ids differ, e.g. {examples}"
    )


async def self_test_checksum(backend: TeacherBackend, *, k: int = 5, decimals: int = 2) -> str:
    """Score a fixed sequence and return a 12-hex-digit checksum of its top-k ids and rounded logprobs.

    Replicas of one teacher give the same checksum; log it at start so disagreeing ones show up. A wrong
    answer (misaligned, or a logprob that is NaN, infinite, above 0 or a sentinel such as vLLM's -9999) raises
    ``TeacherConfigError``: the worker refuses to start (exit 2) instead of dropping every group. A failure a
    retry may cure (a timeout, a 5xx) raises ``RuntimeError``.
    """
    req = ScoreRequest(SELF_TEST_TOKENS, max(1, min(k, backend.max_k)))
    (out,) = await backend.score([req])
    if isinstance(out, ScoreFailure):
        if out.retryable:
            raise RuntimeError(f"teacher self-test failed: {out.reason}")
        raise TeacherConfigError(f"teacher self-test failed: {out.reason}")
    problem = result_problem(req, out)
    if problem is not None:
        raise TeacherConfigError(f"teacher self-test answer refused: {problem}")
    h = hashlib.sha256()
    h.update(np.ascontiguousarray(out.topk_ids, "<i4").tobytes())
    for a in (out.topk_logprobs, out.sampled_logprobs):
        # +0.0 turns -0.0 into 0.0 so the hash does not depend on the sign of zero.
        h.update((np.round(a.astype(np.float64), decimals) + 0.0).astype("<f8").tobytes())
    return h.hexdigest()[:12]
