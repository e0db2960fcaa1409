"""Where row 2's gap goes: py-spy profiles of distillq and the raw-bytes stub, per function, per group.

``python -m bench.profile [--len 1024] [--seconds 10]`` runs ``bench.transport``'s in-process pipeline,
then the stub, each in a child process under ``py-spy record`` (500 Hz, raw output), and prints the
functions where each sample landed (the innermost Python frame; time in C code called from a line counts
for that line's function), as microseconds of process CPU per group acknowledged by the learner, sorted by
how much more distillq spends than the stub. Import frames and the namespace clean-up are left out.
Needs ``py-spy`` (``pip install py-spy``) and permission to trace a child process (root, or ptrace allowed).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

RATE_HZ = 500
_FRAME = re.compile(r"(.*) \((.*):(\d+)\)$")
_SKIP = ("importlib", "drop_namespace", "StubPipeline.build")


def _leaf(stack: str) -> str:
    m = _FRAME.match(stack.rsplit(";", 1)[-1])
    return f"{m.group(1)} ({os.path.basename(m.group(2))})" if m else stack.rsplit(";", 1)[-1]


def per_group_us(raw: str, groups: int) -> dict[str, float]:
    """Microseconds per group by innermost function, from py-spy's raw (collapsed stack) output."""
    out: collections.Counter[str] = collections.Counter()
    for line in raw.splitlines():
        stack, _, n = line.rpartition(" ")
        if stack and not any(s in stack for s in _SKIP):
            out[_leaf(stack)] += int(n)
    return {k: v * 1e6 / RATE_HZ / max(groups, 1) for k, v in out.items()}


async def _child(variant: str, seq_len: int, seconds: float) -> None:
    from bench.common import Workload, quiet_logs
    from bench.transport import run_distillq, run_stub
    from tests.redis_server import RedisServer

    quiet_logs()
    server = RedisServer().start()
    try:
        run = run_distillq if variant == "distillq" else run_stub
        t = await run(server.url, Workload(8, seq_len), 0.0, seconds)
    finally:
        server.stop()
    print(json.dumps({"groups": t.groups, **t.as_dict()}))


def profile(variant: str, seq_len: int, seconds: float) -> tuple[dict[str, float], dict[str, float]]:
    """(us per group by function, the run's throughput figures) for one variant under py-spy."""
    spy = shutil.which("py-spy")
    if spy is None:
        raise SystemExit("py-spy not found: pip install py-spy")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "raw.txt")
        cmd = [spy, "record", "-r", str(RATE_HZ), "-f", "raw", "-o", out, "--", sys.executable, "-m", "bench.profile",
               "--child", variant, "--len", str(seq_len), "--seconds", str(seconds)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
        figures = json.loads([ln for ln in done.stdout.splitlines() if ln.startswith("{")][-1])
        with open(out) as f:
            return per_group_us(f.read(), int(figures["groups"])), figures


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--len", type=int, default=1024, help="tokens per sequence (8 sequences per group)")
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        asyncio.run(_child(a.child, a.len, a.seconds))
        return
    (d, fd), (s, fs) = profile("distillq", a.len, a.seconds), profile("stub", a.len, a.seconds)
    print(f"8x{a.len}: distillq {fd['groups_per_s']:.1f} groups/s, {sum(d.values()):.0f} us sampled per group; "
          f"stub {fs['groups_per_s']:.1f} groups/s, {sum(s.values()):.0f} us per group\n")
    print("| function (innermost Python frame) | distillq us/group | stub us/group | difference |")
    print("|---|---|---|---|")
    for k in sorted(set(d) | set(s), key=lambda k: -(d.get(k, 0.0) - s.get(k, 0.0)))[: a.top]:
        print(f"| `{k}` | {d.get(k, 0.0):.0f} | {s.get(k, 0.0):.0f} | {d.get(k, 0.0) - s.get(k, 0.0):+.0f} |")


if __name__ == "__main__":
    main()
