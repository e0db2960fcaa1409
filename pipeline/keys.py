"""Every Redis key distillq uses, in one place.

All keys live under a namespace (default ``distillq``) so several pipelines share one Redis. Keys that
one operation touches together share a hash tag (``{...}``), so the same code runs on Redis Cluster:

==============================================  ============  =================================================
key                                             type          written by / meaning
==============================================  ============  =================================================
``{ns}:{rollouts}``                             stream        rollout workers / producers; read by teachers
``{ns}:{scored}``                               stream        teacher workers; read by the feeder
``{ns}:{batches}``                              stream        feeder; read by the learner
``{ns}:{dlq}``                                  stream        any stage: dead letters (stage, reason, bytes)
``{ns}:{<stream>}:seen:<group id>``             string (TTL)  producer: dedupe marker -> entry id written
``{ns}:health:<stage>:<consumer>``              string (TTL)  worker heartbeat (JSON), read by ``--check``
``{ns}:policy_version``                         string        learner: current policy version (int)
``{ns}:kl``                                     string        feeder: KL controller state (JSON)
``{ns}:config``                                 hash          pipeline-wide settings every worker agrees on
``{ns}:arq:*``                                  (arq)         rollout job queue, owned by arq (pipeline.jobs)
==============================================  ============  =================================================

Each stage stream is read by exactly one consumer group (named after the consuming stage, see
``CONSUMER_GROUPS``) which deletes entries once acknowledged, so a stream's length is its backlog.
Debugging readers (``distillq tail``) use XRANGE/XREAD and never join a group.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

#: Short stage-stream names, as the CLI takes them.
STREAMS: Final = ("rollouts", "scored", "batches", "dlq")
#: The consumer group that reads each stage stream.
CONSUMER_GROUPS: Final = {"rollouts": "teacher", "scored": "feeder", "batches": "learner"}
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

    def stream(self, name: str) -> str:
        """The stream key for a short name (``rollouts``, ``scored``, ``batches``, ``dlq``)."""
        return f"{self.namespace}:{{{_check(name, 'stream name')}}}"

    def short_name(self, key: str) -> str:
        """Inverse of ``stream``: ``distillq:{scored}`` -> ``scored``."""
        prefix = f"{self.namespace}:{{"
        if key.startswith(prefix) and key.endswith("}"):
            return key[len(prefix) : -1]
        raise ValueError(f"{key!r} is not a stream of namespace {self.namespace!r}")

    def seen(self, stream: str, group_id: str) -> str:
        """Dedupe marker for ``group_id`` on ``stream`` (same hash slot as the stream)."""
        return f"{self.stream(stream)}:seen:{group_id}"

    @property
    def dlq(self) -> str:
        return self.stream("dlq")

    def consumer_group(self, stream: str) -> str:
        return CONSUMER_GROUPS.get(stream, f"{stream}-readers")

    def heartbeat(self, stage: str, consumer: str) -> str:
        return f"{self.namespace}:health:{_check(stage, 'stage')}:{consumer}"

    def heartbeat_pattern(self, stage: str = "*") -> str:
        return f"{self.namespace}:health:{stage}:*"

    @property
    def policy_version(self) -> str:
        return f"{self.namespace}:policy_version"

    @property
    def kl_state(self) -> str:
        return f"{self.namespace}:kl"

    @property
    def config(self) -> str:
        return f"{self.namespace}:config"

    @property
    def arq_queue(self) -> str:
        return f"{self.namespace}:arq:queue"

    @property
    def arq_prefix(self) -> str:
        return f"{self.namespace}:arq:"
