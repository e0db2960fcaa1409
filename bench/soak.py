"""``python -m bench.soak --minutes 60 [--seed S]``: the chaos soak (``tests.reliability.chaos``) for a given
time, its figures printed one per line (faults per kind, prompts in and out, dead letters by reason, prompts
lost in the Redis reset, duplicates, recovery times per fault kind: median/max seconds), then each invariant
violation and each process that exited on its own. Exit 0 when the invariant held, 1 when it did not."""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from tests.reliability.chaos import SoakConfig, run_soak


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__)
    p.add_argument("--minutes", type=float, default=60.0, help="length of the whole soak (default: 60)")
    p.add_argument("--seed", type=int, default=0, help="seed of the fault schedule and the prompts")
    p.add_argument("--prompt-rate", type=float, default=1.0, help="prompts enqueued per second (default: 1)")
    p.add_argument("--fault-gap", type=float, default=14.0, help="mean seconds between faults (default: 14)")
    p.add_argument("--workdir", type=Path, help="keep logs and records here (default: a temporary folder)")
    a = p.parse_args(argv)
    cfg = SoakConfig(seconds=a.minutes * 60, seed=a.seed, prompt_rate=a.prompt_rate, fault_gap_s=a.fault_gap,
                     workdir=a.workdir)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the soak's processes are ended on the way out
    result = run_soak(cfg)
    print(f"SOAK workdir={result.workdir}")
    for f in result.faults:
        print(f"FAULT +{f.start - result.started:.0f}s {f.kind} ({f.end - f.start:.1f} s) recovery_s={f.recovery_s} "
              f"{f.note}")
    print(result.summary())
    return 1 if result.violations else 0


if __name__ == "__main__":
    sys.exit(main())
