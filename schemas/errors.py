"""The root of every exception distillq raises, and the family of the wire contract's own.

``DistillqError`` lives here, in the lowest layer, so that ``schemas`` (which imports nothing of ``pipeline``)
and every layer above can subclass it; ``pipeline.errors`` re-exports it with the other families.
``WireFormatError``: bytes or arrays that do not make a valid distillq message (``DecodeError`` in
``schemas.validate``, ``ArrayError`` in ``schemas.arrays``).

Every concrete class also keeps the builtin base it had before (``ValueError`` for both of these), so an
``except ValueError`` written against it still catches it.
"""

from __future__ import annotations

__all__ = ["DistillqError", "WireFormatError"]


class DistillqError(Exception):
    """Base of every exception distillq raises on purpose: ``except DistillqError`` catches them all."""


class WireFormatError(DistillqError):
    """A message or an array on the wire is not valid (malformed, inconsistent, out of bounds)."""
