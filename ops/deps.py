"""Dependency locks for distillq: freeze an environment into a constraints file, pin the lower ends of the
allowed ranges, and say which package versions differ between an environment and the lock.

Used by ops/deps.sh (the lock refresh, and CI's newest and floor runs); stdlib only, so it runs in any venv.

    python ops/deps.py freeze OUT.txt            # this interpreter's packages as == pins (distillq left out)
    python ops/deps.py floor                     # the lower end of every fast-moving range, as == pins
    python ops/deps.py diff LOCK.txt             # packages whose installed version differs from LOCK.txt
"""

from __future__ import annotations

import datetime
import platform
import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: Dependencies that release often and break APIs distillq uses; their allowed ranges are tested at both ends.
FAST_MOVING = ("transformers", "tokenizers", "numpy", "atroposlib", "verifiers")
OWN = {"distillq"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def installed() -> dict[str, str]:
    """Every distribution in this interpreter's environment, by normalised name, without local version tags
    (``torch 2.13.0+cpu`` is pinned as ``2.13.0``, which the CPU wheel satisfies)."""
    out: dict[str, str] = {}
    for dist in metadata.distributions():
        name = _norm(dist.metadata["Name"])
        if name not in OWN:
            out[name] = dist.version.split("+", 1)[0]
    return out


def read_lock(path: Path) -> dict[str, str]:
    pins: dict[str, str] = {}
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            pins[_norm(name)] = version.strip()
    return pins


def freeze(out: Path) -> None:
    pins = installed()
    header = [
        "# distillq's locked dependency set: the versions the test suite last passed with.",
        "# Used as pip constraints by the README's commands and CI: pip install -c constraints.txt -e '.[test]'.",
        "# Refresh with `bash ops/deps.sh lock` (newest allowed versions, kept only if the suite passes).",
        f"# Written {datetime.date.today().isoformat()} on Python {platform.python_version()}, {platform.machine()}.",
    ]
    lines = [f"{name}=={pins[name]}" for name in sorted(pins) if name not in {"pip", "setuptools", "wheel"}]
    out.write_text("\n".join(header + lines) + "\n")
    print(f"wrote {len(lines)} pins to {out}")


def _requirements() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        reqs.extend(extra)
    return reqs


def floor() -> list[str]:
    """``name==lower`` for each fast-moving dependency's ``>=lower`` in pyproject.toml (the tightest one)."""
    lows: dict[str, str] = {}
    for req in _requirements():
        m = re.match(r"^\s*([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?\s*(.*)$", req)
        if not m or _norm(m.group(1)) not in FAST_MOVING:
            continue
        for part in m.group(2).split(","):
            spec = part.strip()
            if spec.startswith(">="):
                version = spec[2:].strip()
                name = _norm(m.group(1))
                if name not in lows or _vkey(version) > _vkey(lows[name]):
                    lows[name] = version
    return [f"{name}=={lows[name]}" for name in sorted(lows)]


def _vkey(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version))


def diff(lock: Path) -> int:
    pins, now = read_lock(lock), installed()
    changed = sorted(n for n in pins.keys() & now.keys() if pins[n] != now[n])
    for name in changed:
        print(f"  {name}: locked {pins[name]} -> here {now[name]}")
    for name in sorted(now.keys() - pins.keys()):
        print(f"  {name}: not in the lock -> here {now[name]}")
    if not changed:
        print("  (no locked package differs)")
    return 0


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "freeze":
        freeze(Path(argv[1]))
        return 0
    if argv == ["floor"]:
        print("\n".join(floor()))
        return 0
    if len(argv) == 2 and argv[0] == "diff":
        return diff(Path(argv[1]))
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
