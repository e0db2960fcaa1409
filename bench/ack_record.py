"""What the learner's acknowledgement record costs on the hot path: a batch ack with its groups' batches markers
rewritten to ``acked:<entry>`` and the consumer-name check (``AsyncLearner.ack`` today) against the bare ack
(XACK + XDEL), side by side on one redis-server; and one audit of every stage stream (``pipeline.transport.audit``,
the feeder's every 30 s).

    python -m bench.ack_record [--groups 16 64] [--reps 400]

Each rep acks one batch entry both ways, alternated (the order flips every rep); the figures are the median
microseconds of each and their ratio. Redis is a private ``redis-server`` on a free port (``pipeline.cli.embedded``).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

from bench.provenance import header, run_info


async def _measure(url: str, groups: int, reps: int) -> dict[str, Any]:
    from pipeline.config import RedisSettings, StreamSettings
    from pipeline.transport.connection import connect
    from pipeline.transport.consumer import StreamConsumer
    from pipeline.transport.identity import Claim
    from pipeline.transport.keys import Keys

    r = connect(RedisSettings(redis_url=url))
    keys = Keys(f"ack{groups}")
    consumer = StreamConsumer(r, keys, "batches", "learner-0", StreamSettings(), stage="learner")
    await consumer.ensure_group()
    claim = Claim(r, keys, keys.learner_health("learner-0", 0), "learner consumer learner-0 rank 0")
    await claim.take(lambda: {"pid": 1}, 60_000, 0.0)
    key = keys.stream("batches")
    timings: dict[str, list[float]] = {"recorded": [], "bare": []}
    try:
        for rep in range(reps):
            for variant in (("recorded", "bare") if rep % 2 == 0 else ("bare", "recorded")):
                gids = [f"r{rep}-{variant}-{i}" for i in range(groups)]
                marks = [keys.seen("batches", g) for g in gids]
                eid = (await r.xadd(key, {b"t": b"batch", b"d": b"x"})).decode()
                async with r.pipeline(transaction=False) as p:
                    for m in marks:
                        p.set(m, eid, px=86_400_000)
                    await p.execute()
                (d,) = await consumer.read(1, block_ms=100)
                t0 = time.perf_counter()
                if variant == "recorded":
                    await claim.check()
                    await consumer.ack([d], acked_markers=marks)
                else:
                    await consumer.ack([d])
                timings[variant].append(time.perf_counter() - t0)
        await r.xadd(key, {b"t": b"batch", b"d": b"x"})  # one waiting: the audit reads a stream with a group
        t0 = time.perf_counter()
        from pipeline.transport.audit import audit_streams

        audits = 20
        for _ in range(audits):
            await audit_streams(r, keys, writer="bench")
        audit_s = (time.perf_counter() - t0) / audits
    finally:
        await r.aclose()
    rec, bare = (statistics.median(timings[v]) * 1e6 for v in ("recorded", "bare"))
    return {"groups": groups, "reps": reps, "recorded_us": round(rec, 1), "bare_us": round(bare, 1),
            "ratio": round(rec / bare, 3), "audit_ms": round(audit_s * 1000, 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.ack_record", description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", type=int, nargs="+", default=[16, 64], help="groups per batch (default: 16 64)")
    ap.add_argument("--reps", type=int, default=400, help="acks of each kind per size (default: 400)")
    a = ap.parse_args(argv)
    from pipeline.cli.embedded import EmbeddedRedis

    print(header("bench.ack_record", run_info()))
    server = EmbeddedRedis().start()
    try:
        for g in a.groups:
            row = asyncio.run(_measure(server.url, g, a.reps))
            print(f"{g:>4} groups/batch: ack with the record {row['recorded_us']} us, bare {row['bare_us']} us "
                  f"(ratio {row['ratio']}); one audit of every stage stream {row['audit_ms']} ms")
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
