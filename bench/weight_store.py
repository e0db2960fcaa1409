"""Weights through a store (``redis://``): bytes per version as deltas vs whole, and the time from
``publish_weights`` returning to a reader in another process having the version loaded.

    python -m bench.weight_sync --store [--store-steps 20] [--student alternate]

The real pair's student (``pipeline.demo.realpair``; ``alternate``: every other layer, 81M parameters) is
trained ``--store-steps`` AdamW steps at the real demo's learning rate (2e-4, decaying linearly to 0 at the last
step, as ``distillq demo --real`` runs it) on next-token loss over the real task set's train prompts and answers
(8 a step). After each step the same weights are published twice, in bfloat16 and in float32, each to its own
prefix of a private redis-server (snapshot every 10 versions, the newest 3 kept), and a reader process per
prefix (``Mirror`` polled every 50 ms, then ``load_into`` a transformers model) prints when it has each version
loaded. Reported per dtype: the full and stored bytes of each version (the first is a snapshot), the
publish seconds, the publish-returned-to-loaded seconds, and the weights Redis's ``used_memory`` after each
version (less what the empty server used).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

READER = """
import json, sys, time
from pathlib import Path
from pipeline.models.weights import latest, load_causal_lm, load_into
from pipeline.weightstore.mirror import Mirror
from pipeline.weightstore.stores import open_store
url, local, student = sys.argv[1:4]
model = load_causal_lm(student)
mirror = Mirror(open_store(url), Path(local))
print("BENCH " + json.dumps({"ready": True}), flush=True)
loaded = None
while True:
    v = mirror.sync()
    if v is not None and v != loaded:
        load_into(model, latest(local))
        loaded = v
        print("BENCH " + json.dumps({"version": v, "t": time.time(), "fetch_s": mirror.last_seconds,
                                     "fetched": mirror.last_bytes}), flush=True)
    time.sleep(0.05)
"""


def said(reader: subprocess.Popen[str]) -> dict[str, Any]:
    """The reader's next ``BENCH`` line (its log lines skipped)."""
    assert reader.stdout is not None
    while True:
        line = reader.stdout.readline()
        if not line:
            raise RuntimeError("the reader exited")
        if line.startswith("BENCH "):
            got: dict[str, Any] = json.loads(line[6:])
            return got


def train_step(model: Any, opt: Any, tok: Any, texts: list[str]) -> None:
    batch = tok(texts, return_tensors="pt", padding=True)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    loss = model(**batch, labels=labels).loss
    opt.zero_grad()
    loss.backward()
    opt.step()


def run(steps: int, student_method: str) -> dict[str, Any]:
    import redis
    import torch
    from transformers import AutoTokenizer

    from pipeline.demo.realpair import ensure_real_pair
    from pipeline.demo.realtasks import load
    from pipeline.learner.publish import last_upload, publish_weights
    from pipeline.models.weights import load_causal_lm
    from tests.redis_server import RedisServer

    pair = ensure_real_pair(by="alternate") if student_method == "alternate" else ensure_real_pair()
    tok = AutoTokenizer.from_pretrained(pair.student)
    rows = load("train")
    texts = [tok.apply_chat_template(r["messages"], tokenize=False, add_generation_prompt=True) + r["answer"]
             for r in rows]
    torch.manual_seed(0)
    model = load_causal_lm(pair.student)
    params = sum(p.numel() for p in model.parameters())
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-4, weight_decay=0.0)
    server = RedisServer().start()
    client = redis.Redis.from_url(server.url)
    base_memory = int(client.info("memory")["used_memory"])  # type: ignore[index]
    urls = {d: f"{server.url.rsplit('/', 1)[0]}/0?prefix=w-{d}&keep=3&snapshot_every=10" for d in ("bf16", "fp32")}
    dtypes = {"bf16": "bfloat16", "fp32": None}
    out: dict[str, Any] = {"params": params, "steps": steps, "rows": {d: [] for d in urls}}
    readers: dict[str, subprocess.Popen[str]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "DISTILLQ_LOG_JSON": "1"}
        for d, url in urls.items():
            readers[d] = subprocess.Popen([sys.executable, "-c", READER, url, f"{tmp}/{d}", str(pair.student)],
                                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
            assert said(readers[d])["ready"]
        try:
            for step in range(steps + 1):
                if step:
                    for g in opt.param_groups:
                        g["lr"] = 2e-4 * (1 - (step - 1) / steps)
                    train_step(model, opt, tok, [texts[(step * 8 + i) % len(texts)] for i in range(8)])
                for d, url in urls.items():
                    t0 = time.perf_counter()
                    publish_weights(model, step, url, publish=lambda v: None, tokenizer_dir=pair.student,
                                    dtype=dtypes[d])
                    returned = time.time()
                    report = last_upload(url)
                    assert report is not None
                    got = said(readers[d])
                    while got["version"] != step:
                        got = said(readers[d])
                    out["rows"][d].append({
                        "version": step, "snapshot": report.snapshot, "full_bytes": report.full_bytes,
                        "stored_bytes": report.stored_bytes, "publish_s": time.perf_counter() - t0,
                        "to_loaded_s": got["t"] - returned, "reader_fetch_s": got["fetch_s"],
                        "kept": list(report.kept),
                        "redis_used_bytes": int(client.info("memory")["used_memory"]) - base_memory,  # type: ignore[index]
                    })
                print(json.dumps({d: out["rows"][d][-1] for d in urls}), flush=True)
        finally:
            for p in readers.values():
                p.kill()
                p.wait(10)
            server.stop()
    return out


def table(out: dict[str, Any]) -> str:
    lines = [f"{out['params'] / 1e6:.1f}M parameters, {out['steps']} steps, snapshot every 10, keep 3", "",
             "| dtype | full bytes | snapshot stored | delta stored, median (min-max) | delta / full | "
             "publish s (delta) | publish returned -> loaded s | bytes held in the store, max (last) |",
             "|---|---|---|---|---|---|---|---|"]
    for d, rows in out["rows"].items():
        deltas = [r for r in rows if not r["snapshot"]]
        snap = next(r for r in rows if r["snapshot"])
        ds = [r["stored_bytes"] for r in deltas]
        stored = {r["version"]: r["stored_bytes"] for r in rows}
        held = [sum(stored[v] for v in r["kept"]) for r in rows]  # the versions kept after each upload
        full = snap["full_bytes"]
        lines.append(
            f"| {d} | {full:,} | {snap['stored_bytes']:,} | {statistics.median(ds):,.0f} ({min(ds):,}-{max(ds):,}) | "
            f"{statistics.median(ds) / full:.3f} ({min(ds) / full:.3f}-{max(ds) / full:.3f}) | "
            f"{statistics.median(r['publish_s'] for r in deltas):.2f} | "
            f"{statistics.median(r['to_loaded_s'] for r in deltas):.2f} "
            f"({min(r['to_loaded_s'] for r in deltas):.2f}-{max(r['to_loaded_s'] for r in deltas):.2f}) | "
            f"{max(held):,} ({held[-1]:,}) |")
    used = [max(a["redis_used_bytes"], b["redis_used_bytes"]) for a, b in zip(*out["rows"].values(), strict=True)]
    lines.append(f"\nthe weights Redis's used_memory (both dtypes' prefixes), max {max(used):,}, last {used[-1]:,}")
    return "\n".join(lines)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="python -m bench.weight_store", description=__doc__.splitlines()[0])
    parser.add_argument("steps", type=int, nargs="?", default=20, help="training steps, a version each")
    result = run(parser.parse_args().steps, "alternate")
    Path("/tmp/weight_store_bench.json").write_text(json.dumps(result))
    print(table(result))
