"""State of the student server: one tree-mode tracker per rollout, and groups waiting for their rollouts.

A rollout is identified by its ``X-Session-ID`` header (verifiers sends its trace id, the same on every
turn). ``SessionStore`` keeps one ``Session`` per id, bounded two ways so rollouts that are never
finished cannot hold memory forever: a session idle for ``ttl_s`` is evicted by ``sweep``, and creating
one beyond ``max_sessions`` evicts the least recently used. Every eviction is logged
(``student.session_evicted``) and counted (``distillq_student_sessions_evicted_total{reason}``); the ids
of recently evicted sessions are remembered so a late finish gets a clear answer.

``GroupAssembler`` collects finished rollouts per task until ``group_size`` of them are in, then builds
one ``RolloutGroup`` holding every branch of every rollout. A task whose group stays incomplete for
``ttl_s`` is flushed as a partial group (``metadata["partial"] = True``) rather than dropped.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

import structlog

from pipeline.metrics import STUDENT_GROUPS as GROUPS_BUILT
from pipeline.metrics import STUDENT_SESSIONS as SESSIONS
from pipeline.metrics import STUDENT_SESSIONS_EVICTED as SESSIONS_EVICTED
from pipeline.rollout.openai_facade import TrackedClient
from pipeline.rollout.tracker import Tracker
from schemas.messages import RolloutGroup
from schemas.messages import Sequence as WireSequence

log = structlog.get_logger(__name__)


#: How many evicted session ids are remembered (to answer a late finish with 410 instead of 404).
EVICTED_MEMORY: Final = 10_000


@dataclass
class Session:
    """One rollout: its tracker (tree mode), sampling parameters, and a chat client when it chats."""

    id: str
    tracker: Tracker
    created: float
    last_seen: float
    requests: int = 0
    generation_params: dict[str, Any] | None = None  # the first request's
    chat: TrackedClient | None = None
    versions: list[int | None] = field(default_factory=list)  # each request's weight version (synced servers)


class SessionStore:
    """Sessions by id, least recently used first; ``clock`` is injectable for tests."""

    def __init__(
        self, *, max_sessions: int = 4096, ttl_s: float = 1800.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if max_sessions < 1 or ttl_s <= 0:
            raise ValueError(f"max_sessions must be >= 1 and ttl_s > 0, got {max_sessions}, {ttl_s}")
        self.max_sessions = max_sessions
        self.ttl_s = ttl_s
        self.clock = clock
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self._evicted: OrderedDict[str, str] = OrderedDict()  # id -> reason

    def __len__(self) -> int:
        return len(self._sessions)

    def touch(self, session_id: str) -> Session:
        """The session ``session_id``, created if new; marks it as just used."""
        now = self.clock()
        s = self._sessions.get(session_id)
        if s is None:
            while len(self._sessions) >= self.max_sessions:
                oldest = next(iter(self._sessions))
                self._evict(oldest, "capacity", now)
            s = Session(session_id, Tracker("tree"), created=now, last_seen=now)
            self._sessions[session_id] = s
            self._evicted.pop(session_id, None)
            SESSIONS.set(len(self._sessions))
        else:
            self._sessions.move_to_end(session_id)
        s.last_seen = now
        return s

    def get(self, session_id: str) -> Session | None:
        return self._sessions.get(session_id)

    def pop(self, session_id: str) -> Session | None:
        s = self._sessions.pop(session_id, None)
        SESSIONS.set(len(self._sessions))
        return s

    def eviction_reason(self, session_id: str) -> str | None:
        """Why ``session_id`` was evicted, if it was recently."""
        return self._evicted.get(session_id)

    def sweep(self) -> list[str]:
        """Evict every session idle for ``ttl_s``; their ids."""
        now = self.clock()
        expired = [sid for sid, s in self._sessions.items() if now - s.last_seen >= self.ttl_s]
        for sid in expired:
            self._evict(sid, "ttl", now)
        return expired

    def _evict(self, session_id: str, reason: str, now: float) -> None:
        s = self._sessions.pop(session_id)
        SESSIONS.set(len(self._sessions))
        SESSIONS_EVICTED.labels(reason).inc()
        self._evicted[session_id] = reason
        while len(self._evicted) > EVICTED_MEMORY:
            self._evicted.popitem(last=False)
        log.warning(
            "student.session_evicted",
            session=session_id,
            reason=reason,
            idle_s=round(now - s.last_seen, 3),
            requests=s.requests,
            sequences=len(s.tracker.leaves()),
        )


@dataclass(frozen=True, slots=True)
class FinishedRollout:
    """A finished rollout's training sequences (one per branch), already carrying its reward."""

    session_id: str
    sequences: list[WireSequence]
    generation_params: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """Where a finished rollout goes: its task and the group it fills."""

    task: str
    group_size: int = 1
    env_id: int = 0
    policy_version: int = 0
    group_overrides: dict[str, Any] | None = None


@dataclass
class _Bucket:
    spec: GroupSpec
    opened: float
    rollouts: list[FinishedRollout] = field(default_factory=list)


def group_id_for(session_ids: list[str]) -> str:
    """A group id derived from its rollouts, so building the same group twice pushes it once."""
    return hashlib.sha256("\n".join(sorted(session_ids)).encode()).hexdigest()[:32]


def build_group(spec: GroupSpec, rollouts: list[FinishedRollout], *, partial: bool = False) -> RolloutGroup:
    """One ``RolloutGroup`` with every sequence of ``rollouts``; metadata maps sequences to sessions."""
    sessions = [r.session_id for r in rollouts]
    return RolloutGroup(
        group_id=group_id_for(sessions),
        sequences=[s for r in rollouts for s in r.sequences],
        env_id=spec.env_id,
        task_id=spec.task,
        policy_version=spec.policy_version,
        created_at=time.time(),
        group_overrides=spec.group_overrides,
        generation_params=next((r.generation_params for r in rollouts if r.generation_params), None),
        metadata={
            "sessions": sessions,
            "sequence_sessions": [r.session_id for r in rollouts for _ in r.sequences],
            "partial": partial,
        },
    )


class GroupAssembler:
    """Finished rollouts per task until their group is full (or ``ttl_s`` passes: a partial group)."""

    def __init__(self, *, ttl_s: float = 1800.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.clock = clock
        self._open: dict[tuple[str, int, int], _Bucket] = {}  # (task, env_id, policy_version)

    def __len__(self) -> int:
        return len(self._open)

    def waiting(self, task: str, env_id: int = 0, policy_version: int = 0) -> int:
        b = self._open.get((task, env_id, policy_version))
        return len(b.rollouts) if b is not None else 0

    def add(self, spec: GroupSpec, rollout: FinishedRollout) -> RolloutGroup | None:
        """Add ``rollout``; the group when this completes it. The first rollout's ``spec`` sizes the group."""
        key = (spec.task, spec.env_id, spec.policy_version)  # a group never mixes weight versions
        b = self._open.get(key)
        if b is None:
            b = self._open[key] = _Bucket(spec, self.clock())
        b.rollouts.append(rollout)
        if len(b.rollouts) < b.spec.group_size:
            return None
        del self._open[key]
        GROUPS_BUILT.labels("full").inc()
        return build_group(b.spec, b.rollouts)

    def expired(self) -> list[RolloutGroup]:
        """Groups open for ``ttl_s``, as partial groups."""
        now = self.clock()
        return self._flush([k for k, b in self._open.items() if now - b.opened >= self.ttl_s])

    def drain(self) -> list[RolloutGroup]:
        """Every open group, as partial groups (at shutdown)."""
        return self._flush(list(self._open))

    def _flush(self, keys: list[tuple[str, int, int]]) -> list[RolloutGroup]:
        out = []
        for key in keys:
            b = self._open.pop(key)
            GROUPS_BUILT.labels("partial").inc()
            log.warning(
                "student.partial_group", task=b.spec.task, rollouts=len(b.rollouts), group_size=b.spec.group_size
            )
            out.append(build_group(b.spec, b.rollouts, partial=True))
        return out
