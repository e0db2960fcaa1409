"""Options and functions shared by CLI commands."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TextIO, TypeVar

import redis.asyncio as aioredis
from redis.exceptions import RedisError
from rich.console import Console

from pipeline.config import RedisSettings, redis_settings_from_args
from pipeline.flags import HelpFormatter
from pipeline.stages.exits import EXIT_FAILED, EXIT_REDIS, EXIT_USAGE, CliError
from pipeline.transport.connection import connect, redis_error_line
from pipeline.transport.keys import STREAMS, Keys, stream_pool
from schemas.pools import pool_problem

T = TypeVar("T")

__all__ = ["add_command", "ensure_reachable", "make_console", "namespace_keys", "read_input", "report_bad_lines", "run",
           "run_output", "stream_name", "with_redis"]

#: Columns for rich output that goes to a file or a pipe: wide enough that tables and lines never wrap.
PLAIN_WIDTH = 10_000


def add_command(sub: argparse._SubParsersAction[argparse.ArgumentParser], name: str, help_text: str,
                description: str | None = None) -> argparse.ArgumentParser:
    """A subcommand whose ``--help`` has a description and shows every option's default."""
    return sub.add_parser(name, help=help_text, description=description or help_text[:1].upper() + help_text[1:],
                          formatter_class=HelpFormatter)


def stream_name(value: str) -> str:
    """A stage stream's short name, or a teacher pool's rollouts stream (``rollouts.<pool>``)."""
    pool = stream_pool(value)
    if value in STREAMS or (pool is not None and pool_problem(pool) is None):
        return value
    raise argparse.ArgumentTypeError(f"unknown stream {value!r}; choose from {', '.join(STREAMS)} "
                                     "(or rollouts.POOL, a teacher pool's)")


def is_terminal(stream: TextIO | None) -> bool:
    try:
        return stream is not None and stream.isatty()
    except ValueError:  # closed
        return False


def make_console(*, stderr: bool = False) -> Console:
    """A rich console for stdout (or stderr): sized to the terminal on one, and on a file or a pipe (logs, CI)
    as wide as the content, so table headers and long error lines are never cut or wrapped."""
    if is_terminal(sys.stderr if stderr else sys.stdout):
        return Console(stderr=stderr)
    return Console(stderr=stderr, width=PLAIN_WIDTH, soft_wrap=True)


def read_input(path: Path) -> str:
    """The text of an input file (``-``: stdin), or a ``CliError`` (exit status 2) saying why it cannot be read."""
    if str(path) == "-":
        return sys.stdin.read()
    try:
        return path.read_text(encoding="utf-8")
    except OSError as e:
        raise CliError(f"cannot read {path}: {e.strerror or e}", EXIT_USAGE) from e
    except UnicodeDecodeError as e:
        raise CliError(f"cannot read {path}: not UTF-8 text (byte {e.start})", EXIT_USAGE) from e


def namespace_keys(settings: RedisSettings) -> Keys:
    """The keys of ``settings.namespace``, or a ``CliError`` (exit status 2) for an invalid namespace."""
    try:
        return Keys(settings.namespace)
    except ValueError as e:
        raise CliError(str(e), EXIT_USAGE) from e


async def with_redis(args: argparse.Namespace, fn: Callable[[aioredis.Redis, Keys], Awaitable[T]]) -> T:
    settings = redis_settings_from_args(args)
    keys = namespace_keys(settings)
    client = connect(settings)
    try:
        return await fn(client, keys)
    finally:
        await client.aclose()


async def ensure_reachable(settings: RedisSettings, url: str | None = None) -> None:
    """Fail fast, in one line (exit status 3), when the Redis at ``url`` (default: the settings' URL) is away:
    before work that would take long or retry and log each attempt first."""
    url = url or settings.redis_url
    client = connect(settings.model_copy(update={"redis_url": url}))
    try:
        await client.ping()
    except (RedisError, OSError) as e:  # OSError: a socket error the client did not wrap
        raise CliError(redis_error_line(e, url), EXIT_REDIS) from e
    finally:
        await client.aclose()


def run(coro: Awaitable[T]) -> T:
    return asyncio.run(coro)  # type: ignore[arg-type]


def run_output(coro: Awaitable[int]) -> int:
    """``run`` for a command that prints as it goes (``tail``, ``stats``): Ctrl-C and a reader that closed the
    pipe (``| head``) end it quietly with status 0."""
    try:
        return run(coro)
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:
        sys.stderr.close()
        return 0


def report_bad_lines(file: str, errors: list[str], what: str) -> int:
    """Every bad line of ``file`` on stderr, then ``nothing <what>: N bad line(s)``; the exit status."""
    from rich.markup import escape

    err = make_console(stderr=True)
    for e in errors:
        err.print(f"[red]error[/red] {escape(f'{file}: {e}')}", highlight=False)
    err.print(f"nothing {what}: {len(errors)} bad line(s)", highlight=False)
    return EXIT_FAILED
