"""``distillq push FILE.jsonl``: reference-format ScoredDataGroup lines onto a stream.

Every line is validated first; if any line is bad, each bad line is reported with its number and
reason and nothing from the file is pushed. A line without a ``group_id`` gets one derived from its
content (``schemas.atropos.content_group_id``), so pushing the same file again is deduplicated like any
other re-push.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Final

import redis.asyncio as aioredis

from pipeline.config import StreamSettings
from pipeline.ops.cli.common import add_command, add_redis_args, read_input, report_bad_lines, run, with_redis
from pipeline.ops.cli.errors import EXIT_FAILED, CliError
from pipeline.transport.keys import STREAMS, Keys
from pipeline.transport.producer import AddResult, StreamProducer
from pipeline.transport.sharding import get_shards
from schemas import DecodeError, Message, RolloutGroup, ScoredGroup
from schemas.atropos import rollout_from_atropos

#: The streams groups can be pushed onto, and who writes the others.
PUSHABLE: Final = ("rollouts", "scored")
_WRITTEN_BY: Final = {"batches": "the feeder (batches of scored groups)", "dlq": "the workers (dead letters)"}


def push_stream(value: str) -> str:
    if value in PUSHABLE:
        return value
    if value in STREAMS:
        raise argparse.ArgumentTypeError(
            f"cannot push onto {value!r}: it is written by {_WRITTEN_BY[value]}; push groups onto rollouts or scored")
    raise argparse.ArgumentTypeError(f"unknown stream {value!r}; choose rollouts or scored")


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = add_command(sub, "push", "push reference-format ScoredDataGroup JSON lines onto a stream",
                    "Push reference-format ScoredDataGroup JSON lines onto rollouts (the teacher scores them) or "
                    "scored (they carry teacher arrays and go straight to the feeder). Every line is validated "
                    "first; nothing is pushed if any is bad. Idempotent by group id; a line without group_id gets "
                    "one derived from its content.")
    p.add_argument("file", type=Path, help="JSONL file, one ScoredDataGroup object per line ('-' for stdin)")
    p.add_argument("--stream", type=push_stream, default="rollouts", metavar="{rollouts,scored}",
                   help="rollouts: teacher arrays in the input are validated, then left out, and the teacher scores "
                        "the group; scored: every line must carry distill_token_ids/distill_logprobs")
    p.add_argument("--policy-version", type=int, default=0, metavar="N",
                   help="policy version for lines without policy_version")
    add_redis_args(p)
    p.set_defaults(func=main)


def parse_file(lines: list[str], stream: str, policy_version: int) -> tuple[list[Message], list[str]]:
    """All messages, or the list of errors (``line N: reason``) if any line is bad."""
    if stream not in PUSHABLE:
        raise ValueError(f"cannot push groups onto {stream!r}; use rollouts or scored")
    msgs: list[Message] = []
    errors: list[str] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            if not isinstance(obj, dict):
                raise DecodeError("line", f"expected a JSON object, got {type(obj).__name__}")
            msg = rollout_from_atropos(obj, policy_version=policy_version)  # no group_id: content_group_id(obj)
        except json.JSONDecodeError as e:
            errors.append(f"line {n}: invalid JSON: {e.msg} at column {e.colno}")
            continue
        except DecodeError as e:
            errors.append(f"line {n}: {e}")
            continue
        except (RecursionError, ValueError) as e:  # nesting too deep, an integer of thousands of digits
            errors.append(f"line {n}: unreadable JSON: {type(e).__name__}: {str(e)[:200]}")
            continue
        if stream == "rollouts" and isinstance(msg, ScoredGroup):
            msg = msg.group  # the teacher scores it again
        elif stream == "scored" and isinstance(msg, RolloutGroup):
            errors.append(f"line {n}: no distill_token_ids/distill_logprobs; cannot push to 'scored'")
            continue
        msgs.append(msg)
    return msgs, errors


async def push_all(redis: aioredis.Redis, keys: Keys, stream: str, msgs: list[Message]) -> tuple[int, int]:
    producer = StreamProducer(redis, keys, stream, StreamSettings(), shards=await get_shards(redis, keys))
    added = dup = 0
    for m in msgs:
        res = await producer.send(m)
        if res.result is AddResult.ADDED:
            added += 1
        else:
            dup += 1
    return added, dup


def main(args: argparse.Namespace) -> int:
    msgs, errors = parse_file(read_input(args.file).splitlines(), args.stream, args.policy_version)
    if errors:
        return report_bad_lines(args.file, errors, "pushed")
    if not msgs:
        raise CliError(f"no groups in {args.file}; nothing pushed", EXIT_FAILED)
    added, dup = run(with_redis(args, lambda r, k: push_all(r, k, args.stream, msgs)))
    print(f"pushed {added} group(s) onto {args.stream}" + (f" ({dup} already present, skipped)" if dup else ""),
          file=sys.stdout, flush=True)
    return 0
