"""Teacher backend protocol and the request/result types every backend speaks.

Results use distillq's logits-aligned convention (see ``schemas.messages``): for a request of ``L``
tokens, row ``r`` is the teacher distribution of token ``r + 1`` given ``tokens[:r + 1]``. A request
names the rows it wants (``ScoreRequest.rows``, the rows the learner trains on); a result holds those
rows only, in that order, so a backend never needs ``[L, V]`` for prompt, earlier-turn or tool-output
positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from pipeline.errors import ConfigurationError

#: Failure reasons that mean "the answer is wrong", not "the teacher is down".
MISALIGNED = "misaligned"
K_OVER_CAP = "k_over_cap"


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
    """A request that produced no result. ``retryable``: timeouts, 5xx, lost connections."""

    reason: str
    retryable: bool


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


def result_problem(req: ScoreRequest, res: ScoreResult, *, values: bool = True) -> str | None:
    """Why ``res`` cannot be the answer to ``req`` (a ``misaligned: ...`` reason), or ``None``.

    Always: the shapes, and every top-k row sorted descending (all rows, not a sample; a NaN fails
    this and is reported as non-finite logprobs). With ``values`` (the default) also: logprobs finite
    and ids non-negative. ``Scorer`` passes ``values=False`` because it validates the encoded payload
    with ``schemas.validate.validate_teacher_part`` next, which checks those (and ids against the
    vocabulary) on the bytes that go on the wire; checking them here too would read them twice.
    """
    rows, k = req.n_rows, req.k
    ids, lps, sampled = res.topk_ids, res.topk_logprobs, res.sampled_logprobs
    if ids.shape != (rows, k) or lps.shape != (rows, k):
        return f"{MISALIGNED}: top-k shapes {ids.shape}/{lps.shape}, expected {(rows, k)}"
    if sampled.shape != (rows,):
        return f"{MISALIGNED}: sampled shape {sampled.shape}, expected {(rows,)}"
    if values:
        if not (np.isfinite(lps).all() and np.isfinite(sampled).all()):
            return f"{MISALIGNED}: non-finite logprobs"
        if ids.size and int(ids.min()) < 0:
            return f"{MISALIGNED}: negative token id"
    if not rows_sorted(lps):
        if not np.isfinite(lps).all():  # only reachable with values=False
            return f"{MISALIGNED}: non-finite logprobs"
        return f"{MISALIGNED}: top-k rows not sorted descending"
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
