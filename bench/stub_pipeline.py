"""The floor for ``bench.transport``: distillq's stream operations on pre-built bytes, no logic.

Same topology, connections, field names and payload sizes as the real stages: producer XADD ->
teacher XREADGROUP (8) / per entry MULTI of SET payload + XADD header (the claim check) / XACK+XDEL ->
feeder XREADGROUP (8) / XADD of one batch manifest per ``batch_groups`` entries / XACK+XDEL -> learner
XREADGROUP (1) / MGET of the batch's payloads / XACK+XDEL / DEL of the payloads. Nothing is encoded,
decoded, validated or scored: payloads are bytes made once. ``producer=True`` writes every entry with
``StreamProducer.send_raw`` instead of a plain XADD (distillq's write protocol: dedupe markers, backlog
cap, atomic add), which prices that protocol apart from the stages' logic.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import redis.asyncio as aioredis

from bench.common import Meter, Window, Workload, client, drop_namespace, new_group, stream_settings
from pipeline.stages.batching import BatchingConfig, Pending, build_batch
from pipeline.transport.claimcheck import encode_header, header_of
from pipeline.transport.keys import Keys
from pipeline.transport.producer import StreamProducer
from schemas import encode
from schemas.build import synthetic_scored

READ = 8  # entries per XREADGROUP, as StreamSettings.read_count


@dataclass
class StubPipeline:
    url: str
    keys: Keys
    work: Workload
    payloads: dict[str, bytes | memoryview]
    header: bytes  # the scored group's claim-check header
    producer: bool = False
    clients: list[aioredis.Redis] = field(default_factory=list)
    producers: dict[tuple[int, str], StreamProducer] = field(default_factory=dict)

    @classmethod
    async def build(cls, url: str, keys: Keys, work: Workload, *, producer: bool = False) -> StubPipeline:
        """Payloads as large as distillq's: a rollout, a scored group, its header and a batch manifest."""
        rollout = work.rollout()
        scored = synthetic_scored(rollout, work.k)
        groups = [msgspec.structs.replace(scored, group=new_group(rollout, f"g{i}")) for i in range(work.batch_groups)]
        key = keys.payload(keys.stream("scored"), "g0", "0123456789ab")
        batch = build_batch([Pending(str(i), header_of(g), key) for i, g in enumerate(groups)], 1.0, 0,
                            BatchingConfig()).batch
        payloads: dict[str, bytes | memoryview] = {"rollout": encode(rollout), "scored": encode(scored),
                                                   "batch": encode(batch)}
        stub = cls(url, keys, work, payloads, encode_header(scored), producer)
        r = stub._client()
        for name in ("rollouts", "scored", "batches"):
            await r.xgroup_create(keys.stream(name), keys.consumer_group(name), id="0", mkstream=True)
        return stub

    def _client(self) -> aioredis.Redis:
        self.clients.append(client(self.url))
        return self.clients[-1]

    async def add(self, r: aioredis.Redis, stream: str, kind: bytes, gid: str, data: bytes | memoryview) -> None:
        header = self.header if stream == "scored" else None
        if self.producer:
            p = self.producers.get((id(r), stream))
            if p is None:
                p = self.producers[id(r), stream] = StreamProducer(r, self.keys, stream, stream_settings())
            await p.send_raw(data, kind, gid, header=header)
        elif header is not None:  # the claim check: payload in its own key, header in the entry
            key = self.keys.payload(self.keys.stream(stream), gid, "0123456789ab")
            async with r.pipeline(transaction=True) as pipe:
                pipe.set(key, data)
                pipe.xadd(self.keys.stream(stream), {b"t": kind, b"gid": gid.encode(), b"h": header, b"p": key})
                await pipe.execute()
        else:
            await r.xadd(self.keys.stream(stream), {b"t": kind, b"gid": gid.encode(), b"d": data})

    async def ack(self, r: aioredis.Redis, stream: str, ids: list[bytes]) -> None:
        key = self.keys.stream(stream)
        async with r.pipeline(transaction=False) as pipe:
            pipe.xack(key, self.keys.consumer_group(stream), *ids)
            pipe.xdel(key, *ids)
            await pipe.execute()

    async def read(self, r: aioredis.Redis, stream: str, count: int) -> list[Any]:
        group, key = self.keys.consumer_group(stream), self.keys.stream(stream)
        resp = await r.xreadgroup(group, "c", {key: ">"}, count=count, block=200)
        return [e for _s, entries in resp or () for e in entries]

    def start(self, stop: asyncio.Event, win: Window, meter: Meter) -> list[Awaitable[Any]]:
        p, per_batch = self.payloads, self.work.batch_groups
        r_prod, r_teach, r_feed, r_learn = (self._client() for _ in range(4))

        async def produce() -> None:
            i = 0
            while not stop.is_set():
                await win.acquire()
                await self.add(r_prod, "rollouts", b"rollout", f"g{i}", p["rollout"])
                i += 1

        async def teacher() -> None:
            while not stop.is_set():
                entries = await self.read(r_teach, "rollouts", READ)
                for _eid, f in entries:
                    await self.add(r_teach, "scored", b"scored", f[b"gid"].decode(), p["scored"])
                if entries:
                    await self.ack(r_teach, "rollouts", [e for e, _ in entries])

        async def feeder() -> None:
            held: list[tuple[bytes, bytes]] = []
            n = 0
            while not stop.is_set():
                held += [(e, f[b"p"]) for e, f in await self.read(r_feed, "scored", READ)]
                while len(held) >= per_batch:
                    take, held = held[:per_batch], held[per_batch:]
                    # The manifest's bytes are fixed; the learner gets the real keys from a side table.
                    refs[f"b{n}"] = [k for _, k in take]
                    await self.add(r_feed, "batches", b"batch", f"b{n}", p["batch"])
                    await self.ack(r_feed, "scored", [e for e, _ in take])
                    n += 1

        refs: dict[str, list[bytes]] = {}

        async def learner() -> None:
            while not stop.is_set():
                for eid, f in await self.read(r_learn, "batches", 1):
                    blobs = refs.pop(f[b"gid"].decode())
                    await r_learn.mget(blobs)
                    await self.ack(r_learn, "batches", [eid])
                    await r_learn.delete(*blobs)
                    meter.add(per_batch)
                    await win.release(per_batch)

        return [produce(), teacher(), feeder(), learner()]

    async def close(self) -> None:
        await drop_namespace(self.clients[0], self.keys)
        for c in self.clients:
            await c.aclose()

