"""``distillq enqueue FILE.jsonl [--epoch N]``: one rollout job per prompt line (id + prompt or messages).

All lines are validated first; nothing is enqueued if any is bad. Re-enqueueing an id for the same
epoch is a no-op.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import msgspec
from rich.console import Console

from pipeline.ops.cli.common import add_redis_args, redis_settings_from_args, run
from pipeline.transport.jobs import PROMPT_DECODER, PromptJob, enqueue_prompts
from pipeline.transport.keys import Keys

err = Console(stderr=True)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("enqueue", help="enqueue prompts (JSONL: id, prompt or messages, answer) as rollout jobs")
    p.add_argument("file", type=Path, help="JSONL file ('-' for stdin)")
    p.add_argument("--epoch", type=int, default=0)
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
    text = sys.stdin.read() if str(args.file) == "-" else args.file.read_text()
    jobs, errors = parse_prompts(text.splitlines())
    if errors:
        for e in errors:
            err.print(f"[red]error[/red] {args.file}: {e}", highlight=False)
        err.print(f"nothing enqueued: {len(errors)} bad line(s)")
        return 1
    rs = redis_settings_from_args(args)
    new, old = run(enqueue_prompts(rs, Keys(rs.namespace), jobs, epoch=args.epoch))
    err.print(f"enqueued {new} prompt(s) for epoch {args.epoch}" + (f"; {old} already enqueued" if old else ""))
    return 0
