"""``distillq`` entry point: one subcommand per module.

Failures a user can act on (Redis unreachable, an unreadable file, an invalid setting) are caught in one
place, ``errors.run_command``, and printed as one line on stderr with the exit status docs/cli.md gives.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from pipeline.logs import configure_logging
from pipeline.stages.exits import EXIT_USAGE, fail, run_command

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def build_parser() -> argparse.ArgumentParser:
    from pipeline.cli.commands import (
        demo,
        dlq,
        enqueue,
        models,
        namespaces,
        push,
        serve,
        shards,
        stats,
        tail,
        up,
        where,
        worker,
    )
    from pipeline.flags import HelpFormatter

    parser = argparse.ArgumentParser(
        prog="distillq", formatter_class=HelpFormatter,
        description="Redis-streams pipeline for on-policy distillation. Every command, flag, environment variable "
                    "and exit status: docs/cli.md; distillq COMMAND --help for one command.")
    parser.add_argument("--log-level", default=None, type=str.upper, choices=LOG_LEVELS, metavar="LEVEL",
                        help="DEBUG, INFO, WARNING or ERROR (default: $DISTILLQ_LOG_LEVEL or INFO)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (demo, enqueue, push, tail, where, up, worker, stats, namespaces, dlq, shards, serve, models):
        module.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        configure_logging(args.log_level)
    except ValueError as e:  # DISTILLQ_LOG_LEVEL=LOUD
        fail(str(e))
        return EXIT_USAGE
    return run_command(args)


if __name__ == "__main__":
    sys.exit(main())
