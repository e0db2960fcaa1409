"""distillq's public API in one import: the learner client, ``to_torch``, the losses, the producer SDK, the
verifiers converter, weight publishing, the wire messages and the exceptions (``except distillq.DistillqError``
catches every failure distillq raises on purpose).

Every name is the object of its home module, re-exported as it is (same object, same signature):

=============================================  ======================================================
``Learner``, ``AsyncLearner``, ``LearnerBatch``  ``pipeline.learner.client`` (``batch``)
``to_torch``, ``TorchBatch``                     ``pipeline.learner.torch_batch``
the losses                                       ``pipeline.learner.losses``
``gather_logprobs``, ``chunked_*``               ``pipeline.learner.chunked`` (``chunked_topk_forward_kl``
                                                 is ``chunked.topk_forward_kl``: the same losses from hidden
                                                 states and the lm_head)
``publish_weights``                              ``pipeline.learner.publish``
``save_checkpoint``, ``load_checkpoint``,        ``pipeline.learner.checkpoint``
``Checkpoint``
``LearnerDataset``                               ``pipeline.learner.data`` (a torch ``IterableDataset``)
``DistillTrainer``                               ``pipeline.learner.hf_trainer`` (a transformers ``Trainer``)
``GroupProducer``, ``AsyncGroupProducer``        ``pipeline.transport.sdk``
``groups_from_traces``                           ``pipeline.serve.student`` (verifiers' records as groups)
the wire messages, ``encode``, ``decode``        ``schemas``
the exceptions: ``DistillqError``, its families  ``pipeline.errors`` (the families; each class from the
and every class under them                       module that raises it, table in ``pipeline.errors``)
=============================================  ======================================================

``import distillq`` loads the exceptions of ``pipeline.errors`` and the wire messages (``schemas``) only; every
other name loads its home module on first use, so a bare ``pip install distillq`` imports it and uses every name
but those of ``NEEDS_EXTRA`` (torch for ``to_torch``, ``TorchBatch``, the losses and ``LearnerDataset``; transformers
and accelerate for ``DistillTrainer``), which fail on first use with one line naming the extra to install.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Final

from pipeline.errors import (
    ApiError,
    BackendError,
    ConfigurationError,
    DistillqError,
    LearnerError,
    TransportError,
    WireFormatError,
)
from schemas import (
    ArrayError,
    BatchManifest,
    DecodeError,
    DistillStatus,
    GroupHeader,
    GroupRef,
    Limits,
    Message,
    RolloutGroup,
    ScoredGroup,
    Sequence,
    TeacherPayload,
    TrainBatch,
    decode,
    encode,
)

if TYPE_CHECKING:
    from pipeline.demo.realpair import RealPairUnavailable
    from pipeline.demo.vocabs import VocabUnavailable
    from pipeline.learner.batch import LearnerBatch
    from pipeline.learner.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
    from pipeline.learner.checks import LearnerConnectionError
    from pipeline.learner.chunked import gather_logprobs
    from pipeline.learner.chunked import generalized_jsd as chunked_generalized_jsd
    from pipeline.learner.chunked import importance_sampled_pg_loss as chunked_importance_sampled_pg_loss
    from pipeline.learner.chunked import token_logprobs as chunked_token_logprobs
    from pipeline.learner.chunked import topk_forward_kl as chunked_topk_forward_kl
    from pipeline.learner.client import AsyncLearner, Learner
    from pipeline.learner.data import LearnerDataset
    from pipeline.learner.hf_trainer import DistillTrainer
    from pipeline.learner.losses import (
        full_vocab_kl,
        generalized_jsd,
        generalized_jsd_from_logprobs,
        importance_sampled_pg_loss,
        reduce_masked,
        reverse_kl_advantages,
        sampled_reverse_kl,
        token_logprobs,
        topk_forward_kl,
        topk_forward_kl_from_logprobs,
    )
    from pipeline.learner.publish import publish_weights
    from pipeline.learner.ranks import RankTakenOver
    from pipeline.learner.torch_batch import TorchBatch, to_torch
    from pipeline.models.weights import CheckpointError
    from pipeline.rollout.students.base import StudentBackendError
    from pipeline.rollout.sync_engines import EngineError
    from pipeline.serve.student.jsonbody import BodyProblem
    from pipeline.serve.student.service import ServeError
    from pipeline.serve.student.validation import RequestError
    from pipeline.serve.student.verifiers import groups_from_traces
    from pipeline.stages.exits import CliError
    from pipeline.teacher.base import TeacherConfigError
    from pipeline.teacher.crosstok import RoundTripError
    from pipeline.teacher.vllm_engine_proc import HookMissing
    from pipeline.teacher.vocab import VocabMismatchError
    from pipeline.transport.connection import ClusterUnreachableError
    from pipeline.transport.identity import NameHeld
    from pipeline.transport.producer import BackpressureTimeout, MessageTooLarge, ProducerStopped
    from pipeline.transport.prompts import BadPrompt
    from pipeline.transport.sdk import AsyncGroupProducer, GroupProducer
    from pipeline.transport.sharding import ShardConfigError
    from pipeline.weightstore.codec import CodecError
    from pipeline.weightstore.stores import WeightStoreUnavailable
    from schemas.validate import InvalidLogprobs

#: Every name but the exceptions of ``pipeline.errors`` and the wire messages: name -> (home module, attribute),
#: imported on first use and then kept as a plain attribute.
_HOME: Final[dict[str, tuple[str, str]]] = {
    "RealPairUnavailable": ("pipeline.demo.realpair", "RealPairUnavailable"),
    "VocabUnavailable": ("pipeline.demo.vocabs", "VocabUnavailable"),
    "LearnerBatch": ("pipeline.learner.batch", "LearnerBatch"),
    "Checkpoint": ("pipeline.learner.checkpoint", "Checkpoint"),
    "load_checkpoint": ("pipeline.learner.checkpoint", "load_checkpoint"),
    "save_checkpoint": ("pipeline.learner.checkpoint", "save_checkpoint"),
    "LearnerConnectionError": ("pipeline.learner.checks", "LearnerConnectionError"),
    "chunked_generalized_jsd": ("pipeline.learner.chunked", "generalized_jsd"),
    "chunked_importance_sampled_pg_loss": ("pipeline.learner.chunked", "importance_sampled_pg_loss"),
    "chunked_token_logprobs": ("pipeline.learner.chunked", "token_logprobs"),
    "chunked_topk_forward_kl": ("pipeline.learner.chunked", "topk_forward_kl"),
    "gather_logprobs": ("pipeline.learner.chunked", "gather_logprobs"),
    "AsyncLearner": ("pipeline.learner.client", "AsyncLearner"),
    "Learner": ("pipeline.learner.client", "Learner"),
    "LearnerDataset": ("pipeline.learner.data", "LearnerDataset"),
    "DistillTrainer": ("pipeline.learner.hf_trainer", "DistillTrainer"),
    "full_vocab_kl": ("pipeline.learner.losses", "full_vocab_kl"),
    "generalized_jsd": ("pipeline.learner.losses", "generalized_jsd"),
    "generalized_jsd_from_logprobs": ("pipeline.learner.losses", "generalized_jsd_from_logprobs"),
    "importance_sampled_pg_loss": ("pipeline.learner.losses", "importance_sampled_pg_loss"),
    "reduce_masked": ("pipeline.learner.losses", "reduce_masked"),
    "reverse_kl_advantages": ("pipeline.learner.losses", "reverse_kl_advantages"),
    "sampled_reverse_kl": ("pipeline.learner.losses", "sampled_reverse_kl"),
    "token_logprobs": ("pipeline.learner.losses", "token_logprobs"),
    "topk_forward_kl": ("pipeline.learner.losses", "topk_forward_kl"),
    "topk_forward_kl_from_logprobs": ("pipeline.learner.losses", "topk_forward_kl_from_logprobs"),
    "publish_weights": ("pipeline.learner.publish", "publish_weights"),
    "RankTakenOver": ("pipeline.learner.ranks", "RankTakenOver"),
    "TorchBatch": ("pipeline.learner.torch_batch", "TorchBatch"),
    "to_torch": ("pipeline.learner.torch_batch", "to_torch"),
    "CheckpointError": ("pipeline.models.weights", "CheckpointError"),
    "StudentBackendError": ("pipeline.rollout.students.base", "StudentBackendError"),
    "EngineError": ("pipeline.rollout.sync_engines", "EngineError"),
    "BodyProblem": ("pipeline.serve.student.jsonbody", "BodyProblem"),
    "ServeError": ("pipeline.serve.student.service", "ServeError"),
    "RequestError": ("pipeline.serve.student.validation", "RequestError"),
    "groups_from_traces": ("pipeline.serve.student.verifiers", "groups_from_traces"),
    "CliError": ("pipeline.stages.exits", "CliError"),
    "TeacherConfigError": ("pipeline.teacher.base", "TeacherConfigError"),
    "RoundTripError": ("pipeline.teacher.crosstok", "RoundTripError"),
    "HookMissing": ("pipeline.teacher.vllm_engine_proc", "HookMissing"),
    "VocabMismatchError": ("pipeline.teacher.vocab", "VocabMismatchError"),
    "ClusterUnreachableError": ("pipeline.transport.connection", "ClusterUnreachableError"),
    "NameHeld": ("pipeline.transport.identity", "NameHeld"),
    "BackpressureTimeout": ("pipeline.transport.producer", "BackpressureTimeout"),
    "MessageTooLarge": ("pipeline.transport.producer", "MessageTooLarge"),
    "ProducerStopped": ("pipeline.transport.producer", "ProducerStopped"),
    "BadPrompt": ("pipeline.transport.prompts", "BadPrompt"),
    "AsyncGroupProducer": ("pipeline.transport.sdk", "AsyncGroupProducer"),
    "GroupProducer": ("pipeline.transport.sdk", "GroupProducer"),
    "ShardConfigError": ("pipeline.transport.sharding", "ShardConfigError"),
    "CodecError": ("pipeline.weightstore.codec", "CodecError"),
    "WeightStoreUnavailable": ("pipeline.weightstore.stores", "WeightStoreUnavailable"),
    "InvalidLogprobs": ("schemas.validate", "InvalidLogprobs"),
}

#: The names that need an extra (``pip install 'distillq[EXTRA]'``) beyond a bare install, and which.
NEEDS_EXTRA: Final[dict[str, str]] = {
    "LearnerDataset": "hf",
    "TorchBatch": "hf",
    "chunked_generalized_jsd": "hf",
    "chunked_importance_sampled_pg_loss": "hf",
    "chunked_token_logprobs": "hf",
    "chunked_topk_forward_kl": "hf",
    "full_vocab_kl": "hf",
    "gather_logprobs": "hf",
    "generalized_jsd": "hf",
    "generalized_jsd_from_logprobs": "hf",
    "importance_sampled_pg_loss": "hf",
    "reduce_masked": "hf",
    "reverse_kl_advantages": "hf",
    "sampled_reverse_kl": "hf",
    "to_torch": "hf",
    "token_logprobs": "hf",
    "topk_forward_kl": "hf",
    "topk_forward_kl_from_logprobs": "hf",
    "DistillTrainer": "trainer",
}

__all__ = [
    "NEEDS_EXTRA",
    "ApiError",
    "ArrayError",
    "AsyncGroupProducer",
    "AsyncLearner",
    "BackendError",
    "BackpressureTimeout",
    "BadPrompt",
    "BatchManifest",
    "BodyProblem",
    "Checkpoint",
    "CheckpointError",
    "CliError",
    "ClusterUnreachableError",
    "CodecError",
    "ConfigurationError",
    "DecodeError",
    "DistillStatus",
    "DistillTrainer",
    "DistillqError",
    "EngineError",
    "GroupHeader",
    "GroupProducer",
    "GroupRef",
    "HookMissing",
    "InvalidLogprobs",
    "Learner",
    "LearnerBatch",
    "LearnerConnectionError",
    "LearnerDataset",
    "LearnerError",
    "Limits",
    "Message",
    "MessageTooLarge",
    "NameHeld",
    "ProducerStopped",
    "RankTakenOver",
    "RealPairUnavailable",
    "RequestError",
    "RolloutGroup",
    "RoundTripError",
    "ScoredGroup",
    "Sequence",
    "ServeError",
    "ShardConfigError",
    "StudentBackendError",
    "TeacherConfigError",
    "TeacherPayload",
    "TorchBatch",
    "TrainBatch",
    "TransportError",
    "VocabMismatchError",
    "VocabUnavailable",
    "WeightStoreUnavailable",
    "WireFormatError",
    "chunked_generalized_jsd",
    "chunked_importance_sampled_pg_loss",
    "chunked_token_logprobs",
    "chunked_topk_forward_kl",
    "decode",
    "encode",
    "full_vocab_kl",
    "gather_logprobs",
    "generalized_jsd",
    "generalized_jsd_from_logprobs",
    "groups_from_traces",
    "importance_sampled_pg_loss",
    "load_checkpoint",
    "publish_weights",
    "reduce_masked",
    "reverse_kl_advantages",
    "sampled_reverse_kl",
    "save_checkpoint",
    "to_torch",
    "token_logprobs",
    "topk_forward_kl",
    "topk_forward_kl_from_logprobs",
]


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attr = _HOME[name]
    try:
        value = getattr(importlib.import_module(module), attr)
    except ModuleNotFoundError as e:
        extra = NEEDS_EXTRA.get(name)
        if extra is None or (e.name or "").partition(".")[0] in ("pipeline", "schemas", "distillq"):
            raise
        raise ImportError(f"distillq.{name} needs the {extra!r} extra ({e.name} is not installed): "
                          f"pip install 'distillq[{extra}]'") from None
    globals()[name] = value  # once loaded, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
