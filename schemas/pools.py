"""Teacher pools: the name a group gives its teacher, and the rule for valid names.

A group names its teacher pool in ``group_overrides.teacher`` (next to ``teacher_top_k``); no name, or
``null``, means the pool ``default``. A pool name is 1 to 32 characters of lower-case letters, digits, ``_``
and ``-``, starting with a letter or digit, so it can be part of a Redis key and a metric label as it is.
"""

from __future__ import annotations

import re
from typing import Any, Final

#: The pool of a group that names none.
DEFAULT_POOL: Final = "default"
#: The ``group_overrides`` field that names a group's pool.
TEACHER_FIELD: Final = "teacher"
_POOL = re.compile(r"[a-z0-9][a-z0-9_-]{0,31}")
POOL_RULE: Final = "1-32 of a-z, 0-9, '_', '-', starting with a letter or digit"


def pool_problem(name: object) -> str | None:
    """Why ``name`` is not a valid pool name (None when it is)."""
    if not isinstance(name, str):
        return f"must be a string, got {name!r}"
    if not _POOL.fullmatch(name):
        return f"invalid pool name {name!r}: {POOL_RULE}"
    return None


def check_pool(name: str) -> str:
    """``name`` if it is a valid pool name; else ``ValueError`` saying why."""
    problem = pool_problem(name)
    if problem is not None:
        raise ValueError(problem)
    return name


def pool_of(group_overrides: dict[str, Any] | None) -> str:
    """The pool a group with these ``group_overrides`` goes to (``DEFAULT_POOL`` when it names none).
    Assumes a validated group: a name that is not a string reads as the default pool."""
    name = (group_overrides or {}).get(TEACHER_FIELD)
    return name if isinstance(name, str) and name else DEFAULT_POOL
