"""Feeder throughput vs a bare read-decode-ack loop over the same stream (issue 5; not a test).

    python -m bench.feeder [--groups 400] [--seq-len 512] [--k 8] [--rounds 3]

Each round fills the scored stream with the same N groups, then (a) drains it with a bare loop
(XREADGROUP COUNT 8, decode with the same validation, XACK+XDEL), and (b) refills it and runs the
feeder (batches of 8 groups, advantages, TrainBatch written to the batches stream) with a no-op learner
that reads, decodes and acks every batch, until every group reached the learner. Rounds alternate
(a) and (b) on a private redis-server; the table reports best and median groups/s and the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import time

from pipeline.batching import BatchingConfig
from pipeline.config import RedisSettings, StreamSettings
from pipeline.connection import connect
from pipeline.consumer import StreamConsumer
from pipeline.feeder import Feeder
from pipeline.keys import Keys
from pipeline.kl_control import ConstantKL
from pipeline.learner import AsyncLearner
from pipeline.producer import StreamProducer, message_id, message_type
from schemas import ScoredGroup, decode, encode
from schemas.build import synthetic_rollout, synthetic_scored
from tests.redis_server import RedisServer


def settings() -> StreamSettings:
    return StreamSettings(block_ms=50, max_backlog=100_000, read_count=8, claim_interval_ms=60_000)


async def fill(url: str, keys: Keys, payloads: list[tuple[bytes, bytes, str]]) -> None:
    r = connect(RedisSettings(redis_url=url))
    p = StreamProducer(r, keys, "scored", settings(), dedupe=False)
    for data, mtype, gid in payloads:
        await p.send_raw(data, mtype, gid)
    await r.aclose()


async def bare(url: str, keys: Keys, n: int) -> float:
    r = connect(RedisSettings(redis_url=url))
    c = StreamConsumer(r, keys, "scored", "bare", settings(), group="bare")
    await c.ensure_group()
    t0 = time.perf_counter()
    done = 0
    while done < n:
        batch = await c.read(8)
        for d in batch:
            decode(d.payload, expect=ScoredGroup)
        await c.ack(batch)
        done += len(batch)
    dt = time.perf_counter() - t0
    await r.aclose()
    return n / dt


async def feeder(url: str, keys: Keys, n: int) -> float:
    r = connect(RedisSettings(redis_url=url))
    f = Feeder(r, keys, BatchingConfig(max_batch_groups=8, max_batch_tokens=10**9, max_wait_s=0.05,
                                       max_staleness=None), ConstantKL(0.1), settings(), consumer_name="f")
    learner = AsyncLearner(redis=r, namespace=keys.namespace, settings=settings())
    stop = asyncio.Event()
    t0 = time.perf_counter()
    task = asyncio.create_task(f.run(stop))
    got = 0
    while got < n:
        b = await learner.next_batch(timeout_s=30)
        if b is None:
            raise RuntimeError(f"learner starved after {got} groups")
        got += len(b.batch.groups)
        await learner.ack(b)
    dt = time.perf_counter() - t0
    stop.set()
    await task
    await r.aclose()
    return n / dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--groups", type=int, default=400)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    groups = [synthetic_scored(synthetic_rollout(8, a.seq_len, group_id=f"g{i}", seed=i), k=a.k, seed=i)
              for i in range(a.groups)]
    payloads = [(encode(g), message_type(g), message_id(g)) for g in groups]
    mb = sum(len(p[0]) for p in payloads) / 1e6
    server = RedisServer().start()
    results: dict[str, list[float]] = {"bare": [], "feeder": []}
    try:
        for rnd in range(a.rounds):
            for name, fn in (("bare", bare), ("feeder", feeder)):
                keys = Keys(f"b{rnd}{name}")
                asyncio.run(fill(server.url, keys, payloads))
                results[name].append(asyncio.run(fn(server.url, keys, a.groups)))
    finally:
        server.stop()
    print(f"# feeder benchmark: {a.groups} scored groups of 8 x {a.seq_len} tokens, k={a.k} ({mb:.0f} MB); "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}")
    print("| loop | best groups/s | median groups/s |")
    print("|---|---|---|")
    for name, xs in results.items():
        print(f"| {name} | {max(xs):.0f} | {statistics.median(xs):.0f} |")
    best = max(results["feeder"]) / max(results["bare"])
    med = statistics.median(results["feeder"]) / statistics.median(results["bare"])
    print(f"| feeder / bare | {best:.2f} | {med:.2f} |  (target >= 0.90)")


if __name__ == "__main__":
    main()
