"""Encode and decode stream messages (msgpack via msgspec; never pickle).

``decode`` never raises anything but ``DecodeError`` on bad bytes: a reader can dead-letter the entry
with the reason and go on.
"""

from __future__ import annotations

from typing import Final, TypeVar, overload

import msgspec

from schemas.messages import Message, RolloutGroup, ScoredGroup, TrainBatch
from schemas.validate import DecodeError, Limits, validate

_ENCODER: Final = msgspec.msgpack.Encoder()
_DECODER: Final = msgspec.msgpack.Decoder(Message)
DEFAULT_LIMITS: Final = Limits()

M = TypeVar("M", bound=RolloutGroup | ScoredGroup | TrainBatch)


def encode(msg: Message) -> bytes:
    """Serialise a message. Array bytes are copied once, into the returned buffer."""
    return _ENCODER.encode(msg)


@overload
def decode(data: bytes | memoryview, limits: Limits = ..., *, expect: None = None) -> Message: ...
@overload
def decode(data: bytes | memoryview, limits: Limits = ..., *, expect: type[M]) -> M: ...
def decode(
    data: bytes | memoryview, limits: Limits = DEFAULT_LIMITS, *, expect: type[M] | None = None
) -> Message | M:
    """Decode and validate one message; arrays are views into ``data`` (no copy).

    Raises ``DecodeError`` (with the failing field) for anything that is not a valid message: oversize,
    truncated or corrupted bytes, wrong types, inconsistent lengths, non-finite logprobs, bad ids.
    """
    size = len(data)
    if size > limits.max_bytes:
        raise DecodeError("message", f"{size} bytes exceeds the cap of {limits.max_bytes}")
    try:
        msg: Message = _DECODER.decode(data)
    except msgspec.ValidationError as e:
        raise DecodeError("message", f"invalid: {e}") from None
    except (msgspec.DecodeError, RecursionError, ValueError, TypeError, OverflowError) as e:
        raise DecodeError("message", f"malformed msgpack: {e}") from None
    if expect is not None and not isinstance(msg, expect):
        raise DecodeError("t", f"expected a {expect.__name__}, got a {type(msg).__name__}")
    try:
        validate(msg, limits)
    except DecodeError:
        raise
    except (ValueError, TypeError, IndexError, OverflowError) as e:  # defensive: never another type
        raise DecodeError("message", f"invalid: {e}") from None
    return msg
