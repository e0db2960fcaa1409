"""Teacher backends: score token sequences, return top-k prompt logprobs (logits-aligned)."""

from pipeline.teacher.base import (
    K_OVER_CAP,
    MISALIGNED,
    ScoreFailure,
    ScoreOutcome,
    ScoreRequest,
    ScoreResult,
    TeacherBackend,
    TeacherConfigError,
    result_problem,
)

__all__ = [
    "K_OVER_CAP",
    "MISALIGNED",
    "ScoreFailure",
    "ScoreOutcome",
    "ScoreRequest",
    "ScoreResult",
    "TeacherBackend",
    "TeacherConfigError",
    "result_problem",
]
