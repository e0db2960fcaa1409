"""Every exception distillq raises on purpose, in one hierarchy: ``except DistillqError`` catches them all, and
``except`` of a family catches one kind of failure wherever it is raised.

==========================  ===================================================================================
family                      its classes (home module)
==========================  ===================================================================================
``WireFormatError``         ``DecodeError`` and its ``InvalidLogprobs`` (``schemas.validate``), ``ArrayError``
                            (``schemas.arrays``), ``BadPrompt`` (``pipeline.transport.prompts``),
                            ``RoundTripError`` (``pipeline.teacher.crosstok``), ``CodecError``
                            (``pipeline.weightstore.codec``: a weights chunk that does not decode)
``ConfigurationError``      ``TeacherConfigError`` (``pipeline.teacher.base``), ``VocabMismatchError``
                            (``pipeline.teacher.vocab``), ``ShardConfigError`` (``pipeline.transport.sharding``),
                            ``NameHeld`` (``pipeline.transport.identity``: a consumer name a live process holds),
                            ``RealPairUnavailable`` (``pipeline.demo.realpair``), ``VocabUnavailable``
                            (``pipeline.demo.vocabs``); itself where no narrower class
                            fits (``workers.rollout``, ``pipeline.demo.learner``)
``BackendError``            ``StudentBackendError`` (``pipeline.rollout.students.base``), ``EngineError``
                            (``pipeline.rollout.sync_engines``), ``HookMissing`` (``pipeline.teacher.vllm_engine_proc``)
``TransportError``          ``BackpressureTimeout``, ``MessageTooLarge``, ``ProducerStopped``
                            (``pipeline.transport.producer``), ``ClusterUnreachableError``
                            (``pipeline.transport.connection``; a redis-py ``ConnectionError``: transient),
                            ``WeightStoreUnavailable`` (``pipeline.weightstore.stores``: the weights store's
                            Redis silent past its retries; a ``ConnectionError`` too)
``LearnerError``            ``LearnerConnectionError`` (``pipeline.learner.checks``), ``RankTakenOver``
                            (``pipeline.learner.ranks``)
``ApiError``                ``ServeError`` (``pipeline.serve.student.service``), ``RequestError``
                            (``pipeline.serve.student.validation``), ``BodyProblem``
                            (``pipeline.serve.student.jsonbody``)
``CheckpointError``         itself (``pipeline.models.weights``)
``CliError``                itself (``pipeline.stages.exits``)
==========================  ===================================================================================

The families are defined here (``DistillqError`` and ``WireFormatError`` in ``schemas.errors``, the lowest layer,
so the wire contract can use them too); each class lives beside the code that raises it and keeps the builtin
base it always had (``class BackpressureTimeout(TransportError, TimeoutError)``), so ``except TimeoutError``
still catches it. ``distillq`` exports the families and the classes. This module imports only ``schemas.errors``:
every layer may import it.

Every entry point ends a process through ``pipeline.stages.exits.run_command``, which turns these into one line
on stderr and an exit status: a ``ConfigurationError`` is exit status 2 (``distillq up`` does not restart it), a
``LearnerError`` that is a ``ConnectionError`` is 3, like a Redis error, a ``CliError`` carries its own.
"""

from __future__ import annotations

from schemas.errors import DistillqError, WireFormatError

__all__ = [
    "ApiError",
    "BackendError",
    "ConfigurationError",
    "DistillqError",
    "LearnerError",
    "TransportError",
    "WireFormatError",
]


class ConfigurationError(DistillqError):
    """A setting, a flag or a pairing of models that cannot work: nothing is retried, the process does not start
    (exit status 2)."""


class BackendError(DistillqError):
    """An inference backend or a model server failed, or answered something that cannot be used."""


class TransportError(DistillqError):
    """A message was not put on a stream: backpressure that did not clear, a message too large, a stopped producer."""


class LearnerError(DistillqError):
    """The learner client cannot go on: Redis away, or another process took over its rank."""


class ApiError(DistillqError):
    """A request one of distillq's HTTP servers refuses; the server answers it with an error status."""
