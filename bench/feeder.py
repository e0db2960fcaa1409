"""Feeder throughput vs a bare read-decode-ack loop over the same stream (not a test).

    python -m bench.feeder [--groups 1000] [--seq-len 512] [--k 8] [--rounds 3]

Each round fills the scored stream with the same N groups (as teacher workers write them: a header
entry plus the payload in its own key, see ``pipeline.transport.claimcheck``), then (a) drains it with a bare
loop (XREADGROUP COUNT 8, MGET of the payloads, decode with full validation, XACK+XDEL+DEL), and (b)
refills it and runs the feeder (headers only: batches of 8 groups, ``BatchManifest`` written to the
batches stream) with a no-op learner client (reads each batch, fetches and validates its groups,
computes the advantages, acks), until every group reached the learner: (b) with the feeder as an
asyncio task in the learner's process, and (b') with the feeder as its own process, as it is deployed
(``distillq worker feeder``; the clock starts once it is connected). (a') is the bare loop over the
pre-claim-check layout (payload inline in the entry), for context. Rounds alternate the loops on a
private redis-server; the table reports best and median groups/s and the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import multiprocessing
import os
import platform
import statistics
import time
from collections.abc import Sequence

import redis.asyncio as aioredis

from pipeline.config import RedisSettings, StreamSettings
from pipeline.learner.client import AsyncLearner
from pipeline.logs import configure_logging
from pipeline.stages.batching import BatchingConfig
from pipeline.stages.feeder import Feeder
from pipeline.stages.kl_control import ConstantKL
from pipeline.transport.claimcheck import encode_header
from pipeline.transport.connection import connect
from pipeline.transport.consumer import StreamConsumer
from pipeline.transport.keys import Keys
from pipeline.transport.producer import StreamProducer, message_id, message_type
from schemas import ScoredGroup, decode, encode
from schemas.build import synthetic_rollout, synthetic_scored
from tests.redis_server import RedisServer

GROUPS_PER_BATCH = 8


def settings() -> StreamSettings:
    return StreamSettings(block_ms=50, max_backlog=100_000, read_count=8, claim_interval_ms=60_000)


async def fill(url: str, keys: Keys, payloads: Sequence[tuple[bytes | memoryview, bytes, str, bytes]], *,
               inline: bool = False) -> None:
    r = connect(RedisSettings(redis_url=url))
    p = StreamProducer(r, keys, "scored", settings(), dedupe=False)
    for data, mtype, gid, header in payloads:
        if inline:
            await r.xadd(keys.stream("scored"), {b"t": mtype, b"gid": gid, b"d": data})
        else:
            await p.send_raw(data, mtype, gid, header=header)
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
            decode(d.payload, expect=ScoredGroup)  # full validation, as the learner client does
        await c.ack(batch)
        done += len(batch)
    dt = time.perf_counter() - t0
    await r.aclose()
    return n / dt


async def learn(r: aioredis.Redis, keys: Keys, n: int, prefetch: bool = True) -> None:
    """The no-op learner: the client's iterator (fetch, validate, advantages), then ack."""
    learner = AsyncLearner(redis=r, namespace=keys.namespace, settings=settings(), prefetch=prefetch)
    got = 0
    while got < n:
        b = await learner.next_batch(timeout_s=30)
        if b is None:
            raise RuntimeError(f"learner starved after {got} groups")
        got += len(b.batch.groups)
        await learner.ack(b)
    await learner.aclose()


def make_feeder(r: aioredis.Redis, keys: Keys) -> Feeder:
    """The feeder both (b) and (b') run: batches of ``GROUPS_PER_BATCH`` groups, no token or staleness bound."""
    cfg = BatchingConfig(max_batch_groups=GROUPS_PER_BATCH, max_batch_tokens=10**9, max_wait_s=0.05,
                         max_staleness=None)
    return Feeder(r, keys, cfg, ConstantKL(0.1), settings(), consumer_name="f")


def _feeder_process(url: str, namespace: str) -> None:
    """A feeder worker in its own process, as deployed: waits for the go key, then drains ``scored``."""
    configure_logging("WARNING")

    async def go() -> None:
        r, keys = connect(RedisSettings(redis_url=url)), Keys(namespace)
        f = make_feeder(r, keys)
        await r.set(f"{namespace}:bench:ready", 1)
        await r.blpop([f"{namespace}:bench:go"], timeout=60)  # type: ignore[misc]
        await f.run(asyncio.Event(), burst=True)
        await r.aclose()

    asyncio.run(go())


async def feeder_process(url: str, keys: Keys, n: int, prefetch: bool = True) -> float:
    r = connect(RedisSettings(redis_url=url))
    proc = multiprocessing.get_context("spawn").Process(target=_feeder_process, args=(url, keys.namespace))
    proc.start()
    while not await r.get(f"{keys.namespace}:bench:ready"):
        await asyncio.sleep(0.05)
    t0 = time.perf_counter()
    await r.rpush(f"{keys.namespace}:bench:go", 1)  # type: ignore[misc]
    await learn(r, keys, n, prefetch)
    dt = time.perf_counter() - t0
    await asyncio.to_thread(proc.join, 30)
    await r.aclose()
    return n / dt


async def feeder(url: str, keys: Keys, n: int, prefetch: bool = True) -> float:
    r = connect(RedisSettings(redis_url=url))
    f = make_feeder(r, keys)
    stop = asyncio.Event()
    t0 = time.perf_counter()
    task = asyncio.create_task(f.run(stop))
    await learn(r, keys, n, prefetch)
    dt = time.perf_counter() - t0
    stop.set()
    await task
    await r.aclose()
    return n / dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--groups", type=int, default=1000)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-prefetch", action="store_true", help="learner client without prefetch")
    a = ap.parse_args()
    prefetch = not a.no_prefetch
    groups = [synthetic_scored(synthetic_rollout(8, a.seq_len, group_id=f"g{i}", seed=i), k=a.k, seed=i)
              for i in range(a.groups)]
    payloads = [(encode(g), message_type(g), message_id(g), encode_header(g)) for g in groups]
    mb = sum(len(p[0]) for p in payloads) / 1e6
    server = RedisServer().start()
    configure_logging("WARNING")
    results: dict[str, list[float]] = {"bare": [], "feeder": [], "feeder_process": [], "bare_inline": []}
    loops = (("bare", bare), ("feeder", functools.partial(feeder, prefetch=prefetch)),
             ("feeder_process", functools.partial(feeder_process, prefetch=prefetch)), ("bare_inline", bare))
    try:
        for rnd in range(a.rounds):
            for name, fn in loops:
                keys = Keys(f"b{rnd}{name}")
                asyncio.run(fill(server.url, keys, payloads, inline=name == "bare_inline"))
                results[name].append(asyncio.run(fn(server.url, keys, a.groups)))
    finally:
        server.stop()
    print(f"# feeder benchmark: {a.groups} scored groups of 8 x {a.seq_len} tokens, k={a.k} ({mb:.0f} MB); "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}; "
          f"learner prefetch {'on' if prefetch else 'off'}")
    print("| loop | best groups/s | median groups/s |")
    print("|---|---|---|")
    for name, xs in results.items():
        print(f"| {name} | {max(xs):.0f} | {statistics.median(xs):.0f} |")
    for num, den, note in (("feeder_process", "bare", "(target >= 0.90)"), ("feeder", "bare", "(one process)"),
                           ("feeder_process", "bare_inline", "(context)")):
        best = max(results[num]) / max(results[den])
        med = statistics.median(results[num]) / statistics.median(results[den])
        print(f"| {num} / {den} | {best:.2f} | {med:.2f} |  {note}")


if __name__ == "__main__":
    main()
