"""Settings classes as command-line flags: each field of a ``FlagSettings`` class is declared once and gives
its argparse flag (name, type, default, metavar, help), its environment variable and its row of the docs table.

    class TeacherSettings(FlagSettings):
        top_k: Annotated[int, Flag(env="TOP_K", metavar="K")] = Field(20, ge=1, description="default k")

gives ``--top-k K`` (an integer, at least 1; ``argument --top-k: 0 is below 1`` otherwise), read from
``DISTILLQ_TOP_K`` when the flag is not given, 20 when neither is. Precedence: the flag > the environment
variable > the field's default. The environment is read when the parser is built, so ``--help`` shows the
default in effect and a bad value there is a usage error naming the flag, as a bad flag is. An empty variable
counts as unset.

One text per field: the ``description`` (markdown) is the docs table's meaning, and the ``--help`` text is the
same words without the markup (``help_text``: backticks dropped, links reduced to their text, a parenthesised
link to another page left out). Configs are built from a settings object by explicit code beside the settings
class (``workers.settings.scoring_config``, ...); nothing here routes values by name.

Types: ``bool`` is an on/off switch (``store_true``); ``Literal[...]`` a choice; ``int`` with ``ge`` (and
``le``) in that range; ``list[str] | None`` a repeatable flag whose variable is comma-separated; ``Flag.parse``
any other parser; a field without a default a flag that must be given.
``TeacherSettings()`` alone reads the environment the same way (no flags), for code that embeds a stage.

Why not pydantic-settings' own ``CliSettingsSource`` (2.16, measured): its ``--help`` shows the field's default
(``--top-k int  default k (default: 20)``) when ``DISTILLQ_TOP_K=7`` is in effect; a bad value, from the
environment or a flag, is a pydantic ``ValidationError`` naming the field (``top_k``), not an argparse usage
error naming ``--top-k``; and a ``bool`` field becomes a ``--x/--no-x`` pair (or a flag that takes a value),
not today's ``store_true`` switch, with a type name (``int``) for a metavar.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import types
import typing
from collections.abc import Callable
from typing import Any, Literal, TypeVar, get_args, get_origin

import annotated_types
from pydantic import model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from pipeline.config import ENV_PREFIX, env

S = TypeVar("S", bound="FlagSettings")


@dataclasses.dataclass(frozen=True)
class Flag:
    """How a settings field appears on the command line, in the environment and in the docs.

    ``env``: the variable's name without ``DISTILLQ_``; ``flag``: the option (default ``--field-name``);
    ``parse``: an argparse ``type`` for values no annotation describes; ``cli_default``: the string the parser
    converts when neither flag nor variable is given (``auto``), shown as the default; ``default_text``: what
    ``--help`` and the docs say the default is when it is not a value (``none, the model's``);
    the help and the docs' meaning are the field's ``description`` (see ``help_text``)."""

    env: str | None = None
    flag: str | None = None
    metavar: str | None = None
    parse: Callable[[str], Any] | None = None
    cli_default: str | None = None
    default_text: str | None = None


def flag_of(field: FieldInfo) -> Flag:
    return next((m for m in field.metadata if isinstance(m, Flag)), Flag())


def env_name(meta: Flag) -> str | None:
    return f"{ENV_PREFIX}{meta.env}" if meta.env else None


def _env_value(meta: Flag) -> str | None:
    return (env(meta.env) or None) if meta.env else None  # empty: unset


def _is_list(field: FieldInfo) -> bool:
    return any(get_origin(a) is list for a in (field.annotation, *get_args(field.annotation)))


class _FlagEnvironment(PydanticBaseSettingsSource):
    """Each field's own variable (``Flag.env``); a field without one is never read from the environment."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return _env_value(flag_of(field)), field_name, False

    def __call__(self) -> dict[str, Any]:
        found = {name: self.get_field_value(f, name)[0] for name, f in self.settings_cls.model_fields.items()}
        return {k: v for k, v in found.items() if v is not None}


class FlagSettings(BaseSettings):
    """Base of the settings classes whose fields are flags (see the module docstring)."""

    model_config = SettingsConfigDict(extra="ignore")

    @classmethod
    def settings_customise_sources(
        cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource, dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, _FlagEnvironment(settings_cls)

    @model_validator(mode="before")
    @classmethod
    def _split_lists(cls, data: Any) -> Any:
        """A list from the environment is one comma-separated string."""
        if isinstance(data, dict):
            for name, field in cls.model_fields.items():
                value = data.get(name)
                if isinstance(value, str) and _is_list(field):
                    data[name] = [u for u in value.split(",") if u]
        return data


def one_of(*options: str) -> Callable[[str], str]:
    """An argparse ``type`` accepting ``options`` only. Unlike ``choices=``, argparse also applies it to a
    string default, so a bad value from the environment (``DISTILLQ_TEACHER_ROWS=bogus``) is a usage error."""

    def parse(value: str) -> str:
        if value not in options:
            raise argparse.ArgumentTypeError(f"invalid choice {value!r} (choose from {', '.join(options)})")
        return value

    parse.__name__ = "choice"
    return parse


def int_at_least(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse ``type``: an integer ``>= low`` (and ``<= high`` when given), applied to environment defaults
    too."""

    def parse(value: str) -> int:
        try:
            n = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid integer {value!r}") from None
        if n < low:
            raise argparse.ArgumentTypeError(f"{n} is below {low}")
        if high is not None and n > high:
            raise argparse.ArgumentTypeError(f"{n} is above {high}")
        return n

    parse.__name__ = "integer"
    return parse


def _value_type(field: FieldInfo) -> Any:
    """The annotation without ``| None``."""
    ann = field.annotation
    if get_origin(ann) in (typing.Union, types.UnionType):
        rest = [a for a in get_args(ann) if a is not type(None)]
        return rest[0] if len(rest) == 1 else ann
    return ann


def _parser(field: FieldInfo, meta: Flag) -> tuple[Callable[[str], Any], tuple[str, ...] | None]:
    """The argparse ``type`` and ``choices`` of a field that takes a value."""
    if meta.parse is not None:
        return meta.parse, None
    kind = _value_type(field)
    if get_origin(kind) is Literal:
        options = tuple(str(o) for o in get_args(kind))
        return one_of(*options), options
    if kind is int:
        low = next((m.ge for m in field.metadata if isinstance(m, annotated_types.Ge)), None)
        high = next((m.le for m in field.metadata if isinstance(m, annotated_types.Le)), None)
        if low is None:
            return int, None
        return int_at_least(int(low), None if high is None else int(high)), None  # type: ignore[call-overload]
    if kind is float:
        return float, None
    if kind is str:
        return str, None
    raise TypeError(f"no command-line parser for {field.annotation}; give Flag(parse=...)")


def option(name: str, meta: Flag) -> str:
    return meta.flag or "--" + name.replace("_", "-")


_LINK = r"\[([^\]]*)\]\([^)\s]*\)"


def plain(description: str) -> str:
    """``description`` without its markdown: a parenthesised link to another page (`` ([learner.md](...))``)
    and a link closing a parenthesis (``; [below](#x))``) left out, other links reduced to their text,
    backticks dropped."""
    text = re.sub(r"\s*\(" + _LINK + r"\)", "", description)
    text = re.sub(r"[;,]\s*" + _LINK + r"(?=\))", "", text)
    return re.sub(_LINK, r"\1", text).replace("`", "")


def help_text(field: FieldInfo, meta: Flag) -> str:
    """The description as plain text (``plain``), then the variable and a default that is not a value:
    ``(env DISTILLQ_X; default: ...)``. A default that is a value is added by the help formatter
    (``(default: 20)``)."""
    notes = []
    if meta.env:
        notes.append(f"env {env_name(meta)}" + (", comma-separated" if _is_list(field) else ""))
    if meta.default_text is not None:
        notes.append("default: " + meta.default_text.replace("`", ""))
    elif field.is_required():
        notes.append("required")
    elif _is_list(field) or (field.default is None and meta.cli_default is None):
        notes.append("default: none")
    text = plain(field.description or "").replace("%", "%%")
    return f"{text} ({'; '.join(notes)})" if notes else text


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows each option's default (``(default: X)``) unless it is None or off, or the help text
    already says it (a default that comes from elsewhere, such as ``$DISTILLQ_REDIS_URL``)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        off = action.default is None or action.default is False or action.default is argparse.SUPPRESS
        if off or action.default == [] or "default:" in text or "%(default)" in text:  # not `in (...)`: 0 == False
            return text
        if action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            return f"{text} (default: %(default)s)"
        return text


def add_flags(p: argparse.ArgumentParser, cls: type[FlagSettings]) -> None:
    """One argparse option per field of ``cls``, its destination the field's name."""
    for name, field in cls.model_fields.items():
        meta = flag_of(field)
        kwargs: dict[str, Any] = {"dest": name, "help": help_text(field, meta)}
        if field.annotation is bool:
            p.add_argument(option(name, meta), action="store_true", **kwargs)
            continue
        if meta.metavar:
            kwargs["metavar"] = meta.metavar
        if _is_list(field):  # repeatable; the variable is read when the settings are built (flags replace it)
            p.add_argument(option(name, meta), action="append", default=None, **kwargs)
            continue
        parse, choices = _parser(field, meta)
        default = _env_value(meta) or (meta.cli_default if meta.cli_default is not None else field.default)
        if field.is_required() and default is field.default:  # no default and no variable: the flag must be given
            kwargs["required"], default = True, None
        p.add_argument(option(name, meta), type=parse, choices=choices, default=default, **kwargs)


def from_args(cls: type[S], args: argparse.Namespace) -> S:
    """``cls`` from parsed flags (``add_flags``); a repeatable flag not given falls back to its variable."""
    given = {name: getattr(args, name) for name, field in cls.model_fields.items()
             if hasattr(args, name) and not (_is_list(field) and getattr(args, name) is None)}
    return cls(**given)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _doc_default(field: FieldInfo, meta: Flag) -> str:
    if meta.default_text is not None:
        return meta.default_text
    if field.is_required():
        return "required"
    if field.annotation is bool:
        return "off"
    value = meta.cli_default if meta.cli_default is not None else field.default
    if value is None:
        return ""
    return f"`{value}`" if isinstance(value, str) else str(value)


def doc_table(cls: type[FlagSettings]) -> str:
    """The markdown table of ``cls``' flags: flag, env, default, meaning."""
    lines = ["| flag | env | default | meaning |", "|---|---|---|---|"]
    for name, field in cls.model_fields.items():
        meta = flag_of(field)
        var = env_name(meta)
        env_cell = f"`{var}`" + (" (comma-separated)" if _is_list(field) else "") if var else ""
        meaning = field.description or ""
        cells = (f"`{option(name, meta)}`", env_cell, _cell(_doc_default(field, meta)), _cell(meaning))
        lines.append("|" + "|".join(f" {c} " if c else " " for c in cells) + "|")
    return "\n".join(lines) + "\n"
