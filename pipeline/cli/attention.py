"""What ``distillq stats`` lists under ``attention:``: one line per thing an operator should act on (pure: a
``Snapshot`` in, lines out; empty when all is well).

In order: the namespace has no keys; recent incidents (faults from outside distillq that a worker recorded);
Redis memory near or at ``maxmemory``, or an evicting policy; a full stream; a stage stream with entries and
no live worker of the stage that reads it (a teacher pool's stream: no live teacher worker of that pool);
entries delivered more than once (rollout jobs retrying) and
rollout dead letters; learner ranks missing (a rank heartbeats a world size and another rank below it has no
heartbeat), a learner rank holding a batch longer than ``hold_warn_s`` (from its heartbeat) and batches held
under a learner consumer name no live learner process has (a learner that stopped or failed); what workers
report (a failing or slow backend, invalid teacher values, teacher and feeder drops, clamped k); feeders
that disagree on a setting; a worker clock off Redis's by more than ``MAX_SKEW_S``; consumers holding
entries without a live heartbeat; dead letters.
"""

from __future__ import annotations

from typing import Final

from pipeline.cli.streamstats import GroupStats, Snapshot, StreamStats, WorkerStats, serves
from pipeline.learner.health import RankBeat, missing_ranks
from pipeline.stages.liveness import MAX_SKEW_S, skew_note
from pipeline.transport.keys import CONSUMER_GROUPS, family, stream_pool
from schemas.pools import DEFAULT_POOL

#: Redis memory used above this share of ``maxmemory`` is named.
MEMORY_WARN: Final = 0.9
#: Incidents listed (newest first); the rest are counted.
INCIDENTS_SHOWN: Final = 5
#: Consumer groups whose readers write no worker heartbeat: the learner's write their own (``Snapshot.learners``);
#: without one, a consumer counts as live while it reads or renews leases.
UNBEATING: Final = frozenset({"learner"})


def secs(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 120:
        return f"{s:.1f} s"
    return f"{s / 60:.1f} min" if s < 7200 else f"{s / 3600:.1f} h"


def size(n: int) -> str:
    v = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if v < 1024 or unit == "GiB":
            return f"{v:.0f} {unit}" if unit == "B" else f"{v:.1f} {unit}"
        v /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


def counts(d: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(d.items())) or "-"


def attention(snap: Snapshot) -> list[str]:
    """What an operator should look at, one line each (empty when all is well)."""
    out: list[str] = [snap.namespace_note] if snap.namespace_note else []
    out += incident_notes(snap) + memory_notes(snap)
    for s in snap.streams.values():
        if s.full and ":" not in s.name:  # a sharded stream: its total row
            out.append(f"{s.name} is full ({s.length} entries, cap {snap.max_backlog} per stream key): its producers "
                       "wait (backpressure_wait, downstream_full, learner_stalled in their logs)")
    out += unread_notes(snap) + redelivery_notes(snap) + learner_rank_notes(snap) + learner_hold_notes(snap)
    out += worker_notes(snap) + feeder_settings_notes(snap) + clock_notes(snap) + orphan_notes(snap)
    if snap.dead_letters:
        by_stage = f" (newest by stage: {counts(snap.dead_letters_by_stage)})" if snap.dead_letters_by_stage else ""
        out.append(f"{snap.dead_letters} dead letter(s){by_stage}: distillq dlq list")
    return out


def incident_notes(snap: Snapshot) -> list[str]:
    out = [f"incident {secs(i.age_s)} ago ({i.kind}{', ' + i.writer if i.writer else ''}): {i.text}"
           for i in snap.incidents[:INCIDENTS_SHOWN]]
    if len(snap.incidents) > INCIDENTS_SHOWN:
        out.append(f"{len(snap.incidents) - INCIDENTS_SHOWN} older incident(s) of the last 24 h: distillq stats --json")
    return out


def memory_notes(snap: Snapshot) -> list[str]:
    m = snap.memory
    if m is None:
        return []
    out: list[str] = []
    used = f"used {size(m.used_bytes)}" + (f" of maxmemory {size(m.max_bytes)}" if m.max_bytes else "")
    share = m.used_fraction
    # One snapshot cannot tell refusals of now from older ones: near the limit, any refusal since Redis started
    # counts (with refreshes, those since the last one).
    refusing = m.oom_errors_new if m.oom_errors_new is not None else (
        m.oom_errors if share is not None and share >= MEMORY_WARN else 0)
    if (share is not None and share >= 1.0) or refusing:
        since = "since the last refresh" if m.oom_errors_new is not None else "since Redis started"
        refused = f", {refusing} write(s) refused for memory {since}" if refusing else ""
        out.append(f"Redis is full: writes wait ({used}{refused}); drain the streams or raise maxmemory")
    elif share is not None and share >= MEMORY_WARN:
        out.append(f"Redis is nearly full ({used}, {share:.0%}): at maxmemory writes wait")
    if m.max_bytes and m.policy != "noeviction":
        out.append(f"Redis maxmemory-policy is {m.policy}: it may evict stream entries and payloads; "
                   "set maxmemory-policy noeviction")
    return out


def stage_streams(snap: Snapshot) -> list[tuple[StreamStats, str]]:
    """Each stage stream shown (a sharded one by its total row; each teacher pool's rollouts stream) with the
    stage that reads it."""
    return [(s, CONSUMER_GROUPS[family(s.name)]) for s in snap.streams.values()
            if family(s.name) in CONSUMER_GROUPS and ":" not in s.name]


def _group(s: StreamStats, name: str) -> GroupStats | None:
    return next((g for g in s.groups if g.name == name and g.exists), None)


def _seen_s(g: GroupStats | None) -> float | None:
    """Since a consumer of the group last read or renewed a lease (None: it has none)."""
    return min((c.idle_s for c in g.consumer_list), default=None) if g is not None else None


def live_readers(snap: Snapshot, s: StreamStats, stage: str) -> bool:
    """A live worker reads ``s``: a heartbeat of ``stage`` or of one of its group's consumers (``serve
    atropos`` reads ``scored`` in the feeder group); for the learner, a learner rank heartbeat, or a consumer
    that read or renewed a lease within the claim idle time."""
    g = _group(s, stage)
    if stage in UNBEATING:
        if snap.learners:
            return True
        seen = _seen_s(g)
        return seen is not None and seen < snap.claim_idle_s
    names = {c.name for c in g.consumer_list} if g is not None else set()
    pool = stream_pool(s.name)
    if pool is not None:  # a teacher pool's stream: a worker of that pool
        return any(serves(w, pool) or (w.stage == stage and w.consumer in names) for w in snap.workers)
    return any(w.stage == stage or w.consumer in names for w in snap.workers)


def unread_notes(snap: Snapshot) -> list[str]:
    out: list[str] = []
    for s, stage in stage_streams(snap):
        if s.length <= 0 or live_readers(snap, s, stage):
            continue
        line = f"stream {s.name} has {s.length} entries and no live {stage} worker"
        pool = stream_pool(s.name)
        if pool is not None and pool != DEFAULT_POOL:
            out.append(f"teacher pool {pool}: stream {s.name} has {s.length} group(s) and no live teacher worker of "
                       f"the pool: start one (distillq worker teacher --pool {pool})")
            continue
        if stage in UNBEATING:
            seen = _seen_s(_group(s, stage))
            line += (" (no consumer in its group)" if seen is None else
                     f" (its group's consumers last read or renewed a lease {secs(seen)} ago; no {stage} heartbeat)")
        else:
            line += f": start one (distillq worker {stage})"
        out.append(line)
    return out


def redelivery_notes(snap: Snapshot) -> list[str]:
    out: list[str] = []
    for s, stage in stage_streams(snap):
        g = _group(s, stage)
        if g is None or not g.redelivered:
            continue
        what = "rollout jobs retrying: " if stage == "rollout" else ""
        out.append(f"{what}{s.name}: {g.redelivered} entries delivered more than once (up to {g.max_deliveries} "
                   f"times): {stage} work on them failed or its worker died holding them; after "
                   "DISTILLQ_MAX_DELIVERIES they are dead-lettered")
    failed = snap.dead_letters_by_stage.get("rollout", 0)
    if failed:
        out.append(f"rollout jobs failed: {failed} prompt(s) dead-lettered by stage rollout, with the reason: "
                   "distillq dlq list")
    return out


def _rank_name(b: RankBeat) -> str:
    rank = f" rank {b.rank} of {b.world_size}" if b.world_size > 1 else ""
    return f"learner {b.consumer}{rank} (host {b.host}, pid {b.pid})"


def learner_rank_notes(snap: Snapshot) -> list[str]:
    """From the learner ranks' heartbeats: ranks missing, and ranks holding a batch longer than ``hold_warn_s``
    (the time since the batch was handed to the rank, aged on the Redis clock)."""
    out: list[str] = []
    for consumer, (world, gone) in missing_ranks(snap.learners).items():
        which = ", ".join(str(r) for r in gone)
        out.append(f"learner {consumer}: rank(s) {which} of {world} missing (no heartbeat): the process is gone, not "
                   "started yet, or its event loop is blocked; the other ranks wait for it (learner_ranks_waiting "
                   "in their logs)")
    for b in snap.learners:
        if b.held and b.held_s is not None and b.held_s > snap.hold_warn_s:
            out.append(f"{_rank_name(b)} has held a batch for {secs(b.held_s)} without acknowledging it ({b.held} "
                       f"held; over {snap.hold_warn_s:.0f} s, --hold-warn): a long step, an evaluation or a "
                       "checkpoint, or a stuck rank")
    return out


def learner_hold_notes(snap: Snapshot) -> list[str]:
    """Batches pending to a learner consumer name no live learner process holds (no rank heartbeat of that name):
    the learner stopped or failed, and its batches wait for the next one. A learner whose heartbeat is live is
    ``learner_rank_notes``' (it tells the hold exactly). The oldest pending batch's age (from its entry id) bounds
    how long it has been held; its idle time says whether anything still renews its lease."""
    s = snap.streams.get("batches")
    g = _group(s, CONSUMER_GROUPS["batches"]) if s is not None else None
    if g is None or not g.pending:
        return []
    live = {b.consumer for b in snap.learners}
    holders = [(c.name, c.pending) for c in g.consumer_list if c.pending and c.name not in live]
    if not g.consumer_list and g.oldest_pending_consumer and g.oldest_pending_consumer not in live:
        holders = [(g.oldest_pending_consumer, g.pending)]
    out = []
    for name, n in holders:
        line = (f"learner {name} holds {n} batch(es) unacknowledged and no learner process of that name is alive "
                "(no heartbeat): it stopped or failed (its log says why); a learner started as "
                f"{name} is handed them at once, one under another name once they are idle "
                f"{secs(snap.claim_idle_s)}")
        age, idle = g.oldest_pending_age_s, g.oldest_pending_idle_s
        if g.oldest_pending_consumer == name and age is not None:
            line += f"; the oldest was written {secs(age)} ago"
            if idle is not None and idle >= snap.claim_idle_s:
                line += f" and its lease last renewed {secs(idle)} ago"
        out.append(line)
    return out


def worker_notes(snap: Snapshot) -> list[str]:
    out: list[str] = []
    for w in sorted(snap.workers, key=lambda w: (w.stage, w.consumer)):
        out += _one_worker(w)
    return out


def _one_worker(w: WorkerStats) -> list[str]:
    out: list[str] = []
    if w.problem:
        out.append(f"{w.stage} {w.consumer}: {w.problem}")
    if w.checkpoint:
        out.append(f"{w.stage} {w.consumer}: {w.checkpoint} (the published folder is torn or holds bad tensors; "
                   "publish the version again)")
    if w.slow:
        out.append(f"{w.stage} {w.consumer}: {w.slow} (slow but alive, not unreachable)")
    invalid = w.drops.get("invalid_logprobs", 0)
    if invalid:
        out.append(f"{w.stage} {w.consumer} got invalid teacher values for {invalid} group(s) (NaN, infinity, above 0 "
                   "or at the floor): their payloads were dropped (invalid_logprobs); check the teacher server")
    others = {k: v for k, v in w.drops.items() if k != "invalid_logprobs"}  # those have their own line above
    if others:
        out.append(f"{w.stage} {w.consumer} dropped teacher payloads: {counts(others)} (the groups flow on "
                   "without teacher signal; teacher_payload_dropped in its log)")
    if w.clamped_k:
        out.append(f"{w.stage} {w.consumer} clamped k for {w.clamped_k} groups (k asked above the cap)")
    dropped = {k: v for k, v in w.outcomes.items() if k == "stale" or k.startswith("no_distill")}
    if w.stage == "feeder" and dropped:
        out.append(f"feeder {w.consumer} dropped groups: {counts(dropped)} (group_not_batched in its log; "
                   "distillq where GROUP_ID)")
    return out


def feeder_settings_notes(snap: Snapshot) -> list[str]:
    """One line per setting on which live feeders of the namespace disagree."""
    feeders = sorted((w for w in snap.workers if w.stage == "feeder" and w.settings), key=lambda w: w.consumer)
    if len(feeders) < 2:
        return []
    out: list[str] = []
    for name in sorted({k for w in feeders for k in w.settings}):
        values = [(w.consumer, w.settings.get(name)) for w in feeders]
        if len({repr(v) for _, v in values}) > 1:
            each = ", ".join(f"{c} {v}" for c, v in values)
            out.append(f"feeders disagree on {name}: {each} (one namespace batches by one setting: restart them with "
                       "the same flags)")
    return out


def clock_notes(snap: Snapshot) -> list[str]:
    out: list[str] = []
    for w in sorted(snap.workers, key=lambda w: w.consumer):
        note = skew_note(w.consumer, w.clock_skew_s, w.host)
        if note is not None:
            out.append(f"{note} (over {MAX_SKEW_S:.0f} s; ages here and in --check are read on Redis's clock): fix "
                       "the host's time sync")
    return out


def orphan_notes(snap: Snapshot) -> list[str]:
    out: list[str] = []
    for s in snap.streams.values():
        if s.key.startswith("("):
            continue
        for g in s.groups:
            for c in g.consumer_list:
                if c.heartbeat is False and c.pending:
                    when = "now" if (c.reclaim_in_s or 0) <= 0 else f"in {secs(c.reclaim_in_s)}"
                    if c.reclaim_in_s is None:
                        when = "once idle for DISTILLQ_CLAIM_IDLE_MS"
                    out.append(f"{s.name}: consumer {c.name} holds {c.pending} entries and has no live heartbeat; "
                               f"a live {g.name} worker reclaims them {when}")
    return out
