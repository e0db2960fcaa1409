"""Raw array codec: numpy arrays travel as little-endian bytes with dtype and shape.

Encoding copies the array bytes exactly once (into the msgpack buffer). Decoding copies nothing:
``Array.data`` is a ``memoryview`` into the received message bytes, and ``Array.numpy()`` wraps it
with ``np.frombuffer``. Arrays obtained that way are read-only and keep the message alive.
"""

from __future__ import annotations

from typing import Final

import msgspec
import numpy as np
import numpy.typing as npt

from schemas.errors import WireFormatError

#: dtypes allowed on the wire (always little-endian, see ``ALLOWED``).
INT32: Final = "<i4"
FLOAT32: Final = "<f4"
FLOAT16: Final = "<f2"
UINT8: Final = "|u1"
ALLOWED: Final = frozenset({INT32, FLOAT32, FLOAT16, UINT8})
_ITEMSIZE: Final = {INT32: 4, FLOAT32: 4, FLOAT16: 2, UINT8: 1}
_DTYPES: Final = {code: np.dtype(code) for code in ALLOWED}

#: Largest absolute error of a teacher logprob stored as float16, relative to its magnitude:
#: half a unit in the last place of a 10-bit mantissa. A logprob of -20 is exact to 0.01.
FLOAT16_MAX_RELATIVE_ERROR: Final = 2.0**-11
#: Most negative logprob float16 can carry; smaller values are clipped to it on encode.
FLOAT16_MIN_LOGPROB: Final = -65504.0


class ArrayError(WireFormatError, ValueError):
    """An array on the wire is malformed (dtype, shape and byte length disagree)."""


class Array(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One n-dimensional array on the wire: ``[dtype, shape, data]``.

    ``gc=False``: instances are not tracked by the cycle collector (a str, a tuple of ints and a
    memoryview, all made before the array, cannot lead back to it). A scored group decodes ~50 of
    them; untracked, its decoding is ~1 us faster and counts less toward cyclic collections.
    """

    dtype: str
    shape: tuple[int, ...]
    data: memoryview

    @classmethod
    def from_numpy(cls, arr: npt.NDArray[np.generic], dtype: str | None = None) -> Array:
        """Wrap ``arr`` (converted to ``dtype`` if given) without copying when already conforming."""
        target = np.dtype(dtype) if dtype is not None else arr.dtype.newbyteorder("<")
        if dtype == FLOAT16:
            arr = np.clip(arr, FLOAT16_MIN_LOGPROB, None)
        a = np.ascontiguousarray(arr, dtype=target)
        code = a.dtype.str
        if code not in ALLOWED:
            raise ArrayError(f"dtype {code} is not allowed on the wire (allowed: {sorted(ALLOWED)})")
        # Flatten first: memoryview.cast rejects shapes with a zero dimension, e.g. (0, k).
        return cls(code, tuple(int(n) for n in a.shape), a.reshape(-1).data.cast("B"))

    def check(self, name: str) -> None:
        """Raise ``ArrayError`` naming ``name`` unless dtype, shape and byte length agree."""
        if self.dtype not in ALLOWED:
            raise ArrayError(f"{name}: dtype {self.dtype!r} is not allowed")
        n = 1
        for d in self.shape:
            if d < 0:
                raise ArrayError(f"{name}: negative dimension in shape {self.shape}")
            n *= d
        if self.data.ndim != 1 or self.data.itemsize != 1:
            raise ArrayError(f"{name}: data must be a flat byte buffer")
        expected = n * _ITEMSIZE[self.dtype]
        if self.data.nbytes != expected:
            got = self.data.nbytes
            raise ArrayError(f"{name}: {got} bytes for shape {self.shape} of {self.dtype} (expected {expected})")

    def numpy(self) -> npt.NDArray[np.generic]:
        """Zero-copy, read-only view of the array (call ``check`` first on untrusted input)."""
        a = np.frombuffer(self.data, dtype=_DTYPES.get(self.dtype) or np.dtype(self.dtype))
        return a if len(self.shape) == 1 else a.reshape(self.shape)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes
