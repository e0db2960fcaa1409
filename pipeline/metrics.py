"""Prometheus metrics, one definition each, labelled by stage or stream.

Exposed per worker with ``serve_metrics`` (bound to 127.0.0.1 unless configured otherwise).
"""

from __future__ import annotations

from typing import Final

from prometheus_client import Counter, Gauge, Histogram, start_http_server

PRODUCED: Final = Counter("distillq_produced_total", "entries added to a stream", ["stream"])
PRODUCED_BYTES: Final = Counter("distillq_produced_bytes_total", "payload bytes added", ["stream"])
DEDUPED: Final = Counter("distillq_deduplicated_total", "adds skipped: group id already written", ["stream"])
BACKPRESSURE_WAIT: Final = Histogram(
    "distillq_backpressure_wait_seconds", "time producers waited for stream capacity", ["stream"]
)
CONSUMED: Final = Counter("distillq_consumed_total", "entries read from a stream", ["stream", "source"])
ACKED: Final = Counter("distillq_acked_total", "entries acknowledged and deleted", ["stream"])
DEAD_LETTERED: Final = Counter("distillq_dead_lettered_total", "entries sent to the DLQ", ["stage", "reason"])
DECODE_ERRORS: Final = Counter("distillq_decode_errors_total", "undecodable entries", ["stage"])
PAYLOAD_MISSING: Final = Counter(
    "distillq_payload_missing_total", "claim-checked groups whose payload key was gone", ["stage"]
)
STAGE_MESSAGES: Final = Counter("distillq_stage_messages_total", "messages handled", ["stage", "outcome"])
STAGE_LATENCY: Final = Histogram("distillq_stage_batch_seconds", "time to handle one read batch", ["stage"])
QUEUE_LAG: Final = Histogram(
    "distillq_queue_lag_seconds",
    "age of an entry when a stage reads it",
    ["stage"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)
IN_FLIGHT: Final = Gauge("distillq_in_flight", "messages being handled", ["stage"])
REDIS_ERRORS: Final = Counter("distillq_redis_errors_total", "transient Redis errors (retried)", ["stage"])

TEACHER_GROUPS: Final = Counter("distillq_teacher_groups_total", "groups scored, by status", ["status"])
TEACHER_DROPS: Final = Counter("distillq_teacher_drops_total", "distill payloads dropped, by reason", ["reason"])
TEACHER_TOKENS: Final = Counter("distillq_teacher_tokens_total", "tokens scored by the teacher")
TEACHER_LATENCY: Final = Histogram("distillq_teacher_call_seconds", "teacher backend call latency")
TEACHER_CROSS_TOKENS: Final = Counter(
    "distillq_teacher_cross_tokens_total",
    "a teacher of another tokenizer: trained tokens of the groups it scored (kind=trained) and those in aligned "
    "chunks with teacher signal (kind=aligned); rate(aligned) / rate(trained) is the aligned share",
    ["pool", "kind"],
)
TEACHER_CROSS_TOPK_MASS: Final = Counter(
    "distillq_teacher_cross_topk_mass_total",
    "a teacher of another tokenizer: its top-k probability mass at the rows looked up (kind=total) and the part "
    "that mapped to student ids (kind=mapped); rate(mapped) / rate(total) is the mapped share",
    ["pool", "kind"],
)
POOL_GROUPS: Final = Counter("distillq_pool_groups_total", "groups scored, by teacher pool and status",
                             ["pool", "status"])
POOL_TOKENS: Final = Counter("distillq_pool_tokens_total", "tokens scored, by teacher pool", ["pool"])
POOL_BATCHED: Final = Counter("distillq_pool_batched_groups_total", "groups the feeder batched, by teacher pool",
                              ["pool"])

STUDENT_SESSIONS: Final = Gauge("distillq_student_sessions", "rollouts tracked by the student server")
STUDENT_SESSIONS_EVICTED: Final = Counter(
    "distillq_student_sessions_evicted_total", "rollouts dropped before being finished", ["reason"]
)
STUDENT_GROUPS: Final = Counter("distillq_student_groups_total", "groups built from finished rollouts", ["kind"])


WEIGHT_SYNCS: Final = Counter(
    "distillq_weight_syncs_total",
    "student server weight syncs by outcome (ok, failed, refused: checkpoint does not fit, bad_checkpoint)",
    ["outcome"],
)
CHECKPOINTS_NOT_LOADABLE: Final = Counter(
    "distillq_checkpoints_not_loadable_total",
    "published weight versions a student refused to load (incomplete, corrupt, non_finite, mismatch), once each",
    ["kind"],
)
WEIGHT_SYNC_SECONDS: Final = Histogram(
    "distillq_weight_sync_seconds", "one server's weight sync, pause to resume",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
)
STUDENT_SERVERS_IN_ROTATION: Final = Gauge(
    "distillq_student_servers_in_rotation", "student servers on the newest weights, receiving requests"
)
UNATTRIBUTED_SAMPLES: Final = Counter(
    "distillq_unattributed_samples_total",
    "samples whose requests did not all run on one weight version (resampled, or dropped)",
    ["outcome"],
)


FEEDER_BATCHES: Final = Counter("distillq_feeder_batches_total", "train batches written")
FEEDER_DROPPED: Final = Counter("distillq_feeder_dropped_groups_total", "groups not batched", ["reason"])
FEEDER_BATCH_TOKENS: Final = Histogram("distillq_feeder_batch_tokens", "tokens per batch",
                                       buckets=(1e3, 4e3, 1.6e4, 6.4e4, 2.6e5, 1e6))
FEEDER_PADDING: Final = Gauge("distillq_feeder_padding_fraction", "padding fraction of the last batch")
FEEDER_REVERSE_KL: Final = Gauge("distillq_feeder_reverse_kl", "mean sampled-token reverse KL of the last batch")
FEEDER_NO_DISTILL: Final = Gauge("distillq_feeder_no_distill_share", "share of groups without teacher payload")
FEEDER_KL_COEF: Final = Gauge("distillq_feeder_kl_coef", "current KL coefficient")
FEEDER_STALENESS: Final = Histogram("distillq_feeder_staleness_versions", "policy versions behind, per group",
                                    buckets=(0, 1, 2, 3, 4, 6, 8, 16))


def serve_metrics(port: int, host: str = "127.0.0.1") -> None:
    """Expose /metrics on ``host:port`` (port 0 disables)."""
    if port:
        start_http_server(port, addr=host)
