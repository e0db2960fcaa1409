"""Throughput on a 3-master Redis Cluster with S = 1 and S = 3 shards, and one Redis's ceiling.

``python -m bench.cluster`` starts a ``tests.cluster.LocalCluster`` (3 masters on loopback; AOF is
switched off with CONFIG SET for the run) and, for each workload and S in (1, 3), runs the stages as
separate processes on the cluster URL (``redis+cluster://``):

* ``teacher``: producer (rollouts 8 x 1024) -> teacher processes (``StageRunner`` + ``TeacherStage`` +
  ``Scorer(SyntheticTeacher())``, k = 20) -> ``scored`` -> consumer (decode, structural checks, ack).
* ``scored``: producer (ready-scored groups 8 x 1024, k = 20, the byte-heavy case) -> consumer.

Every process connects and reports ready before the clock starts; the producers then push N groups and
the clock stops when the consumers have acked all N. Reported: groups/s, MB/s of entries written to the
streams, Redis CPU per master (``INFO cpu`` deltas) and the client processes' CPU, in cores. Then, on one
plain redis-server: XADD-only MB/s of ~5.6 MB scored groups (8 x 4096, k = 20), raw and through
``StreamProducer`` (Lua), and the ``scored`` loop with those groups. Children are this module run with
``--role``; they report to the coordinator in JSON lines on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import redis
import structlog

from pipeline.config import RedisSettings, StreamSettings
from pipeline.stages.runloop import StageRunner
from pipeline.stages.scoring import Scorer, ScoringConfig
from pipeline.stages.teacher_stage import TeacherStage
from pipeline.teacher.synthetic import SyntheticTeacher
from pipeline.transport.claimcheck import encode_header
from pipeline.transport.connection import connect
from pipeline.transport.keys import Keys
from pipeline.transport.producer import StreamProducer, dedupe_ids, message_id, message_type
from pipeline.transport.sharding import get_shards, make_consumer, set_shards
from schemas import RolloutGroup, ScoredGroup, decode, encode
from schemas.build import synthetic_rollout
from schemas.validate import Limits

VOCAB = 32000
SEQS = 8
MB = 1e6
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def settings() -> StreamSettings:
    return StreamSettings(max_backlog=64, block_ms=100, read_count=8, max_in_flight=16, shutdown_grace_s=5.0,
                          backpressure_timeout_s=300.0)


async def template(workload: str, seq_len: int, k: int) -> RolloutGroup | ScoredGroup:
    """The rollout (``teacher`` workload) or the scored group (``scored``) every message copies."""
    roll = synthetic_rollout(SEQS, seq_len, vocab=VOCAB, seed=1)
    if workload == "teacher":
        return roll
    return (await Scorer(SyntheticTeacher(vocab_size=VOCAB), ScoringConfig(default_k=k)).score_groups([roll]))[0]


def renamed(tmpl: RolloutGroup | ScoredGroup, gid: str) -> RolloutGroup | ScoredGroup:
    if isinstance(tmpl, RolloutGroup):
        return msgspec.structs.replace(tmpl, group_id=gid)
    return msgspec.structs.replace(tmpl, group=msgspec.structs.replace(tmpl.group, group_id=gid))


# ---- child roles -------------------------------------------------------------------------------------

def report(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


async def role_produce(a: argparse.Namespace) -> dict[str, Any]:
    """Push groups ``lo..hi-1`` (``concurrency`` sends in flight) once the coordinator says go."""
    r, keys = connect(RedisSettings(redis_url=a.url)), Keys(a.ns)
    if await get_shards(r, keys) != a.shards:
        raise RuntimeError("shard count in Redis differs from --shards")
    tmpl = await template(a.workload, a.seq_len, a.k)
    p = StreamProducer(r, keys, "rollouts" if a.workload == "teacher" else "scored", settings(), shards=a.shards)
    report(ready=True)
    await asyncio.to_thread(sys.stdin.readline)
    c0, nbytes, ids = time.process_time(), 0, iter(range(a.lo, a.hi))

    async def sender() -> None:
        nonlocal nbytes
        for i in ids:  # one iterator shared by the senders
            msg = renamed(tmpl, f"g{i}")
            data = encode(msg)
            header = encode_header(msg, len(data)) if p.claim_check else None
            await p.send_raw(data, message_type(msg), message_id(msg), dedupe_ids(msg), header=header)
            nbytes += len(data)

    await asyncio.gather(*(sender() for _ in range(a.concurrency)))
    await r.aclose()
    return {"bytes": nbytes, "cpu": time.process_time() - c0}


async def role_consume(a: argparse.Namespace) -> dict[str, Any]:
    """Read ``scored`` (all shards), decode with structural checks, ack; stop once N groups are acked."""
    r, keys = connect(RedisSettings(redis_url=a.url)), Keys(a.ns)
    c = make_consumer(r, keys, "scored", f"c{a.index}", settings(), stage="bench", shards=a.shards)
    await c.ensure_group()
    done_key, limits = f"{a.ns}:bench:done", Limits(check_values=False)
    report(ready=True)
    c0, groups, nbytes, total = time.process_time(), 0, 0, 0
    while total < a.n:
        batch = await c.read(16, block_ms=100)
        for d in batch:
            decode(d.payload, limits, expect=ScoredGroup)
            nbytes += len(d.payload)
        if batch:
            await c.ack(batch)
            groups += len(batch)
            total = int(await r.incrby(done_key, len(batch)))
        else:
            total = int(await r.get(done_key) or 0)
    await r.aclose()
    return {"groups": groups, "bytes": nbytes, "cpu": time.process_time() - c0}


async def role_teach(a: argparse.Namespace) -> dict[str, Any]:
    """One teacher worker (synthetic teacher, k = ``a.k``) until SIGTERM."""
    r, keys = connect(RedisSettings(redis_url=a.url)), Keys(a.ns)
    scorer = Scorer(SyntheticTeacher(vocab_size=VOCAB), ScoringConfig(default_k=a.k))
    runner = StageRunner(r, keys, TeacherStage(scorer), RolloutGroup, "rollouts", "scored", settings(),
                         consumer_name=f"t{a.index}", shards=a.shards)
    await runner.consumer.ensure_group()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    report(ready=True)
    c0 = time.process_time()
    stats = await runner.run(stop)
    await r.aclose()
    return {"handled": stats.handled, "cpu": time.process_time() - c0}


ROLES = {"produce": role_produce, "consume": role_consume, "teach": role_teach}


# ---- coordinator ---------------------------------------------------------------------------------------

class Child:
    """A role process; its JSON lines arrive on a queue (read by a thread, so waits can time out)."""

    def __init__(self, role: str, args: list[str], logdir: str) -> None:
        self.role = role
        self.log = os.path.join(logdir, f"{role}-{uuid.uuid4().hex[:6]}.log")
        with open(self.log, "wb") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "bench.cluster", "--role", role, *args], cwd=ROOT,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put("")

    def line(self, timeout: float = 600.0) -> dict[str, Any]:
        try:
            text = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"{self.role}: no report in {timeout:.0f} s") from None
        if not text:
            with open(self.log) as f:
                raise RuntimeError(f"{self.role} exited ({self.proc.wait()}): {f.read()[-3000:]}")
        return dict(json.loads(text))

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)


def close(children: list[Child]) -> None:
    """SIGTERM every child still running, then wait (SIGKILL after 30 s)."""
    for ch in children:
        ch.stop()
    for ch in children:
        try:
            ch.proc.wait(30)
        except subprocess.TimeoutExpired:
            ch.proc.kill()
            ch.proc.wait(5)


def contention() -> tuple[float, float]:
    """1-minute load average and CPU pressure (PSI ``some avg10``, % of time tasks waited for a CPU)."""
    try:
        with open("/proc/pressure/cpu") as f:
            psi = float(f.readline().split()[1].split("=")[1])
    except (OSError, IndexError, ValueError):
        psi = float("nan")
    return os.getloadavg()[0], psi


def node_stats(ports: list[int]) -> list[tuple[float, float]]:
    """(CPU seconds, network bytes in) of each Redis node so far."""
    out = []
    for port in ports:
        r = redis.Redis(port=port)
        cpu: Any = r.info("cpu")
        st: Any = r.info("stats")
        out.append((float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]), float(st["total_net_input_bytes"])))
        r.close()
    return out


@dataclass
class Row:
    """One measured run."""

    name: str
    shards: int
    groups: int
    seconds: float
    written_bytes: int  # entries added to the streams (rollouts and scored)
    node_cores: list[float]  # Redis CPU per node, in cores
    node_in_mb: list[float]  # network bytes received per node
    client_cores: dict[str, float] = field(default_factory=dict)  # by role
    load: tuple[float, float] = (0.0, 0.0)  # 1-min load average and CPU pressure (PSI some avg10, %) after

    @property
    def groups_per_s(self) -> float:
        return self.groups / self.seconds

    @property
    def mb_per_s(self) -> float:
        return self.written_bytes / MB / self.seconds

    @property
    def redis_ms(self) -> float:
        """Redis CPU (all nodes) per group, ms."""
        return sum(self.node_cores) * self.seconds * 1e3 / self.groups

    @property
    def busiest_ms(self) -> float:
        """CPU of the busiest Redis node per group, ms."""
        return max(self.node_cores) * self.seconds * 1e3 / self.groups

    @property
    def client_ms(self) -> float:
        """Client processes' CPU per group, ms."""
        return sum(self.client_cores.values()) * self.seconds * 1e3 / self.groups


@dataclass(frozen=True)
class Case:
    url: str
    ports: list[int]
    workload: str
    shards: int
    groups: int
    seq_len: int = 1024
    k: int = 20
    producers: int = 1
    teachers: int = 2
    consumers: int = 1
    concurrency: int = 4


async def _prepare(url: str, ns: str, shards: int) -> None:
    r = connect(RedisSettings(redis_url=url))
    await set_shards(r, Keys(ns), shards)
    await r.aclose()


def run_case(c: Case, logdir: str) -> Row:
    """Start the role processes, wait until all are ready, push ``c.groups`` and time their passage."""
    ns = f"bc{uuid.uuid4().hex[:8]}"
    asyncio.run(_prepare(c.url, ns, c.shards))
    common = ["--url", c.url, "--ns", ns, "--shards", str(c.shards), "--workload", c.workload,
              "--seq-len", str(c.seq_len), "--k", str(c.k), "--n", str(c.groups)]
    consumers = [Child("consume", [*common, "--index", str(i)], logdir) for i in range(c.consumers)]
    teachers = [Child("teach", [*common, "--index", str(i)], logdir)
                for i in range(c.teachers if c.workload == "teacher" else 0)]
    cuts = [c.groups * i // c.producers for i in range(c.producers + 1)]
    producers = [Child("produce", [*common, "--lo", str(cuts[i]), "--hi", str(cuts[i + 1]), "--concurrency",
                                   str(c.concurrency)], logdir) for i in range(c.producers)]
    everyone = consumers + teachers + producers
    try:
        for ch in everyone:
            ch.line(120)
        before, t0 = node_stats(c.ports), time.perf_counter()
        for p in producers:
            p.go()
        made = [p.line() for p in producers]
        got = [ch.line() for ch in consumers]
        t1, after, load = time.perf_counter(), node_stats(c.ports), contention()
        for t in teachers:
            t.stop()
        taught = [t.line(60) for t in teachers]
    finally:
        close(everyone)
    if sum(g["groups"] for g in got) != c.groups:
        raise RuntimeError(f"consumers acked {sum(g['groups'] for g in got)} groups, expected {c.groups}")
    dt = t1 - t0
    written = sum(m["bytes"] for m in made) + (sum(g["bytes"] for g in got) if c.workload == "teacher" else 0)
    cores = {role: sum(x["cpu"] for x in rs) / dt for role, rs in (("producer", made), ("teacher", taught),
                                                                    ("consumer", got)) if rs}
    return Row(c.workload, c.shards, c.groups, dt, written,
               [(b[0] - a[0]) / dt for a, b in zip(before, after, strict=True)],
               [(b[1] - a[1]) / MB for a, b in zip(before, after, strict=True)], cores, load)


async def xadd_only(url: str, port: int, payload: bytes | memoryview, seconds: float, concurrency: int,
                    lua: bool) -> Row:
    """Producer-only MB/s: raw XADD (MAXLEN 4, exact) or ``StreamProducer`` with a trimmer emptying the stream."""
    keys = Keys(f"bx{uuid.uuid4().hex[:8]}")
    clients = [connect(RedisSettings(redis_url=url)) for _ in range(concurrency + 1)]
    key, sent, stop = keys.stream("rollouts"), [0], asyncio.Event()  # an inline stream: trimming frees all
    big = StreamSettings(max_backlog=10**9, backpressure_timeout_s=60.0)

    async def raw(r: Any) -> None:
        while not stop.is_set():
            await r.xadd(key, {b"t": b"rollout", b"d": payload}, maxlen=4, approximate=False)
            sent[0] += 1

    async def script(r: Any, j: int) -> None:
        p, i = StreamProducer(r, keys, "rollouts", big), 0
        while not stop.is_set():
            await p.send_raw(payload, b"rollout", f"x{j}-{i}")
            sent[0], i = sent[0] + 1, i + 1

    async def trimmer(r: Any) -> None:
        while not stop.is_set():
            await r.xtrim(key, maxlen=0)
            await asyncio.sleep(0.005)

    before, c0, t0 = node_stats([port]), time.process_time(), time.perf_counter()
    tasks = [asyncio.ensure_future(script(r, j) if lua else raw(r)) for j, r in enumerate(clients[:-1])]
    if lua:
        tasks.append(asyncio.ensure_future(trimmer(clients[-1])))
    await asyncio.sleep(seconds)
    stop.set()
    await asyncio.gather(*tasks)
    dt, after, cpu = time.perf_counter() - t0, node_stats([port]), time.process_time() - c0
    await clients[0].delete(key)
    for r in clients:
        await r.aclose()
    return Row("xadd-lua" if lua else "xadd-raw", 1, sent[0], dt, sent[0] * len(payload),
               [(after[0][0] - before[0][0]) / dt], [(after[0][1] - before[0][1]) / MB], {"producer": cpu / dt},
               contention())


# ---- output ----------------------------------------------------------------------------------------------

def table(rows: list[Row]) -> str:
    out = ["| run | S | groups | s | groups/s | MB/s written | Redis CPU per node (cores) | MB in per node | "
           "Redis CPU ms/group | client CPU (cores) | client CPU ms/group | load 1m, PSI % |",
           "|---|---:|---:|---:|---:|---:|---|---|---:|---|---:|---|"]
    for r in rows:
        client = ", ".join(f"{k} {v:.2f}" for k, v in r.client_cores.items())
        out.append(f"| {r.name} | {r.shards} | {r.groups} | {r.seconds:.1f} | {r.groups_per_s:.1f} | "
                   f"{r.mb_per_s:.0f} | {' / '.join(f'{x:.2f}' for x in r.node_cores)} | "
                   f"{' / '.join(f'{x:.0f}' for x in r.node_in_mb)} | {r.redis_ms:.1f} | {client} | "
                   f"{r.client_ms:.1f} | {r.load[0]:.1f}, {r.load[1]:.0f} |")
    return "\n".join(out)


def ratios(rows: list[Row]) -> str:
    """S=3 over S=1: best and median groups/s, and medians of CPU per group (all Redis, busiest master, clients).

    The busiest master's CPU per group bounds a Redis-bound run: its inverse is the projected speed-up."""
    out = ["| workload | groups/s, best | groups/s, median | Redis CPU ms/group | busiest master CPU ms/group | "
           "client CPU ms/group |", "|---|---|---|---|---|---|"]
    metrics: list[Callable[[Row], float]] = [lambda r: r.redis_ms, lambda r: r.busiest_ms, lambda r: r.client_ms]
    for name in dict.fromkeys(r.name for r in rows):
        one, three = ([r for r in rows if r.name == name and r.shards == s] for s in (1, 3))
        if not one or not three:
            continue
        pairs = [(max(r.groups_per_s for r in one), max(r.groups_per_s for r in three))]
        pairs += [(statistics.median(f(r) for r in one), statistics.median(f(r) for r in three))
                  for f in [lambda r: r.groups_per_s, *metrics]]
        cells = [f"{b:.1f} / {a:.1f} = **{b / a:.2f}**" for a, b in pairs]
        out.append(f"| {name} | {' | '.join(cells)} |")
    return "\n".join(out)


def cluster_runs(a: argparse.Namespace, logdir: str) -> list[Row]:
    from tests.cluster import LocalCluster

    cluster = LocalCluster(masters=3).start()
    try:
        ports = [n.port for n in cluster.nodes]
        for port in ports:
            redis.Redis(port=port).config_set("appendonly", "no")
        rows: list[Row] = []
        print("\n".join(table(rows).splitlines()[:2]), flush=True)
        for workload, n in (("teacher", a.groups), ("scored", a.scored_groups)):
            for s in (1, 3) * a.repeats:
                rows.append(run_case(Case(cluster.url, ports, workload, s, n, producers=a.producers,
                                          teachers=a.teachers, consumers=a.consumers), logdir))
                print(table(rows[-1:]).splitlines()[-1], flush=True)
                for port in ports:  # our private nodes only: free the memory of the run
                    redis.Redis(port=port).flushall()
        return rows
    finally:
        cluster.stop()


def ceiling_runs(a: argparse.Namespace, logdir: str) -> list[Row]:
    from tests.redis_server import RedisServer

    server = RedisServer().start()
    try:
        payload = encode(asyncio.run(template("scored", 4096, 20)))
        print(f"scored group 8 x 4096, k=20: {len(payload):,} bytes", flush=True)
        rows = [asyncio.run(xadd_only(server.url, server.port, payload, a.seconds, a.concurrency, lua))
                for lua in (False, True)]
        rows.append(run_case(Case(server.url, [server.port], "scored", 1, a.ceiling_groups, seq_len=4096,
                                  producers=a.producers, consumers=a.consumers), logdir))
        rows[-1].name = "scored 8x4096 loop"
        return rows
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", type=int, default=600, help="groups per run, teacher workload")
    p.add_argument("--scored-groups", type=int, default=600, help="groups per run, scored workload")
    p.add_argument("--ceiling-groups", type=int, default=200, help="groups of 8 x 4096 in the one-Redis loop")
    p.add_argument("--repeats", type=int, default=3, help="runs of each (workload, S), alternating S")
    p.add_argument("--producers", type=int, default=1)
    p.add_argument("--teachers", type=int, default=2)
    p.add_argument("--consumers", type=int, default=1)
    p.add_argument("--seconds", type=float, default=5.0, help="duration of each XADD-only run")
    p.add_argument("--concurrency", type=int, default=4, help="connections of the XADD-only runs")
    p.add_argument("--skip-cluster", action="store_true")
    p.add_argument("--skip-ceiling", action="store_true")
    p.add_argument("--json", help="write the rows here")
    # child roles (internal)
    p.add_argument("--role", choices=sorted(ROLES), help=argparse.SUPPRESS)
    for name, kind in (("url", str), ("ns", str), ("workload", str), ("shards", int), ("seq-len", int),
                       ("k", int), ("n", int), ("lo", int), ("hi", int), ("index", int)):
        p.add_argument(f"--{name}", type=kind, default=0 if kind is int else "", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
                        logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    if a.role:
        report(**asyncio.run(ROLES[a.role](a)))
        return
    logdir = tempfile.mkdtemp(prefix="distillq-bench-cluster-")
    print(f"nproc {os.cpu_count()}, load {os.getloadavg()[0]:.1f}; child logs in {logdir}", flush=True)
    rows: list[Row] = []
    if not a.skip_cluster:
        rows += cluster_runs(a, logdir)
        print("\n" + table(rows) + "\n\n" + ratios(rows), flush=True)
    if not a.skip_ceiling:
        ceiling = ceiling_runs(a, logdir)
        print("\nOne plain redis-server:\n" + table(ceiling), flush=True)
        rows += ceiling
    if a.json:
        with open(a.json, "w") as f:
            json.dump([{**r.__dict__, "groups_per_s": r.groups_per_s, "mb_per_s": r.mb_per_s} for r in rows], f,
                      indent=1)


if __name__ == "__main__":
    main()
