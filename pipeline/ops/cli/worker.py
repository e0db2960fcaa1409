"""``distillq worker {teacher,feeder,rollout}``: run one stage as a process (or ``--check`` its health)."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from workers import feeder, rollout, teacher

    p = sub.add_parser("worker", help="run a pipeline stage (teacher, feeder, rollout)")
    stages = p.add_subparsers(dest="stage", required=True, metavar="STAGE")
    for name, module, text in (
        ("teacher", teacher, "score rollout groups with the teacher's top-k logprobs"),
        ("feeder", feeder, "batch scored groups for the learner"),
        ("rollout", rollout, "sample groups from the student for enqueued prompts (arq jobs)"),
    ):
        sp = stages.add_parser(name, help=text)
        module.add_arguments(sp)
        sp.set_defaults(func=module.main)
