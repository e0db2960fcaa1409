"""The chaos soak: the whole pipeline under faults injected at random (reproducibly from a seed), and the
invariant that nothing is lost, nothing is trained twice, and no bad teacher value reaches a batch.

The pipeline, each part its own process against a private ``redis-server`` (AOF on):

    distillq enqueue (paced chunks) -> worker rollout (hf, tiny student, --weights-dir) -> worker teacher
    (vllm backend against ``teacher_stub.SwitchableTeacher``) -> worker feeder -> ``soak_learner`` (Learner,
    one step per batch, checkpoint, ack, publish_weights)

The driver (``Soak.run``) injects, in an order and at times drawn from the seed, each fault kind of ``KINDS``
at least once: SIGKILL of the rollout worker, the teacher, the feeder and the learner (each restarted under its
name); Redis SIGKILLed and restarted on its AOF; Redis restarted once *without its data* (an empty directory,
no persistence: what a server without persistence or a lost disk gives; the teacher is stopped for
``stall_before_wipe_s`` before it, so that prompts and groups wait in Redis when it goes); Redis at
``maxmemory`` (set below its use for ``oom_s``, then unset); the learner stopped (SIGSTOP) for ``pause_s``,
past the workers' ``DISTILLQ_BACKPRESSURE_TIMEOUT_S``; a torn version published (``LATEST`` names a folder
without its ``distillq-checkpoint.json`` and ``policy_version`` announces it, the learner held meanwhile);
the teacher answering vLLM's -9999.0 for ``sentinel_s``; a rolling restart of the learner that starts the new one
before the old one stopped (an orchestrator's order): the new process, under the same consumer name, must be
refused (exit status 2) having trained nothing, then the old one is stopped (SIGTERM) and the new one takes over;
an operator's ``XTRIM`` of the ``rollouts`` stream while groups wait in it (the teacher stopped for
``stall_before_trim_s`` first), after which the operator runs ``distillq stats`` (its audit must record the loss as a
``stream_trimmed`` incident counting every entry removed).
A process that exits without being killed is restarted too (a supervisor's job) and counted.

After the faults the driver waits until every prompt is trained or dead-lettered, or nothing moved for
``settle_s``. The trimmed groups that are then neither trained nor dead-lettered are sampled again as an operator
would, with ``distillq dlq resample GROUP ...`` (it takes only groups ``distillq where`` calls lost, and makes each
``<epoch>:<id>@v<N>``), and must then be trained once, under the new id; a group trained under both ids is trained
twice. The Redis-without-data restart is handled as an operator would: its loss must be named by a
process in ``ns:incidents`` (the Redis-loss line); the prompts enqueued before it that are then neither
trained nor dead-lettered are the ones lost in the reset, and are enqueued again (``distillq enqueue``, same
epoch) and must then be trained. The invariant (``SoakResult.violations`` empty):

* every enqueued prompt is trained exactly once, or never trained and dead-lettered with its reason, and that
  reason is one the faults justify (``justified``: the teacher's bad values), unless the prompt was unfinished
  when Redis lost its data;
* the prompts lost in the reset were all unfinished (not trained, not dead-lettered, or in an enqueue command
  running) when Redis lost its data, and an incident recorded after it names the loss (kind ``*lost*`` or
  ``*reset*``). The entries the incidents count (``N entries`` in the text, ``entries`` and ``*lost*``
  integer fields) are a figure beside the prompts lost; fewer than lost is a finding, not a violation (a
  process can count the entries it held, not those waiting unread in a stream that went);
* no group is trained twice; nothing unknown is trained;
* every trim is counted in full by ``stream_trimmed`` incidents, and every trimmed group left unfinished is taken
  by ``dlq resample``;
* no batch carries a teacher value that is non-finite, above 0 or at/below -1000 (``soak_learner.FLOOR``).

Recovery time of a fault: from its start to the training of the first prompt enqueued after it ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from random import Random
from typing import Any

import numpy as np
import redis.asyncio as aioredis

from pipeline.demo.learner import kept_steps
from pipeline.demo.tinymodels import arithmetic_problem, ensure_tiny_models
from pipeline.models.weights import LATEST, MARKER, folder_name, published_versions, version_of_folder
from pipeline.transport.keys import Keys
from tests.redis_server import RedisServer
from tests.reliability.harness import WorkerProc, Workers
from tests.reliability.teacher_stub import MODEL, SwitchableTeacher

#: Every fault kind; each is injected at least once per soak, ``redis_wipe`` exactly once.
KINDS = ("kill_rollout", "kill_teacher", "kill_feeder", "kill_learner", "redis_restart", "redis_wipe",
         "redis_oom", "learner_pause", "torn_checkpoint", "teacher_sentinel", "learner_rolling_restart",
         "stream_trim")
EPOCH = 1
K = 4
TAIL_S = 20.0  # prompts go on being enqueued this long after the fault phase
PROMPT_ID = re.compile(r"(?:\d+:)?(p\d{5})(?:@v\d+)?")  # a re-sampled group counts as its prompt's
RESAMPLED = re.compile(r"resampled (\S+) .* as group (\S+)$")


@dataclass(frozen=True)
class SoakConfig:
    seconds: float = 300.0  # the whole soak: start-up, faults, drain
    seed: int = 0
    prompt_rate: float = 1.0  # prompts enqueued per second during the fault phase
    fault_gap_s: float = 14.0  # mean time between two fault starts
    enqueue_every_s: float = 5.0
    max_backlog: int = 4  # DISTILLQ_MAX_BACKLOG of the workers: a learner pause fills the streams quickly
    backpressure_timeout_s: float = 4.0  # DISTILLQ_BACKPRESSURE_TIMEOUT_S of the workers
    pause_s: float = 10.0  # learner SIGSTOPped (past the backpressure timeout)
    oom_s: float = 6.0
    sentinel_s: float = 5.0
    stall_before_wipe_s: float = 6.0  # the teacher is stopped this long before Redis loses its data
    stall_before_trim_s: float = 4.0  # ... and this long before the rollouts stream is trimmed
    settle_s: float = 30.0  # the drain ends when nothing moved for this long
    drain_reserve_s: float = 100.0  # of ``seconds``, kept for the drains after the fault phase
    workdir: Path | None = None

    @property
    def fault_phase_s(self) -> float:
        return max(60.0, self.seconds - self.drain_reserve_s - 30.0)


@dataclass
class Fault:
    kind: str
    start: float
    end: float = 0.0
    note: str = ""
    recovery_s: float | None = None


@dataclass
class Exit:
    """A process that exited without the driver killing it (restarted by the driver)."""

    name: str
    at: float
    code: int | None
    after_fault: str
    tail: str


@dataclass
class SoakResult:
    figures: dict[str, Any]
    violations: list[str]
    faults: list[Fault]
    exits: list[Exit]
    workdir: Path
    started: float  # time.time() at the start
    findings: list[str] = field(default_factory=list)  # worth a look, not a breach of the invariant

    def summary(self) -> str:
        lines = [f"{k}={v}" for k, v in self.figures.items()]
        lines += [f"VIOLATION {v}" for v in self.violations]
        lines += [f"FINDING {v}" for v in self.findings]
        lines += [f"EXIT {e.name} code={e.code} after={e.after_fault}: {e.tail[-600:]}" for e in self.exits]
        return "\n".join(lines)


def prompt_lines(n: int, seed: int) -> list[dict[str, Any]]:
    rng = Random(seed)
    out = []
    for i in range(n):
        q, a = arithmetic_problem(rng, "train")
        out.append({"id": f"p{i:05d}", "messages": [{"role": "user", "content": q}], "answer": a})
    return out


def schedule(cfg: SoakConfig) -> list[tuple[float, str]]:
    """(offset into the fault phase, kind): each kind once, more of the repeatable ones to fill the phase,
    ``redis_wipe`` in the middle."""
    rng = Random(cfg.seed)
    n = max(len(KINDS), int(cfg.fault_phase_s / cfg.fault_gap_s))
    kinds = list(KINDS) + [rng.choice([k for k in KINDS if k != "redis_wipe"]) for _ in range(n - len(KINDS))]
    rng.shuffle(kinds)
    kinds.remove("redis_wipe")
    kinds.insert(n // 2, "redis_wipe")
    slot = cfg.fault_phase_s / n
    return [((i + 0.5 + rng.uniform(-0.3, 0.3)) * slot, k) for i, k in enumerate(kinds)]


@dataclass
class LearnerRecord:
    """The learner's JSON lines, read as they grow: what was trained (steps kept by every later restart)."""

    path: Path
    offset: int = 0
    steps: list[dict[str, Any]] = field(default_factory=list)
    starts: list[dict[str, Any]] = field(default_factory=list)

    def poll(self) -> None:
        if not self.path.exists():
            return
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1
        self.offset += end
        for line in data[:end].splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                rec = json.loads(line)
                if rec.get("event") == "step":
                    self.steps.append(rec)
                elif rec.get("event") == "start":
                    self.starts.append(rec)

    def kept(self) -> list[dict[str, Any]]:
        """Step lines whose step is in the weights (the example learner's ``--trained-log`` format)."""
        return kept_steps([*self.starts, *self.steps])

    def trained(self) -> dict[str, list[float]]:
        """Group id -> the times it was trained (kept steps)."""
        out: dict[str, list[float]] = {}
        for rec in self.kept():
            for gid in rec["groups"]:
                out.setdefault(gid, []).append(rec["t"])
        return out


#: How a published version is torn: no marker (``distillq-checkpoint.json``); the marker with a truncated
#: shard; a complete folder whose tensors hold NaN.
TORN = ("no_marker", "truncated", "nan")


def tear_folder(torn: Path, student: Path, complete: Path | None, variant: str) -> None:
    """Write version folder ``torn``: ``no_marker`` from the student's files; the other variants copy the
    complete version ``complete`` (its marker renamed to this version) and spoil its shard."""
    if variant == "no_marker" or complete is None:
        torn.mkdir(parents=True)
        (torn / "config.json").write_text((student / "config.json").read_text())
        (torn / "model.safetensors").write_bytes((student / "model.safetensors").read_bytes()[:1000])
        return
    shutil.copytree(complete, torn)
    marker = json.loads((torn / MARKER).read_text())
    (torn / MARKER).write_text(json.dumps({**marker, "version": version_of_folder(torn.name)}))
    shard = torn / "model.safetensors"
    if variant == "truncated":
        shard.write_bytes(shard.read_bytes()[:1000])
        return
    data = bytearray(shard.read_bytes())  # NaN written over one float32 tensor in place: header and size hold
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    lo, hi = next(v["data_offsets"] for k, v in sorted(header.items()) if k != "__metadata__" and v["dtype"] == "F32")
    data[8 + n + lo:8 + n + hi] = np.full((hi - lo) // 4, np.nan, dtype=np.float32).tobytes()
    shard.write_bytes(bytes(data))


def justified(reason: str) -> bool:
    """Whether a dead letter's reason is one a fault of the soak justifies outside the Redis reset: only the
    teacher's bad values (``invalid_logprobs``). A kill, a restart on the AOF, Redis at maxmemory, a learner
    pause or a torn version must dead-letter nothing."""
    return "invalid_logprobs" in reason


def loss_counts(incident: dict[str, str]) -> list[int]:
    """The numbers of lost entries an incident gives: its ``entries`` and ``*lost*`` integer fields, or else the
    ``N entries`` of its text."""
    out: list[int] = []
    with contextlib.suppress(ValueError, AttributeError):
        fields = json.loads(incident.get("fields") or "{}")
        out = [v for k, v in fields.items() if ("lost" in k or k == "entries") and isinstance(v, int)
               and not isinstance(v, bool)]
    return out or [int(n) for n in re.findall(r"(\d+) entr", incident.get("text", ""))]


class Soak:
    """One soak: its Redis, teacher stub and processes, the driver's record of what it did and saw, and the
    analysis (``run``; ``analyse`` turns the record into figures and violations)."""

    def __init__(self, cfg: SoakConfig) -> None:
        self.cfg = cfg
        self.rng = Random(cfg.seed + 1)
        self.dir = cfg.workdir or Path(tempfile.mkdtemp(prefix="distillq-soak-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        self.ns = f"soak{cfg.seed}"
        self.keys = Keys(self.ns)
        self.server = RedisServer(extra_args=["--appendonly", "yes", "--appendfsync", "everysec"])
        tiny = ensure_tiny_models()
        self.student = str(tiny.student.resolve())
        vocab = int(json.loads((tiny.student / "config.json").read_text())["vocab_size"])
        self.stub = SwitchableTeacher(cap=20, vocab=vocab)  # ids the student's logits have
        self.weights = self.dir / "weights"
        self.record = LearnerRecord(self.dir / "learner.jsonl")
        n = max(1, int(cfg.prompt_rate * (cfg.fault_phase_s + TAIL_S)))
        self.prompts = prompt_lines(n, cfg.seed)
        self.enqueued: dict[str, float] = {}  # group id -> start of the `distillq enqueue` that took it (exit 0)
        self.enqueuing: set[str] = set()  # group ids of the enqueue command running now
        self.enqueue_failures = 0
        self.dead: dict[str, list[str]] = {}  # group id -> dead-letter reasons
        self._dl_seen: set[tuple[str, str]] = set()
        self.incidents: list[dict[str, str]] = []
        self._inc_seen: set[tuple[str, str]] = set()
        self.faults: list[Fault] = []
        self.exits: list[Exit] = []
        self.down: set[str] = set()  # processes the driver is holding down (killed, stopped)
        self.current = ""  # the fault being injected
        self.wipe_at = 0.0
        self.at_risk: set[str] = set()  # unfinished group ids when Redis lost its data
        self.reenqueued: list[str] = []
        self.trimmed: dict[str, float] = {}  # group id -> when its rollouts entry was trimmed
        self.trim_count = 0  # entries removed by the trims (XTRIM's answers)
        self.resampled: dict[str, str] = {}  # new group id -> the trimmed group it re-samples
        self.resample_refused: list[str] = []
        self.procs: dict[str, WorkerProc] = {}
        self.r: aioredis.Redis | None = None
        self.started = time.time()

    # ----- processes -----

    def env(self) -> dict[str, str]:
        return {"DISTILLQ_MAX_BACKLOG": str(self.cfg.max_backlog),
                "DISTILLQ_BACKPRESSURE_TIMEOUT_S": str(self.cfg.backpressure_timeout_s),
                "PYTHONPATH": str(Path(__file__).resolve().parents[2])}

    def start_processes(self) -> None:
        w = Workers(self.server.url, self.ns, self.dir, env=self.env())
        self.workers = w
        self.procs["rollout"] = w.add("rollout", "rollout", "--backend", "hf", "--model", self.student,
                                      "--group-size", "2", "--max-tokens", "8", "--reward", "math",
                                      "--max-jobs", "2", "--weights-dir", str(self.weights))
        self.procs["teacher"] = w.add("teacher", "teacher", "--backend", "vllm", "--url", self.stub.url,
                                      "--model", MODEL, "--top-k", str(K), "--timeout", "5", "--on-drop", "dlq")
        self.procs["feeder"] = w.add("feeder", "feeder", "--max-batch-groups", "4", "--max-wait", "0.5",
                                     "--max-staleness", "-1")
        argv = [sys.executable, "-m", "tests.reliability.soak_learner", "--redis-url", self.server.url,
                "--namespace", self.ns, "--student", self.student, "--weights-dir", str(self.weights),
                "--record", str(self.record.path)]
        self.procs["learner"] = w.procs["learner"] = WorkerProc("learner", argv, self.env(), self.dir).start()

    def supervise(self) -> None:
        """Restart a process that exited on its own (as ``distillq up`` would), and count it."""
        for name, p in self.procs.items():
            if name in self.down or p.alive:
                continue
            last = self.current or (self.faults[-1].kind if self.faults else "none")
            code = p.popen.returncode if p.popen is not None else None
            self.exits.append(Exit(name, time.time(), code, last, p.log_text()[-1500:]))
            p.start()

    # ----- observation -----

    async def observe(self) -> None:
        """Dead letters and incidents (both streams are read whole: a reset empties them), the learner's record."""
        self.record.poll()
        self.supervise()
        r = self.r
        assert r is not None
        with contextlib.suppress(Exception):
            for eid, f in await r.xrange(self.keys.dlq):
                key = (eid.decode(), f.get(b"at_ms", b"").decode())
                if key in self._dl_seen:
                    continue
                self._dl_seen.add(key)
                gid = next((m.group(1) for v in f.values() if len(v) < 64
                            for m in [PROMPT_ID.fullmatch(v.decode("utf-8", "replace"))] if m), None)
                if gid is not None:
                    self.dead.setdefault(f"{EPOCH}:{gid}", []).append(f.get(b"reason", b"").decode()[:200])
        with contextlib.suppress(Exception):
            for eid, f in await r.xrange(self.keys.incidents):
                rec = {k.decode(): v.decode("utf-8", "replace") for k, v in f.items()}
                key = (eid.decode(), rec.get("ts", ""))
                if key not in self._inc_seen:
                    self._inc_seen.add(key)
                    self.incidents.append(rec)

    def finished(self) -> set[str]:
        return set(self.record.trained()) | set(self.dead)

    async def observer(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.observe()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)

    # ----- input -----

    async def enqueue(self, lines: list[dict[str, Any]], tag: str) -> bool:
        f = self.dir / f"prompts-{tag}.jsonl"
        f.write_text("".join(json.dumps(x) + "\n" for x in lines))
        begun = time.time()
        gids = {f"{EPOCH}:{x['id']}" for x in lines}
        self.enqueuing |= gids
        try:
            code, out = await self.cli("enqueue", str(f), "--epoch", str(EPOCH))
        finally:
            self.enqueuing -= gids
        with open(self.dir / "enqueue.log", "a") as log:
            log.write(f"--- {tag} rc={code} {begun - self.started:.1f}-{time.time() - self.started:.1f} s\n{out}")
        if code != 0:
            self.enqueue_failures += 1
            return False
        for x in lines:
            self.enqueued.setdefault(f"{EPOCH}:{x['id']}", begun)
        return True

    async def producer(self, stop: asyncio.Event) -> None:
        """The prompts in chunks, spread over the fault phase and ``TAIL_S`` after it (so that the last fault's
        recovery shows); a failed chunk is tried again."""
        every = self.cfg.enqueue_every_s
        n_chunks = max(1, int((self.cfg.fault_phase_s + TAIL_S) / every))
        size = -(-len(self.prompts) // n_chunks)
        for i in range(0, len(self.prompts), size):
            t0 = time.monotonic()
            while not await self.enqueue(self.prompts[i:i + size], f"{i:05d}"):
                await asyncio.sleep(1.0)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), max(0.0, every - (time.monotonic() - t0)))
            if stop.is_set():
                return

    # ----- faults -----

    async def inject(self, kind: str) -> Fault:
        fault = Fault(kind, time.time())
        self.current = kind
        try:
            fn = getattr(self, f"_{kind}", None)
            fault.note = await (self._kill(kind.removeprefix("kill_")) if fn is None else fn())
        finally:
            self.current = ""
        fault.end = time.time()
        return fault

    async def _kill(self, name: str) -> str:
        p = self.procs[name]
        self.down.add(name)
        try:
            p.kill()
            await asyncio.sleep(self.rng.uniform(0.2, 1.0))
            p.start()
        finally:
            self.down.discard(name)
        return f"pid {p.pid}"

    async def _redis_restart(self) -> str:
        self.server.kill()
        await asyncio.sleep(1.0)
        await asyncio.to_thread(self.server.start)
        return "SIGKILL, restarted on its AOF"

    async def _redis_wipe(self) -> str:
        teacher = self.procs["teacher"]  # stopped first, so that prompts and groups wait in Redis when it goes
        self.down.add("teacher")
        os.kill(teacher.pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(self.cfg.stall_before_wipe_s)
            return await self._wipe()
        finally:
            os.kill(teacher.pid, signal.SIGCONT)
            self.down.discard("teacher")

    async def _wipe(self) -> str:
        await self.observe()
        self.at_risk = (set(self.enqueued) | self.enqueuing) - self.finished()
        self.wipe_at = time.time()
        self.server.kill()
        old = self.server.dir
        self.server.dir = Path(tempfile.mkdtemp(prefix="distillq-redis-"))
        shutil.rmtree(old, ignore_errors=True)
        extra = self.server.extra_args
        self.server.extra_args = ["--appendonly", "no"]
        await asyncio.sleep(1.0)
        try:
            await asyncio.to_thread(self.server.start)
        finally:
            self.server.extra_args = extra
        assert self.r is not None
        await self.r.config_set("appendonly", "yes")  # the later restarts keep what comes after
        return f"{len(self.at_risk)} prompts unfinished at the reset"

    async def _redis_oom(self) -> str:
        assert self.r is not None
        used = int((await self.r.info("memory"))["used_memory"])
        await self.r.config_set("maxmemory", str(max(1, used // 2)))
        await asyncio.sleep(self.cfg.oom_s)
        await self.r.config_set("maxmemory", "0")
        return f"maxmemory {max(1, used // 2)} (used {used}) for {self.cfg.oom_s:g} s"

    async def _learner_pause(self) -> str:
        p = self.procs["learner"]
        if not p.alive:
            return "learner not running: skipped"
        self.down.add("learner")
        try:
            os.kill(p.pid, signal.SIGSTOP)
            await asyncio.sleep(self.cfg.pause_s)
            os.kill(p.pid, signal.SIGCONT)
        finally:
            self.down.discard("learner")
        return f"SIGSTOP {self.cfg.pause_s:g} s (backpressure timeout {self.cfg.backpressure_timeout_s:g} s)"

    async def _learner_rolling_restart(self) -> str:
        p = self.procs["learner"]
        if not p.alive:
            return "learner not running: skipped"
        twin_record = self.dir / f"learner-twin-{len(self.faults)}.jsonl"
        argv = [*p.argv[:p.argv.index("--record") + 1], str(twin_record)]
        twin = WorkerProc(f"learner-twin-{len(self.faults)}", argv, self.env(), self.dir).start()
        try:
            code = await asyncio.to_thread(twin.popen.wait, 60)  # type: ignore[union-attr]
        except Exception:
            twin.kill()
            code = None
        steps = twin_record.read_text().count('"step"') if twin_record.exists() else 0
        refused = code == 2 and "is held by a live process" in twin.log_text() and steps == 0
        self.down.add("learner")
        try:
            await asyncio.to_thread(p.stop, 20.0)  # the old one goes; the new one takes the name
            p.start()
        finally:
            self.down.discard("learner")
        if refused:
            return "the new learner was refused while the old one lived (exit 2), then replaced it"
        return f"violation: the new learner was not refused (exit {code}, {steps} steps trained)"

    async def _stream_trim(self) -> str:
        assert self.r is not None
        teacher = self.procs["teacher"]  # stopped first, so that groups wait in the rollouts stream
        self.down.add("teacher")
        os.kill(teacher.pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(self.cfg.stall_before_trim_s)
            key = self.keys.stream("rollouts")
            rows = await self.r.xrange(key)  # only the rollout worker writes meanwhile, at the tail
            cut = max(1, len(rows) // 2) if rows else 0
            removed = int(await self.r.xtrim(key, maxlen=len(rows) - cut, approximate=False)) if cut else 0
        finally:
            os.kill(teacher.pid, signal.SIGCONT)
            self.down.discard("teacher")
        now = time.time()
        for _, f in rows[:removed]:
            self.trimmed[f[b"gid"].decode()] = now
        self.trim_count += removed
        stats = await self.cli("stats", "--json")  # the operator looks: its audit records the loss
        return f"{removed} of {len(rows)} rollouts entries trimmed; stats exit {stats[0]}"

    async def cli(self, *argv: str) -> tuple[int | None, str]:
        """``distillq ARGV`` against this soak's Redis and namespace: (exit status, output)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("DISTILLQ_")}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "pipeline.cli.main", *argv, "--redis-url", self.server.url, "--namespace",
            self.ns, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), 60)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            out = b"timed out"
        return proc.returncode, out.decode("utf-8", "replace")

    async def resample_trimmed(self, deadline: float) -> None:
        """The operator's step after a trim: ``dlq resample`` of the trimmed groups left unfinished (those
        unfinished at a later Redis reset are the reset's), then a drain of the new groups."""
        left = sorted(set(self.trimmed) - self.finished() - self.at_risk)
        if not left:
            return
        code, out = await self.cli("dlq", "resample", *left)
        with open(self.dir / "resample.log", "a") as log:
            log.write(f"--- exit {code}\n{out}")
        for line in out.splitlines():
            if m := RESAMPLED.search(line):
                self.resampled[m.group(2)] = m.group(1)
            elif line.startswith("kept"):
                self.resample_refused.append(line)
        await self.drain(set(self.resampled), deadline)

    async def _torn_checkpoint(self) -> str:
        assert self.r is not None
        version = max([int(await self.r.get(self.keys.policy_version) or 0), *published_versions(self.weights)]) + 1
        while (self.weights / folder_name(version)).exists():  # never into a folder the learner wrote
            version += 1
        log, learner = self.procs["rollout"], self.procs["learner"]
        seen_before = log.log_text().count("checkpoint_not_loadable")
        # The learner is held while the torn version is the newest: its next publish would replace it at once.
        held = learner.alive
        if held:
            self.down.add("learner")
            os.kill(learner.pid, signal.SIGSTOP)
        try:
            return await self._tear(version, log, seen_before)
        finally:
            if held:
                os.kill(learner.pid, signal.SIGCONT)
                self.down.discard("learner")

    async def _tear(self, version: int, log: WorkerProc, seen_before: int) -> str:
        assert self.r is not None
        torn = self.weights / folder_name(version)
        variant = TORN[sum(f.kind == "torn_checkpoint" for f in self.faults) % len(TORN)]
        tear_folder(torn, Path(self.student), self._newest_complete(), variant)
        tmp = self.weights / f"{LATEST}.torn"
        tmp.write_text(json.dumps({"version": version, "folder": torn.name}))
        tmp.replace(self.weights / LATEST)
        await self.r.set(self.keys.policy_version, version)
        return f"{variant}, " + await self._refused(version, log, seen_before)

    def _newest_complete(self) -> Path | None:
        done = [self.weights / folder_name(v) for v in published_versions(self.weights)]
        return next((d for d in reversed(done) if (d / MARKER).exists()), None)

    async def _refused(self, version: int, log: WorkerProc, seen_before: int) -> str:
        for _ in range(32):
            if log.log_text().count("checkpoint_not_loadable") > seen_before:
                return f"version {version}: refused (checkpoint_not_loadable)"
            await asyncio.sleep(0.25)
        return f"version {version}: no checkpoint_not_loadable logged within 8 s"

    async def _teacher_sentinel(self) -> str:
        before = self.stub.sentinel_answers
        await self.stub.set_mode("sentinel")
        await asyncio.sleep(self.cfg.sentinel_s)
        await self.stub.set_mode("up")
        return f"{self.stub.sentinel_answers - before} answers with -9999.0"

    async def chaos(self, t0: float) -> None:
        for offset, kind in schedule(self.cfg):
            await asyncio.sleep(max(0.0, t0 + offset - time.monotonic()))
            try:
                self.faults.append(await self.inject(kind))
            except Exception as e:  # the driver's own step failed (e.g. Redis unreachable for CONFIG SET)
                self.faults.append(Fault(kind, time.time(), time.time(), f"driver error: {e!r}"))

    # ----- run -----

    async def drain(self, want: set[str], deadline: float) -> bool:
        """Until every group of ``want`` is trained or dead-lettered, or nothing moved for ``settle_s``."""
        last, moved = -1, time.monotonic()
        while time.monotonic() < deadline:
            await self.observe()
            done = len(want & self.finished())
            if done == len(want):
                return True
            if done != last:
                last, moved = done, time.monotonic()
            elif time.monotonic() - moved > self.cfg.settle_s:
                return False
            await asyncio.sleep(0.5)
        return False

    async def run(self) -> SoakResult:
        t_start = time.monotonic()
        self.started = time.time()
        deadline = t_start + self.cfg.seconds
        await asyncio.to_thread(self.server.start)
        await self.stub.start()
        self.r = aioredis.Redis.from_url(self.server.url, socket_timeout=2, socket_connect_timeout=2)
        stop = asyncio.Event()
        tasks: list[asyncio.Task[None]] = []
        try:
            self.start_processes()
            tasks.append(asyncio.create_task(self.observer(stop)))
            while not self.record.starts and time.monotonic() - t_start < 120:
                await asyncio.sleep(0.5)
            tasks.append(asyncio.create_task(self.producer(stop)))
            t0 = time.monotonic()
            await self.chaos(t0)
            await asyncio.wait_for(tasks.pop(), max(1.0, deadline - time.monotonic()))
            fault_end = time.monotonic()
            await self.drain(set(self.enqueued), deadline - 30)
            await self.resample_trimmed(deadline - 20)
            if self.wipe_at:  # the operator's step after a Redis that lost its data
                self.reenqueued = sorted(set(self.enqueued) - self.finished() - set(self.resampled.values()))
                if self.reenqueued:
                    lines = [x for x in self.prompts if f"{EPOCH}:{x['id']}" in set(self.reenqueued)]
                    await self.enqueue(lines, "reenqueue")
                    await self.drain(set(self.reenqueued), deadline - 5)
            await asyncio.sleep(1.5)  # a late duplicate shows here
            await self.observe()
            return self.analyse(time.monotonic() - t_start, fault_end - t0)
        finally:
            stop.set()
            for t in tasks:
                t.cancel()
            for p in self.procs.values():
                if p.alive and p.popen is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(p.pid, signal.SIGCONT)
            if hasattr(self, "workers"):
                self.workers.close()
            await self.stub.close()
            await self.r.aclose()
            self.server.stop()

    # ----- the invariant and the figures -----

    def trained(self) -> dict[str, list[float]]:
        """The learner's record by prompt group: a re-sampled group's training is its trimmed group's."""
        out: dict[str, list[float]] = {}
        for gid, ts in self.record.trained().items():
            out.setdefault(self.resampled.get(gid, gid), []).extend(ts)
        return out

    def trims_named(self) -> tuple[int, list[str]]:
        """The entries ``stream_trimmed`` incidents count, and the trims' violations."""
        lines = [i for i in self.incidents if i.get("kind") == "stream_trimmed"]
        named = sum(n for i in lines for n in loss_counts(i))
        out = []
        if named < self.trim_count:
            out.append(f"{self.trim_count} rollouts entries trimmed, stream_trimmed incidents count {named}: "
                       f"{[i.get('text') for i in lines][:3]}")
        if self.resample_refused:
            out.append(f"dlq resample refused trimmed groups left unfinished: {self.resample_refused[:3]}")
        return named, out

    def analyse(self, elapsed: float, fault_phase: float) -> SoakResult:
        trained = self.trained()
        enq = set(self.enqueued)
        violations: list[str] = []
        findings: list[str] = []  # worth a look, not a breach of the invariant
        dups = {g: len(ts) for g, ts in trained.items() if len(ts) > 1}
        if dups:
            violations.append(f"trained twice or more: {len(dups)} groups, e.g. {sorted(dups.items())[:5]}")
        unknown = sorted(set(trained) - enq)
        if unknown:
            violations.append(f"trained but never enqueued: {unknown[:5]}")
        lost = sorted(enq - set(trained) - set(self.dead))
        if lost:
            violations.append(f"lost (neither trained nor dead-lettered): {len(lost)}, e.g. {lost[:8]}")
        bad = [(rec["batch_id"], gid, why) for rec in self.record.steps for gid, why in rec["bad_teacher"].items()]
        if bad:
            violations.append(f"bad teacher values reached {len({b[0] for b in bad})} batches "
                              f"({len(bad)} groups), e.g. {bad[:3]}")
        unjustified = Counter(r.split(":", 1)[0] for g, rs in self.dead.items() if g not in trained
                              and g not in self.at_risk for r in rs[:1] if not justified(r))
        if unjustified:
            violations.append(f"dead-lettered by faults that must lose nothing: {dict(unjustified)}, e.g. "
                              f"{[(g, rs[0][:160]) for g, rs in self.dead.items() if not justified(rs[0])][:3]}")
        violations += [f"{f.kind}: {f.note.removeprefix('violation: ')}" for f in self.faults
                       if f.note.startswith("violation:")]
        trim_named, trim_violations = self.trims_named()
        violations += trim_violations
        reset_lines = [i for i in self.incidents if float(i.get("ts") or 0) >= self.wipe_at > 0
                       and re.search("lost|reset", i.get("kind", ""))]
        counts = [n for i in reset_lines for n in loss_counts(i)]
        named = sum(counts) if counts else None
        if self.reenqueued:
            outside = sorted(set(self.reenqueued) - self.at_risk)
            if outside:
                violations.append(f"lost outside the reset (finished or not yet enqueued at it): {outside[:8]}")
            if not reset_lines:
                violations.append(f"{len(self.reenqueued)} prompts lost in the reset, and no incident names it")
            elif named is not None and len(self.reenqueued) > named:
                findings.append(f"{len(self.reenqueued)} prompts lost in the reset, the incidents count {named} "
                                f"entries: {[i.get('text') for i in reset_lines][:3]}")
        latency = [trained[g][0] - t for g, t in self.enqueued.items() if g in trained]
        for f in self.faults:
            after = [trained[g][0] for g, t in self.enqueued.items() if t >= f.end and g in trained]
            f.recovery_s = round(min(after) - f.start, 1) if after else None
        reasons = Counter(r.split(":", 1)[0] for rs in self.dead.values() for r in rs[:1])
        per_kind = Counter(f.kind for f in self.faults)
        rec_by_kind: dict[str, list[float]] = {}
        for f in self.faults:
            if f.recovery_s is not None:
                rec_by_kind.setdefault(f.kind, []).append(f.recovery_s)
        figures: dict[str, Any] = {
            "seed": self.cfg.seed, "elapsed_s": round(elapsed, 1), "fault_phase_s": round(fault_phase, 1),
            "faults": sum(per_kind.values()),
            "faults_by_kind": ",".join(f"{k}:{per_kind[k]}" for k in KINDS),
            "prompts_in": len(enq), "trained": len(set(trained) & enq),
            "dead_lettered": len((set(self.dead) - set(trained)) & enq),
            "dead_letter_reasons": ",".join(f"{k}:{v}" for k, v in sorted(reasons.items())) or "-",
            "lost_in_reset": len(self.reenqueued), "named_in_incidents": named,
            "trimmed": self.trim_count, "named_in_trim_incidents": trim_named, "resampled": len(self.resampled),
            "lost": len(lost), "duplicates": sum(n - 1 for n in dups.values()), "unknown": len(unknown),
            "bad_teacher_groups": len(bad),
            "unexpected_exits": ",".join(f"{k}:{v}" for k, v in sorted(Counter(e.name for e in self.exits).items()))
            or "0",
            "incidents": ",".join(f"{k}:{v}" for k, v in sorted(Counter(i.get("kind", "?")
                                                                         for i in self.incidents).items())) or "0",
            "enqueue_failures": self.enqueue_failures,
            "latency_s_median": round(statistics.median(latency), 1) if latency else None,
            "recovery_s": ",".join(f"{k}:{statistics.median(v):.1f}/{max(v):.1f}" for k, v in rec_by_kind.items()),
            "learner_restarts": len(self.record.starts) - 1,
        }
        return SoakResult(figures, violations, self.faults, self.exits, self.dir, self.started, findings)


def run_soak(cfg: SoakConfig) -> SoakResult:
    return asyncio.run(Soak(cfg).run())
