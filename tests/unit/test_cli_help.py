"""``distillq ... --help``: every command has a description, every option a help text and, when it has a
default, the default shown. Read from the real ``--help`` output of each command."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator

import pytest

from pipeline.cli.main import build_parser, main

#: Actions that take no value: their "default" is just "off".
FLAG_ACTIONS = (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._StoreConstAction,
                argparse._CountAction, argparse._HelpAction, argparse._VersionAction)


def commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...],
                                                                                           argparse.ArgumentParser]]:
    """Every parser in the tree, with the argv that reaches it."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from commands(sub, (*path, name))


ALL = list(commands(build_parser()))


def help_text(capsys: pytest.CaptureFixture[str], path: tuple[str, ...]) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main([*path, "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


def entries(text: str) -> dict[str, str]:
    """``--help`` argument entries: the invocation (``-n N, --count N``) -> its help, whitespace collapsed."""
    out: dict[str, str] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        if re.match(r"^  \S", line):  # an entry starts two spaces in; its help may follow on the same line
            invocation, _, rest = line.strip().partition("  ")
            current = [invocation, rest]
            out[invocation] = ""
        elif current is not None and re.match(r"^\s{4,}\S", line):
            current[1] += " " + line.strip()
        else:
            current = None
            continue
        out[current[0]] = " ".join(current[1].split())
    return out


def entry_for(action: argparse.Action, found: dict[str, str]) -> str:
    choices = "{" + ",".join(map(str, action.choices)) + "}" if action.choices else None
    names = action.option_strings or [action.metavar or choices or action.dest]
    for invocation, text in found.items():
        words = set(invocation.replace(",", " ").split())
        if any(str(n) in words or invocation == n for n in names):
            return text
    raise AssertionError(f"{names} not in --help output: {sorted(found)}")


def takes_value(action: argparse.Action) -> bool:
    return not isinstance(action, FLAG_ACTIONS) and not isinstance(action, argparse._SubParsersAction)


@pytest.mark.parametrize(("path", "parser"), ALL, ids=[" ".join(p) or "distillq" for p, _ in ALL])
def test_every_option_has_help_and_its_default(
    path: tuple[str, ...], parser: argparse.ArgumentParser, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "100")
    text = help_text(capsys, path)
    assert text.startswith(f"usage: distillq {' '.join(path)}".rstrip())
    # a description: the paragraph after the usage
    paragraphs = text.split("\n\n")
    assert len(paragraphs) > 2 and not paragraphs[1].startswith(("positional", "options")), text
    assert parser.description and " ".join(parser.description.split())[:40] in " ".join(paragraphs[1].split())

    found = entries(text)
    checked = 0
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:  # each subcommand is listed with its help line
                assert choice.help, f"{path} {choice.dest}: no help"
                assert " ".join(choice.help.split()) in " ".join(text.split())
                checked += 1
            continue
        help_line = entry_for(action, found)
        assert action.help and help_line, f"{' '.join(path)} {action.option_strings or action.dest}: no help text"
        checked += 1
        optional_value = action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE)
        if not takes_value(action) or not optional_value:
            continue  # a flag (off unless given) or a required positional: no default to show
        assert "default: " in help_line, f"{' '.join(path)} {action.option_strings}: no default in {help_line!r}"
        if action.default is not None and not isinstance(action.default, list):
            assert f"default: {action.default}" in help_line, (path, action.option_strings, help_line)
    assert checked == len(parser._actions) - 1 + sum(  # every action but --help was looked at
        len(a.choices) - 1 for a in parser._actions if isinstance(a, argparse._SubParsersAction)), path


def test_worker_help_shows_env_defaults(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A default taken from the environment is the one shown."""
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.setenv("DISTILLQ_TOP_K", "7")
    text = help_text(capsys, ("worker", "teacher"))  # the parser is built inside main(): it reads the variable
    assert "(env DISTILLQ_TOP_K) (default: 7)" in " ".join(text.split())
    monkeypatch.delenv("DISTILLQ_TOP_K")
    text = help_text(capsys, ("worker", "teacher"))
    assert "(env DISTILLQ_TOP_K) (default: 20)" in " ".join(text.split())


def test_the_tree_has_every_documented_command() -> None:
    names = {" ".join(p) for p, _ in ALL}
    for cmd in ("demo", "enqueue", "push", "tail", "up", "stats", "shards", "worker teacher", "worker feeder",
                "worker rollout", "dlq list", "dlq show", "dlq replay", "dlq purge"):
        assert cmd in names
