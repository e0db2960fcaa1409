"""Supervised local worker processes: ``distillq up`` and the demo (the no-docker ``--scale``).

Each process runs in its own session (process group), logs to a file, and is restarted with backoff
if it dies unexpectedly (any status but 0 and 2, or a signal). One that exits with status 2 (``EXIT_USAGE``:
it refused its configuration, and a restart would refuse again) is reported once
(``process_refused_config``, with its last log line: the ``distillq: ...`` line naming the problem) and not
restarted; one that used up its restarts is reported once (``process_gave_up``). ``stop`` sends SIGTERM to
every group, waits for a grace period, then SIGKILLs what is left: no process outlives the supervisor. A supervisor
killed outright (SIGKILL, a crash) cannot do that: each child is started with the parent-death signal set
(``die_with``), so the kernel sends it SIGTERM and it stops gracefully. A process started under a consumer name
that another live process holds (an earlier supervisor's) is refused with that process's host and pid (exit
status 2, ``pipeline.transport.identity``), and reported here as a configuration refusal.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import structlog

from pipeline.backoff import BackoffPolicy
from pipeline.stages.exits import EXIT_INTERRUPTED, EXIT_USAGE

log = structlog.get_logger("distillq.supervisor")

_PR_SET_PDEATHSIG = 1  # linux/prctl.h

#: The wait before restarting a crashed process (``pipeline.backoff``): up to 1 s, 2 s, 4 s, ... 30 s.
RESTART_BACKOFF = BackoffPolicy(base=1.0, cap=30.0)


@dataclass
class ProcSpec:
    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    restart: bool = True


@dataclass
class Proc:
    spec: ProcSpec
    popen: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    next_start: float = 0.0
    exit_code: int | None = None
    log_file: IO[bytes] | None = None


def distillq_argv(*args: str) -> list[str]:
    """``distillq ARGS`` run with this interpreter (works without the console script on PATH)."""
    return [sys.executable, "-m", "pipeline.cli.main", *args]


class Supervisor:
    def __init__(self, specs: Sequence[ProcSpec], log_dir: str | Path, *, base_env: dict[str, str] | None = None,
                 max_restarts: int = 5) -> None:
        self.procs = [Proc(s) for s in specs]
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.base_env = {**os.environ, **(base_env or {})}
        self.max_restarts = max_restarts
        atexit.register(self.stop)

    def _spawn(self, p: Proc) -> None:
        if p.log_file is None:
            p.log_file = open(self.log_path(p), "ab")  # noqa: SIM115
        p.popen = subprocess.Popen(p.spec.argv, env={**self.base_env, **p.spec.env}, stdout=p.log_file,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                   preexec_fn=die_with(os.getpid()))  # noqa: PLW1509 (one prctl call, no lock)
        log.debug("process_started", name=p.spec.name, pid=p.popen.pid, restarts=p.restarts)

    def start(self) -> None:
        for p in self.procs:
            self._spawn(p)

    def poll(self) -> dict[str, int | None]:
        """Restart crashed processes (bounded, with backoff); exit codes of those that are done."""
        now = time.monotonic()
        for p in self.procs:
            if p.popen is None or p.popen.poll() is None:
                if p.popen is None and p.next_start and now >= p.next_start:
                    self._spawn(p)
                continue
            code = p.popen.returncode
            if code == EXIT_USAGE and p.spec.restart:  # it refused its configuration: a restart would too
                if p.exit_code is None:
                    log.error("process_refused_config", name=p.spec.name, code=code, restarted=False,
                              reason=self.last_line(p), log_file=str(self.log_path(p)))
                p.exit_code = code
            elif code != 0 and p.spec.restart and p.restarts < self.max_restarts:
                p.restarts += 1
                p.next_start = now + RESTART_BACKOFF.delay(p.restarts)
                log.warning("process_died", name=p.spec.name, code=code, restart_in=round(p.next_start - now, 1),
                            last_line=self.last_line(p))
                p.popen = None
            else:
                if p.exit_code is None and code != 0 and p.spec.restart:
                    log.error("process_gave_up", name=p.spec.name, code=code, restarts=p.restarts,
                              last_line=self.last_line(p), log_file=str(self.log_path(p)))
                p.exit_code = code
        return {p.spec.name: p.exit_code for p in self.procs}

    def log_path(self, p: Proc) -> Path:
        return self.log_dir / f"{p.spec.name}.log"

    def last_line(self, p: Proc) -> str:
        """The last non-empty line a process wrote to its log (its exit message, usually)."""
        try:
            with open(self.log_path(p), "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
                lines = [ln.strip() for ln in f.read().decode("utf-8", "replace").splitlines() if ln.strip()]
        except OSError:
            return ""
        return lines[-1][:500] if lines else ""

    def alive(self, name: str) -> bool:
        return any(p.spec.name == name and p.popen is not None and p.popen.poll() is None for p in self.procs)

    def stop(self, grace_s: float = 40.0) -> None:
        """SIGTERM every process group, wait ``grace_s`` (longer than a worker's 30 s drain), then SIGKILL."""
        running = [p for p in self.procs if p.popen is not None and p.popen.poll() is None]
        for p in running:
            assert p.popen is not None
            _signal_group(p.popen.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in running:
            assert p.popen is not None
            try:
                p.popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("process_killed", name=p.spec.name, pid=p.popen.pid)
                _signal_group(p.popen.pid, signal.SIGKILL)
                p.popen.wait(5)
        for p in self.procs:
            if p.popen is not None:
                _signal_group(p.popen.pid, signal.SIGKILL)  # stragglers in the group, if any
            if p.log_file is not None:
                p.log_file.close()
                p.log_file = None


def die_with(parent: int) -> Callable[[], None] | None:
    """For ``Popen(preexec_fn=...)``: the child gets SIGTERM when ``parent`` dies, even by SIGKILL (Linux
    ``PR_SET_PDEATHSIG``; its own session keeps it out of the terminal's signals), so a killed supervisor leaves no
    orphans. ``None`` where the system has no such call."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)

    def arm() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the call: nothing would signal us
            os._exit(EXIT_INTERRUPTED)

    return arm


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
