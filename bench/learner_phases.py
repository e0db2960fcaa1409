"""Where the example learner's step goes on the real pair's student: seconds of each phase, checkpointing every
step against every N.

    python -m bench.learner_phases [--steps 8] [--every 4] [--model DIR]

Runs ``pipeline.demo.learner.train`` (an embedded Redis, no evaluation) twice on the same synthetic batches
(``--groups`` groups of 4 completions of 60 tokens, 36 of them trained, teacher top-64, the student's vocabulary):
with ``--checkpoint-every 1`` (the default: model and AdamW state, about 1.5 GB for the 124M-parameter student,
written and synced every step) and with ``--checkpoint-every N``. Weights are published every step in both. Prints
and writes (``--out``/phases.json) the mean seconds of each phase per step from the learner's own records
(``forward_backward_s``, ``optimizer_s``, ``checkpoint_s``, ``publish_s``, ``wait_s``) and the seconds per step.
Then the loss's forward and backward alone, the example learner's (one pass over the lm_head for both losses)
against the two losses each with its own pass, alternated ``--head-reps`` times on one batch (median seconds, ratio);
and the same forward and backward alone, beside a thread writing checkpoints in a loop, and beside a process doing
so: whether writing a step's checkpoint while the next step computes would hide its cost on this machine.
The default model is the real pair's student (``pipeline.demo.realpair``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.provenance import header, run_info

PHASES = ("wait_s", "forward_backward_s", "optimizer_s", "checkpoint_s", "publish_s")


def _scored_groups(vocab: int, n: int) -> list[Any]:
    """``n`` synthetic scored groups of 4 completions of 60 tokens (36 of them trained), teacher top-64."""
    from schemas.build import synthetic_rollout, synthetic_scored

    return [synthetic_scored(synthetic_rollout(4, 60, vocab=vocab, prompt_len=24, group_id=f"g{i:03d}", seed=i),
                             k=64, vocab=vocab, seed=i) for i in range(n)]


async def _feed(url: str, namespace: str, vocab: int, batches: int, groups: int) -> None:
    from pipeline.config import RedisSettings
    from pipeline.stages.batching import BatchingConfig
    from pipeline.stages.feeder import Feeder
    from pipeline.stages.kl_control import ConstantKL
    from pipeline.transport.connection import connect
    from pipeline.transport.keys import Keys
    from pipeline.transport.producer import StreamProducer

    r = connect(RedisSettings(redis_url=url))
    keys = Keys(namespace)
    try:
        prod = StreamProducer(r, keys, "scored", None)
        for g in _scored_groups(vocab, batches * groups):
            await prod.send(g)
        cfg = BatchingConfig(max_batch_groups=groups, max_wait_s=0.0, max_staleness=1000)
        await Feeder(r, keys, cfg, ConstantKL(1.0)).run(asyncio.Event(), burst=True)
    finally:
        await r.aclose()


def measure(model: Path, steps: int, every: int, groups: int, url: str, work: Path) -> dict[str, Any]:
    """One learner run of ``steps`` steps at ``--checkpoint-every every``: the mean of each phase, s/step."""
    from pipeline.demo.learner import LearnerConfig, train
    from pipeline.models.weights import read_config

    namespace = f"phases-{every}"
    asyncio.run(_feed(url, namespace, int(read_config(model / "config.json")["vocab_size"]), steps, groups))
    cfg = LearnerConfig(student=str(model), weights_dir=str(work / namespace), steps=steps, lr=2e-4, pg_weight=0.0,
                        checkpoint_every=every, batch_timeout_s=60.0, redis_url=url, namespace=namespace)
    recs = [r for r in train(cfg) if r.get("step", 0) > 0]
    out: dict[str, Any] = {p: round(statistics.fmean(r[p] for r in recs), 3) for p in PHASES}
    out["s_per_step"] = round((recs[-1]["wall_s"] - recs[0]["wall_s"]) / (len(recs) - 1), 3) if len(recs) > 1 else None
    out["steps"] = len(recs)
    out["checkpoints"] = sum(1 for r in recs if r["checkpoint_s"] > 0)
    return out


def _student_and_batch(model: Path, groups: int) -> tuple[Any, Any]:
    """The student (train mode) and a synthetic batch as tensors: ``groups`` groups of 4 completions of 60 tokens,
    36 of them trained, teacher top-64."""
    import numpy as np

    from pipeline.learner.torch_batch import to_torch
    from pipeline.models.weights import load_causal_lm
    from schemas import TrainBatch
    from schemas.arrays import Array

    student = load_causal_lm(model).train()
    scored = _scored_groups(int(student.config.vocab_size), groups)
    adv = [Array.from_numpy(np.zeros(s.length, np.float32)) for g in scored for s in g.group.sequences]
    return student, to_torch(TrainBatch(batch_id="b", groups=scored, advantages=adv))


def _one_pass(student: Any, tb: Any) -> Callable[[], None]:
    """The example learner's loss forward and backward (``step_losses``)."""
    from pipeline.demo.learner import step_losses

    def one() -> None:
        _, pg, kd = step_losses(student, tb, 0.2)
        (pg + kd).backward()  # type: ignore[no-untyped-call]

    return one


def head_passes(model: Path, groups: int, reps: int) -> dict[str, Any]:
    """The example learner's loss forward and backward (``step_losses``: one pass over the lm_head for both
    losses) against the same two losses each with its own pass (``chunked.token_logprobs`` and
    ``chunked.topk_forward_kl``), alternated on one synthetic batch: median seconds of each and their ratio."""
    from pipeline.learner import losses
    from pipeline.learner.chunked import token_logprobs, topk_forward_kl

    student, tb = _student_and_batch(model, groups)
    one = _one_pass(student, tb)

    def two() -> None:
        hidden = student.get_decoder()(input_ids=tb.input_ids, attention_mask=tb.attention_mask.long())
        h, w = hidden.last_hidden_state[:, :-1], student.get_output_embeddings().weight
        new = token_logprobs(h, w, tb.labels, tb.loss_mask)
        pg = losses.importance_sampled_pg_loss(new, tb.student_logprobs, tb.advantages, tb.loss_mask, 0.2)
        (pg + topk_forward_kl(h, w, tb.teacher_topk_ids, tb.teacher_topk_logprobs, tb.distill_mask)).backward()  # type: ignore[no-untyped-call]

    times: dict[str, list[float]] = {"one_pass_s": [], "two_passes_s": []}
    for _ in range(reps):
        for name, fn in (("one_pass_s", one), ("two_passes_s", two)):
            student.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    out: dict[str, Any] = {k: round(statistics.median(v), 3) for k, v in times.items()}
    out["ratio"] = round(out["one_pass_s"] / out["two_passes_s"], 3)
    out["reps"] = reps
    return out


_WRITER = """
import sys, torch
torch.set_num_threads(1)
from pipeline.learner.checkpoint import save_checkpoint
from pipeline.models.weights import load_causal_lm
m = load_causal_lm(sys.argv[1]); o = torch.optim.AdamW(m.parameters(), lr=1e-5)
m(torch.zeros((1, 2), dtype=torch.long)).logits.sum().backward(); o.step()
d, i = sys.argv[2], 0
print("ready", flush=True)
while True:
    i += 1; save_checkpoint(d, m, o, step=i, policy_version=i)
"""


def write_overlap(model: Path, groups: int, reps: int) -> dict[str, Any]:
    """Whether a checkpoint written while the loss's forward and backward run costs the step less than one
    written after it: the forward and backward alone, then beside a thread of the same process writing the model
    and AdamW state (``save_checkpoint``) in a loop, then beside another process doing the same (median seconds;
    one torch thread each, as the demo's processes)."""
    import subprocess
    import threading

    import torch

    from pipeline.learner.checkpoint import save_checkpoint

    student, tb = _student_and_batch(model, groups)
    opt = torch.optim.AdamW(student.parameters(), lr=1e-5)
    one = _one_pass(student, tb)
    one()
    opt.step()

    def fb() -> float:
        times = []
        for _ in range(reps):
            student.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            one()
            times.append(time.perf_counter() - t0)
        return round(statistics.median(times), 3)

    out: dict[str, Any] = {"alone_s": fb(), "reps": reps}
    stop, written = threading.Event(), list[float]()

    def writer(d: str) -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            save_checkpoint(d, student, opt, step=len(written) + 1, policy_version=len(written) + 1)
            written.append(time.perf_counter() - t0)

    with tempfile.TemporaryDirectory(prefix="phases-writer-") as d:
        th = threading.Thread(target=writer, args=(d,))
        th.start()
        try:
            out["beside_a_writer_thread_s"] = fb()
        finally:
            stop.set()
            th.join()
    out["checkpoint_in_the_thread_s"] = round(statistics.median(written), 3)
    with tempfile.TemporaryDirectory(prefix="phases-writer-") as d, subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(model), d], stdout=subprocess.PIPE, text=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"}) as proc:
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
            time.sleep(5.0)
            out["beside_a_writer_process_s"] = fb()
        finally:
            proc.kill()
    for k in ("beside_a_writer_thread_s", "beside_a_writer_process_s"):
        out[k[:-2] + "_ratio"] = round(out[k] / out["alone_s"], 3)
    return out


def main(argv: list[str] | None = None) -> int:
    import torch

    from pipeline.cli.embedded import EmbeddedRedis

    p = argparse.ArgumentParser(prog="python -m bench.learner_phases", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--every", type=int, default=4, help="the --checkpoint-every compared with 1")
    p.add_argument("--groups", type=int, default=2, help="groups of 4 completions a batch")
    p.add_argument("--model", type=Path, help="the student folder (default: the real pair's student)")
    p.add_argument("--head-reps", type=int, default=5, help="repetitions of the one-pass/two-pass loss comparison")
    p.add_argument("--out", type=Path, default=Path("bench-out/learner-phases"))
    a = p.parse_args(argv)
    info = run_info()
    print(header("bench.learner_phases", info), file=sys.stderr, flush=True)
    if a.model is None:
        from pipeline.demo.realpair import ensure_real_pair

        a.model = ensure_real_pair().student
    torch.set_num_threads(1)  # as the demo's learner process (OMP_NUM_THREADS=1)
    embedded = EmbeddedRedis().start()
    report: dict[str, Any] = {"provenance": info, "model": str(a.model), "steps": a.steps, "groups": a.groups}
    try:
        with tempfile.TemporaryDirectory(prefix="phases-") as work:
            for every in (1, a.every):
                report[f"every_{every}"] = measure(a.model, a.steps, every, a.groups, embedded.url, Path(work))
                print(f"--checkpoint-every {every}: {report[f'every_{every}']}", flush=True)
    finally:
        embedded.stop()
    report["loss_head_passes"] = head_passes(a.model, a.groups, a.head_reps)
    print(f"loss forward+backward, one lm_head pass vs two: {report['loss_head_passes']}", flush=True)
    report["checkpoint_overlap"] = write_overlap(a.model, a.groups, a.head_reps)
    print(f"loss forward+backward beside a checkpoint writer: {report['checkpoint_overlap']}", flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "phases.json").write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
