"""``distillq models tiny|prune``: the demo's tiny models (built and cached), their paths, and the commands that
run the demo's pipeline by hand, so a user can start from them without running the demo; and depth pruning of a
local model (``pipeline.models.prune``)."""

from __future__ import annotations

import argparse
import json
import random
import shlex
import sys
from pathlib import Path

from pipeline.cli.commands.common import add_command
from pipeline.stages.exits import EXIT_USAGE, CliError

DEMO_REDIS_URL = "redis://127.0.0.1:6379/0"


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    models = add_command(sub, "models", "the demo's tiny models, and depth pruning of a local model",
                         "tiny: build the demo's tiny models (cached) and print their paths and commands; prune: "
                         "remove decoder layers from a local model. distillq models ACTION --help for each.")
    msub = models.add_subparsers(dest="models_command", required=True, metavar="ACTION")
    p = add_command(msub, "tiny", "the demo's tiny models: build (cached) and print their paths and commands",
                    "Build the demo's tiny student and teacher (cached; the teacher trained briefly on the arithmetic "
                    "task, as the demo does; a vocabulary of a few hundred tokens) and print their paths; with "
                    "--commands, the commands that run the demo's pipeline by hand with them.")
    p.add_argument("--commands", action="store_true",
                   help="also print the enqueue, worker and learner commands of the demo's pipeline")
    p.add_argument("--prompts", type=Path, default=None, metavar="FILE",
                   help="write arithmetic prompts (the demo's training split) as JSONL for distillq enqueue "
                        "(default: none)")
    p.add_argument("--count", type=int, default=200, metavar="N", help="prompts written with --prompts")
    p.add_argument("--out", type=Path, default=Path("tiny-run"), metavar="DIR",
                   help="where the printed commands put the weights the learner publishes and its metrics")
    p.add_argument("--redis-url", default=None, metavar="URL",
                   help=f"Redis URL the printed commands use (default: $DISTILLQ_REDIS_URL, else {DEMO_REDIS_URL})")
    p.add_argument("--namespace", default=None, metavar="NS",
                   help="namespace the printed commands use (default: $DISTILLQ_NAMESPACE, else distillq)")
    p.add_argument("--link", type=Path, default=None, metavar="DIR",
                   help="also make DIR/student, DIR/teacher and DIR/tokenizer links to them: fixed paths for a "
                        "configuration (ops/compose.cpu.yml) (default: none)")
    p.add_argument("--json", action="store_true", help="one JSON object: paths (and commands)")
    p.set_defaults(func=main)
    add_prune_parser(msub)


def add_prune_parser(msub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from pipeline.models.prune import METHODS

    p = add_command(msub, "prune", "remove decoder layers from a local model: the least important, or every other",
                    "Depth-prune the local causal LM in SRC into OUT: --by block-influence measures each decoder "
                    "layer's block influence (1 - cos(layer input, layer output), mean over the prompts' tokens) and "
                    "drops the --drop lowest; --by alternate keeps every other layer. OUT "
                    "gets the model (float32 safetensors), its tokenizer and prune.json (the dropped and kept layers "
                    "in SRC's numbering, every layer's score, the prompts used). Llama/Qwen2/Mistral-style models.")
    p.add_argument("src", type=Path, metavar="SRC", help="the model folder to prune (config.json, weights, tokenizer)")
    p.add_argument("out", type=Path, metavar="OUT", help="where the pruned model goes (must not exist, or be empty)")
    p.add_argument("--drop", type=int, default=None, metavar="N",
                   help="decoder layers to remove, 1 to the layer count - 1 (default: none; needed with "
                        "block-influence; alternate drops every other layer)")
    p.add_argument("--by", choices=METHODS, default="block-influence",
                   help="block-influence: the N layers of lowest measured influence; alternate: every other layer")
    p.add_argument("--prompts", type=Path, default=None, metavar="FILE",
                   help="JSONL prompts to measure on ('messages' or 'prompt' per line, as distillq enqueue reads) "
                        "(default: the real pair's packaged train prompts)")
    p.add_argument("--json", action="store_true", help="print prune.json instead of the summary lines")
    p.set_defaults(func=main_prune)


def main_prune(args: argparse.Namespace) -> int:
    from pipeline.demo.realtasks import train_prompts
    from pipeline.errors import ConfigurationError
    from pipeline.models.prune import Prompts, prune_folder, read_prompts

    try:
        prompts: Prompts | None = None
        if args.by == "block-influence":
            prompts = read_prompts(args.prompts) if args.prompts is not None else train_prompts()
        result = prune_folder(args.src, args.out, drop=args.drop, by=args.by, prompts=prompts,
                              progress=lambda line: print(line + "...", file=sys.stderr, flush=True))
    except ConfigurationError as e:
        raise CliError(f"models prune: {e}", EXIT_USAGE) from e
    rec = result.record
    if args.json:
        print(json.dumps(rec))
        return 0
    print(f"dropped  {' '.join(map(str, rec['dropped']))}")
    print(f"kept     {' '.join(map(str, rec['kept']))}")
    if rec["scores"] is not None:
        print("scores   " + " ".join(f"{i}:{s:.4f}" for i, s in enumerate(rec["scores"])))
    print(f"model    {result.out.resolve()}")
    return 0


def _shell(argv: list[str]) -> str:
    """A command as a user types it: ``distillq ...`` for the CLI, ``python -m ...`` for modules."""
    if argv[:3] == [sys.executable, "-m", "pipeline.cli.main"]:
        argv = ["distillq", *argv[3:]]
    elif argv[:2] == [sys.executable, "-m"]:
        argv = ["python", *argv[1:]]
    return shlex.join(argv)


def commands(student: Path, teacher: Path, out: Path, url: str, namespace: str, prompts: Path | None) -> list[str]:
    """The demo's processes (``pipeline.demo.tiny.process_specs``) as shell commands, after ``enqueue``."""
    from pipeline.demo.tiny import DemoConfig, process_specs

    where = ["--redis-url", url, "--namespace", namespace]
    cmds = [shlex.join(["distillq", "enqueue", str(prompts or "prompts.jsonl"), *where])]
    for spec in process_specs(DemoConfig(redis_url=url, out=out, namespace=namespace), student, teacher):
        cmds.append(_shell([*spec.argv, *where]))
    return cmds


def link(folder: Path, paths: dict[str, str]) -> None:
    """``folder/NAME`` -> ``paths[NAME]`` for the student, teacher and tokenizer, each replaced atomically."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("student", "teacher", "tokenizer"):
        tmp = folder / f".{name}.link"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(paths[name], target_is_directory=True)
        tmp.replace(folder / name)


def write_prompts(path: Path, n: int) -> None:
    from pipeline.demo.tinymodels import arithmetic_problem

    rng = random.Random(7)
    lines = []
    for i in range(n):
        q, a = arithmetic_problem(rng, "train")
        lines.append(json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": q}], "answer": a}))
    path.write_text("\n".join(lines) + "\n")


def main(args: argparse.Namespace) -> int:
    from pipeline.config import env
    from pipeline.demo.pretrain import train_teacher
    from pipeline.demo.tinymodels import ensure_tiny_models

    print("building the tiny models and training the teacher (cached after the first run)...", file=sys.stderr)
    tiny = ensure_tiny_models()
    teacher = train_teacher(tiny)
    student, teacher = tiny.student.resolve(), teacher.resolve()
    paths = {"tokenizer": str(tiny.tokenizer.resolve()), "student": str(student), "teacher": str(teacher),
             "teacher_untrained": str(tiny.teacher.resolve())}
    if args.link is not None:
        link(args.link, paths)
    if args.prompts is not None:
        write_prompts(args.prompts, args.count)
    cmds: list[str] = []
    if args.commands:
        url = args.redis_url or env("REDIS_URL") or DEMO_REDIS_URL
        ns = args.namespace or env("NAMESPACE") or "distillq"
        cmds = commands(student, teacher, args.out.resolve(), url, ns, args.prompts)
    if args.json:
        print(json.dumps({**paths, **({"commands": cmds} if args.commands else {})}))
        return 0
    for name, path in paths.items():
        print(f"{name:<18} {path}")
    if cmds:
        print("\n# the demo's pipeline by hand: enqueue once, then each command in its own terminal")
        print("\n".join(cmds))
    return 0
