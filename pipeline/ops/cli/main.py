"""``distillq`` entry point: one subcommand per module."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from pipeline.logs import configure_logging


def build_parser() -> argparse.ArgumentParser:
    from pipeline.ops.cli import demo, dlq, enqueue, push, shards, stats, tail, up, worker

    parser = argparse.ArgumentParser(prog="distillq", description="Redis-streams pipeline for on-policy distillation")
    parser.add_argument("--log-level", default=None, help="DEBUG, INFO (default), WARNING")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (demo, enqueue, push, tail, up, worker, stats, dlq, shards):
        module.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    configure_logging(args.log_level)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
