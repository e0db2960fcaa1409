"""The on-policy loop, closed, on CPU: a real vLLM student server kept on the learner's newest weights, the HF
teacher worker, the feeder and a 2-rank DDP (gloo) learner publishing weights every step, each its own process,
against a real redis-server. The demo's tiny pretrained teacher and student (``distillq demo --student vllm``).

Over ``STEPS`` learner steps it checks that every group trained on was sampled within the feeder's
``--max-staleness`` of the learner's version at that step; that every group's recorded student logprobs equal
a transformers forward of the published weights of the version it is tagged with; that the held-out reverse
KL falls by half at least (the feeder waits for full batches, so the samples trained do not depend on how fast the
machine samples). Faults, in the same run: a half-written checkpoint
folder that ``LATEST`` names is planted
(never loaded); one learner rank is killed with SIGKILL in the middle of a step (the group is restarted; the
batch comes back to both ranks and is trained once); the vLLM server is killed with SIGKILL while a reload
holds it paused (it is restarted and synced before it serves again). That DDP's gradients equal one process
training on the whole batch (1e-6) is shown by tests/integration/test_learner_ranks.py
(``test_ddp_ranks_gradients_equal_one_process_on_the_whole_batch``) with the same loss normalisation as
tests/learner_loop.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeline.cli.supervisor import Supervisor
from pipeline.demo.tiny import DemoConfig, enqueue, process_specs, worker_env
from pipeline.models.weights import LATEST, folder_name
from pipeline.transport.keys import Keys
from tests.kill_proxy import KillOnPauseProxy
from tests.redis_server import free_port
from tests.vllm_server import needs_vllm

STEPS = 60
MAX_STALENESS = 3  # the demo feeder's --max-staleness
HOLD_AT = 6  # rank 1 is killed in the middle of this step
VLLM_KILL_AFTER = 12  # the vLLM server is killed during the first reload after this learner step
BAD_VERSION = 99_999
FULL_BATCH_WAIT_S = 60.0  # the feeder waits this long for a full batch (the demo: 0.5 s)
TOL = 1e-4
ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.redis, pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(1200), needs_vllm]


def records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def log_events(path: Path) -> list[dict[str, Any]]:
    out = []
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                with contextlib.suppress(json.JSONDecodeError):
                    out.append(json.loads(line))
    return out


def kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


class Ranks:
    """The learner's 2 DDP rank processes (restarted together, as torchrun's agent restarts a failed group)."""

    def __init__(self, base: list[str], env: dict[str, str], out: Path) -> None:
        self.base, self.env, self.out, self.starts = base, env, out, 0
        self.killing = False  # a rank is being killed: exits are expected
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, hold_at: int = 0) -> None:
        """Both ranks; with ``hold_at``, rank 1 stops in the middle of that step."""
        port = str(free_port())  # a fresh rendezvous for each group
        self.starts += 1
        self.procs = []
        for r in range(2):
            hold = ("--hold-at-step", str(hold_at)) if r == 1 and hold_at else ()
            with open(self.out / f"rank{r}.log", "ab") as log:
                self.procs.append(subprocess.Popen(
                    [*self.base, "--rank", str(r), "--world-size", "2", "--port", port, "--record",
                     str(self.out / f"rank{r}.jsonl"), *hold],
                    env=self.env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))

    def stop(self) -> None:
        for p in self.procs:
            kill_group(p.pid)
            p.wait(10)


def wait(pred: Callable[[], bool], timeout: float, tick: Callable[[], None], what: str) -> None:
    t0 = time.monotonic()
    while not pred():
        tick()
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.2)


def reference_logprobs(model: Any, tokens: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens])).logits[0].double()
    lp = torch.log_softmax(logits, -1)
    return [0.0] + [float(lp[t - 1, tokens[t]]) for t in range(1, len(tokens))]


class Loop:
    """The loop's processes: the demo's vLLM server, rollout worker (through a ``KillOnPauseProxy``), teacher and
    feeder under a ``Supervisor`` (which restarts a killed server), and the learner's two ranks."""

    def __init__(self, redis_url: str, keys: Keys, out: Path) -> None:
        from pipeline.demo.pretrain import train_teacher
        from pipeline.demo.tinymodels import ensure_tiny_models

        tiny = ensure_tiny_models()
        self.out, self.student, teacher = out, tiny.student.resolve(), train_teacher(tiny).resolve()
        cfg = DemoConfig(redis_url=redis_url, out=out, namespace=keys.namespace, steps=STEPS, student_backend="vllm")
        self.weights = out / "weights"
        self.weights.mkdir()
        enqueue(cfg)
        env = worker_env(cfg)
        specs = [s for s in process_specs(cfg, self.student, teacher) if s.name != "learner"]
        rollout = next(s for s in specs if s.name == "rollout-0")
        feeder = next(s for s in specs if s.name == "feeder")
        # Full batches (the demo's 4 groups): how far the KL falls in STEPS steps then depends on the samples
        # trained, not on how fast this machine samples (where the learner outran sampling, the feeder flushed
        # partial batches of 1-2 groups after 0.5 s).
        feeder.argv[feeder.argv.index("--max-wait") + 1] = str(FULL_BATCH_WAIT_S)
        at = rollout.argv.index("--url") + 1
        self.sup = Supervisor(specs, out / "logs", base_env=env)
        self.server = next(p for p in self.sup.procs if p.spec.name == "vllm-student")
        self.proxy = KillOnPauseProxy(rollout.argv[at], lambda: self.server.popen.pid if self.server.popen else None)
        rollout.argv[at] = self.proxy.url  # the rollout worker reaches the server through the proxy
        self.ranks = Ranks([sys.executable, "-m", "tests.learner_loop", "--student", str(self.student),
                            "--weights-dir", str(self.weights), "--steps", str(STEPS), "--eval-teacher", str(teacher),
                            "--lr", "8e-3"], {**os.environ, **env, "PYTHONPATH": str(ROOT)}, out)
        self.rank_recs = [out / "rank0.jsonl", out / "rank1.jsonl"]
        self.rollout_log = out / "logs" / "rollout-0.log"
        self.rank0_exit: int | None = None

    def tick(self) -> None:
        self.sup.poll()
        for p in self.ranks.procs:
            code = p.poll()
            if code not in (None, 0) and not self.ranks.killing:
                raise AssertionError(f"a learner rank exited with {code}: "
                                     f"{(self.out / 'rank0.log').read_text()[-3000:]}")

    def steps_acked(self) -> int:
        return max((r["step"] for r in records(self.rank_recs[0]) if r["event"] == "acked"), default=0)

    def plant_half_written(self) -> None:
        """A version folder without its marker and with a truncated shard, and ``LATEST`` naming it."""
        bad = self.weights / folder_name(BAD_VERSION)
        bad.mkdir()
        (bad / "config.json").write_text((self.student / "config.json").read_text())
        (bad / "model.safetensors").write_bytes((self.student / "model.safetensors").read_bytes()[:1000])
        tmp = self.weights / (LATEST + ".planted")
        tmp.write_text(json.dumps({"version": BAD_VERSION, "folder": bad.name}))
        tmp.replace(self.weights / LATEST)

    def run(self) -> None:
        with self.proxy:
            self.sup.start()
            self.ranks.start(hold_at=HOLD_AT)
            try:
                self.faults_and_steps()
            finally:
                self.ranks.stop()
                self.sup.stop()

    def faults_and_steps(self) -> None:
        ranks = self.ranks
        # 1. Rank 1 stops in the middle of step HOLD_AT. Meanwhile LATEST names a half-written folder.
        wait(lambda: any(r["event"] == "hold" for r in records(self.rank_recs[1])), 600, self.tick, "rank 1 to hold")
        self.plant_half_written()
        wait(lambda: any(e.get("event") == "checkpoint_not_loadable" for e in log_events(self.rollout_log)), 30,
             self.tick, "the rollout worker to refuse the half-written folder")
        # SIGKILL of rank 1 mid-step: rank 0's collective fails; the group restarts from the checkpoint.
        ranks.killing = True
        kill_group(ranks.procs[1].pid)
        ranks.procs[1].wait(10)
        with contextlib.suppress(subprocess.TimeoutExpired):
            ranks.procs[0].wait(30)  # gloo reports the lost peer
        self.rank0_exit = ranks.procs[0].poll()
        ranks.stop()
        ranks.start()
        ranks.killing = False
        # 2. The vLLM server is killed while a reload holds it paused (between /pause and /resume).
        wait(lambda: self.steps_acked() >= VLLM_KILL_AFTER, 600, self.tick, f"learner step {VLLM_KILL_AFTER}")
        self.proxy.armed = True
        wait(lambda: self.proxy.killed_at > 0, 120, self.tick, "a reload to kill the server in")
        # 3. The loop goes on to STEPS.
        wait(lambda: all(p.poll() is not None for p in ranks.procs), 900, self.tick, f"learner step {STEPS}")
        assert [p.returncode for p in ranks.procs] == [0, 0], (self.out / "rank0.log").read_text()[-3000:]


def check_steps(recs: list[list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Every step trained once by both ranks on one batch; the batch held at the kill came back to both ranks;
    parts disjoint; every group within the staleness bound and trained once. Returns the groups trained."""
    steps = [[r for r in rs if r["event"] == "step"] for rs in recs]
    acked = [[r for r in rs if r["event"] == "acked"] for rs in recs]
    for rank in (0, 1):
        assert [r["step"] for r in acked[rank]] == list(range(1, STEPS + 1)), acked[rank]
        assert all(r["ok"] for r in acked[rank])
        assert len({r["batch_id"] for r in acked[rank]}) == STEPS
    assert [r["batch_id"] for r in acked[0]] == [r["batch_id"] for r in acked[1]]
    held = next(r for r in recs[1] if r["event"] == "hold")
    for rank in (0, 1):
        got = [r for r in steps[rank] if r["batch_id"] == held["batch_id"]]
        assert len(got) == 2 and got[1]["redelivered"] and got[1]["generation"] > got[0]["generation"], got
        assert [g["group_id"] for g in got[0]["groups"]] == [g["group_id"] for g in got[1]["groups"]]
    assert held["batch_id"] in [r["batch_id"] for r in acked[0]]
    trained = {r["step"]: (r, r1) for r, r1 in zip(
        [max((x for x in steps[0] if x["step"] == s), key=lambda x: x["t"]) for s in range(1, STEPS + 1)],
        [max((x for x in steps[1] if x["step"] == s), key=lambda x: x["t"]) for s in range(1, STEPS + 1)],
        strict=True)}
    groups: dict[str, dict[str, Any]] = {}
    for step, (r0, r1) in sorted(trained.items()):
        assert r0["batch_id"] == r1["batch_id"] and r0["version"] == r1["version"] == step - 1
        ids0, ids1 = {g["group_id"] for g in r0["groups"]}, {g["group_id"] for g in r1["groups"]}
        assert not ids0 & ids1 and ids0 | ids1
        for g in r0["groups"] + r1["groups"]:
            # Staleness: sampled within the bound of the learner's version at the step that trained it.
            assert 0 <= r0["version"] - g["version"] <= MAX_STALENESS, (step, r0["version"], g["version"])
            assert g["group_id"] not in groups, f"group {g['group_id']} trained twice"
            groups[g["group_id"]] = g
    return groups


def logprob_gap(model: Any, groups: Iterable[dict[str, Any]]) -> tuple[float, int]:
    """The largest |forward of ``model`` - sampled logprob| over the trained tokens of ``groups``, and their count."""
    worst, tokens = 0.0, 0
    for g in groups:
        for s in g["sequences"]:
            ref = reference_logprobs(model, s["tokens"])
            for t, m in enumerate(s["loss_mask"]):
                if m:
                    worst = max(worst, abs(ref[t] - s["logprobs"][t]))
                    tokens += 1
    return worst, tokens


def check_logprobs(groups: dict[str, dict[str, Any]], weights: Path) -> tuple[float, int, int]:
    """Every group's student logprobs equal a transformers forward of the weights of the version it names.
    Returns (largest difference, tokens checked, versions)."""
    from pipeline.models.weights import load_causal_lm

    versions = sorted({g["version"] for g in groups.values()})
    assert BAD_VERSION not in versions
    worst, tokens = 0.0, 0
    for v in versions:
        model = load_causal_lm(weights / folder_name(v)).eval()
        gap, n = logprob_gap(model, (g for g in groups.values() if g["version"] == v))
        worst, tokens = max(worst, gap), tokens + n
    assert tokens > 0 and worst <= TOL, worst
    return worst, tokens, len(versions)


def check_sync_log(events: list[dict[str, Any]]) -> None:
    """The half-written folder was refused, never loaded; the killed server left the rotation and was synced
    again before it served."""
    assert any(e.get("event") == "checkpoint_not_loadable" for e in events)
    synced = [e for e in events if e.get("event") == "student_server_synced"]
    assert synced and not any(e.get("version") == BAD_VERSION for e in synced)
    out_at = [e["timestamp"] for e in events if e.get("event") == "student_server_out_of_rotation"]
    assert out_at, "the killed server never left the rotation"
    assert any(e["timestamp"] > out_at[0] for e in synced), "the restarted server was never synced"


def test_closed_loop_on_cpu(redis_url: str, keys: Keys, tmp_path: Path) -> None:
    t0 = time.monotonic()
    loop = Loop(redis_url, keys, tmp_path)
    loop.run()
    wall_s = time.monotonic() - t0
    recs = [records(p) for p in loop.rank_recs]
    groups = check_steps(recs)
    worst, tokens, versions = check_logprobs(groups, loop.weights)
    evals = {r["step"]: r["heldout_reverse_kl"] for r in recs[0] if r["event"] == "eval"}
    kl0, kl1 = evals[0], evals[STEPS]
    assert kl1 <= kl0 / 2, (kl0, kl1)
    check_sync_log(log_events(loop.rollout_log))
    assert loop.server.restarts == 1 and loop.proxy.killed_at > 0
    print(f"\nclosed loop: {STEPS} steps, held-out reverse KL {kl0:.4f} -> {kl1:.4f}, {len(groups)} groups "
          f"({tokens} sampled tokens) of {versions} versions checked, max |logprob diff| {worst:.2e}, "
          f"rank 0 exit code after the kill {loop.rank0_exit}, wall {wall_s:.0f} s", file=sys.stderr)
