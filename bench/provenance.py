"""Where and when a benchmark ran: the date, the machine and the git commit, read at run time.

``header(title, run_info())`` is the first line ``python -m bench`` prints; ``--json`` writes ``run_info()``.
"""

from __future__ import annotations

import os
import platform
import subprocess
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the checkout whose code is measured


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True, timeout=30).stdout


def git_commit(root: Path = ROOT) -> str:
    """``git rev-parse --short HEAD`` of ``root``, with ``-dirty`` appended when tracked files differ from it
    (untracked files do not count); ``"unknown"`` when ``root`` is not in a git checkout or git is missing."""
    try:
        commit = _git(root, "rev-parse", "--short", "HEAD").strip()
        dirty = _git(root, "status", "--porcelain", "--untracked-files=no").strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if not commit:
        return "unknown"
    return f"{commit}-dirty" if dirty else commit


def cpu_model() -> str:
    """``lscpu``'s model name; ``platform.processor()`` (or ``"unknown"``) where lscpu is missing."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True, timeout=30).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.SubprocessError, StopIteration):
        return platform.processor() or "unknown"


def machine() -> str:
    """CPU model, core count, Python version and the load average now."""
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"{cpu_model()}, nproc {os.cpu_count()}, Python {platform.python_version()}, load average {load}"


def now() -> str:
    """The date and time now, UTC, to the minute: ``2026-11-27 00:41 UTC``."""
    return datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")


def run_info() -> dict[str, str]:
    """``{"date": now(), "commit": git_commit(), "machine": machine()}``, all read now."""
    return {"date": now(), "commit": git_commit(), "machine": machine()}


def header(title: str, info: dict[str, str]) -> str:
    """One line: ``title``, then the date, commit and machine of ``info`` (``run_info()``)."""
    return f"{title}, {info['date']}, commit {info['commit']}; {info['machine']}"
