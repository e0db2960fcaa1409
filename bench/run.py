"""distillq performance suite: every figure a ratio measured side by side in the same run.

Run: ``python -m bench`` (same as ``python bench/run.py``); ``--quick`` for a short run; ``--rows`` picks
rows: codec, transport, reference, teacher, scaling, latency, memory, rss. A private redis-server on a
free port serves every Redis row (``tests.redis_server``); nothing touches the server on 6379.
The first line printed says when the run started (UTC), on which commit (``-dirty``: tracked files differ
from it) and on which machine (``bench.provenance``); ``--json`` writes the same under ``"run"``.
See the modules for what each row measures: ``bench.codec``, ``bench.transport`` (+ ``stub_pipeline``,
``reference_transport``), ``bench.teacher``, ``bench.scaling``, ``bench.latency``, ``bench.memory``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

if __name__ == "__main__" and not __package__:  # ``python bench/run.py``: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROWS = ("codec", "transport", "reference", "teacher", "scaling", "latency", "memory", "rss")


@dataclass
class Row:
    """One line of the table. ``ratio`` is the figure the target is about."""

    row: str
    what: str
    value: str
    baseline: str
    ratio: str
    target: str
    met: bool | None = None


@dataclass
class Suite:
    args: argparse.Namespace
    url: str
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict)
    best: dict[str, float] = field(default_factory=dict)  # distillq groups/s by workload label

    @property
    def quick(self) -> bool:
        return bool(self.args.quick)

    def add(self, *a: Any, **kw: Any) -> None:
        self.rows.append(Row(*a, **kw))


def workloads(args: argparse.Namespace) -> list[Any]:
    from bench.common import Workload

    return [Workload(8, int(n)) for n in args.sizes.split(",")]


def row_codec(s: Suite) -> None:
    from bench.codec import run

    rows, _info = run(*((10, 10, 1, 1) if s.quick else (30, 20, 2, 2)))
    by = {r["key"]: r for r in rows}
    s.raw["codec"] = rows
    a, b, c, e = by["a"], by["b"], by["c"], by["e"]
    s.add("1 codec", "round trip 8x4096 k=20, structural checks (best ms)", f"{a['best_ms']:.3f}",
          f"memcpy {c['best_ms']:.3f}", f"{a['memcpy_ratio_best']:.2f} (median {a['memcpy_ratio_median']:.2f})",
          ">= 0.8", a["memcpy_ratio_best"] >= 0.8)
    s.add("1 codec", "same, full value validation (context)", f"{b['best_ms']:.3f}", f"memcpy {c['best_ms']:.3f}",
          f"{b['memcpy_ratio_best']:.2f}", "-")
    s.add("1 codec", "round trip vs reference JSON + gzip 9 (x faster)", f"{a['best_ms']:.3f}",
          f"{e['best_ms']:,.0f}", f"{a['x_faster_than_e']:,.0f}x", ">= 1000x", a["x_faster_than_e"] >= 1000)


def row_transport(s: Suite) -> None:
    from bench.transport import side_by_side

    rounds, warm, dur = (1, 1.0, 2.5) if s.quick else (3, 1.5, 4.0)
    for w in workloads(s.args):
        sb = asyncio.run(side_by_side(s.url, w, rounds, warm, dur))
        d, st, prod = sb.best("distillq"), sb.best("stub"), sb.best("stub_producer")
        s.best[w.label] = d.groups_per_s
        s.raw[f"transport_{w.label}"] = {k: [t.as_dict() for t in v] for k, v in sb.runs.items()}
        best, med = sb.ratio()
        s.add(f"2 transport {w.label}", "distillq vs stub, groups/s (best of runs; median)",
              f"{d.groups_per_s:.1f} ({sb.median('distillq'):.1f})", f"{st.groups_per_s:.1f} ({sb.median('stub'):.1f})",
              f"{best:.2f} (median {med:.2f})", ">= 0.90", best >= 0.9)
        pb, pm = sb.ratio("stub_producer")
        s.add(f"2 transport {w.label}", "context: stub writing through StreamProducer.send_raw, vs stub",
              f"{prod.groups_per_s:.1f} ({sb.median('stub_producer'):.1f})", f"{st.groups_per_s:.1f}",
              f"{pb:.2f} (median {pm:.2f})", "-")
        for name, t in (("distillq", d), ("stub", st), ("stub_producer", prod)):
            s.notes.append(f"transport {w.label} {name}: CPU ms per group (best run): process "
                           f"{t.cpu_per_group_ms:.1f}, Redis {t.redis_cpu_per_group_ms:.1f}; machine busy "
                           f"{t.machine_cores:.2f} of {os.cpu_count()} cores.")
        s.notes.append(f"transport {w.label}: {rounds} rotating rounds x {dur:.1f} s after {warm:.1f} s warm-up.")


def row_reference(s: Suite) -> None:
    from bench.reference_transport import run_reference
    from bench.transport import run_distillq

    for w in workloads(s.args):
        if w.label not in s.best:
            s.best[w.label] = asyncio.run(run_distillq(s.url, w, 1.0, 2.5)).groups_per_s
        groups = 1 if s.quick else (4 if w.seq_len <= 1024 else 2)
        ref = run_reference(w.seqs, w.seq_len, w.k, groups, batch_groups=min(groups, w.batch_groups))
        s.raw[f"reference_{w.label}"] = asdict(ref)
        x = s.best[w.label] / ref.groups_per_s
        s.add(f"2 transport {w.label}", "distillq vs reference HTTP+JSON+gzip 9, groups/s",
              f"{s.best[w.label]:.1f}", f"{ref.groups_per_s:.3f}", f"{x:,.0f}x", ">= 20x", x >= 20)
        s.notes.append(
            f"reference {w.label}: {ref.groups} groups in {ref.seconds:.1f} s; CPU s per group: client "
            f"{ref.client_cpu_s / ref.groups:.2f}, server {ref.server_cpu_s / ref.groups:.2f}."
        )


def row_teacher(s: Suite) -> None:
    import bench.teacher as bt

    args = argparse.Namespace(groups=4 if s.quick else 8, per_group=8, min_len=128, max_len=512, k=20, budget=8192,
                              threads=2, repeats=2 if s.quick else 6, vocab=None)
    t, tokens, vocab = asyncio.run(bt.run(args))
    s.raw["teacher"] = {"wall": t.wall, "cpu": t.cpu, "tokens": tokens, "vocab": vocab}
    best = min(t.wall["bare"]) / min(t.wall["scorer"])
    med = statistics.median(t.wall["bare"]) / statistics.median(t.wall["scorer"])
    s.add("3 teacher", f"Scorer+HFTeacher vs bare forward+top-k, tokens/s ({tokens} tokens, vocab {vocab})",
          f"{tokens / min(t.wall['scorer']):,.0f}", f"{tokens / min(t.wall['bare']):,.0f}",
          f"{best:.2f} (median {med:.2f})", ">= 0.90", best >= 0.9)
    cpu = statistics.median(t.cpu["bare"]) / statistics.median(t.cpu["scorer"])
    s.notes.append(f"teacher: {args.repeats} interleaved repeats; process-CPU ratio (medians) {cpu:.2f}; "
                   "bench/teacher.py times the Scorer stage logic with the HF backend, without Redis "
                   "(row 2 prices the transport).")


def row_scaling(s: Suite) -> None:
    from bench.common import Workload
    from bench.scaling import ScalePoint, efficiency, point

    w = Workload(8, s.args.scaling_len)
    warm, dur = (0.5, 1.5) if s.quick else (1.0, 4.0)
    points: list[ScalePoint] = []
    for mode in s.args.scaling_modes.split(","):
        for n in (int(x) for x in (s.args.workers or ("1,2" if s.quick else "1,2,4,8")).split(",")):
            try:
                points.append(asyncio.run(point(s.url, mode, n, w, 4, warm, dur)))
            except RuntimeError as err:
                s.add(f"4 scaling {mode}", f"{n} teacher worker(s): run failed ({err})", "-", "-", "-", ">= 0.9", False)
    eff = efficiency(points)
    s.raw["scaling"] = [asdict(p) for p in points]
    one = {p.mode: p.groups_per_s for p in points if p.workers == 1}
    for p in points:
        e = eff.get((p.mode, p.workers))
        s.add(f"4 scaling {p.mode}", f"{p.workers} teacher worker(s), 50 ms/call, {w.label}: groups/s "
              f"[Redis {p.redis_cores:.2f}, workers {p.worker_cores:.2f}, machine {p.machine_cores:.2f} cores]",
              f"{p.groups_per_s:.1f}", f"{p.workers} x {one.get(p.mode, float('nan')):.1f}",
              "-" if e is None else f"{e:.2f}", ">= 0.9", None if e is None else e >= 0.9)


def row_latency(s: Suite) -> None:
    from bench.common import Workload
    from bench.latency import latency, summary

    w = Workload(8, 1024)
    warm, dur = (1.0, 4.0) if s.quick else (2.0, 12.0)
    for bg in (1,) if s.quick else (1, w.batch_groups):
        r = asyncio.run(latency(s.url, w, bg, 0.5, warm, dur))
        m = summary(r)
        s.raw[f"latency_batch{bg}"] = m
        target = r.target_ms
        p99 = m["p99_ms"] if bg == 1 else m["completing_p99_ms"]
        what = "push -> batch readable, p99 (p50) ms" if bg == 1 else "same, batches of 8: completing group p99 (p50)"
        p50 = m["p50_ms"] if bg == 1 else m["completing_p50_ms"]
        s.add(f"5 latency {w.label}", f"{what}; {r.rate:.1f} groups/s = 50% of {r.max_rate:.1f}",
              f"{p99:.1f} ({p50:.1f})", f"50 + teacher p99 {m['teacher_p99_ms']:.1f} = {target:.1f}",
              f"{p99 / target:.2f}", "<= 1.00", p99 <= target)
        if bg > 1:
            s.notes.append(f"latency, batches of {bg}: per group incl. waiting for the batch to fill: "
                           f"p50 {m['p50_ms']:.1f} ms, p99 {m['p99_ms']:.1f} ms.")
        s.notes.append(f"latency batch={bg}: {m['groups']:.0f} groups measured, reached the learner at "
                       f"{m['achieved']:.1f}/s of {m['rate']:.1f}/s offered; teacher call p50 "
                       f"{m['teacher_p50_ms']:.1f} ms; machine busy {m['machine_cores']:.2f} of "
                       f"{os.cpu_count()} cores.")


def row_memory(s: Suite) -> None:
    from bench.memory import redis_per_group

    for w in workloads(s.args):
        for kind in ("rollout", "scored"):
            n = {"rollout": 100, "scored": 32}[kind] // (4 if w.seq_len > 1024 else 1) // (2 if s.quick else 1)
            st = asyncio.run(redis_per_group(s.url, w, kind, n))
            s.raw[f"redis_{kind}_{w.label}"] = asdict(st) | {"ratio": st.ratio}
            s.add(f"6 memory {w.label}", f"Redis used_memory per stored {kind} group ({n} groups)",
                  f"{st.redis_bytes_per_group:,.0f} B", f"payload {st.payload_bytes:,} B", f"{st.ratio:.3f}",
                  "<= 1.3", st.ratio <= 1.3)


def row_rss(s: Suite) -> None:
    from bench.memory import soak

    minutes = s.args.rss_minutes if s.args.rss_minutes is not None else (0.5 if s.quick else 10.0)
    so = asyncio.run(soak(s.url, minutes, s.args.rss_rate))
    s.raw["rss"] = {"t": so.t, "rss": so.rss, "backlog": so.backlog, "groups": so.groups}
    for name in ("teacher", "feeder", "redis"):
        a, b = so.after_warmup(name)
        slope = so.slope_mb_per_min(name)
        what = "Redis used_memory" if name == "redis" else f"{name} worker VmRSS"
        s.add("6 memory rss", f"{what} over {minutes:g} min at {so.rate:g} groups/s 8x1024, MB (after 20% warm-up)",
              f"{a:.1f} -> {b:.1f}", "-", f"{slope:+.2f} MB/min", "flat (report)")
    left = {k: v[-1] for k, v in so.backlog.items()}
    s.notes.append(f"rss soak: {so.groups} groups reached the learner ({so.groups / (minutes * 60):.1f}/s of "
                   f"{so.rate:g}/s offered); backlog at the end {left}; payload keys left "
                   f"{so.payload_keys_left}, of which {so.payloads_in_flight} held by scored entries or unacked "
                   f"batches (leaked: {so.payload_keys_left - so.payloads_in_flight}); "
                   f"dedupe markers {so.markers_left} (they expire after dedupe_ttl_s: Redis memory grows "
                   "with them until then).")


RUNNERS: dict[str, Callable[[Suite], None]] = {
    "codec": row_codec, "transport": row_transport, "reference": row_reference, "teacher": row_teacher,
    "scaling": row_scaling, "latency": row_latency, "memory": row_memory, "rss": row_rss,
}


def table(rows: list[Row]) -> str:
    out = ["| row | measurement | distillq | baseline | ratio | target | met |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        met = "-" if r.met is None else ("yes" if r.met else "**no**")
        out.append(f"| {r.row} | {r.what} | {r.value} | {r.baseline} | {r.ratio} | {r.target} | {met} |")
    return "\n".join(out)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="short run (~3 min): fewer rounds, shorter windows, less work")
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated subset of: {', '.join(ROWS)}")
    p.add_argument("--sizes", default="1024,4096", help="sequence lengths of the 8-sequence groups (rows 2, 6)")
    p.add_argument("--workers", default=None, help="teacher worker counts (row 4; default 1,2,4,8; 1,2 with --quick)")
    p.add_argument("--scaling-modes", default="tasks,procs", help="tasks (in-process) and/or procs (row 4)")
    p.add_argument("--scaling-len", type=int, default=128, help="sequence length of row 4's 8-sequence groups")
    p.add_argument("--rss-minutes", type=float, default=None, help="RSS soak length (default 10; 0.5 with --quick)")
    p.add_argument("--rss-rate", type=float, default=10.0, help="groups/s pushed during the RSS soak")
    p.add_argument("--json", default=None, help="also write raw results to this file")
    args = p.parse_args(argv)
    bad = set(args.rows.split(",")) - set(ROWS)
    if bad:
        p.error(f"unknown rows: {', '.join(sorted(bad))}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from bench.common import quiet_logs
    from bench.provenance import header, machine, run_info
    from tests.redis_server import RedisServer

    quiet_logs()
    started, info = time.time(), run_info()
    print(header("distillq performance suite", info), flush=True)
    server = RedisServer().start()
    suite = Suite(args, server.url)
    try:
        for name in ROWS:
            if name in args.rows.split(","):
                t0 = time.time()
                RUNNERS[name](suite)
                print(f"  {name}: {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    finally:
        server.stop()
    print(f"\nmachine at the end: {machine()}; wall time {time.time() - started:.0f} s")
    print(f"command: python -m bench {' '.join(sys.argv[1:] if argv is None else argv)}\n")
    print(table(suite.rows))
    if suite.notes:
        print("\n" + "\n".join(f"- {n}" for n in suite.notes))
    if args.json:
        out = {"run": info, "rows": [asdict(r) for r in suite.rows], "raw": suite.raw, "notes": suite.notes}
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
