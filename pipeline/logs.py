"""structlog configuration: JSON lines in containers (no TTY), readable console output on a terminal.

``configure_logging`` also turns off the Hugging Face progress bars ("Loading weights", "Writing model
shards"): every entry point calls it first, so worker logs and the demo's output hold log lines only.
"""

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


def quiet_progress_bars() -> None:
    """No tqdm bars from transformers or huggingface_hub while models load or save.

    ``HF_HUB_DISABLE_PROGRESS_BARS=1`` is read when those libraries are imported (here and in every child
    process, which inherits it), so nothing is imported just for this; when they are already loaded, their
    own switches are turned off too. An explicit ``HF_HUB_DISABLE_PROGRESS_BARS=0`` keeps the bars.
    """
    if os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1") != "1":
        return
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars  # type: ignore[attr-defined]

        disable_progress_bars()
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]


def configure_logging(level: str | None = None, *, json: bool | None = None) -> None:
    """Configure structlog once per process. ``DISTILLQ_LOG_LEVEL`` / ``DISTILLQ_LOG_JSON`` override.

    Raises ``ValueError`` for an unknown level name.
    """
    from pipeline.config import env

    level_name = (level or env("LOG_LEVEL") or "INFO").upper()
    levels = logging.getLevelNamesMapping()
    if level_name not in levels:
        raise ValueError(f"unknown log level {level_name!r}: use DEBUG, INFO, WARNING or ERROR")
    if json is None:
        given = env("LOG_JSON")
        json = given == "1" if given is not None else not sys.stderr.isatty()
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
        wrapper_class=structlog.make_filtering_bound_logger(levels[level_name]),
        logger_factory=_stderr_logger,
        cache_logger_on_first_use=False,
    )
    quiet_progress_bars()
