"""Published weight versions a student refused to load: one log line and one count per refused folder, and the
refusal in force for a worker's heartbeat.

A local student (``HFStudent``) and a set of servers (``SyncedStudent``) each hold a ``CheckpointRefusals`` as
``checkpoint_refusals``. A refusal (``CheckpointError``: torn, corrupt, non-finite tensors, another model's
shape) is logged as ``checkpoint_not_loadable`` (version, kind, error, the version kept) and counted in
``distillq_checkpoints_not_loadable_total{kind}`` once per folder state, however often the same folder is
tried; the student keeps sampling with the version it has. ``report()`` is the one line a heartbeat shows
while the refusal is in force (until a version loads).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import structlog

from pipeline import metrics
from pipeline.models.weights import MARKER, Checkpoint, CheckpointError, CheckpointFault

log = structlog.get_logger("distillq.weight_sync")

#: What identifies one state of a published folder: its path, version and marker's modification time (a folder
#: rewritten in place is a new state).
FolderKey = tuple[str, int, int]


@dataclass(frozen=True, slots=True)
class Refusal:
    """One refused version. ``version``: the version ``LATEST`` names (None when the pointer is unreadable);
    ``kept``: the version the student kept sampling with (None: the weights it started with)."""

    version: int | None
    kind: CheckpointFault
    error: str
    kept: int | None
    at: float

    def line(self) -> str:
        what = "?" if self.version is None else f"v{self.version}"
        kept = "the weights it started with" if self.kept is None else f"v{self.kept}"
        return f"checkpoint_not_loadable: {what} refused ({self.kind}: {self.error}); sampling with {kept}"


def folder_key(ckpt: Checkpoint) -> FolderKey:
    """``ckpt``'s folder state (``FolderKey``)."""
    try:
        mtime = (ckpt.path / MARKER).stat().st_mtime_ns
    except OSError:
        mtime = -1
    return str(ckpt.path), ckpt.version, mtime


class CheckpointRefusals:
    """The refusals of one student. ``count``: versions refused so far; ``last``: the refusal in force (None once
    a version loaded after it)."""

    def __init__(self) -> None:
        self.count = 0
        self.last: Refusal | None = None
        self._refused_folders: set[FolderKey] = set()
        self._logged: set[tuple[int | None, str]] = set()

    def refuse(self, error: CheckpointError, *, kept: int | None, folder: FolderKey | None = None) -> None:
        """Record ``error``; log and count it unless this refusal was recorded before. ``folder``: the state of a
        folder that was read (a later ``known(folder)`` skips reading it again)."""
        if folder is not None:
            self._refused_folders.add(folder)
        self.last = Refusal(error.version, error.kind, str(error), kept, time.time())
        key = (error.version, str(error))
        if key in self._logged:
            return
        self._logged.add(key)
        self.count += 1
        metrics.CHECKPOINTS_NOT_LOADABLE.labels(error.kind).inc()
        log.error("checkpoint_not_loadable", version=error.version, kind=error.kind, error=str(error), kept=kept,
                  action="keeps sampling with the version it has")

    def known(self, folder: FolderKey) -> bool:
        """Whether this folder state was read and refused before (no need to read it again)."""
        return folder in self._refused_folders

    def loaded(self) -> None:
        """A version loaded: no refusal is in force any more."""
        self.last = None

    def report(self) -> str | None:
        """The refusal in force, as one line (``checkpoint_not_loadable: v2 refused (non_finite: ...); sampling
        with v1``), or None."""
        return None if self.last is None else self.last.line()
