"""Two things in a JSON request body that no field's own check sees, each named by the field it sits in:

* nesting deeper than ``MAX_DEPTH`` levels (Python's JSON parser recurses per level: 100,000 levels is a
  ``RecursionError``, and code that walks the value recurses again);
* a lone surrogate (``"\\ud800"`` without its pair): valid JSON, but no Unicode string, so a tokenizer, an
  encoder or Redis fails on it later with an error that names no field.

``body_problem`` scans the raw bytes only when a cheap test says one of them may be there (more than
``MAX_DEPTH`` opening brackets in all, or a ``\\uD8xx``-``\\uDFxx`` escape), so an ordinary body costs two
byte counts and one regular-expression search.
"""

from __future__ import annotations

import json
import re
from typing import Final

from pipeline.errors import ApiError

#: The deepest nesting a request body may have (the body itself is level 1).
MAX_DEPTH: Final = 64
#: Path components shown before the field is cut short (a deep value's path is as long as it is deep).
_SHOWN: Final = 8

_TOKEN: Final = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{},]', re.DOTALL)
_SURROGATE_ESCAPE: Final = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_SURROGATE: Final = re.compile("[\ud800-\udfff]")


class BodyProblem(ApiError, ValueError):
    """A body refused before it is parsed: ``field`` names where (``messages[0].content``), ``reason`` why."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field, self.reason = field, reason


def body_problem(raw: bytes, max_depth: int = MAX_DEPTH) -> BodyProblem | None:
    """What is wrong with ``raw`` as said above, or None (also for a body that is not JSON: the parser says
    what is wrong with that)."""
    deep = raw.count(b"[") + raw.count(b"{") > max_depth
    if not deep and _SURROGATE_ESCAPE.search(raw) is None:
        return None
    return _scan(raw, max_depth)


def _scan(raw: bytes, max_depth: int) -> BodyProblem | None:
    # one frame per open container: [kind, the key or index of the value being read in it]
    frames: list[list[str | int | None]] = []
    expect_key = False
    for m in _TOKEN.finditer(raw):
        tok = m.group()
        c = tok[:1]
        if c == b'"':
            text = _string(tok)
            if frames and frames[-1][0] == "{" and expect_key:
                frames[-1][1] = text
                expect_key = False
                if text is not None and _SURROGATE.search(text):
                    return BodyProblem(_field(frames[:-1]), _lone(text, "a key holds"))
            elif text is not None and _SURROGATE.search(text):
                return BodyProblem(_field(frames), _lone(text, "holds"))
        elif c in b"[{":
            if len(frames) >= max_depth:
                return BodyProblem(_field(frames, cut=True), f"nested more than {max_depth} levels deep")
            frames.append(["[", 0] if c == b"[" else ["{", None])
            expect_key = c == b"{"
        elif c in b"]}":
            if frames:
                frames.pop()
            expect_key = False
        elif frames:  # a comma
            top = frames[-1]
            if top[0] == "[" and isinstance(top[1], int):
                top[1] += 1
            else:
                expect_key = True
    return None


def _string(tok: bytes) -> str | None:
    try:
        text = json.loads(tok)
    except ValueError:  # not a valid JSON string: the parser reports it
        return None
    return text if isinstance(text, str) else None


def _lone(text: str, what: str) -> str:
    m = _SURROGATE.search(text)
    code = ord(m.group()) if m else 0
    return f"{what} a lone surrogate (\\u{code:04x}), which is not Unicode text; send the character it stands for"


def _field(frames: list[list[str | int | None]], *, cut: bool = False) -> str:
    """``messages[0].content`` for the frames' keys and indices; ``cut``: only the first ``_SHOWN`` components,
    up to the last object key among them (the field whose value nests too deep)."""
    parts = [f[1] for f in frames if f[1] is not None]
    if cut:
        parts = parts[:_SHOWN]
        keys = [i for i, p in enumerate(parts) if isinstance(p, str)]
        parts = parts[: keys[-1] + 1] if keys else []
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else p)
    return out or "body"
