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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import redis.asyncio as aioredis

from pipeline.cli.commands.common import (
    add_command,
    read_input,
    report_bad_lines,
    run,
    with_redis,
)
from pipeline.cli.namespaces import absent_note
from pipeline.cli.recovery import admit_push
from pipeline.config import StreamSettings, add_redis_args, redis_settings_from_args
from pipeline.stages.exits import EXIT_FAILED, CliError
from pipeline.transport.keys import STREAMS, Keys
from pipeline.transport.pools import PoolProducer
from pipeline.transport.producer import AddResult, BackpressureTimeout, StreamProducer, message_id
from pipeline.transport.sharding import get_shards
from schemas import DecodeError, Message, RolloutGroup, ScoredGroup
from schemas.atropos import rollout_from_atropos

#: The streams groups can be pushed onto, and who writes the others.
PUSHABLE: Final = ("rollouts", "scored")
_WRITTEN_BY: Final = {"prompts": "distillq enqueue (prompts for the rollout workers)",
                       "batches": "the feeder (batches of scored groups)", "dlq": "the workers (dead letters)"}


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
    p.add_argument("--force", action="store_true",
                   help="push groups whose id was pushed before (within DISTILLQ_DEDUPE_TTL_S): the markers that "
                        "would stop them are cleared first, the batches marker too for a group the learner "
                        "dead-lettered out of its batch (never trained); a group trained, or in a batch the learner "
                        "has not acknowledged, is refused with the reason (default: skip them)")
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


@dataclass(slots=True)
class PushResult:
    added: int = 0
    duplicates: list[str] = field(default_factory=list)  # group ids skipped as already present
    refused: list[tuple[str, str]] = field(default_factory=list)  # --force: (group id, why not and what to do)


async def push_all(redis: aioredis.Redis, keys: Keys, stream: str, msgs: list[Message], *,
                   force: bool = False) -> PushResult:
    """Send ``msgs`` in order. A ``CliError`` (exit status 1) when the stream stays full, saying how many
    got in: the rest were not written, and pushing the same file again skips those that were."""
    settings = StreamSettings()
    shards = await get_shards(redis, keys)
    producer = (PoolProducer(redis, keys, settings, shards=shards) if stream == "rollouts"  # by teacher pool
                else StreamProducer(redis, keys, stream, settings, shards=shards))
    note = await absent_note(redis, keys)
    if note is not None:
        print(f"note: {note}", file=sys.stderr, flush=True)
    out = PushResult()
    for n, m in enumerate(msgs):
        gid = message_id(m)
        if force and (refusal := await admit_push(redis, keys, gid, shards, settings)) is not None:
            out.refused.append((gid, refusal.line()))
            continue
        try:
            res = await producer.send(m)
        except BackpressureTimeout as e:
            raise CliError(
                f"pushed {out.added} of {len(msgs)} group(s) onto {stream} in namespace {keys.namespace!r}, then "
                f"it stayed full: {e}; the other {len(msgs) - n} were not pushed (push the file again once it "
                "drains: groups already pushed are skipped)", EXIT_FAILED) from e
        if res.result is AddResult.ADDED:
            out.added += 1
        else:
            out.duplicates.append(gid)
    return out


def main(args: argparse.Namespace) -> int:
    msgs, errors = parse_file(read_input(args.file).splitlines(), args.stream, args.policy_version)
    if errors:
        return report_bad_lines(args.file, errors, "pushed")
    if not msgs:
        raise CliError(f"no groups in {args.file}; nothing pushed", EXIT_FAILED)
    res = run(with_redis(args, lambda r, k: push_all(r, k, args.stream, msgs, force=args.force)))
    ns = redis_settings_from_args(args).namespace
    dup = len(res.duplicates)
    print(f"pushed {res.added} group(s) onto {args.stream} in namespace {ns!r}"
          + (f" ({dup} already present, skipped)" if dup else "")
          + (f" ({len(res.refused)} refused by --force, see stderr)" if res.refused else ""),
          file=sys.stdout, flush=True)
    for gid, why in res.refused:
        print(f"not pushed again: {gid}: {why}", file=sys.stderr, flush=True)
    if dup:
        ttl_h = StreamSettings().dedupe_ttl_s / 3600
        print(f"{dup} group id(s) were pushed onto {args.stream} before, within the last {ttl_h:g} h "
              f"(DISTILLQ_DEDUPE_TTL_S), e.g. {res.duplicates[0]}: a group id goes onto a stream once. "
              f"distillq where {res.duplicates[0]} shows what became of it; distillq push --force pushes them again",
              file=sys.stderr, flush=True)
    return EXIT_FAILED if res.refused else 0
