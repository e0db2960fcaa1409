"""``distillq enqueue FILE.jsonl [--epoch N] [--again]``: one entry on the prompts stream per prompt line (id + prompt
or messages), for the rollout workers (``pipeline.transport.prompts``).

All lines are validated first; nothing is enqueued if any is bad. Re-enqueueing an id for the same epoch is a no-op;
``--again`` enqueues the prompts whose last attempt left no group (dead-lettered, or lost with Redis data) and skips
those still queued, in flight or done.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import msgspec
import redis.asyncio as aioredis

from pipeline.cli.commands.common import (
    add_command,
    namespace_keys,
    read_input,
    report_bad_lines,
    run,
    with_redis,
)
from pipeline.config import add_redis_args, redis_settings_from_args
from pipeline.stages.exits import EXIT_FAILED, CliError
from pipeline.transport.keys import Keys
from pipeline.transport.prompts import PROMPT_DECODER, Added, PromptJob, enqueue_prompts


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = add_command(sub, "enqueue", "enqueue prompts (JSONL: id, prompt or messages, answer) for the rollout workers",
                    "Enqueue one prompt per line (id plus prompt or messages) on the prompts stream for the rollout "
                    "workers; each becomes the group <epoch>:<id>. Every line is validated first; nothing is enqueued "
                    "if any is bad. Idempotent per (epoch, id); --again enqueues those whose last attempt left no "
                    "group (dead-lettered, or lost with Redis data).")
    p.add_argument("file", type=Path, help="JSONL file, one prompt object per line ('-' for stdin)")
    p.add_argument("--epoch", type=int, default=0, metavar="N",
                   help="epoch of these prompts: a new epoch samples the same prompt ids again")
    p.add_argument("--again", action="store_true",
                   help="enqueue again the prompts of this epoch whose last attempt left no group (dead-lettered, or "
                        "lost with Redis data); those still queued, in flight or done are skipped")
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


async def enqueue(redis: aioredis.Redis, keys: Keys, jobs: list[PromptJob], args: argparse.Namespace) -> int:
    got = await enqueue_prompts(redis, keys, jobs, epoch=args.epoch, again=args.again)
    skipped = [(got[Added.ENQUEUED_BEFORE], "already enqueued"), (got[Added.STILL_QUEUED], "still queued or in flight"),
               (got[Added.DONE], "done (group written)")]
    print(f"enqueued {got[Added.ADDED]} prompt(s) for epoch {args.epoch} in namespace {keys.namespace!r}"
          + "".join(f"; {n} {what}" for n, what in skipped if n), file=sys.stdout, flush=True)
    return 0


def main(args: argparse.Namespace) -> int:
    jobs, errors = parse_prompts(read_input(args.file).splitlines())
    if errors:
        return report_bad_lines(args.file, errors, "enqueued")
    if not jobs:
        raise CliError(f"no prompts in {args.file}; nothing enqueued", EXIT_FAILED)
    namespace_keys(redis_settings_from_args(args))  # a bad namespace: one line before Redis is asked
    return run(with_redis(args, lambda r, k: enqueue(r, k, jobs, args)))
