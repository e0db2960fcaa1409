"""Teacher backend protocol and the request/result types every backend speaks.

Results use distillq's logits-aligned convention (see ``schemas.messages``): for a request of ``L``
tokens, row ``r`` is the teacher distribution of token ``r + 1`` given ``tokens[:r + 1]``. A request
names the rows it wants (``ScoreRequest.rows``, the rows the learner trains on); a result holds those
rows only, in that order, so a backend never needs ``[L, V]`` for prompt, earlier-turn or tool-output
positions.

Every answer goes through ``result_problem`` (the scoring stage for each sequence, the worker's start-up
self-test): shapes, then the values, then the row order. A NaN, an infinity, a logprob above 0 or at/below the
floor (vLLM's -9999.0 for -inf; ``schemas.validate.LOGPROB_FLOOR``) is ``invalid_logprobs: ...`` naming the
array, the row, the token it predicts and the value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from pipeline.errors import ConfigurationError
from schemas.validate import Limits, logprob_fault, teacher_logprob_problem

#: Failure reasons that mean "the answer is wrong", not "the teacher is down".
MISALIGNED = "misaligned"
K_OVER_CAP = "k_over_cap"
INVALID_LOGPROBS = "invalid_logprobs"
#: Every such reason's prefix: never retried, never counted against the backend's health.
ANSWER_PROBLEMS = (MISALIGNED, K_OVER_CAP, INVALID_LOGPROBS)
_LIMITS = Limits()


class TeacherConfigError(ConfigurationError, RuntimeError):
    """The teacher cannot serve this configuration (e.g. k above the server's cap); do not start."""


@dataclass(frozen=True, slots=True)
class ScoreRequest:
    """One sequence to score: ``tokens`` int32 ``[L]``, ``k`` top-k entries per row.

    ``rows``: the logits-aligned rows wanted, int32, strictly increasing, each in ``[0, L - 1)``; ``None``
    means all ``L - 1``. Row ``r`` predicts ``tokens[r + 1]``.
    """

    tokens: npt.NDArray[np.int32]
    k: int
    rows: npt.NDArray[np.int32] | None = None

    @property
    def n_rows(self) -> int:
        """How many rows the result must have."""
        if self.rows is not None:
            return int(self.rows.shape[0])
        return max(int(self.tokens.shape[0]) - 1, 0)

    def row_index(self) -> npt.NDArray[np.int32]:
        """The rows wanted, as an array (``arange(L - 1)`` when ``rows`` is ``None``)."""
        if self.rows is not None:
            return self.rows
        return np.arange(self.n_rows, dtype=np.int32)

    @property
    def first_row(self) -> int:
        """The first row wanted (``L - 1`` when none is): tokens before ``first_row + 1`` are context only."""
        if self.rows is None:
            return 0
        return int(self.rows[0]) if self.rows.shape[0] else max(int(self.tokens.shape[0]) - 1, 0)


@dataclass(frozen=True, slots=True)
class ScoreResult:
    """Teacher view of one sequence at the request's rows ``R`` (all ``L - 1`` when it names none):
    ``[R, k]`` top-k ids and logprobs (sorted desc), ``[R]`` logprobs of the sampled tokens."""

    topk_ids: npt.NDArray[np.int32]
    topk_logprobs: npt.NDArray[np.float32]
    sampled_logprobs: npt.NDArray[np.float32]


@dataclass(frozen=True, slots=True)
class ScoreFailure:
    """A request that produced no result. ``retryable``: timeouts, 5xx, lost connections. ``timeout_s``: set
    when the backend took the request but gave no answer within this many seconds (slow, not unreachable)."""

    reason: str
    retryable: bool
    timeout_s: float | None = None


ScoreOutcome = ScoreResult | ScoreFailure


class TeacherBackend(Protocol):
    """A teacher model behind some transport. ``score`` returns one outcome per request, in order,
    and reports per-request problems as ``ScoreFailure`` instead of raising."""

    @property
    def identity(self) -> str: ...

    @property
    def max_k(self) -> int: ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def score(self, reqs: list[ScoreRequest]) -> list[ScoreOutcome]: ...


def plan_chunks(lengths: list[int], max_batch_tokens: int) -> list[list[int]]:
    """Indices grouped into chunks, longest first, each with ``len(chunk) * longest <= budget``
    (a single sequence above the budget forms its own chunk)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    chunks: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        longest = lengths[cur[0]] if cur else lengths[i]
        if cur and (len(cur) + 1) * longest > max_batch_tokens:
            chunks.append(cur)
            cur = []
        cur.append(i)
    if cur:
        chunks.append(cur)
    return chunks


def rows_problem(req: ScoreRequest) -> str | None:
    """Why ``req.rows`` is unusable (not 1-D integers, strictly increasing, in ``[0, L - 1)``), or None."""
    rows = req.rows
    if rows is None:
        return None
    n = int(req.tokens.shape[0])
    if rows.ndim != 1 or not np.issubdtype(rows.dtype, np.integer):
        return f"rows must be a 1-D integer array, got {rows.dtype} of shape {rows.shape}"
    if rows.shape[0] and (int(rows[0]) < 0 or int(rows[-1]) >= n - 1):
        return f"rows outside [0, {n - 1})"
    if rows.shape[0] > 1 and not bool((np.diff(rows.astype(np.int64)) > 0).all()):
        return "rows not strictly increasing"
    return None


def result_problem(
    req: ScoreRequest, res: ScoreResult, *, values: bool = True, limits: Limits = _LIMITS
) -> str | None:
    """Why ``res`` cannot be the answer to ``req`` (a ``misaligned: ...`` or ``invalid_logprobs: ...``
    reason), or ``None``.

    Always: the shapes, every logprob valid (``logprob_problem``), and every top-k row sorted descending (all
    rows, not a sample). With ``values`` (the default) also: ids non-negative. ``Scorer`` passes
    ``values=False`` because it validates the encoded payload with ``schemas.validate.validate_teacher_part``
    next, which checks the ids (against the vocabulary too) on the bytes that go on the wire.
    """
    rows, k = req.n_rows, req.k
    ids, lps, sampled = res.topk_ids, res.topk_logprobs, res.sampled_logprobs
    if ids.shape != (rows, k) or lps.shape != (rows, k):
        return f"{MISALIGNED}: top-k shapes {ids.shape}/{lps.shape}, expected {(rows, k)}"
    if sampled.shape != (rows,):
        return f"{MISALIGNED}: sampled shape {sampled.shape}, expected {(rows,)}"
    bad = logprob_problem(req, res, limits)
    if bad is not None:
        return bad
    if values and ids.size and int(ids.min()) < 0:
        return f"{MISALIGNED}: negative token id"
    if not rows_sorted(lps):
        return f"{MISALIGNED}: top-k rows not sorted descending"
    return None


def logprob_problem(req: ScoreRequest, res: ScoreResult, limits: Limits = _LIMITS) -> str | None:
    """``invalid_logprobs: <array> row <r>[, entry <j>] (token <r + 1>) is <value>: <why>`` for the first
    logprob of ``res`` (shapes already checked against ``req``) that is NaN, infinite, above 0 or at/below
    ``limits.logprob_floor``; None when every one is valid."""
    for field, a in (("sampled_logprobs", res.sampled_logprobs), ("topk_logprobs", res.topk_logprobs)):
        bad = teacher_logprob_problem(a, limits)
        if bad is None:
            continue
        i, v = bad
        j, entry = divmod(i, a.shape[1]) if a.ndim == 2 else (i, None)
        row = int(req.row_index()[j])
        at = f"row {row}" if entry is None else f"row {row}, entry {entry}"
        return f"{INVALID_LOGPROBS}: {field} {at} (token {row + 1}) is {v:g}: {logprob_fault(v, limits)}"
    return None


def rows_sorted(lps: npt.NDArray[np.floating]) -> bool:
    """Every row of ``lps`` (``[rows, k]``) is non-increasing; False if any entry is NaN.

    One comparison over the flattened array, neighbours ``(j, j + 1)``, with the pairs that straddle
    two rows (``j = k - 1, 2k - 1, ...``) then set true: no float temporary, and a contiguous pass
    (about 5x faster than ``np.diff(lps, axis=1) > 0`` on ``[1023, 20]``).
    """
    if lps.ndim != 2 or lps.shape[1] < 2 or lps.size == 0:
        return True
    k = lps.shape[1]
    flat = lps.reshape(-1)  # a view when contiguous (the usual case), else a copy
    ok = flat[1:] <= flat[:-1]
    ok[k - 1 :: k] = True
    return bool(ok.all())


def empty_result(k: int) -> ScoreResult:
    """The result for a one-token sequence: no rows."""
    return ScoreResult(np.zeros((0, k), np.int32), np.zeros((0, k), np.float32), np.zeros(0, np.float32))
