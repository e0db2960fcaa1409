"""A learner process for the consumer-identity tests: ``Learner`` under a given consumer name that records each batch
it is handed and each ack, and can hold its first batch (trained, not yet acked) for a while.

    python -m tests.hold_learner --name learner-0 --record OUT.jsonl [--hold-first S] [--idle-exit S]

Each line of ``--record``: ``{"pid", "event": "start" | "batch" | "acked", "entry", "groups", "redelivered"}``.
Exits once no batch came for ``--idle-exit`` seconds, or through ``run_command`` (one line, its exit status) when
the learner client refuses (a name another live process holds).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from pipeline.learner.client import Learner
from pipeline.stages.exits import run_command
from tests.streams import process_settings


def record(path: Path, **fields: Any) -> None:
    with path.open("a") as f:
        f.write(json.dumps({"pid": os.getpid(), **fields}) + "\n")


def main(args: argparse.Namespace) -> int:
    with Learner(consumer_name=args.name, settings=process_settings()) as learner:
        record(args.record, event="start")
        held = False
        while (lb := learner.next_batch(args.idle_exit)) is not None:
            record(args.record, event="batch", entry=lb.entry_id, groups=lb.group_ids, redelivered=lb.redelivered)
            if not held and args.hold_first:
                held = True
                time.sleep(args.hold_first)
            record(args.record, event="acked", entry=lb.entry_id, ok=learner.ack(lb))
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--name", required=True)
    p.add_argument("--record", type=Path, required=True)
    p.add_argument("--hold-first", type=float, default=0.0)
    p.add_argument("--idle-exit", type=float, default=3.0)
    p.set_defaults(func=main)
    sys.exit(run_command(p.parse_args()))
