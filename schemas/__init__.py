"""distillq wire contract: msgspec Structs for every stream message, and the raw array codec."""

from schemas.arrays import FLOAT16, FLOAT16_MAX_RELATIVE_ERROR, FLOAT32, INT32, UINT8, Array, ArrayError
from schemas.codec import decode, encode
from schemas.errors import DistillqError, WireFormatError
from schemas.messages import (
    SCHEMA_VERSION,
    BatchManifest,
    DistillStatus,
    GroupHeader,
    GroupRef,
    Message,
    RolloutGroup,
    ScoredGroup,
    Sequence,
    TeacherPayload,
    TrainBatch,
)
from schemas.validate import DecodeError, Limits

__all__ = [
    "FLOAT16",
    "FLOAT16_MAX_RELATIVE_ERROR",
    "FLOAT32",
    "INT32",
    "SCHEMA_VERSION",
    "UINT8",
    "Array",
    "ArrayError",
    "BatchManifest",
    "DecodeError",
    "DistillStatus",
    "DistillqError",
    "GroupHeader",
    "GroupRef",
    "Limits",
    "Message",
    "RolloutGroup",
    "ScoredGroup",
    "Sequence",
    "TeacherPayload",
    "TrainBatch",
    "WireFormatError",
    "decode",
    "encode",
]
