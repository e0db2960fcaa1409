"""structlog configuration: JSON lines in containers (no TTY), readable console output on a terminal."""

from __future__ import annotations

import logging
import os
import sys

import structlog


class StderrLogger:
    """Writes each line to the *current* ``sys.stderr`` (resolved per call, not at configure time)."""

    def msg(self, message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    log = debug = info = warning = warn = error = critical = exception = fatal = msg


def _stderr_logger(*args: object) -> StderrLogger:
    return StderrLogger()


def configure_logging(level: str | None = None, *, json: bool | None = None) -> None:
    """Configure structlog once per process. ``DISTILLQ_LOG_LEVEL`` / ``DISTILLQ_LOG_JSON`` override."""
    level_name = (level or os.environ.get("DISTILLQ_LOG_LEVEL") or "INFO").upper()
    if json is None:
        env = os.environ.get("DISTILLQ_LOG_JSON")
        json = env == "1" if env is not None else not sys.stderr.isatty()
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info if json else structlog.processors.StackInfoRenderer(),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level_name]),
        logger_factory=_stderr_logger,
        cache_logger_on_first_use=False,
    )
