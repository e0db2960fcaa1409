"""Keeping student servers on the newest published weights: the decisions, apart from any HTTP.

A server's weight version is whatever the server says (``GET /weight_info`` on vLLM, ``/get_weight_version``
on SGLang, the adapter name on a LoRA server), never what a worker believes it loaded. A server is in the
rotation (receives requests) only while it answered that it holds the newest version this process has
seen, or a newer one; one that failed to reload, or did not answer, is out until a retry brings it back.

A sample is attributed to one version only if every request that produced it ran on that version: each
request reads the server's version before and after (a reload pauses the server, so a request that ran
across a reload sees two versions) and records what it saw into the ``attribution()`` of its caller.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field

from pipeline.backoff import BackoffPolicy

#: The label a server gets when a reload failed midway: its weights are not any published version.
UNSYNCED = "unsynced"
#: What vLLM and SGLang report before any update.
DEFAULT_LABELS = ("default", "")

_SEEN: ContextVar[list[int | None] | None] = ContextVar("distillq_weight_versions", default=None)


def parse_version(label: object, *, anything_published: bool) -> int | None:
    """A server's version label as an int; ``None`` when it names no published version.

    The weights a server was started with ("default") count as version 0 while nothing is published yet,
    and as no version once something is (the server must be synced first)."""
    text = str(label).strip() if label is not None else ""
    if text.isdigit():
        return int(text)
    if text in DEFAULT_LABELS and not anything_published:
        return 0
    return None


def needs_sync(server_version: int | None, newest: int | None) -> bool:
    """Whether a server must load ``newest`` (never moves a server back to an older version)."""
    if newest is None:
        return False
    return server_version is None or server_version < newest


#: When a server that failed a sync is tried again (``pipeline.backoff``: full jitter, so the rollout workers
#: of one server do not all come back to it at once).
SYNC_RETRY = BackoffPolicy(base=0.5, cap=30.0)


def retry_delay_s(failures: int) -> float:
    """The wait before trying a server again after its ``failures``-th failure in a row."""
    return SYNC_RETRY.delay(failures)


@dataclass
class ServerState:
    """What this process knows of one server."""

    url: str
    version: int | None = None  # as last read from the server
    in_rotation: bool = False
    syncing: bool = False
    failures: int = 0
    retry_at: float = 0.0
    error: str = ""
    refused: set[int] = field(default_factory=set)  # versions refused as not fitting (logged once)
    syncs: int = 0

    def usable(self) -> bool:
        return self.in_rotation and not self.syncing

    def synced(self, version: int) -> None:
        self.version, self.in_rotation, self.failures, self.error = version, True, 0, ""
        self.syncs += 1

    def failed(self, error: str, now: float | None = None) -> bool:
        """Out of the rotation until ``retry_at``; True when it was in the rotation (a transition to log)."""
        was = self.in_rotation
        self.in_rotation, self.error = False, error
        self.failures += 1
        self.retry_at = (time.monotonic() if now is None else now) + retry_delay_s(self.failures)
        return was


@contextlib.contextmanager
def attribution() -> Iterator[list[int | None]]:
    """Collect the versions of every request made in this context (``None``: a request whose server changed
    weights while it ran, or named no version)."""
    seen: list[int | None] = []
    token = _SEEN.set(seen)
    try:
        yield seen
    finally:
        _SEEN.reset(token)


def record(version: int | None) -> None:
    seen = _SEEN.get()
    if seen is not None:
        seen.append(version)


def attribute(seen: Sequence[int | None]) -> int | None:
    """The one version every request ran on, or ``None`` (no request, or versions differ)."""
    versions = set(seen)
    if len(versions) != 1 or None in versions:
        return None
    return next(iter(versions))


def request_version(before: int | None, after: int | None) -> int | None:
    """A request's version from the server's label read before and after it."""
    return before if before is not None and before == after else None
