"""Every Redis key distillq uses, in one place.

All keys live under a namespace (default ``distillq``) so several pipelines share one Redis. Keys that
one operation touches together share a hash tag (``{...}``, which includes the namespace), so the same
code runs on Redis Cluster, and each stream shard gets its own slot:

=================================================  ============  ==============================================
key                                                type          written by / meaning
=================================================  ============  ==============================================
``{ns:prompts}``                                   stream        ``distillq enqueue``: prompts; read by rollout workers
``{ns:prompts}:prompt:<epoch>:<prompt id>``        hash (TTL)    ``enqueue`` / rollout workers: a prompt's job, its
                                                                 latest entry, the group written, its last error
                                                                 (``transport.prompts``)
``{ns:rollouts}`` (shard i of S>1: ``{ns:rollouts:i~n}``)  stream  rollout workers / producers; read by teachers
``{ns:rollouts.<pool>}`` (``{ns:rollouts.<pool>:i~n}``)  stream  the same, for the groups of teacher pool <pool>
                                                                 (``pool_stream``; the pool ``default`` is
                                                                 ``{ns:rollouts}``)
``ns:pools``                                       set           producers: every teacher pool a group was sent to
``{ns:scored}`` (``{ns:scored:i}``)                stream        teacher workers; read by the feeder
``{ns:batches}``                                   stream        feeder; read by the learner (never sharded)
``{ns:dlq}``                                       stream        any stage: dead letters (stage, reason, bytes)
``<stream key>:seen:<group id>``                   string (TTL)  producer: dedupe marker -> entry id written; a
                                                                 ``batches`` one becomes ``acked:<entry id>`` when a
                                                                 learner acknowledges that batch
``<stream key>:reserving``                         zset          producer: writes reserved, not yet done (cap)
``<scored stream key>:payload:<group id>:<n>``     string (TTL)  teacher: a scored group's bytes (claim check,
                                                                 ``transport.claimcheck``); deleted by the learner
                                                                 client when it acks the batch holding the group
``ns:health:<stage>:<consumer>``                   string (TTL)  worker heartbeat (JSON), read by ``--check``;
                                                                 also the consumer name's claim: one live process
                                                                 per name (``transport.identity``)
``<stream key>:audit``                             string        ``transport.audit``: entries added, length and
                                                                 entries lost at the stream's last audit
``ns:policy_version``                              string        learner: current policy version (int)
``ns:pacing``                                      hash          rollout workers with ``--max-ahead``: groups
                                                                 started and the version they last saw
                                                                 (``transport.pacing``)
``ns:learner_health:<consumer>:<rank>``            string (TTL)  learner rank heartbeat (JSON: step, held batches,
                                                                 versions; ``pipeline.learner.health``), for
                                                                 ``stats``; the claim of that name and rank
``{ns:batches}:ranks``                             hash          learner ranks: world size, generation, the batch
                                                                 entry all ranks work on, its delivery version
``{ns:batches}:ranks:joined``                      hash          learner ranks: rank -> process token (this gen)
``{ns:batches}:ranks:acked``                       set           learner ranks: ranks that acked the current batch
``{ns:batches}:ranks:reading``                     string (TTL)  learner ranks: the rank reading the next batch
``ns:kl``                                          string        feeder: KL controller state (JSON)
``ns:dropped:<group id>``                          string (TTL)  feeder: why it dropped a group (stale, no payload;
                                                                 JSON), for ``distillq where``
``ns:config``                                      hash          pipeline settings all workers agree on (shards)
``ns:incidents``                                   stream        any process: faults outside distillq it noticed
                                                                 (Redis reset, data lost), for ``stats``
                                                                 ``attention:`` (``transport.incidents``)
``ns:demo``                                        string        ``distillq demo``: this namespace is the demo's (the
                                                                 next demo run may delete its keys; a namespace
                                                                 without it is never deleted by the demo)
``ns:sentinel``                                    hash          first consumer of the namespace: a random token
                                                                 that lives as long as the namespace's data; a
                                                                 worker that finds it gone or changed names the
                                                                 data loss (``transport.resets``)
``{ns:atropos}:trainer``                           hash          ``serve atropos``: the trainer's registration
                                                                 (batch size, ...), step, started
``{ns:atropos}:envs``                              hash          ``serve atropos``: env id -> env record (JSON)
``{ns:atropos}:buffer:<env id>``                   list          ``serve atropos``: groups of another size than
                                                                 their env's, waiting for a set that fills it
``{ns:atropos}:inflight``                          hash          ``serve atropos``: group id -> ``env|sequences`` of
                                                                 groups posted and not yet scored
``{ns:atropos}:inflight_at``                       zset          ``serve atropos``: the same groups by post time
``{ns:atropos}:discard``                           set           ``serve atropos``: groups posted before a reset,
                                                                 dropped when they come out of the teacher
``{ns:atropos}:queue``                             stream        ``serve atropos``: scored groups waiting for
                                                                 ``/batch`` (id, payload key, sequences, env)
``{ns:atropos}:seen:<group id>``                   string (TTL)  ``serve atropos``: dedupe marker of a group queued
``{ns:atropos}:leases``                            hash          ``serve atropos``: leased batch id -> its groups
``{ns:atropos}:lease_deadlines``                   zset          ``serve atropos``: leased batch id -> deadline (ms)
``{ns:atropos}:latest``                            string        ``serve atropos``: the last group posted (JSON)
``{ns:atropos}:front``                             hash          ``serve atropos``: groups put back ahead of the
                                                                 queue (queue entry id -> the group, JSON)
``{ns:atropos}:counts``                            hash          ``serve atropos``: ``env|sequences`` -> groups
                                                                 queued (queue and front), for ``/status-env``
``{ns:atropos}:env:<group id>``                    string (TTL)  ``serve atropos``: env id of a group posted and
                                                                 not yet queued
``{ns:atropos}:dlq_cursor``                        string        ``serve atropos``: the last dead letter read for
                                                                 groups lost in flight
``{ns:atropos}:lock``                              string (TTL)  ``serve atropos``: the writers' lock, shared by
                                                                 every replica (``pipeline.serve.atropos.lock``)
``{ns:atropos}:buffers_lock``                      string (TTL)  ``serve atropos``: the lock of the per-env buffers
=================================================  ============  ==============================================

The ``serve atropos`` keys share one hash tag, ``{ns:atropos}``, so its scripts touch several at once.

Weights published to a ``redis://`` location live in a Redis (by default a database) of their own, under their own
prefix, not the namespace: their keys are named in ``pipeline.weightstore.keys``.

Teacher pools (``schemas.pools``): each pool has its own rollouts stream, read by the ``teacher`` consumer group of
that pool's workers; a pool stream is sharded like ``rollouts``, and its short name is ``rollouts.<pool>``.

Sharding: ``rollouts`` and ``scored`` may be split into S shards (``ns:config`` field ``shards``); a
group's shard is a stable hash of its group id, so its dedupe marker shares the shard's slot.
``batches`` and ``dlq`` are single streams: a batch's dedupe markers (one per group) must share one slot.
``prompts`` is a single stream too: each prompt's record shares its slot, so one script checks the record and adds
the entry; a prompt is read once per group sampled, far below what one slot serves.

Each stage stream is read by exactly one consumer group (named after the consuming stage, see
``CONSUMER_GROUPS``) which deletes entries once acknowledged, so a stream's length is its backlog.
Debugging readers (``distillq tail``) use XRANGE/XREAD and never join a group.
"""

from __future__ import annotations

import functools
import re
import zlib
from dataclasses import dataclass
from typing import Final

from redis.crc import key_slot

from schemas.pools import DEFAULT_POOL, check_pool

#: Short stage-stream names, as the CLI takes them.
STREAMS: Final = ("prompts", "rollouts", "scored", "batches", "dlq")
#: The consumer group that reads each stage stream.
CONSUMER_GROUPS: Final = {"prompts": "rollout", "rollouts": "teacher", "scored": "feeder", "batches": "learner"}
#: Streams that may be sharded (see ``shard_of``).
SHARDABLE: Final = frozenset({"rollouts", "scored"})
MAX_SHARDS: Final = 1024
#: The single keys of the Atropos-compatible server (``Keys.atropos``).
ATROPOS_PARTS: Final = frozenset(
    {"trainer", "envs", "inflight", "inflight_at", "discard", "queue", "leases", "lease_deadlines", "latest",
     "front", "counts", "dlq_cursor", "lock", "buffers_lock"}
)


SLOTS: Final = 16384


@functools.lru_cache(maxsize=4096)
def shard_tag(namespace: str, name: str, shard: int, shards: int) -> str:
    """The hash tag of shard ``shard`` of ``shards``: ``ns:name:i``, salted (``ns:name:i~n``) so its cluster
    slot falls in the i-th of ``shards`` equal slot ranges. A cluster that splits its slots evenly over its
    masters (the default) thus gets the shards spread evenly; every process computes the same keys."""
    lo, hi = shard * SLOTS // shards, (shard + 1) * SLOTS // shards
    margin = (hi - lo) // 8  # away from the range's ends, where cluster tools may split differently by a slot
    for salt in range(1 << 20):
        tag = f"{namespace}:{name}:{shard}" + (f"~{salt}" if salt else "")
        if lo + margin <= key_slot(tag.encode()) < hi - margin:
            return tag
    raise RuntimeError(f"no tag found for shard {shard} of {shards}")  # unreachable in practice


def family(name: str) -> str:
    """The stage stream a short name belongs to: ``rollouts.math`` (teacher pool ``math``) -> ``rollouts``."""
    return name.split(".", 1)[0]


def pool_stream(pool: str) -> str:
    """The short name of teacher pool ``pool``'s rollouts stream: ``rollouts`` for the pool ``default``, else
    ``rollouts.<pool>``."""
    return "rollouts" if pool == DEFAULT_POOL else f"rollouts.{check_pool(pool)}"


def stream_pool(name: str) -> str | None:
    """Inverse of ``pool_stream``: the pool a short stream name feeds (None when it is no rollouts stream)."""
    if name == "rollouts":
        return DEFAULT_POOL
    if name.startswith("rollouts."):
        return name[len("rollouts."):]
    return None


def shard_of(group_id: str, shards: int) -> int:
    """The shard of ``group_id`` among ``shards``: stable across processes, versions and machines."""
    return zlib.crc32(group_id.encode()) % shards if shards > 1 else 0
_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")


def _check(part: str, what: str) -> str:
    if not _NAME.match(part):
        raise ValueError(f"invalid {what} {part!r}: use letters, digits, '_', '.', '-'")
    return part


@dataclass(frozen=True, slots=True)
class Keys:
    """Key builder for one pipeline namespace."""

    namespace: str = "distillq"

    def __post_init__(self) -> None:
        _check(self.namespace, "namespace")

    def stream(self, name: str, shard: int | None = None, shards: int = 1) -> str:
        """The stream key for a short name (``prompts``, ``rollouts``, ``scored``, ``batches``, ``dlq``).

        Unsharded (``shard=None`` or ``shards == 1``): ``{ns:name}``. Shard ``i`` of ``shards``:
        ``{ns:name:i}`` (salted, see ``shard_tag``).
        """
        _check(name, "stream name")
        if shard is None or shards <= 1:
            return f"{{{self.namespace}:{name}}}"
        if family(name) not in SHARDABLE or not 0 <= shard < shards <= MAX_SHARDS:
            raise ValueError(f"stream {name!r} has no shard {shard} of {shards}")
        return f"{{{shard_tag(self.namespace, name, shard, shards)}}}"

    def streams(self, name: str, shards: int) -> list[str]:
        """Every key of a stage stream: one when unsharded, else one per shard."""
        if shards <= 1 or family(name) not in SHARDABLE:
            return [self.stream(name)]
        return [self.stream(name, i, shards) for i in range(shards)]

    def stream_for(self, name: str, group_id: str, shards: int) -> str:
        """The key ``group_id`` is written to."""
        if shards <= 1 or family(name) not in SHARDABLE:
            return self.stream(name)
        return self.stream(name, shard_of(group_id, shards), shards)

    def seen(self, stream: str, group_id: str, shards: int = 1) -> str:
        """Dedupe marker for ``group_id`` on ``stream`` (same hash slot as the stream key it goes to)."""
        return f"{self.stream_for(stream, group_id, shards)}:seen:{group_id}"

    @staticmethod
    def payload(stream_key: str, group_id: str, nonce: str) -> str:
        """Where a claim-checked entry's payload lives (same hash slot as ``stream_key``); ``nonce`` is
        unique per write, so two writes of one group (without dedupe) never share a payload."""
        return f"{stream_key}:payload:{group_id}:{nonce}"

    @staticmethod
    def audit(stream_key: str) -> str:
        """A stage stream's last audit record (``pipeline.transport.audit``), in the stream's hash slot."""
        return f"{stream_key}:audit"

    @staticmethod
    def reservations(stream_key: str) -> str:
        """The producer's outstanding write reservations for a stream key (same hash slot)."""
        return f"{stream_key}:reserving"

    @property
    def dlq(self) -> str:
        return self.stream("dlq")

    def consumer_group(self, stream: str) -> str:
        return CONSUMER_GROUPS.get(family(stream), f"{stream}-readers")

    def heartbeat(self, stage: str, consumer: str) -> str:
        return f"{self.namespace}:health:{_check(stage, 'stage')}:{consumer}"

    def heartbeat_pattern(self, stage: str = "*") -> str:
        return f"{self.namespace}:health:{stage}:*"

    @property
    def pools(self) -> str:
        """The set of teacher pools groups were sent to (``pipeline.transport.pools``), for ``stats``."""
        return f"{self.namespace}:pools"

    @property
    def policy_version(self) -> str:
        return f"{self.namespace}:policy_version"

    @property
    def pacing(self) -> str:
        """Rollout pacing (``pipeline.transport.pacing``): groups started, the policy version last seen."""
        return f"{self.namespace}:pacing"

    def learner_health(self, consumer: str = "*", rank: int | str = "*") -> str:
        """A learner rank's heartbeat (``pipeline.learner.health``); the defaults give the pattern of all of them."""
        return f"{self.namespace}:learner_health:{consumer}:{rank}"

    def learner_ranks(self, part: str = "") -> str:
        """Coordination of learner ranks (``pipeline.learner.ranks``): the state hash, or one of its parts
        (``joined``, ``acked``, ``reading``); all in the batches stream's hash slot, so one script touches
        them and the stream together."""
        if part not in ("", "joined", "acked", "reading"):
            raise ValueError(f"unknown learner ranks key {part!r}")
        return f"{self.stream('batches')}:ranks" + (f":{part}" if part else "")

    @property
    def kl_state(self) -> str:
        return f"{self.namespace}:kl"

    def dropped(self, group_id: str) -> str:
        """Why the feeder dropped a group (JSON: reason, versions, time); lives ``dedupe_ttl_s``."""
        return f"{self.namespace}:dropped:{group_id}"

    @property
    def config(self) -> str:
        return f"{self.namespace}:config"

    @property
    def incidents(self) -> str:
        """Faults from outside distillq that a process noticed (``pipeline.transport.incidents``)."""
        return f"{self.namespace}:incidents"

    @property
    def demo_owned(self) -> str:
        """Set by ``distillq demo`` in a namespace it made: the next demo run may delete that namespace's keys."""
        return f"{self.namespace}:demo"

    @property
    def sentinel(self) -> str:
        """A token that lives as long as the namespace's data (``pipeline.transport.resets``)."""
        return f"{self.namespace}:sentinel"

    def atropos(self, part: str) -> str:
        """A key of the Atropos-compatible server (``distillq serve atropos``): ``{ns:atropos}:<part>``, one
        hash slot for all of them. ``part`` is one of ``ATROPOS_PARTS``."""
        if part not in ATROPOS_PARTS:
            raise ValueError(f"unknown atropos key {part!r}; one of {sorted(ATROPOS_PARTS)}")
        return f"{{{self.namespace}:atropos}}:{part}"

    def atropos_buffer(self, env_id: int) -> str:
        """Groups of env ``env_id`` waiting for others to fill its group size (``serve atropos``)."""
        return f"{{{self.namespace}:atropos}}:buffer:{int(env_id)}"

    def atropos_env(self, group_id: str) -> str:
        """Env id of a group posted to ``serve atropos`` and not yet on its queue."""
        return f"{{{self.namespace}:atropos}}:env:{group_id}"

    def atropos_seen(self, group_id: str) -> str:
        """Dedupe marker of a group put on the ``serve atropos`` queue."""
        return f"{{{self.namespace}:atropos}}:seen:{group_id}"

    def prompt_record(self, epoch: int, prompt_id: str) -> str:
        """A prompt's record (``pipeline.transport.prompts``), in the prompts stream's hash slot."""
        return f"{self.stream('prompts')}:prompt:{int(epoch)}:{prompt_id}"
