"""The rollout stage logic without Redis: the group sampled for a job, its policy version, and the reload of a
local student's weights when the learner published a newer version."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs
from transformers import AutoTokenizer

from pipeline.demo.tinymodels import ensure_tiny_models
from pipeline.rollout.refusals import CheckpointRefusals
from pipeline.rollout.rewards import exact_match
from pipeline.rollout.students.base import Completion, GenParams
from pipeline.stages.rollout_stage import RolloutConfig, RolloutStage
from pipeline.transport.prompts import PromptJob

EOS = 2


class Student:
    """A local student replying ``reply`` to every request; ``load_weights`` (when ``reloads``) reports the
    versions it is asked to load from ``versions``."""

    def __init__(self, tokenizer: Any, reply: str, versions: list[int | None] | None = None) -> None:
        self._tokenizer, self.reply = tokenizer, reply
        self.versions = versions
        self.loads: list[str] = []
        self.requests: list[dict[str, Any]] = []

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    async def generate(self, prompt_ids: list[int], params: GenParams, n: int = 1) -> list[Completion]:
        self.requests.append({"n": n, "max_tokens": params.max_tokens, "temperature": params.temperature})
        ids = [*self._tokenizer.encode(self.reply, add_special_tokens=False), EOS]
        return [Completion(ids, [-0.5] * len(ids), "stop") for _ in range(n)]


class ReloadingStudent(Student):
    def __init__(self, tokenizer: Any, reply: str, versions: list[int | None] | None = None) -> None:
        super().__init__(tokenizer, reply, versions)
        self.checkpoint_refusals = CheckpointRefusals()

    async def load_weights(self, directory: str | Path) -> int | None:
        self.loads.append(str(directory))
        assert self.versions is not None
        return self.versions.pop(0)


@pytest.fixture(scope="module")
def tok() -> Any:
    return AutoTokenizer.from_pretrained(str(ensure_tiny_models().tokenizer))


def published(*versions: int) -> Any:
    seq = list(versions)

    async def read() -> int:
        return seq.pop(0) if len(seq) > 1 else seq[0]

    return read


async def test_a_job_becomes_one_rewarded_group_tagged_with_the_published_version(tok: Any) -> None:
    student = Student(tok, "4")
    cfg = RolloutConfig(group_size=3, params=GenParams(max_tokens=5, temperature=0.7))
    stage = RolloutStage(student, exact_match, cfg, published(7))
    job = PromptJob(id="p1", prompt="2+2=", answer="4", env_id=2, task_id="t", metadata={"k": "v"})
    group = await stage.sample(job, epoch=3)
    assert group is not None and stage.synced is None
    assert group.group_id == "3:p1" and group.policy_version == 7 and group.env_id == 2 and group.task_id == "t"
    assert len(group.sequences) == 3 and [s.score for s in group.sequences] == [1.0, 1.0, 1.0]
    assert student.requests == [{"n": 3, "max_tokens": 5, "temperature": 0.7}]  # one request for the group
    assert student.loads == []  # no weights directory: nothing reloaded


async def test_a_local_student_loads_a_newer_published_version_once(tok: Any, tmp_path: Path) -> None:
    student = ReloadingStudent(tok, "5", versions=[2, 4])
    stage = RolloutStage(student, exact_match, RolloutConfig(group_size=1, weights_dir=str(tmp_path)),
                         published(2, 2, 4))
    with capture_logs() as logs:
        first = await stage.current_version()
        again = await stage.current_version()  # version 2 is loaded: no second load
        newer = await stage.current_version()
    assert (first, again, newer) == (2, 2, 4) and student.loads == [str(tmp_path)] * 2
    assert [e["version"] for e in logs if e["event"] == "weights_reloaded"] == [2, 4]


async def test_a_local_student_without_published_weights_keeps_its_own(tok: Any, tmp_path: Path) -> None:
    student = ReloadingStudent(tok, "5", versions=[None])  # nothing in the directory yet
    stage = RolloutStage(student, exact_match, RolloutConfig(group_size=1, weights_dir=str(tmp_path)), published(1))
    group = await stage.sample(PromptJob(id="p", prompt="1+4="), epoch=0)
    assert group is not None and group.policy_version == 0 and stage.loaded == -1
