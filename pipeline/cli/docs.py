"""The generated parts of docs/cli.md: the flag tables of the commands whose flags come from settings classes
(``pipeline.flags``). Each table sits between ``<!-- flags: NAME -->`` and ``<!-- /flags -->`` and is never
edited by hand: change the field, then

    python -m pipeline.cli.docs            # rewrite the tables in docs/cli.md
    python -m pipeline.cli.docs --check    # exit 1 (and say which) when docs/cli.md is out of date
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from pipeline.flags import FlagSettings, doc_table
from pipeline.serve.atropos.settings import AtroposSettings
from pipeline.serve.student.settings import StudentServeSettings
from workers.settings import FeederSettings, RolloutSettings, TeacherSettings, WorkerSettings

DOC = Path(__file__).resolve().parents[2] / "docs" / "cli.md"

#: Table name (as in the marker) -> the settings class it lists.
TABLES: dict[str, type[FlagSettings]] = {
    "worker": WorkerSettings,
    "worker teacher": TeacherSettings,
    "worker feeder": FeederSettings,
    "worker rollout": RolloutSettings,
    "serve atropos": AtroposSettings,
    "serve student": StudentServeSettings,
}

_BLOCK = re.compile(r"(<!-- flags: (?P<name>[\w -]+?) -->\n)(?P<body>.*?)(<!-- /flags -->)", re.DOTALL)


def render(text: str) -> str:
    """``text`` with every marked table regenerated; a ``ValueError`` for an unknown or missing table."""
    seen: set[str] = set()

    def table(m: re.Match[str]) -> str:
        name = m["name"]
        if name not in TABLES:
            raise ValueError(f"unknown flag table {name!r} (known: {', '.join(TABLES)})")
        seen.add(name)
        return m.group(1) + doc_table(TABLES[name]) + m.group(4)

    out = _BLOCK.sub(table, text)
    missing = set(TABLES) - seen
    if missing:
        raise ValueError(f"no <!-- flags: NAME --> block for {', '.join(sorted(missing))}")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipeline.cli.docs", description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 when docs/cli.md's tables are out of date")
    p.add_argument("--file", type=Path, default=DOC, help="the markdown file (default: docs/cli.md)")
    args = p.parse_args(argv)
    text = args.file.read_text(encoding="utf-8")
    new = render(text)
    if new == text:
        return 0
    if args.check:
        print(f"{args.file} is out of date: run python -m pipeline.cli.docs", file=sys.stderr)
        return 1
    args.file.write_text(new, encoding="utf-8")
    print(f"rewrote the flag tables of {args.file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
