"""How every distillq process fails: one line on stderr, and the exit status docs/cli.md gives for it.

``run_command`` runs a parsed command and catches, in one place, the failures a user can act on: a ``CliError``
a command raised on purpose (an unreadable input file, an empty one, a flag that cannot be used), a
``ConfigurationError`` (a flag, a setting or a pairing of models that cannot work: a missing ``--model``, a
``--top-k`` above a cap, a teacher server that never answered, a shard outside the pipeline's), an invalid
setting, a Redis that cannot be reached or replies with an error, a learner client that cannot go on. Anything
else is a bug and keeps its traceback.

Every entry point goes through it, so a failure reads the same whichever way it was run: ``distillq``
(``pipeline.cli.main``), ``python -m workers.*`` (``workers.common.standalone``), ``python -m
pipeline.demo.learner``, ``torchrun ... -m pipeline.demo.ranks_learner`` and ``python -m
pipeline.cli.commands.serve_student``. It lives in this layer, below ``workers``, ``pipeline.demo`` and the
commands, so that each of them imports it from here.
"""

from __future__ import annotations

import argparse
import errno
import sys
from typing import Final

from pydantic import ValidationError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from pipeline.errors import ConfigurationError, DistillqError, LearnerError
from pipeline.transport.connection import redis_error_line

__all__ = [
    "EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_REDIS", "EXIT_USAGE", "REDIS_ERRORS", "CliError", "describe", "fail",
    "redis_url", "run_command",
]

#: Exit statuses every entry point shares (docs/cli.md, "Exit status").
EXIT_FAILED: Final = 1  # the command ran and reports a failure: bad lines, nothing to do, refused; a crash
#: a usage or configuration error: unknown flag, invalid value, unreadable input file, a ``ConfigurationError``.
#: ``distillq up`` never restarts a worker that exits with it: a restart would refuse again.
EXIT_USAGE: Final = 2
EXIT_REDIS: Final = 3  # Redis cannot be reached (refused, unknown host, timeout, bad credentials) or replied an error
EXIT_INTERRUPTED: Final = 130  # Ctrl-C or SIGTERM

REDIS_ERRORS: Final = (RedisConnectionError, RedisTimeoutError, RedisClusterException, ResponseError)


class CliError(DistillqError):
    """A failure the user can act on: printed as ``distillq: MESSAGE``, exits with ``status``."""

    def __init__(self, message: str, status: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


#: Storage failures a user acts on (a folder not writable, a disk or quota full): errno -> what to do.
_STORAGE_ERRNOS: Final = {
    errno.EACCES: "give this process write access to it, or pass another folder",
    errno.EPERM: "give this process write access to it, or pass another folder",
    errno.EROFS: "the file system is read-only: pass a folder on a writable one",
    errno.ENOSPC: "the disk is full: free space or pass a folder on another disk",
    errno.EDQUOT: "the disk quota is exhausted: free space or pass a folder elsewhere",
}

_KNOWN: Final = (CliError, ConfigurationError, LearnerError, ValidationError, *REDIS_ERRORS)


def _leaf(exc: BaseException) -> BaseException:
    """The first error we know how to describe inside an exception group (a TaskGroup's), else ``exc``."""
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            leaf = _leaf(inner)
            if isinstance(leaf, _KNOWN):
                return leaf
    return exc


def redis_url(args: argparse.Namespace) -> str | None:
    """The Redis URL the command used: its flag, else the environment, else the default (None: the demo's own)."""
    from pipeline.config import redis_settings_from_args

    if getattr(args, "command", None) == "demo":  # the demo's own Redis unless --redis-url (never the environment's)
        return getattr(args, "redis_url", None)
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


def _one_line(text: str) -> str:
    return " ".join(text.split())


def describe(exc: BaseException, args: argparse.Namespace) -> tuple[str, int] | None:
    """(one line, exit status) for a failure the user can act on; None for a bug (keep the traceback).

    ``CliError``: its own status. ``ConfigurationError`` and an invalid setting: ``EXIT_USAGE``. Redis errors,
    and a ``LearnerError`` that is a ``ConnectionError`` (the learner client cannot reach Redis): ``EXIT_REDIS``;
    another ``LearnerError`` (a rank taken over): ``EXIT_FAILED``. A file that cannot be written (permission,
    read-only file system, disk or quota full; ``OSError`` naming the file): ``EXIT_FAILED``."""
    exc = _leaf(exc)
    if isinstance(exc, CliError):
        return exc.message, exc.status
    if isinstance(exc, ConfigurationError):
        return _one_line(str(exc)), EXIT_USAGE
    if isinstance(exc, ValidationError):
        return _settings_error(exc), EXIT_USAGE
    if isinstance(exc, REDIS_ERRORS):
        return redis_error_line(exc, redis_url(args)), EXIT_REDIS
    if isinstance(exc, LearnerError):
        return _one_line(str(exc)), EXIT_REDIS if isinstance(exc, ConnectionError) else EXIT_FAILED
    if isinstance(exc, OSError) and exc.errno in _STORAGE_ERRNOS and exc.filename:
        return f"cannot write {exc.filename}: {exc.strerror} ({_STORAGE_ERRNOS[exc.errno]})", EXIT_FAILED
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
