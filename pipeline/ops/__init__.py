"""Operator tooling: the ``distillq`` CLI, the demo, embedded Redis, the supervisor, stream inspection and stats."""
