"""``import distillq``: every public name resolves, and each is the very object of its home module."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest

import distillq


@pytest.mark.parametrize("name", distillq.__all__)
def test_every_exported_name_resolves(name: str) -> None:
    value = getattr(distillq, name)
    assert value is not None
    assert name in dir(distillq)


def test_the_exports_are_the_home_objects() -> None:
    from distillq import AsyncLearner, GroupProducer, Learner, RolloutGroup, groups_from_traces, publish_weights
    from pipeline.learner import chunked, losses
    from pipeline.learner.client import AsyncLearner as HomeAsyncLearner
    from pipeline.learner.client import Learner as HomeLearner
    from pipeline.learner.publish import publish_weights as home_publish_weights
    from pipeline.learner.torch_batch import to_torch
    from pipeline.serve.student.verifiers import groups_from_traces as home_groups_from_traces
    from pipeline.transport.sdk import GroupProducer as HomeGroupProducer
    from schemas import RolloutGroup as HomeRolloutGroup

    assert Learner is HomeLearner
    assert AsyncLearner is HomeAsyncLearner
    assert GroupProducer is HomeGroupProducer
    assert groups_from_traces is home_groups_from_traces
    assert publish_weights is home_publish_weights
    assert RolloutGroup is HomeRolloutGroup
    assert distillq.to_torch is to_torch
    assert distillq.topk_forward_kl is losses.topk_forward_kl
    assert distillq.chunked_topk_forward_kl is chunked.topk_forward_kl
    assert distillq.chunked_topk_forward_kl is not distillq.topk_forward_kl


def test_signatures_are_the_real_ones() -> None:
    from pipeline.learner.losses import topk_forward_kl

    assert inspect.signature(distillq.topk_forward_kl) == inspect.signature(topk_forward_kl)
    assert "student_logits" in inspect.signature(distillq.topk_forward_kl).parameters
    assert "redis_url" in inspect.signature(distillq.publish_weights).parameters


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError):
        _ = distillq.no_such_name


def test_import_distillq_does_not_import_torch() -> None:
    code = "import sys, distillq; sys.exit('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr or "import distillq imported torch"
