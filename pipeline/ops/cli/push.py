"""``distillq push FILE.jsonl``: reference-format ScoredDataGroup lines onto a stream.

Every line is validated first; if any line is bad, each bad line is reported with its number and
reason and nothing from the file is pushed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import redis.asyncio as aioredis
from rich.console import Console

from pipeline.config import StreamSettings
from pipeline.ops.cli.common import add_redis_args, run, stream_name, with_redis
from pipeline.transport.keys import Keys
from pipeline.transport.producer import AddResult, StreamProducer
from pipeline.transport.sharding import get_shards
from schemas import DecodeError, Message, RolloutGroup, ScoredGroup
from schemas.atropos import rollout_from_atropos

err = Console(stderr=True)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("push", help="push reference-format ScoredDataGroup JSON lines onto a stream")
    p.add_argument("file", type=Path, help="JSONL file, one ScoredDataGroup object per line ('-' for stdin)")
    p.add_argument("--stream", type=stream_name, default="rollouts", help="rollouts (default) or scored")
    p.add_argument("--policy-version", type=int, default=0)
    add_redis_args(p)
    p.set_defaults(func=main)


def parse_file(lines: list[str], stream: str, policy_version: int) -> tuple[list[Message], list[str]]:
    """All messages, or the list of errors (``line N: reason``) if any line is bad."""
    msgs: list[Message] = []
    errors: list[str] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            if not isinstance(obj, dict):
                raise DecodeError("line", f"expected a JSON object, got {type(obj).__name__}")
            msg = rollout_from_atropos(obj, policy_version=policy_version)
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
    if stream not in ("rollouts", "scored"):
        errors.append(f"cannot push groups onto {stream!r}; use rollouts or scored")
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
    text = sys.stdin.read() if str(args.file) == "-" else args.file.read_text()
    msgs, errors = parse_file(text.splitlines(), args.stream, args.policy_version)
    if errors:
        for e in errors:
            err.print(f"[red]error[/red] {args.file}: {e}", highlight=False)
        err.print(f"nothing pushed: {len(errors)} bad line(s)")
        return 1
    added, dup = run(with_redis(args, lambda r, k: push_all(r, k, args.stream, msgs)))
    err.print(f"pushed {added} group(s) onto {args.stream}" + (f" ({dup} already present, skipped)" if dup else ""))
    return 0
