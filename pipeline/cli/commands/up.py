"""``distillq up``: the stages as supervised local processes (the no-docker ``docker compose up --scale``).

    distillq up --teachers 2 --feeders 1 --rollout 2 \\
        --teacher-args "--backend vllm --url http://gpu1:8000 --model Qwen/Qwen3-8B --top-k 20" \\
        --rollout-args "--backend vllm --url http://gpu2:8000 --model Qwen/Qwen3-1.7B"

Crashed workers are restarted with backoff; Ctrl-C (or SIGTERM) stops every process gracefully, and a killed
``up`` takes its workers with it (``pipeline.cli.supervisor``). Each worker has a consumer name of its own
(``STAGE-i``, ``STAGE-POOL-i`` for a teacher pool's); a name another live process holds is refused, naming it.
"""

from __future__ import annotations

import argparse
import shlex
import signal
import time
from pathlib import Path
from types import FrameType

from pipeline.cli.commands.common import add_command, make_console
from pipeline.cli.supervisor import ProcSpec, Supervisor, distillq_argv
from pipeline.config import add_redis_args, redis_settings_from_args
from pipeline.stages.exits import EXIT_USAGE, CliError
from schemas.pools import DEFAULT_POOL


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = add_command(sub, "up", "run N workers of each stage as supervised local processes",
                    "Run distillq worker STAGE processes on this machine, each with a stable consumer name and a "
                    "log file; a worker that exits with an error is restarted (up to 5 times, with backoff). "
                    "Ctrl-C or SIGTERM stops them all gracefully.")
    p.add_argument("--rollout", type=int, default=0, metavar="N", help="rollout workers")
    p.add_argument("--teachers", type=int, default=1, metavar="N", help="teacher workers")
    p.add_argument("--feeders", type=int, default=1, metavar="N", help="feeder workers")
    p.add_argument("--rollout-args", default="", metavar="ARGS",
                   help="extra flags for each rollout worker, one shell-quoted string (default: none)")
    p.add_argument("--teacher-args", default="", metavar="ARGS",
                   help="extra flags for each teacher worker, one shell-quoted string (default: none)")
    p.add_argument("--feeder-args", default="", metavar="ARGS",
                   help="extra flags for each feeder, one shell-quoted string (default: none)")
    p.add_argument("--log-dir", type=Path, default=Path("distillq-logs"), metavar="DIR",
                   help="directory of the workers' log files, one <name>.log each")
    p.add_argument("--duration", type=float, default=None, metavar="SECONDS",
                   help="stop after this many seconds (default: run until stopped)")
    add_redis_args(p)
    p.set_defaults(func=main)


def pool_of(argv: list[str]) -> str | None:
    """The ``--pool`` a worker's flags name (the last one wins, as argparse has it), else None."""
    pool = None
    for i, a in enumerate(argv):
        if a == "--pool" and i + 1 < len(argv):
            pool = argv[i + 1]
        elif a.startswith("--pool="):
            pool = a.split("=", 1)[1]
    return pool


def specs(args: argparse.Namespace) -> list[ProcSpec]:
    """One process per worker, each under a consumer name of its own: ``STAGE-i``, and ``STAGE-POOL-i`` for the
    workers of a teacher pool other than ``default`` (two ``up`` runs, one per pool, never share a name)."""
    out: list[ProcSpec] = []
    for stage, n, extra in (("rollout", args.rollout, args.rollout_args), ("teacher", args.teachers, args.teacher_args),
                            ("feeder", args.feeders, args.feeder_args)):
        flags = shlex.split(extra)
        pool = pool_of(flags)
        prefix = stage if pool in (None, DEFAULT_POOL) else f"{stage}-{pool}"
        for i in range(n):
            argv = distillq_argv("worker", stage, *flags, "--consumer-name", f"{prefix}-{i}")
            out.append(ProcSpec(f"{prefix}-{i}", argv))
    return out


def _stop(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def main(args: argparse.Namespace) -> int:
    console = make_console(stderr=True)
    rs = redis_settings_from_args(args)
    procs = specs(args)
    if not procs:
        raise CliError("nothing to run: give --rollout, --teachers or --feeders", EXIT_USAGE)
    env = {"DISTILLQ_REDIS_URL": rs.redis_url, "DISTILLQ_NAMESPACE": rs.namespace}
    sup = Supervisor(procs, args.log_dir, base_env=env)
    signal.signal(signal.SIGTERM, _stop)
    sup.start()
    console.print(f"started {len(procs)} worker(s): {', '.join(p.name for p in procs)}; logs in {args.log_dir}/")
    t0 = time.monotonic()
    try:
        while args.duration is None or time.monotonic() - t0 < args.duration:
            codes = sup.poll()
            if all(c is not None for c in codes.values()):
                break
            time.sleep(0.5)
    except KeyboardInterrupt:
        console.print("stopping...")
    finally:
        sup.stop()
    failed = {p.spec.name: p.exit_code for p in sup.procs if p.exit_code not in (None, 0)}
    console.print("stopped" + (f"; exited with errors: {failed}" if failed else ""))
    return 1 if failed else 0
