"""Real shapes: wire bytes with teacher rows only where the learner trains, ``to_torch`` at 16 x 8192 with
k = 256, and the transport at 16 x 8192 with k = 64 beside the raw-bytes stub.

Run: ``python -m bench.shapes [--rows wire,to_torch,transport] [--rounds N]``. Not a timed test: every row
is a ratio or a figure measured side by side in one run. Vocabulary 151,936 for the ids throughout.

* wire: one group encoded twice from the same rollout, once with a payload of every row (schema 1's
  layout, what the teacher workers shipped before) and once with the trained rows only (today's). Two
  groups: 8 x (prompt 1024 + completion 1024) at k = 64, and an agentic multi-turn group where most
  tokens are prompt or tool output. Target: trained-rows bytes <= (the prompt-free share + 5%) of full.
* to_torch: a 16 x 8192 batch (prompt 1024 shared per group of 16) at k = 256, each dtype choice in a
  fresh process: wall time and the process's peak RSS above its state before the call (VmHWM - VmRSS).
* transport: ``bench.transport.side_by_side`` at 16 x 8192, k = 64: distillq's stages vs the raw stub.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
from datetime import date

import numpy as np

from bench.codec import cpu_model
from bench.common import Workload, quiet_logs
from schemas import encode
from schemas.build import make_sequence, synthetic_scored
from schemas.messages import RolloutGroup, Sequence

VOCAB = 151_936


def prompt_then_completion(seqs: int, prompt: int, completion: int, seed: int = 0) -> RolloutGroup:
    """``seqs`` sequences sharing one ``prompt``-token prompt, each with its own ``completion`` tokens."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, VOCAB, prompt, dtype=np.int32)
    out: list[Sequence] = []
    for _ in range(seqs):
        tok = np.concatenate([shared, rng.integers(0, VOCAB, completion, dtype=np.int32)])
        mask = np.zeros(tok.shape[0], np.uint8)
        mask[prompt:] = 1
        out.append(make_sequence(tok, mask, logprobs=np.where(mask, -0.5, 0.0).astype(np.float32)))
    return RolloutGroup(group_id=f"p{prompt}c{completion}", sequences=out)


def agentic(seqs: int, seed: int = 1) -> RolloutGroup:
    """System + task prompt 1500 tokens, then 6 turns of (assistant 120 tokens, tool output 600 tokens)."""
    rng = np.random.default_rng(seed)
    out: list[Sequence] = []
    for _ in range(seqs):
        parts, mask_parts = [rng.integers(0, VOCAB, 1500, dtype=np.int32)], [np.zeros(1500, np.uint8)]
        for _turn in range(6):
            parts += [rng.integers(0, VOCAB, 120, dtype=np.int32), rng.integers(0, VOCAB, 600, dtype=np.int32)]
            mask_parts += [np.ones(120, np.uint8), np.zeros(600, np.uint8)]
        tok, mask = np.concatenate(parts), np.concatenate(mask_parts)
        out.append(make_sequence(tok, mask, logprobs=np.where(mask, -0.5, 0.0).astype(np.float32)))
    return RolloutGroup(group_id="agentic", sequences=out)


def wire_rows() -> list[dict[str, float | str]]:
    rows: list[dict[str, float | str]] = []
    for name, group, k in (("8 x (1024 prompt + 1024 completion)", prompt_then_completion(8, 1024, 1024), 64),
                           ("8 x agentic (1500 prompt, 6 x (120 assistant + 600 tool))", agentic(8), 64)):
        full = len(encode(synthetic_scored(group, k, vocab=VOCAB, all_rows=True)))
        trained = len(encode(synthetic_scored(group, k, vocab=VOCAB)))
        rollout = len(encode(group))
        share = sum(int(s.loss_mask.numpy()[1:].sum()) for s in group.sequences) / sum(
            s.length - 1 for s in group.sequences)
        teacher_full, teacher_trained = full - rollout, trained - rollout
        rows.append({"group": name, "k": k, "full_MB": full / 1e6, "trained_MB": trained / 1e6,
                     "ratio": trained / full, "teacher_part_ratio": teacher_trained / teacher_full,
                     "prompt_free_share": share, "target": share + 0.05})
    return rows


_TO_TORCH = """
import json, resource, sys, time
import numpy as np, torch
from bench.shapes import prompt_then_completion, VOCAB
from schemas import TrainBatch, decode, encode
from schemas.arrays import Array
from schemas.build import synthetic_scored
from pipeline.learner import to_torch

def vm(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024
    raise KeyError(field)

topk_dtype, index_dtype = getattr(torch, sys.argv[1]), getattr(torch, sys.argv[2])
group = prompt_then_completion(16, 1024, 8192 - 1024)
scored = synthetic_scored(group, 256, vocab=VOCAB)
adv = [Array.from_numpy(np.zeros(s.length, np.float32)) for s in group.sequences]
batch = decode(encode(TrainBatch(batch_id="b", groups=[scored], advantages=adv)), expect=TrainBatch)
torch.set_num_threads(1)
before = vm("VmRSS")
t0 = time.perf_counter()
tb = to_torch(batch, topk_dtype=topk_dtype, index_dtype=index_dtype)
dt = time.perf_counter() - t0
peak = vm("VmHWM") - before
size = tb.teacher_topk_ids.nbytes + tb.teacher_topk_logprobs.nbytes
print(json.dumps({"seconds": dt, "peak_above_MB": peak / 1e6, "topk_tensors_MB": size / 1e6,
                  "distill_positions": int(tb.distill_mask.sum())}))
"""


def to_torch_rows() -> list[dict[str, float | str]]:
    rows: list[dict[str, float | str]] = []
    for topk, index in (("float32", "int64"), ("bfloat16", "int32")):
        out = subprocess.run([sys.executable, "-c", _TO_TORCH, topk, index], capture_output=True, text=True,
                             check=True)
        got = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append({"dtypes": f"{index} ids + {topk} logprobs", **got})
    return rows


async def transport_rows(rounds: int) -> list[dict[str, float | str]]:
    from bench.transport import side_by_side
    from tests.redis_server import RedisServer

    quiet_logs()
    server = RedisServer().start()
    try:
        work = Workload(16, 8192, 64)
        s = await side_by_side(server.url, work, rounds, 3.0, 12.0)
    finally:
        server.stop()
    rows: list[dict[str, float | str]] = []
    stub = s.best("stub")
    for name in ("distillq", "stub", "stub_producer"):
        best = s.best(name)
        rows.append({"variant": name, "groups_per_s": best.groups_per_s, "tokens_per_s": best.groups_per_s * 16 * 8192,
                     "cpu_ms_per_group": best.cpu_per_group_ms, "redis_cpu_ms_per_group": best.redis_cpu_per_group_ms,
                     "vs_stub": best.groups_per_s / stub.groups_per_s if stub.groups_per_s else 0.0})
    return rows


def table(rows: list[dict[str, float | str]]) -> str:
    cols = list(rows[0])
    fmt = [(f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c])) for r in rows for c in cols]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for i in range(len(rows)):
        lines.append("| " + " | ".join(fmt[i * len(cols):(i + 1) * len(cols)]) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    ap.add_argument("--rows", default="wire,to_torch,transport", help="which rows to run (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=1, help="transport rounds per variant (default: %(default)s)")
    args = ap.parse_args(argv)
    print(f"# real shapes, {date.today()}, {cpu_model()}, vocabulary {VOCAB}")
    which = args.rows.split(",")
    if "wire" in which:
        print("\n## wire bytes per scored group: trained rows only vs every row\n")
        print(table(wire_rows()))
    if "to_torch" in which:
        print("\n## to_torch, 16 x 8192 tokens (prompt 1024), k = 256\n")
        print(table(to_torch_rows()))
    if "transport" in which:
        print("\n## transport at 16 x 8192, k = 64 (best of rounds)\n")
        print(table(asyncio.run(transport_rows(args.rounds))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
