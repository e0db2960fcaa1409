"""``import distillq``: every public name resolves, and each is the very object of its home module."""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

import distillq

ROOT = Path(__file__).resolve().parents[2]


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


DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])


def names_the_docs_import() -> set[tuple[str, str]]:
    """``(file, name)`` for every ``from distillq import ...`` (one line, or parenthesised over several) and every
    `` `distillq.NAME` `` in README.md and docs/*.md."""
    found: set[tuple[str, str]] = set()
    for path in DOCS:
        text = path.read_text()
        for m in re.finditer(r"from distillq import (\([^)]*\)|[^\n`]+)", text):
            for part in re.sub(r"#[^\n]*", "", m.group(1)).strip("()").replace("\n", " ").split(","):
                name = part.strip().split(" as ")[0].strip()
                if name and name != "...":
                    found.add((path.name, name))
        found |= {(path.name, n) for n in re.findall(r"`distillq\.([A-Za-z_]\w*)", text)}
    return found


def test_the_docs_import_names_from_distillq() -> None:
    names = {n for _, n in names_the_docs_import()}
    assert {"Learner", "to_torch", "save_checkpoint", "load_checkpoint", "LearnerDataset", "DistillTrainer"} <= names


@pytest.mark.parametrize(("doc", "name"), sorted(names_the_docs_import()))
def test_every_name_the_docs_import_from_distillq_resolves(doc: str, name: str) -> None:
    assert name in distillq.__all__, f"{doc} imports {name} from distillq, which does not export it"
    assert getattr(distillq, name) is not None


def test_the_learner_and_checkpoint_exports_are_the_home_objects() -> None:
    from pipeline.learner import checkpoint
    from pipeline.learner.data import LearnerDataset
    from pipeline.learner.hf_trainer import DistillTrainer

    assert distillq.save_checkpoint is checkpoint.save_checkpoint
    assert distillq.load_checkpoint is checkpoint.load_checkpoint
    assert distillq.Checkpoint is checkpoint.Checkpoint
    assert distillq.LearnerDataset is LearnerDataset
    assert distillq.DistillTrainer is DistillTrainer


@pytest.mark.parametrize("cls", [distillq.Learner, distillq.AsyncLearner], ids=lambda c: c.__name__)
def test_the_learner_constructors_name_their_keywords(cls: type) -> None:
    """``help(Learner)`` and type checkers see every keyword, typed, with the ``AsyncLearner`` defaults."""
    params = inspect.signature(cls.__init__).parameters
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    wanted = {"redis_url": None, "namespace": None, "consumer_name": "learner-0", "settings": None, "redis": None,
              "limits": None, "prefetch": True, "rank": 0, "world_size": 1, "max_staleness": "feeder",
              "on_stale": "dead_letter"}
    assert {n: p.default for n, p in params.items() if n != "self"} == wanted
    assert all(p.annotation is not inspect.Parameter.empty for n, p in params.items() if n != "self")
    sync = inspect.signature(distillq.Learner.__init__).parameters
    assert {n: (p.kind, p.annotation) for n, p in sync.items()} == {
        n: (p.kind, p.annotation) for n, p in inspect.signature(distillq.AsyncLearner.__init__).parameters.items()}
