"""One exception hierarchy: every exception class the code base defines is a ``DistillqError``, sits in the family
``pipeline.errors`` documents, keeps its builtin base, and is exported by ``distillq``."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

import distillq
from pipeline.errors import (
    ApiError,
    BackendError,
    ConfigurationError,
    DistillqError,
    LearnerError,
    TransportError,
    WireFormatError,
)

PACKAGES = ("schemas", "pipeline", "workers", "distillq")


def defined_exceptions() -> dict[str, type[BaseException]]:
    """``module.Class`` -> class, for every exception class defined (not imported) in a module of ``PACKAGES``."""
    found: dict[str, type[BaseException]] = {}
    for package in PACKAGES:
        root = importlib.import_module(package)
        modules = [root, *(importlib.import_module(m.name)
                           for m in pkgutil.walk_packages(root.__path__, f"{package}."))]
        for module in modules:
            for name, value in vars(module).items():
                if inspect.isclass(value) and issubclass(value, BaseException) and value.__module__ == module.__name__:
                    found[f"{module.__name__}.{name}"] = value
    return found


def test_every_exception_class_is_a_distillq_error() -> None:
    found = defined_exceptions()
    assert len(found) >= 25  # the walk reached the code base (the families and ~18 classes)
    public = {name: cls for name, cls in found.items() if not name.rsplit(".", 1)[1].startswith("_")}
    outside = sorted(name for name, cls in public.items() if not issubclass(cls, DistillqError))
    assert outside == [], f"exception classes outside the hierarchy of pipeline.errors: {outside}"


def test_every_exception_class_is_exported_by_distillq() -> None:
    public = {cls.__name__ for name, cls in defined_exceptions().items() if not name.rsplit(".", 1)[1].startswith("_")}
    assert sorted(public - set(distillq.__all__)) == []


FAMILIES: list[tuple[str, type[BaseException], type[BaseException]]] = [
    # (home module.class, family, the builtin base it kept)
    ("schemas.validate.DecodeError", WireFormatError, ValueError),
    ("schemas.validate.InvalidLogprobs", WireFormatError, ValueError),
    ("schemas.arrays.ArrayError", WireFormatError, ValueError),
    ("pipeline.transport.prompts.BadPrompt", WireFormatError, ValueError),
    ("pipeline.teacher.crosstok.RoundTripError", WireFormatError, ValueError),
    ("pipeline.weightstore.codec.CodecError", WireFormatError, ValueError),
    ("pipeline.teacher.base.TeacherConfigError", ConfigurationError, RuntimeError),
    ("pipeline.teacher.vocab.VocabMismatchError", ConfigurationError, RuntimeError),
    ("pipeline.transport.sharding.ShardConfigError", ConfigurationError, RuntimeError),
    ("pipeline.transport.identity.NameHeld", ConfigurationError, Exception),
    ("pipeline.demo.realpair.RealPairUnavailable", ConfigurationError, RuntimeError),
    ("pipeline.demo.vocabs.VocabUnavailable", ConfigurationError, RuntimeError),
    ("pipeline.rollout.students.base.StudentBackendError", BackendError, RuntimeError),
    ("pipeline.rollout.sync_engines.EngineError", BackendError, RuntimeError),
    ("pipeline.teacher.vllm_engine_proc.HookMissing", BackendError, RuntimeError),
    ("pipeline.transport.producer.BackpressureTimeout", TransportError, TimeoutError),
    ("pipeline.transport.producer.MessageTooLarge", TransportError, ValueError),
    ("pipeline.transport.producer.ProducerStopped", TransportError, RuntimeError),
    ("pipeline.transport.connection.ClusterUnreachableError", TransportError, RedisConnectionError),
    ("pipeline.weightstore.stores.WeightStoreUnavailable", TransportError, RedisConnectionError),
    ("pipeline.learner.checks.LearnerConnectionError", LearnerError, ConnectionError),
    ("pipeline.learner.ranks.RankTakenOver", LearnerError, RuntimeError),
    ("pipeline.serve.student.service.ServeError", ApiError, Exception),
    ("pipeline.serve.student.validation.RequestError", ApiError, ValueError),
    ("pipeline.serve.student.jsonbody.BodyProblem", ApiError, ValueError),
    ("pipeline.models.weights.CheckpointError", DistillqError, Exception),
    ("pipeline.stages.exits.CliError", DistillqError, Exception),
]


@pytest.mark.parametrize(("path", "family", "builtin"), FAMILIES, ids=[p.rsplit(".", 1)[1] for p, _, _ in FAMILIES])
def test_each_class_is_in_its_family_and_keeps_its_builtin_base(
    path: str, family: type[BaseException], builtin: type[BaseException]
) -> None:
    module, name = path.rsplit(".", 1)
    cls = getattr(importlib.import_module(module), name)
    assert issubclass(cls, family) and issubclass(cls, builtin) and issubclass(cls, DistillqError)
    assert getattr(distillq, name) is cls
    others = {ApiError, BackendError, ConfigurationError, LearnerError, TransportError, WireFormatError} - {family}
    assert not any(issubclass(cls, f) for f in others)  # one family each


def test_the_table_covers_every_class() -> None:
    tabled = {path for path, _, _ in FAMILIES}
    public = {name for name in defined_exceptions() if not name.rsplit(".", 1)[1].startswith("_")}
    families = {f"{f.__module__}.{f.__name__}" for f in (DistillqError, WireFormatError, ApiError, BackendError,
                                                           ConfigurationError, LearnerError, TransportError)}
    assert sorted(public - families - tabled) == []


def test_an_except_of_the_family_or_of_the_old_builtin_catches_it() -> None:
    from pipeline.transport.producer import BackpressureTimeout
    from schemas import ArrayError, DecodeError

    for exc, catchers in [
        (BackpressureTimeout("stuck"), (TimeoutError, OSError, TransportError, DistillqError)),
        (DecodeError("t", "no"), (ValueError, WireFormatError, DistillqError)),
        (ArrayError("bad"), (ValueError, WireFormatError)),
    ]:
        for catcher in catchers:
            with pytest.raises(catcher):
                raise exc
    assert str(DecodeError("t", "no")) == "t: no" and not issubclass(ArrayError, DecodeError)


def test_the_base_is_one_object_everywhere() -> None:
    import schemas
    from schemas.errors import DistillqError as WireBase

    assert DistillqError is WireBase is schemas.DistillqError is distillq.DistillqError
