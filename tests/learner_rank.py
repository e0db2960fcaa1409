"""One learner rank as a process, for tests: reads batches as rank R of N and records what it got.

    python -m tests.learner_rank URL NAMESPACE RANK WORLD OUT.jsonl [--batches N] [--hold-at I] [--step-s S]

Each batch handed out is a JSON line ``{"event": "got", ...}`` (entry, batch id, group ids, tokens,
redelivered, generation); each ack a line ``{"event": "ack", ...}`` with the ranks' ack code (-1 refused,
1 counted, 2 settled the batch). ``--hold-at I``: on the I-th batch handed out, write the ``got`` line and
then sleep without acking (to be killed). Exits after ``--batches`` settled-or-counted acks, or when no
batch comes for ``--idle-s``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

from pipeline.learner.client import AsyncLearner
from tests.streams import fast


async def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("namespace")
    p.add_argument("rank", type=int)
    p.add_argument("world", type=int)
    p.add_argument("out")
    p.add_argument("--batches", type=int, default=1 << 30)
    p.add_argument("--hold-at", type=int, default=0)
    p.add_argument("--step-s", type=float, default=0.0)
    p.add_argument("--idle-s", type=float, default=5.0)
    a = p.parse_args(argv)
    settings = fast(claim_idle_ms=2000, claim_interval_ms=100)
    learner = AsyncLearner(a.url, namespace=a.namespace, settings=settings, rank=a.rank, world_size=a.world)
    assert learner._ranks is not None
    ranks = learner._ranks
    codes: list[int] = []
    real_ack = ranks.ack

    async def ack(entry_id: str, generation: int) -> int:  # record the ranks' ack code
        codes.append(await real_ack(entry_id, generation))
        return codes[-1]

    ranks.ack = ack  # type: ignore[method-assign]
    handed = acked = 0
    with open(a.out, "a") as out:
        def emit(rec: dict[str, Any]) -> None:
            out.write(json.dumps({"rank": a.rank, "t": time.time(), **rec}) + "\n")
            out.flush()

        emit({"event": "start", "token": ranks.token})
        while acked < a.batches:
            lb = await learner.next_batch(a.idle_s)
            if lb is None:
                break
            handed += 1
            tokens = sum(s.length for g in lb.batch.groups for s in g.group.sequences)
            emit({"event": "got", "entry": lb.entry_id, "batch_id": lb.batch.batch_id, "groups": lb.group_ids,
                  "tokens": tokens, "redelivered": lb.redelivered, "generation": lb.generation,
                  "stats": lb.batch.stats})
            if handed == a.hold_at:
                await asyncio.sleep(3600)
            if a.step_s:
                await asyncio.sleep(a.step_s)
            ok = await learner.ack(lb)
            emit({"event": "ack", "entry": lb.entry_id, "ok": ok, "code": codes[-1]})
            acked += ok
        emit({"event": "end"})
    await learner.aclose()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(sys.argv[1:])))
