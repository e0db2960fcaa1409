"""Teacher scoring stage logic (no Redis): rollout groups in, scored groups out, same order.

Rules (the reference system's, made explicit):

* ``group.discard`` -> SKIPPED ``discarded``; never sent to the teacher.
* ``group_overrides.skip_teacher_top_k`` true -> SKIPPED ``skip_teacher_top_k``.
* ``group_overrides.teacher_top_k <= -1`` -> SKIPPED ``teacher_top_k=-1: no teacher`` (the Atropos rule;
  ``schemas.build.no_teacher_reason``, shared with the Atropos conversion).
* k = ``group_overrides.teacher_top_k`` if present (0 raised to 1), else ``default_k``. Above the
  teacher's cap: ``k_over_cap="clamp"`` uses the cap (recorded in ``ScoredGroup.k``), ``"drop"`` drops
  the group's payload with reason ``k_over_cap: ...``.
* Each sequence asks for the teacher rows the learner trains on (row ``r`` where ``loss_mask[r + 1]`` is 1;
  ``rows="all"`` asks for every row) and its payload holds those rows only (``TeacherPayload.rows``).
  A sequence with no trained row needs no teacher call.
* Sequences of all groups are packed into backend calls of at most ``max_batch_tokens`` padded tokens.
  Retryable failures are retried (bounded, exponential backoff with a cap); if any sequence of a group
  still fails, or comes back misaligned, the whole group is DROPPED with the reason and no payload, and
  is still returned.

Each teacher answer is checked once. Per sequence, as it arrives (``result_problem(values=False)``, the
one check every backend's answers go through): the shapes and that every top-k row is sorted (all rows) ->
``misaligned: ... (sequence i)``; every logprob finite, at most 0 and above the floor (vLLM's -9999.0 for
-inf is a sentinel, not a logprob) -> ``invalid_logprobs: <array> row r (token r+1) is v: <why> (sequence
i)``. Either drops the whole group's payload, is never retried, and is counted by its category. Per group,
on the encoded payload (``schemas.validate.validate_teacher_part``, what the feeder checks): payload
count and k, shapes, finite logprobs, ids ``>= 0`` (and below ``limits.vocab_size`` when set) and the
position-convention spot check -> ``misaligned: scored.teacher[i].<field>: <reason>``. The rollout half
is not re-validated here: the groups come from ``decode``, which validated them (callers that build
groups in process must pass valid ones).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import numpy as np
import numpy.typing as npt
import structlog

from pipeline.backoff import BackoffPolicy
from pipeline.teacher.base import (
    ANSWER_PROBLEMS,
    INVALID_LOGPROBS,
    K_OVER_CAP,
    MISALIGNED,
    ScoreFailure,
    ScoreOutcome,
    ScoreRequest,
    ScoreResult,
    TeacherBackend,
    empty_result,
    plan_chunks,
    result_problem,
)
from pipeline.teacher.crosstok import RoundTripError
from schemas.build import make_teacher, no_teacher_reason, trained_rows
from schemas.messages import (
    BASE_SCHEMA,
    SCHEMA_VERSION,
    DistillStatus,
    RolloutGroup,
    ScoredGroup,
    Sequence,
    TeacherPayload,
)
from schemas.pools import DEFAULT_POOL
from schemas.validate import DecodeError, InvalidLogprobs, Limits, validate_teacher_part

if TYPE_CHECKING:
    from pipeline.teacher.crossscore import CrossPlan, CrossStats, CrossTokenizer

log = structlog.get_logger(__name__)
#: Backend calls the ``slow`` figure looks back over.
SLOW_WINDOW = 10

SKIP_REASON = "skip_teacher_top_k"
DISCARD_REASON = "discarded"


@dataclass(frozen=True, slots=True)
class ScoringConfig:
    """How the scoring stage calls its teacher."""

    default_k: int = 20
    max_batch_tokens: int = 16384  # padded tokens (rows x longest) per backend call
    retries: int = 3  # extra attempts for retryable failures
    backoff_base_s: float = 0.5
    backoff_max_s: float = 8.0
    k_over_cap: Literal["clamp", "drop"] = "clamp"
    fp16_topk: bool = False  # store top-k logprobs as float16 on the wire
    concurrent_calls: int = 1  # backend calls in flight at once, over all batches (raise for HTTP teachers)
    rows: Literal["trained", "all"] = "trained"  # teacher rows scored and shipped per sequence

    def __post_init__(self) -> None:
        if self.default_k < 1:
            raise ValueError("default_k must be >= 1")
        if self.max_batch_tokens < 1 or self.retries < 0 or self.concurrent_calls < 1:
            raise ValueError("max_batch_tokens and concurrent_calls must be >= 1, retries >= 0")
        if self.k_over_cap not in ("clamp", "drop"):
            raise ValueError(f"k_over_cap must be 'clamp' or 'drop', got {self.k_over_cap!r}")
        if self.rows not in ("trained", "all"):
            raise ValueError(f"rows must be 'trained' or 'all', got {self.rows!r}")

    def backoff(self, attempt: int) -> float:
        """Delay before retry number ``attempt`` (1-based): ``pipeline.backoff``'s policy, so teacher workers
        that failed together do not retry together (full jitter under ``backoff_base_s * 2**(attempt-1)``,
        at most ``backoff_max_s``)."""
        return BackoffPolicy(self.backoff_base_s, self.backoff_max_s).delay(attempt)


@dataclass
class ScoringStats:
    """Outcome counters; the worker exports them as metrics. Reasons are counted by their category
    (the text before the first ':'), so the label set stays small."""

    groups: Counter[str] = field(default_factory=Counter)  # by DistillStatus value
    reasons: Counter[str] = field(default_factory=Counter)  # by reason category
    sequences_scored: int = 0
    tokens_scored: int = 0
    rows_scored: int = 0  # teacher rows requested and shipped (``tokens_scored - rows_scored``: context only)
    teacher_calls: int = 0
    retries: int = 0
    clamped_groups: int = 0  # groups whose k was clamped to the teacher's cap (``k_over_cap="clamp"``)
    failing_calls: int = 0  # backend calls in a row that failed as a whole, not by a timeout (0 after any other)
    last_backend_error: str | None = None  # the latest such failure
    # Per backend call of the last SLOW_WINDOW: whether a request of it timed out (the backend took it and did
    # not answer in time: slow, not unreachable), and the latest such timeout.
    timed_out_calls: deque[bool] = field(default_factory=lambda: deque(maxlen=SLOW_WINDOW))
    timeout_s: float | None = None
    latencies_s: deque[float] = field(default_factory=lambda: deque(maxlen=1024))
    latency_hooks: list[Callable[[float], None]] = field(default_factory=list)
    # A teacher of another tokenizer (``Scorer(cross=...)``), over its OK groups: trained tokens, those in aligned
    # chunks with teacher signal, and the teacher's top-k probability mass at the rows looked up, and what mapped.
    cross_trained: int = 0
    cross_aligned: int = 0
    cross_topk_mass: float = 0.0
    cross_mapped_mass: float = 0.0
    cross_fallback_bytes: int = 0  # trained bytes not UTF-8 text, scored as the teacher's single-byte tokens

    def observe_latency(self, seconds: float) -> None:
        self.latencies_s.append(seconds)
        for hook in self.latency_hooks:
            hook(seconds)

    def count(self, status: DistillStatus, reason: str | None) -> None:
        self.groups[status.value] += 1
        if reason:
            self.reasons[reason.split(":", 1)[0]] += 1


@dataclass
class _Item:
    """One sequence awaiting the teacher."""

    group: int
    seq: int
    req: ScoreRequest
    plan: CrossPlan | None = None  # a teacher of another tokenizer: ``req`` is over its ids


def _cut(items: list[_Item], max_batch_tokens: int) -> list[list[_Item]]:
    """Items sorted longest first, cut into calls of at most ``max_batch_tokens`` padded tokens."""
    return [[items[i] for i in chunk] for chunk in plan_chunks([_length(it) for it in items], max_batch_tokens)]


def _length(it: _Item) -> int:
    return int(it.req.tokens.shape[0])


def pack(items: list[_Item], max_batch_tokens: int) -> list[list[_Item]]:
    """Calls of at most ``max_batch_tokens`` padded tokens (rows x longest row; one sequence above the
    budget goes alone). A group's sequences stay in one call whenever the group fits the budget, so a
    backend can compute their shared prompt once; groups are placed longest first, and a group larger
    than the budget is cut on its own, longest sequences first."""
    by_group: dict[int, list[_Item]] = {}
    for it in items:
        by_group.setdefault(it.group, []).append(it)
    groups = sorted((sorted(g, key=lambda i: -_length(i)) for g in by_group.values()), key=lambda g: -_length(g[0]))
    calls: list[list[_Item]] = []
    cur: list[_Item] = []
    for g in groups:
        if len(g) * _length(g[0]) > max_batch_tokens:
            calls += _cut(g, max_batch_tokens)
            continue
        if cur and (len(cur) + len(g)) * _length(cur[0]) > max_batch_tokens:  # cur[0] is the call's longest
            calls.append(cur)
            cur = []
        cur += g
    if cur:
        calls.append(cur)
    return calls


def _request(seq: Sequence, k: int, all_rows: bool) -> ScoreRequest:
    arr: npt.NDArray[np.int32] = seq.tokens.numpy().astype(np.int32, copy=False)
    return ScoreRequest(arr, k, None if all_rows else trained_rows(seq))


def _failure_reason(f: ScoreFailure) -> str:
    if f.reason.startswith(ANSWER_PROBLEMS):
        return f.reason
    return f"teacher_error: {f.reason}"


class Scorer:
    """Scores rollout groups with a ``TeacherBackend`` (started by the caller)."""

    def __init__(
        self,
        backend: TeacherBackend,
        config: ScoringConfig | None = None,
        *,
        stats: ScoringStats | None = None,
        limits: Limits | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        clock: Callable[[], float] = time.time,
        pool: str = DEFAULT_POOL,
        cross: CrossTokenizer | None = None,
    ) -> None:
        self.backend = backend
        #: a teacher of another tokenizer: each sequence is converted to the teacher's ids and its answer mapped
        #: back into student positions (``pipeline.teacher.crossscore``)
        self.cross = cross
        self.pool = pool  # recorded on every group it scores (``ScoredGroup.pool``)
        self.config = config or ScoringConfig()
        self.limits = limits or Limits(max_k=max(256, self.config.default_k))
        self.stats = stats or ScoringStats()
        self._sleep = sleep
        self._clock = clock
        # One limit on backend calls for the whole Scorer: a worker with two read batches in flight (the
        # default, so that one batch's outputs are written while the next is scored) still sends at most
        # ``concurrent_calls`` calls at once. Made per event loop (a semaphore binds to its loop).
        self._calls: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore] | None = None

    def group_k(self, group: RolloutGroup) -> tuple[int, str | None]:
        """``(k, None)`` with the k to use for ``group``, or ``(k, reason)`` when it must be dropped."""
        raw = group.overrides.get("teacher_top_k")
        if raw is not None and (not isinstance(raw, int) or isinstance(raw, bool)):
            return 0, f"bad_override: teacher_top_k={raw!r} is not an integer"
        k = self.config.default_k if raw is None else max(1, raw)
        cap = self.backend.max_k
        if cap >= 1:  # readers refuse a k above limits.max_k (DISTILLQ_MAX_K): never ask for more
            cap = min(cap, self.limits.max_k)
        if 1 <= cap < k:  # cap 0: backend not started; it refuses the requests itself
            if self.config.k_over_cap == "drop":
                return k, f"{K_OVER_CAP}: requested k={k} above the teacher cap {cap}"
            self.stats.clamped_groups += 1
            log.info("teacher_k_clamped", group_id=group.group_id, asked_k=k, used_k=cap)
            k = cap
        return k, None

    async def score_groups(self, groups: list[RolloutGroup]) -> list[ScoredGroup]:
        """Score ``groups``; one ``ScoredGroup`` per input, same order. Never raises for a teacher error."""
        ks: list[int] = [0] * len(groups)
        done: dict[int, tuple[DistillStatus, str]] = {}
        items: list[_Item] = []
        for g, group in enumerate(groups):
            if group.discard:
                done[g] = (DistillStatus.SKIPPED, DISCARD_REASON)
            elif group.overrides.get(SKIP_REASON):
                done[g] = (DistillStatus.SKIPPED, SKIP_REASON)
            elif (no_teacher := no_teacher_reason(group.group_overrides)) is not None:
                done[g] = (DistillStatus.SKIPPED, no_teacher)
            else:
                ks[g], drop = self.group_k(group)
                if drop is not None:
                    done[g] = (DistillStatus.DROPPED, drop)
                    continue
                if self.cross is not None:
                    try:
                        items += self._cross_items(g, group, ks[g])
                    except RoundTripError as e:  # the reason starts with ``cross_tokenizer:``
                        done[g] = (DistillStatus.DROPPED, str(e))
                    continue
                all_rows = self.config.rows == "all"
                items += [_Item(g, s, _request(seq, ks[g], all_rows)) for s, seq in enumerate(group.sequences)]
        results = await self._score_items(items, done)
        payloads: dict[int, list[TeacherPayload]] = {}
        cross: dict[int, CrossStats] = {}
        fp16 = self.config.fp16_topk
        for it in items:
            if it.group in done:
                continue
            res = results[(it.group, it.seq)]
            if it.plan is not None:
                payload, st = it.plan.payload(res, fp16=fp16)
                payloads.setdefault(it.group, []).append(payload)
                cross[it.group] = cross[it.group] + st if it.group in cross else st
                continue
            payloads.setdefault(it.group, []).append(
                make_teacher(res.topk_ids, res.topk_logprobs, res.sampled_logprobs, fp16=fp16, rows=it.req.rows)
            )
        return [self._finish(g, group, ks[g], done.get(g), payloads.get(g), cross.get(g))
                for g, group in enumerate(groups)]

    def _cross_items(self, g: int, group: RolloutGroup, k: int) -> list[_Item]:
        """The group's sequences converted to the teacher's tokenizer (``RoundTripError`` names the sequence)."""
        assert self.cross is not None
        out = []
        for s, seq in enumerate(group.sequences):
            try:
                plan = self.cross.convert(seq.tokens.numpy(), seq.loss_mask.numpy(), k)
            except RoundTripError as e:
                raise RoundTripError(f"{e} (sequence {s})") from None
            out.append(_Item(g, s, plan.request, plan))
        return out

    @property
    def identity(self) -> str:
        """The backend's identity, with the teacher's tokenizer when it differs from the student's."""
        ident = self.backend.identity
        return f"{ident} tokenizer={self.cross.name}" if self.cross is not None else ident

    def _finish(
        self,
        g: int,
        group: RolloutGroup,
        k: int,
        outcome: tuple[DistillStatus, str] | None,
        payload: list[TeacherPayload] | None,
        cross: CrossStats | None = None,
    ) -> ScoredGroup:
        now = self._clock()
        ident = self.identity
        if outcome is None:
            assert payload is not None and len(payload) == len(group.sequences)
            scored = ScoredGroup(
                group=group, status=DistillStatus.OK, teacher=payload, k=k, teacher_id=ident, scored_at=now,
                pool=self.pool, schema=SCHEMA_VERSION if self.cross is not None else BASE_SCHEMA,
            )
            try:  # what the feeder will check of the teacher half: a bad payload is dropped, not emitted
                validate_teacher_part(scored, self.limits)
            except DecodeError as e:  # InvalidLogprobs here: a value float16 rounded onto the floor
                category = INVALID_LOGPROBS if isinstance(e, InvalidLogprobs) else MISALIGNED
                outcome = (DistillStatus.DROPPED, f"{category}: {e}")
            else:
                self.stats.count(DistillStatus.OK, None)
                self.stats.sequences_scored += len(payload)
                self.stats.tokens_scored += group.num_tokens
                self.stats.rows_scored += sum(p.topk_ids.shape[0] for p in payload)
                if cross is not None:
                    st = self.stats
                    st.cross_trained += cross.trained
                    st.cross_aligned += cross.aligned
                    st.cross_topk_mass += cross.topk_mass
                    st.cross_mapped_mass += cross.mapped_mass
                    st.cross_fallback_bytes += cross.fallback_bytes
                    if cross.fallback_bytes:
                        log.info("cross_byte_fallback", group_id=group.group_id, fallback_bytes=cross.fallback_bytes)
                return scored
        status, reason = outcome
        self.stats.count(status, reason)
        if status is DistillStatus.DROPPED:
            log.warning("teacher_payload_dropped", group_id=group.group_id, reason=reason)
        return ScoredGroup(group=group, status=status, reason=reason, k=k, teacher_id=ident, scored_at=now,
                           pool=self.pool)

    async def _score_items(
        self, items: list[_Item], done: dict[int, tuple[DistillStatus, str]]
    ) -> dict[tuple[int, int], ScoreResult]:
        """Results by (group, seq); groups that fail are added to ``done`` as DROPPED."""
        results: dict[tuple[int, int], ScoreResult] = {}
        pending = []
        for it in items:  # nothing to ask the teacher for a sequence without a trained row
            if it.req.n_rows == 0:
                results[(it.group, it.seq)] = empty_result(it.req.k)
            else:
                pending.append(it)
        for attempt in range(self.config.retries + 1):
            if attempt:
                self.stats.retries += len(pending)
                await self._sleep(self.config.backoff(attempt))
            retry: list[_Item] = []
            for it, out in await self._run_calls(pending):
                if it.group in done:
                    continue
                if isinstance(out, ScoreResult):
                    problem = result_problem(it.req, out, values=False, limits=self.limits)
                    if problem is None:
                        results[(it.group, it.seq)] = out
                        continue
                    fail = ScoreFailure(problem, retryable=False)
                else:
                    fail = out
                if fail.retryable and attempt < self.config.retries:
                    retry.append(it)
                else:
                    done[it.group] = (DistillStatus.DROPPED, f"{_failure_reason(fail)} (sequence {it.seq})")
            pending = [it for it in retry if it.group not in done]
            if not pending:
                break
        return results

    def _backend_health(self, outs: list[ScoreOutcome]) -> None:
        """Count calls in a row whose every request failed for a reason other than the answer's content or a
        timeout (the backend down or erroring); log ``teacher_backend_failing`` when such a run starts and
        ``teacher_backend_recovered`` when it ends. A call with a timed-out request counts as slow
        (``timed_out_calls``; ``teacher_backend_slow`` when the window had none before): the backend took it."""
        failed = [o for o in outs if isinstance(o, ScoreFailure) and not o.reason.startswith(ANSWER_PROBLEMS)]
        timed = [f.timeout_s for f in failed if f.timeout_s is not None]
        st = self.stats
        if timed and not any(st.timed_out_calls):
            log.warning("teacher_backend_slow", timeout_s=timed[0], timed_out=len(timed), requests=len(outs),
                        hint="the teacher takes the requests but answers none in time: raise --timeout or add capacity")
        st.timed_out_calls.append(bool(timed))
        if timed:
            st.timeout_s = timed[0]
        if outs and len(failed) == len(outs) and len(timed) < len(failed):
            st.failing_calls += 1
            st.last_backend_error = next(f for f in failed if f.timeout_s is None).reason[:300]
            if st.failing_calls == 1:
                log.warning("teacher_backend_failing", error=st.last_backend_error,
                            hint="groups lose their teacher payload (teacher_error) until it answers again")
        elif st.failing_calls:
            log.warning("teacher_backend_recovered", failed_calls=st.failing_calls)
            st.failing_calls = 0

    def _call_limit(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if self._calls is None or self._calls[0] is not loop:
            self._calls = (loop, asyncio.Semaphore(self.config.concurrent_calls))
        return self._calls[1]

    async def _run_calls(self, items: list[_Item]) -> list[tuple[_Item, ScoreOutcome]]:
        sem = self._call_limit()

        async def call(batch: list[_Item]) -> list[tuple[_Item, ScoreOutcome]]:
            async with sem:
                t0 = time.perf_counter()
                try:
                    outs = await self.backend.score([it.req for it in batch])
                except Exception as e:  # a backend bug or outage must not kill the stage
                    log.exception("teacher_call_failed", sequences=len(batch))
                    outs = [ScoreFailure(f"{type(e).__name__}: {e}", retryable=True)] * len(batch)
                self.stats.teacher_calls += 1
                self.stats.observe_latency(time.perf_counter() - t0)
                self._backend_health(outs)
            if len(outs) != len(batch):
                outs = [ScoreFailure(f"{MISALIGNED}: {len(outs)} results for {len(batch)} requests", False)] * len(
                    batch
                )
            return list(zip(batch, outs, strict=True))

        done = await asyncio.gather(*(call(b) for b in pack(items, self.config.max_batch_tokens)))
        return [pair for batch in done for pair in batch]
