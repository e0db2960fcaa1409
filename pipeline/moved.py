"""Module paths that keep working after their modules moved: the old name imports the new module itself.

A package that lost modules calls ``keep_old_paths`` from its ``__init__`` with a table of old name -> new
name. ``import pipeline.ops.demo`` then returns the module ``pipeline.cli.demo`` (the same object: its
attributes, a monkeypatch of them, classes for ``isinstance`` and pickles all agree with the new path), and
``python -m OLD`` runs the new module's code. An old *package* that no longer exists (``pipeline.ops.cli``) is
listed in ``packages``: it imports as an empty package, so ``from pipeline.ops.cli import main`` and
``import pipeline.ops.cli.main`` resolve through the table.

The finder goes at the end of ``sys.meta_path``, after the real finders, so a module that exists under the
old name always wins, and it answers only the names in its table.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Iterable, Mapping, Sequence
from types import CodeType, ModuleType


class _NewModule(importlib.abc.Loader):
    """Loads an old name as the module that now holds its code."""

    def __init__(self, target: str) -> None:
        self.target = target
        self._spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.target)
        self._spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self._spec  # the import system put the old name's spec on it: the real one goes back

    def get_code(self, fullname: str) -> CodeType | None:
        """The new module's code, for ``python -m OLD``."""
        spec = importlib.util.find_spec(self.target)
        loader = spec.loader if spec is not None else None
        if not isinstance(loader, importlib.abc.InspectLoader):
            raise ImportError(f"{self.target} (the module {fullname} moved to) has no code to run", name=fullname)
        return loader.get_code(self.target)


class _OldPackage(importlib.abc.Loader):
    """An empty package under an old name, so its old submodule names resolve through the table."""

    def __init__(self, doc: str) -> None:
        self.doc = doc

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None  # the default: a new, empty module

    def exec_module(self, module: ModuleType) -> None:
        module.__doc__ = self.doc


class OldPaths(importlib.abc.MetaPathFinder):
    """Answers the old names of moved modules (``modules``: old -> new) and of removed packages."""

    def __init__(self, modules: Mapping[str, str], packages: Iterable[str] = ()) -> None:
        self.modules = dict(modules)
        self.packages = frozenset(packages)

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname in self.packages:
            moved = sorted(new for old, new in self.modules.items() if old.startswith(fullname + "."))
            spec = importlib.machinery.ModuleSpec(
                fullname, _OldPackage(f"Old path of modules that moved: {', '.join(moved)}."), is_package=True)
            spec.submodule_search_locations = []
            return spec
        new = self.modules.get(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _NewModule(new))


def keep_old_paths(modules: Mapping[str, str], packages: Iterable[str] = ()) -> None:
    """Make every old name in ``modules`` import its new module (idempotent: one finder per table)."""
    finder = OldPaths(modules, packages)
    for f in sys.meta_path:
        if isinstance(f, OldPaths) and f.modules == finder.modules and f.packages == finder.packages:
            return
    sys.meta_path.append(finder)
