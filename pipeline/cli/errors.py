"""What a failed ``distillq`` command prints: one line on stderr, and the exit status docs/cli.md gives for it.

``run_command`` runs a parsed command and catches these in one place: a ``CliError`` a command raised on
purpose (an unreadable input file, an empty one, a flag that cannot be used), a Redis that cannot be reached
or replies with an error, an invalid setting. Anything else is a bug and keeps its traceback. ``distillq``
(``pipeline.cli.main``) and every other entry point of a command (``python -m
pipeline.cli.commands.serve_student``) go through it, so a failure reads the same whichever way it was run.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Final

from pydantic import ValidationError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from pipeline.errors import DistillqError
from pipeline.transport.connection import redis_error_line

#: Exit statuses every command shares (docs/cli.md, "Exit status").
EXIT_FAILED: Final = 1  # the command ran and reports a failure: bad lines, nothing to do, refused
EXIT_USAGE: Final = 2  # a usage error: unknown flag, invalid value, an input file that cannot be read
EXIT_REDIS: Final = 3  # Redis cannot be reached (refused, unknown host, timeout, bad credentials) or replied an error
EXIT_INTERRUPTED: Final = 130  # Ctrl-C or SIGTERM

REDIS_ERRORS: Final = (RedisConnectionError, RedisTimeoutError, RedisClusterException, ResponseError)


class CliError(DistillqError):
    """A failure the user can act on: printed as ``distillq: MESSAGE``, exits with ``status``."""

    def __init__(self, message: str, status: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


def _leaf(exc: BaseException) -> BaseException:
    """The first error we know how to describe inside an exception group (a TaskGroup's), else ``exc``."""
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            leaf = _leaf(inner)
            if isinstance(leaf, (CliError, ValidationError, *REDIS_ERRORS)):
                return leaf
    return exc


def redis_url(args: argparse.Namespace) -> str | None:
    """The Redis URL the command used: its flag, else the environment, else the default (None: the demo's own)."""
    from pipeline.config import redis_settings_from_args

    if getattr(args, "command", None) == "demo":
        return getattr(args, "redis_url", None) or os.environ.get("DISTILLQ_REDIS_URL")
    try:
        return redis_settings_from_args(args).redis_url
    except ValidationError:
        return getattr(args, "redis_url", None)


def _settings_error(e: ValidationError) -> str:
    parts = []
    for err in e.errors():
        where = ".".join(str(x) for x in err["loc"])
        parts.append(f"{where}: {str(err['msg']).removeprefix('Value error, ')}")
    return "invalid setting " + "; ".join(parts)


def describe(exc: BaseException, args: argparse.Namespace) -> tuple[str, int] | None:
    """(one line, exit status) for a failure the user can act on; None for a bug (keep the traceback)."""
    exc = _leaf(exc)
    if isinstance(exc, CliError):
        return exc.message, exc.status
    if isinstance(exc, ValidationError):
        return _settings_error(exc), EXIT_USAGE
    if isinstance(exc, REDIS_ERRORS):
        return redis_error_line(exc, redis_url(args)), EXIT_REDIS
    return None


def fail(message: str) -> None:
    """Print ``distillq: MESSAGE`` on stderr: plain print, never wrapped, never styled."""
    print(f"distillq: {message}", file=sys.stderr, flush=True)


def run_command(args: argparse.Namespace) -> int:
    """Run ``args.func(args)``: its exit status, or the status of the failure it raised (printed as one line by
    ``fail``); Ctrl-C is ``EXIT_INTERRUPTED``. A failure ``describe`` does not know is re-raised."""
    try:
        code: int = args.func(args)
    except KeyboardInterrupt:
        fail("interrupted")
        return EXIT_INTERRUPTED
    except Exception as e:  # what describe() does not know is re-raised: a bug keeps its traceback
        failure = describe(e, args)
        if failure is None:
            raise
        fail(failure[0])
        return failure[1]
    return code
