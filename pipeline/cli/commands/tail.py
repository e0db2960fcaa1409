"""``distillq tail STREAM``: read entries without consuming them (XREVRANGE / XREAD, no consumer group).

``--decode`` renders one sequence per entry through a local tokenizer: prompt and completion text
with trainable parts marked and, for scored groups, the teacher's top-k next to each sampled token.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, cast

import redis.asyncio as aioredis

from pipeline.cli.commands.common import add_command, run_output, stream_name, with_redis
from pipeline.cli.summaries import (
    TokenDecoder,
    decode_entry,
    decode_sequence,
    format_decoded,
    one_line,
    summarize_entry,
)
from pipeline.config import add_redis_args, env
from pipeline.stages.exits import EXIT_USAGE, CliError
from pipeline.transport.consumer import resolve_payloads
from pipeline.transport.keys import Keys
from pipeline.transport.sharding import get_shards
from schemas import DecodeError, Message, RolloutGroup, ScoredGroup
from schemas.atropos import to_atropos


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = add_command(sub, "tail", "show the newest entries of a stream without consuming them",
                    "Show the newest entries of a stream, and with --follow the new ones as they come, without "
                    "consuming them (XREVRANGE/XREAD, no consumer group): the pipeline is not disturbed.")
    p.add_argument("stream", type=stream_name, help="rollouts, scored, batches or dlq; rollouts.POOL: the groups "
                                                    "waiting for teacher pool POOL")
    p.add_argument("--count", "-n", type=int, default=10, metavar="N", help="entries shown first")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing new entries until Ctrl-C")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.add_argument("--format", choices=["summary", "atropos"], default="summary",
                   help="summary: one line per entry; atropos: the reference ScoredDataGroup layout plus entry_id, "
                        "one JSON object per line (groups only)")
    p.add_argument("--group-id", default=None, metavar="ID",
                   help="only entries of this group id, and batches holding it (default: all); distillq where ID "
                        "looks in every stream")
    p.add_argument("--status", choices=["ok", "skipped", "dropped"], default=None,
                   help="only scored groups with this status (default: all)")
    p.add_argument("--decode", action="store_true",
                   help="show one sequence as text: trainable parts marked, and for scored groups the teacher's "
                        "top-k next to each sampled token")
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="local tokenizer directory for --decode, nothing is downloaded (default: $DISTILLQ_TOKENIZER)")
    p.add_argument("--seq", type=int, default=0, metavar="I", help="with --decode: which sequence")
    p.add_argument("--top", type=int, default=5, metavar="N", help="with --decode: teacher top-k entries shown")
    p.add_argument("--all-positions", action="store_true", help="with --decode: masked positions too")
    add_redis_args(p)
    p.set_defaults(func=main)


def _matches(args: argparse.Namespace, summary: dict[str, Any]) -> bool:
    if args.group_id is not None and args.group_id != summary.get("group_id") \
            and args.group_id not in summary.get("group_ids", ()):  # a batch holds several groups
        return False
    return args.status is None or summary.get("status") == args.status


def _payload_fields(fields: dict[bytes, bytes]) -> dict[bytes, bytes]:
    """A dead letter's original fields, or the entry's own."""
    if b"orig_d" in fields:
        return {k[len(b"orig_"):]: v for k, v in fields.items() if k.startswith(b"orig_")}
    return fields


def _decoded(args: argparse.Namespace, fields: dict[bytes, bytes], tok: TokenDecoder) -> dict[str, Any]:
    msg = decode_entry(_payload_fields(fields))
    if isinstance(msg, DecodeError):
        return {"error": f"undecodable: {msg}"}
    return decode_sequence(msg, tok, args.seq, top=args.top, all_positions=args.all_positions)


def render(args: argparse.Namespace, entry_id: str, fields: dict[bytes, bytes],
           tokenizer: TokenDecoder | None = None) -> str | None:
    summary = summarize_entry(entry_id, fields)
    if not _matches(args, summary):
        return None
    if tokenizer is not None and args.format == "summary":
        decoded = _decoded(args, fields, tokenizer)
        if args.json:
            return json.dumps({**summary, "decoded": decoded}, ensure_ascii=False)
        return "\n".join([one_line(summary), *format_decoded(decoded)])
    if args.format == "atropos":
        msg: Message | DecodeError = decode_entry(fields)
        if isinstance(msg, RolloutGroup | ScoredGroup):
            obj = to_atropos(msg)
            obj["entry_id"] = entry_id
            return json.dumps(obj)
        return json.dumps({**summary, "error": str(msg) if isinstance(msg, DecodeError) else "not a group"})
    return json.dumps(summary) if args.json else one_line(summary)


def load_tokenizer(path: str | None) -> TokenDecoder | str:
    """A tokenizer from a local path, or why there is none."""
    if not path:
        return "--decode needs --tokenizer PATH or $DISTILLQ_TOKENIZER"
    if not Path(path).exists():
        return f"tokenizer path {path!r} does not exist (local paths only; nothing is downloaded)"
    try:
        from transformers import AutoTokenizer
    except ImportError:
        return "--decode needs transformers (pip install 'distillq[hf]')"
    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        return f"cannot load a tokenizer from {path!r}: {e}"
    return cast(TokenDecoder, tok)


async def tail(redis: aioredis.Redis, keys: Keys, args: argparse.Namespace,
               tokenizer: TokenDecoder | None = None) -> int:
    stream_keys = keys.streams(args.stream, await get_shards(redis, keys))
    entries: list[tuple[tuple[int, int], str, dict[bytes, bytes]]] = []
    last: dict[str, str] = {}
    for key in stream_keys:  # the newest N over all shards, merged by entry id
        rows = await redis.xrevrange(key, count=args.count) if args.count > 0 else []
        await resolve_payloads(redis, [fields for _, fields in rows])
        entries += [(_order(eid.decode()), eid.decode(), fields) for eid, fields in rows]
        last[key] = rows[0][0].decode() if rows else "$"
    shown = 0
    for _, eid, fields in sorted(entries, key=lambda e: e[0])[-args.count :] if args.count > 0 else []:
        shown += _print(render(args, eid, fields, tokenizer))
    if not entries and args.count > 0:
        _note(f"(stream {args.stream} is empty)")
    elif not shown and args.count > 0:
        _note(f"(none of the newest {min(len(entries), args.count)} entries of stream {args.stream} match)")
    block = max(10, 1000 // len(stream_keys))
    while args.follow:
        for key in stream_keys:  # one key per XREAD: shards live in different hash slots
            resp = await redis.xread({key: last[key]}, block=block, count=100)
            for _stream, items in resp or ():
                await resolve_payloads(redis, [fields for _, fields in items])
                for eid, fields in items:
                    last[key] = eid.decode()
                    _print(render(args, last[key], fields, tokenizer))
    return 0


def _order(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _print(line: str | None) -> bool:
    if line is not None:
        print(line, flush=True)
    return line is not None


def _note(text: str) -> None:
    """A remark for the reader, on stderr: stdout keeps entries only (one JSON object per line with --json)."""
    print(text, file=sys.stderr, flush=True)


def main(args: argparse.Namespace) -> int:
    tokenizer: TokenDecoder | None = None
    if args.decode:
        if args.format != "summary":
            raise CliError("tail: --decode applies to --format summary only", EXIT_USAGE)
        loaded = load_tokenizer(args.tokenizer or env("TOKENIZER"))
        if isinstance(loaded, str):
            raise CliError(f"tail: {loaded}", EXIT_USAGE)
        tokenizer = loaded
    return run_output(with_redis(args, lambda r, k: tail(r, k, args, tokenizer)))
