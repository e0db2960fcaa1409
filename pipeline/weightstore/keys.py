"""Every Redis key of a weights store (``redis://host:port/db?prefix=NAME``; ``pipeline.transport.keys`` names
the streams' keys and points here). The weights live under their own prefix, by default in a database of their
own (docs/weights.md: why).

    {prefix}:latest              the newest complete version (an integer), set with its manifest
    {prefix}:versions            sorted set of the versions whose manifest is written (score = version)
    {prefix}:manifest:{v:08d}    a version's manifest (JSON), written after all of its chunks
    {prefix}:chunk:{name}        one chunk (a few MB of zstd bytes); names start with the version: v00000007/0.3
"""

from __future__ import annotations

DEFAULT_PREFIX = "distillq-weights"


class WeightKeys:
    def __init__(self, prefix: str = DEFAULT_PREFIX) -> None:
        if not prefix or any(c.isspace() for c in prefix):
            raise ValueError(f"weights key prefix must be a non-empty word, got {prefix!r}")
        self.prefix = prefix
        self.latest = f"{prefix}:latest"
        self.versions = f"{prefix}:versions"

    def manifest(self, version: int) -> str:
        return f"{self.prefix}:manifest:{int(version):08d}"

    def chunk(self, name: str) -> str:
        return f"{self.prefix}:chunk:{name}"

    def pattern(self) -> str:
        """Every key of the store (for ``SCAN``)."""
        return f"{self.prefix}:*"
