"""What a failed ``distillq`` command prints: one line on stderr, and the exit status docs/cli.md gives for it.

The failure path is ``pipeline.stages.exits`` (one for every entry point: ``distillq``, ``python -m workers.*``,
the example learner, ``python -m pipeline.cli.commands.serve_student``); the commands import it from here.
"""

from __future__ import annotations

from pipeline.stages.exits import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_REDIS,
    EXIT_USAGE,
    REDIS_ERRORS,
    CliError,
    describe,
    fail,
    redis_url,
    run_command,
)

__all__ = [
    "EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_REDIS", "EXIT_USAGE", "REDIS_ERRORS", "CliError", "describe", "fail",
    "redis_url", "run_command",
]
