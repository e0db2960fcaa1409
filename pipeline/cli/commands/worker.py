"""``distillq worker {teacher,feeder,rollout}``: run one stage as a process (or ``--check`` its health)."""

from __future__ import annotations

import argparse

from pipeline.cli.commands.common import add_command


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from workers import feeder, rollout, teacher
    from workers.common import STAGE_DESCRIPTIONS

    p = add_command(sub, "worker", "run a pipeline stage (teacher, feeder, rollout) as a process, or check its health",
                    "Run one pipeline stage as a process until SIGTERM or SIGINT (graceful shutdown), or with "
                    "--check report whether one is healthy. See distillq worker STAGE --help for each stage's flags.")
    stages = p.add_subparsers(dest="stage", required=True, metavar="STAGE")
    for name, module, text in (
        ("teacher", teacher, "score rollout groups with the teacher's top-k logprobs"),
        ("feeder", feeder, "batch scored groups for the learner"),
        ("rollout", rollout, "sample groups from the student for enqueued prompts"),
    ):
        sp = add_command(stages, name, text, STAGE_DESCRIPTIONS[name])
        module.add_arguments(sp)
        sp.set_defaults(func=module.main)
