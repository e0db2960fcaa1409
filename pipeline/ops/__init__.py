"""The old home of the ``distillq`` command line, now ``pipeline.cli``: every ``pipeline.ops.*`` module path
keeps importing the module that moved (the same object), so entry points and code written against the old
paths keep working. ``pipeline.ops.cli.main`` is ``pipeline.cli.main``; the other ``pipeline.ops.cli.*``
commands are ``pipeline.cli.commands.*``; ``pipeline.ops.X`` is ``pipeline.cli.X``.
"""

from pipeline.moved import keep_old_paths

_SUPPORT = ("demo", "demo_real", "demo_vllm", "embedded", "inspect", "locate", "namespaces", "pipelinestate",
            "streamstats", "supervisor")
_COMMANDS = ("common", "demo", "demo_real", "dlq", "enqueue", "models", "namespaces", "push", "serve", "shards",
             "stats", "tail", "up", "where", "worker")

MOVED: dict[str, str] = {
    **{f"pipeline.ops.{m}": f"pipeline.cli.{m}" for m in _SUPPORT},
    **{f"pipeline.ops.cli.{m}": f"pipeline.cli.commands.{m}" for m in _COMMANDS},
    "pipeline.ops.cli.main": "pipeline.cli.main",
    "pipeline.ops.cli.errors": "pipeline.cli.errors",
}

keep_old_paths(MOVED, packages=("pipeline.ops.cli",))
