"""``distillq enqueue FILE.jsonl [--epoch N]``: one rollout job per prompt line (id + prompt or messages).

All lines are validated first; nothing is enqueued if any is bad. Re-enqueueing an id for the same
epoch is a no-op.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import msgspec

from pipeline.cli.commands.common import (
    add_command,
    add_redis_args,
    ensure_reachable,
    namespace_keys,
    read_input,
    redis_settings_from_args,
    report_bad_lines,
    run,
)
from pipeline.cli.errors import EXIT_FAILED, EXIT_USAGE, CliError
from pipeline.transport.jobs import PROMPT_DECODER, PromptJob, arq_settings, enqueue_prompts


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = add_command(sub, "enqueue", "enqueue prompts (JSONL: id, prompt or messages, answer) as rollout jobs",
                    "Enqueue one rollout job per prompt line (id plus prompt or messages) for the rollout workers. "
                    "Every line is validated first; nothing is enqueued if any is bad. Idempotent per (epoch, id).")
    p.add_argument("file", type=Path, help="JSONL file, one prompt object per line ('-' for stdin)")
    p.add_argument("--epoch", type=int, default=0, metavar="N",
                   help="epoch of these jobs: a new epoch samples the same prompt ids again")
    add_redis_args(p)
    p.set_defaults(func=main)


def parse_prompts(lines: list[str]) -> tuple[list[PromptJob], list[str]]:
    jobs: list[PromptJob] = []
    errors: list[str] = []
    seen: set[str] = set()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            job = PROMPT_DECODER.decode(line)
        except (msgspec.DecodeError, ValueError) as e:
            errors.append(f"line {n}: {e}")
            continue
        if job.id in seen:
            errors.append(f"line {n}: duplicate id {job.id!r}")
            continue
        seen.add(job.id)
        jobs.append(job)
    return jobs, errors


def main(args: argparse.Namespace) -> int:
    jobs, errors = parse_prompts(read_input(args.file).splitlines())
    if errors:
        return report_bad_lines(args.file, errors, "enqueued")
    if not jobs:
        raise CliError(f"no prompts in {args.file}; nothing enqueued", EXIT_FAILED)
    rs = redis_settings_from_args(args)
    keys = namespace_keys(rs)
    try:
        arq_settings(rs)
    except ValueError as e:  # a Cluster URL for the job queue
        raise CliError(str(e), EXIT_USAGE) from e
    run(ensure_reachable(rs, rs.jobs_redis_url))  # arq would retry and log five times first
    new, old = run(enqueue_prompts(rs, keys, jobs, epoch=args.epoch))
    print(f"enqueued {new} prompt(s) for epoch {args.epoch} in namespace {keys.namespace!r}"
          + (f"; {old} already enqueued" if old else ""),
          file=sys.stdout, flush=True)
    return 0
