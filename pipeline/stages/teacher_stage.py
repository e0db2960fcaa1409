"""The teacher-scoring stage: ``Scorer`` results turned into run-loop outcomes, with metrics."""

from __future__ import annotations

import time
from collections.abc import Sequence

from pipeline import metrics
from pipeline.stages.runloop import DeadLetter, Emit, Outcome
from pipeline.stages.scoring import Scorer
from schemas import DistillStatus, RolloutGroup

#: Calls in a row that all timed out, at least, for a teacher to count as unhealthy (``--check`` answers 1).
ALL_TIMED_OUT = 3


class TeacherStage:
    """Scores each read batch of groups together. Dropped payloads flow on (or go to the DLQ)."""

    name = "teacher"

    def __init__(self, scorer: Scorer, *, drops_to_dlq: bool = False) -> None:
        self.scorer = scorer
        self.drops_to_dlq = drops_to_dlq
        scorer.stats.latency_hooks.append(metrics.TEACHER_LATENCY.observe)

    def report(self) -> dict[str, object]:
        """Figures for the heartbeat: groups by status, drops by reason (``invalid_logprobs``, ``teacher_error``,
        ...), tokens scored, ``clamped_k`` (groups whose k was clamped to the teacher's cap), ``unhealthy`` (read
        by ``--check`` and ``distillq stats``) while the backend's latest calls all failed for a reason other than
        a timeout (connection refused, an error status, an engine gone) or while the last ``ALL_TIMED_OUT`` or more
        calls all timed out (it answers nothing in time), and ``slow`` while any of the last ``SLOW_WINDOW`` calls
        timed out (the backend took the request but answered too late; alone, not unhealthy). A teacher
        of another tokenizer adds ``cross_aligned_share`` (the share of trained tokens in aligned chunks with teacher
        signal), ``cross_topk_mapped_share`` (the share of the teacher's top-k probability mass, at the rows
        looked up, that mapped to student ids) and ``cross_fallback_bytes`` (trained bytes that were not UTF-8
        text, scored as the teacher's single-byte tokens)."""
        st = self.scorer.stats
        unhealthy = (f"teacher backend failing: last {st.failing_calls} call(s) failed, latest: "
                     f"{st.last_backend_error}") if st.failing_calls else None
        slow_calls = sum(st.timed_out_calls)
        slow = (f"teacher slow: {slow_calls} of the last {len(st.timed_out_calls)} calls timed out after "
                f"{st.timeout_s:g} s") if slow_calls and st.timeout_s is not None else None
        in_a_row = next((i for i, t in enumerate(reversed(st.timed_out_calls)) if not t), len(st.timed_out_calls))
        if unhealthy is None and slow is not None and in_a_row >= ALL_TIMED_OUT:
            unhealthy = (f"teacher backend answers nothing in time: the last {in_a_row} calls all timed out "
                         f"after {st.timeout_s:g} s")  # slow is one thing; no answer at all is a failing backend
        out: dict[str, object] = {
            "pool": self.scorer.pool, "model": self.scorer.identity, "status": dict(st.groups),
            "drops": dict(st.reasons), "tokens_scored": st.tokens_scored, "clamped_k": st.clamped_groups,
            "unhealthy": unhealthy, "slow": slow}
        if self.scorer.cross is not None:  # a teacher of another tokenizer: how much of its signal reaches the student
            out["cross_aligned_share"] = round(st.cross_aligned / st.cross_trained, 4) if st.cross_trained else None
            out["cross_topk_mapped_share"] = (round(st.cross_mapped_mass / st.cross_topk_mass, 4)
                                              if st.cross_topk_mass else None)
            out["cross_fallback_bytes"] = st.cross_fallback_bytes
        return out

    async def handle(self, msgs: Sequence[RolloutGroup]) -> Sequence[Outcome]:
        t0 = time.perf_counter()
        st = self.scorer.stats
        before = (st.cross_trained, st.cross_aligned, st.cross_topk_mass, st.cross_mapped_mass)
        scored = await self.scorer.score_groups(list(msgs))
        if self.scorer.cross is not None:
            self._count_cross(before)
        out: list[Outcome] = []
        for s in scored:
            metrics.TEACHER_GROUPS.labels(s.status.value).inc()
            metrics.POOL_GROUPS.labels(s.pool, s.status.value).inc()
            if s.status is DistillStatus.OK:
                metrics.TEACHER_TOKENS.inc(s.group.num_tokens)
                metrics.POOL_TOKENS.labels(s.pool).inc(s.group.num_tokens)
            elif s.status is DistillStatus.DROPPED:
                metrics.TEACHER_DROPS.labels((s.reason or "unknown").split(":", 1)[0]).inc()
            if self.drops_to_dlq and s.status is DistillStatus.DROPPED:
                out.append(DeadLetter(f"teacher_dropped: {s.reason}"))
            else:
                out.append(Emit(s))
        metrics.STAGE_LATENCY.labels("teacher_score").observe(time.perf_counter() - t0)
        return out

    def _count_cross(self, before: tuple[int, int, float, float]) -> None:
        """The cross-tokenizer figures of the groups just scored (``ScoringStats.cross_*`` since ``before``)."""
        st, pool = self.scorer.stats, self.scorer.pool
        trained, aligned, total, mapped = before
        metrics.TEACHER_CROSS_TOKENS.labels(pool, "trained").inc(st.cross_trained - trained)
        metrics.TEACHER_CROSS_TOKENS.labels(pool, "aligned").inc(st.cross_aligned - aligned)
        metrics.TEACHER_CROSS_TOPK_MASS.labels(pool, "total").inc(max(st.cross_topk_mass - total, 0.0))
        metrics.TEACHER_CROSS_TOPK_MASS.labels(pool, "mapped").inc(max(st.cross_mapped_mass - mapped, 0.0))
