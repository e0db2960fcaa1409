"""Redis-backed state of the Atropos-compatible server: the trainer's registration and step, the envs,
per-env buffers, the groups in flight (posted, not yet scored) and the last group posted. Every key is a
``Keys.atropos*`` key, so a restarted server carries on where the last one stopped.

A posted group's env id travels in its own marker (``Keys.atropos_env``, with the dedupe TTL), which the
queue's enqueue script reads and deletes; the in-flight hash only counts groups for ``/status``. A record
leaves it when its group is queued, when a dead letter names the group (``reconcile_inflight`` reads the
DLQ by group id), or once it is older than the dedupe TTL.

What ``/reset_data`` keeps follows the reference: ``max_token_len``, ``checkpoint_dir``, the checkpoint
interval and the last group posted survive it; everything else is cleared (see ``AtroposState.reset``).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Final

import msgspec
import redis.asyncio as aioredis

from pipeline.serve.atropos.bodies import RegisterEnv, Registration
from pipeline.transport.keys import Keys

#: Registration fields as the trainer hash holds them (all but ``step``, ``started``, ``registered``).
_REG_INT: Final = ("batch_size", "max_token_len", "save_checkpoint_interval", "num_steps")
#: Kept by ``/reset_data``, as the reference keeps them.
_KEPT_ON_RESET: Final = ("max_token_len", "checkpoint_dir", "save_checkpoint_interval")
#: Dead letters read per call while reconciling the in-flight records.
DLQ_READ: Final = 50
_BUF: Final = msgspec.msgpack.Decoder(tuple[str, int, bytes, bytes])
_ENC: Final = msgspec.msgpack.Encoder()


def _s(v: bytes | str | None) -> str | None:
    return v.decode() if isinstance(v, bytes) else v


def env_field(env_id: int | None) -> str:
    """An env id as stored with a group: ``""`` for none."""
    return "" if env_id is None else str(env_id)


def env_of(field: bytes | str | None) -> int | None:
    s = _s(field)
    return int(s) if s else None


class Trainer(msgspec.Struct, frozen=True):
    """The trainer hash, typed."""

    registered: bool = False
    started: bool = False
    step: int = 0
    batch_size: int = -1
    max_token_len: int = -1
    save_checkpoint_interval: int = -1
    num_steps: int = -1
    checkpoint_dir: str = ""
    wandb_group: str | None = None
    wandb_project: str | None = None


class BufferedGroup(msgspec.Struct, frozen=True):
    """A group waiting in its env's buffer: its id, sequences, posted JSON and encoded RolloutGroup."""

    group_id: str
    sequences: int
    posted: bytes
    group: bytes

    def pack(self) -> bytes:
        return _ENC.encode((self.group_id, self.sequences, self.posted, self.group))

    @classmethod
    def unpack(cls, raw: bytes) -> BufferedGroup:
        return cls(*_BUF.decode(raw))


class AtroposState:
    """Reads and writes the server's keys. Callers serialize writers (the shared lock, ``lock``)."""

    def __init__(self, redis: aioredis.Redis, keys: Keys, *, ttl_s: int = 24 * 3600) -> None:
        self.redis, self.keys, self.ttl_s = redis, keys, ttl_s
        self.k_trainer, self.k_envs = keys.atropos("trainer"), keys.atropos("envs")
        self.k_inflight, self.k_inflight_at = keys.atropos("inflight"), keys.atropos("inflight_at")
        self.k_discard, self.k_latest = keys.atropos("discard"), keys.atropos("latest")
        self.k_dlq_cursor = keys.atropos("dlq_cursor")

    # ---- the trainer ----------------------------------------------------------------------------------

    async def trainer(self) -> Trainer:
        raw: dict[bytes, bytes] = await self.redis.hgetall(self.k_trainer)  # type: ignore[misc]
        h = {k.decode(): v.decode() for k, v in raw.items()}
        ints = {k: int(h[k]) for k in (*_REG_INT, "step") if k in h}
        return Trainer(registered=h.get("registered") == "1", started=h.get("started") == "1",
                       checkpoint_dir=h.get("checkpoint_dir", ""), wandb_group=h.get("wandb_group"),
                       wandb_project=h.get("wandb_project"), **ints)

    async def register(self, reg: Registration) -> int:
        """The first registration (none since the last reset) sets the config; later ones change nothing.
        Returns a requester id (a 128-bit integer, as the reference's ``uuid4().int``)."""
        if not (await self.trainer()).registered:
            fields: dict[str, str | int] = {
                "registered": 1, "started": 0, "step": reg.starting_step, "wandb_group": reg.wandb_group,
                "wandb_project": reg.wandb_project, "checkpoint_dir": reg.checkpoint_dir,
                **{k: getattr(reg, k) for k in _REG_INT},
            }
            envs = await self.redis.hlen(self.k_envs)  # type: ignore[misc]
            async with self.redis.pipeline(transaction=True) as p:
                p.delete(self.k_envs, *[self.keys.atropos_buffer(i) for i in range(int(envs))])
                p.hset(self.k_trainer, mapping=fields)
                await p.execute()
        return uuid.uuid4().int

    async def mark_started(self) -> None:
        await self.redis.hset(self.k_trainer, "started", "1")  # type: ignore[misc]

    async def reset(self) -> list[str]:
        """Forget the registration (keeping what the reference keeps), the envs and their buffers, and the
        groups in flight (added to the discard set: dropped when the teacher hands them on). Returns the
        in-flight group ids."""
        t = await self.trainer()
        envs = int(await self.redis.hlen(self.k_envs))  # type: ignore[misc]
        inflight: list[bytes] = await self.redis.hkeys(self.k_inflight)  # type: ignore[misc]
        present = await self._fields()
        kept = {k: getattr(t, k) for k in _KEPT_ON_RESET if k in present}
        async with self.redis.pipeline(transaction=True) as p:
            p.delete(self.k_trainer, self.k_envs, self.k_inflight, self.k_inflight_at,
                     *[self.keys.atropos_buffer(i) for i in range(envs)],
                     *[self.keys.atropos_env(g.decode()) for g in inflight])
            p.hset(self.k_trainer, mapping={"registered": 0, "started": 0, "step": 0, "batch_size": -1,
                                            "num_steps": -1, **kept})
            if inflight:
                p.sadd(self.k_discard, *inflight)
                p.expire(self.k_discard, 24 * 3600)
            await p.execute()
        return [g.decode() for g in inflight]

    async def _fields(self) -> set[str]:
        return {k.decode() for k in await self.redis.hkeys(self.k_trainer)}  # type: ignore[misc]

    # ---- envs -------------------------------------------------------------------------------------------

    async def envs(self) -> list[dict[str, Any]]:
        raw: dict[bytes, bytes] = await self.redis.hgetall(self.k_envs)  # type: ignore[misc]
        records = {int(k): json.loads(v) for k, v in raw.items()}
        return [records[i] for i in sorted(records)]

    async def register_env(self, req: RegisterEnv, t: Trainer) -> dict[str, Any]:
        envs = await self.envs()
        env_id = len(envs)
        real_name = f"{req.desired_name}_{sum(e['desired_name'] == req.desired_name for e in envs)}"
        record = {
            "max_context_len": req.max_token_length, "weight": req.weight, "desired_name": req.desired_name,
            "real_name": real_name, "registered_id": env_id, "last_update": time.time(), "connected": True,
            "min_batch_allocation": req.min_batch_allocation, "group_size": req.group_size,
        }
        await self.save_env(record)
        return {"status": "success", "env_id": env_id, "wandb_name": real_name, "checkpoint_dir": t.checkpoint_dir,
                "starting_step": t.step, "checkpoint_interval": t.save_checkpoint_interval,
                "num_steps": t.num_steps}

    async def save_env(self, record: dict[str, Any]) -> None:
        await self.redis.hset(self.k_envs, str(record["registered_id"]), json.dumps(record))  # type: ignore[misc]

    # ---- groups posted ----------------------------------------------------------------------------------

    async def track(self, group_id: str, env_id: int | None, sequences: int) -> bool:
        """Record a group as in flight, and its env id; False if it already is (the same group id posted again)."""
        async with self.redis.pipeline(transaction=True) as p:
            p.hsetnx(self.k_inflight, group_id, f"{env_field(env_id)}|{sequences}")
            p.zadd(self.k_inflight_at, {group_id: time.time()}, nx=True)
            p.set(self.keys.atropos_env(group_id), env_field(env_id), px=self.ttl_s * 1000, nx=True)
            created, _, _ = await p.execute()
        return bool(created)

    async def untrack(self, *group_ids: str) -> None:
        if not group_ids:
            return
        async with self.redis.pipeline(transaction=True) as p:
            p.hdel(self.k_inflight, *group_ids)
            p.zrem(self.k_inflight_at, *group_ids)
            p.delete(*[self.keys.atropos_env(g) for g in group_ids])
            await p.execute()

    async def inflight(self) -> list[tuple[int | None, int]]:
        """(env id, sequences) of each group in flight."""
        raw: list[bytes] = await self.redis.hvals(self.k_inflight)  # type: ignore[misc]
        out = []
        for v in raw:
            env, _, n = v.decode().partition("|")
            out.append((env_of(env), int(n)))
        return out

    async def reconcile_inflight(self) -> int:
        """Drop the in-flight records of groups that will never reach the queue: those a dead letter names
        (read from the DLQ since the last call, by group id) and those older than the dedupe TTL (their
        markers are gone). Returns how many were dropped."""
        if not await self.redis.zcard(self.k_inflight_at):  # nothing in flight: only later dead letters matter
            secs, micros = await self.redis.time()  # Redis' clock, which stamps the DLQ's entry ids
            await self.redis.set(self.k_dlq_cursor, f"{secs * 1000 + micros // 1000 - 1}-0")
            return 0
        stale: list[bytes] = await self.redis.zrangebyscore(self.k_inflight_at, "-inf", time.time() - self.ttl_s)
        lost = {g.decode() for g in stale}
        raw: bytes | None = await self.redis.get(self.k_dlq_cursor)
        if raw is not None:
            cursor = raw.decode()
        else:  # first run: from the oldest post on (stream ids are Redis' clock: an hour's margin for skew)
            oldest: list[tuple[bytes, float]] = await self.redis.zrange(self.k_inflight_at, 0, 0, withscores=True)
            cursor = f"{max(int((oldest[0][1] - 3600) * 1000), 0)}-0"
        while True:
            rows: list[Any] = await self.redis.xrange(self.keys.dlq, f"({cursor}", "+", count=DLQ_READ)
            for entry_id, fields in rows:
                gid = fields.get(b"orig_gid")
                if gid:
                    lost.add(gid.decode())
                cursor = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
            if len(rows) < DLQ_READ:
                break
        await self.redis.set(self.k_dlq_cursor, cursor)
        present = [g for g, there in zip(lost, await self._inflight_has(list(lost)), strict=True) if there]
        await self.untrack(*present)
        return len(present)

    async def _inflight_has(self, group_ids: list[str]) -> list[bool]:
        if not group_ids:
            return []
        async with self.redis.pipeline(transaction=False) as p:
            for g in group_ids:
                p.hexists(self.k_inflight, g)
            return [bool(x) for x in await p.execute()]

    async def set_latest(self, posted: bytes) -> None:
        await self.redis.set(self.k_latest, posted)

    async def latest(self) -> bytes | None:
        raw: bytes | None = await self.redis.get(self.k_latest)
        return raw

    # ---- per-env buffers ----------------------------------------------------------------------------------

    async def buffered(self, env_id: int) -> list[BufferedGroup]:
        raw: list[bytes] = await self.redis.lrange(self.keys.atropos_buffer(env_id), 0, -1)  # type: ignore[misc]
        return [BufferedGroup.unpack(r) for r in raw]

    async def buffer(self, env_id: int, g: BufferedGroup) -> None:
        await self.redis.rpush(self.keys.atropos_buffer(env_id), g.pack())  # type: ignore[misc]

    async def set_buffer(self, env_id: int, groups: list[BufferedGroup]) -> None:
        key = self.keys.atropos_buffer(env_id)
        async with self.redis.pipeline(transaction=True) as p:
            p.delete(key)
            if groups:
                p.rpush(key, *[g.pack() for g in groups])
            await p.execute()
