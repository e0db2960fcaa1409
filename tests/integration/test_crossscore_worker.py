"""`distillq worker teacher --cross-tokenizer` end to end on real Redis: student groups (the tiny tokenizer's ids,
multi-turn, an untrained tool turn; one ending half-way through a character, read on the byte fallback) scored by
a tiny hf teacher of another tokenizer, batched by the feeder, and delivered to the learner client; the batch
reaches ``to_torch`` with finite advantages, a distill mask and the chunks' ends."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")

from pipeline.cli.main import main
from pipeline.demo.tinymodels import TinyModels, build_model, ensure_tiny_models
from pipeline.learner.client import Learner
from pipeline.learner.torch_batch import to_torch
from pipeline.transport.keys import Keys
from schemas import DistillStatus
from schemas.messages import SCHEMA_VERSION
from tests.unit.test_crossscore import conversation, teacher_tokenizer

pytestmark = [pytest.mark.redis, pytest.mark.slow]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[TinyModels, Path]:
    from transformers import AutoTokenizer

    tiny = ensure_tiny_models()
    teacher = tmp_path_factory.mktemp("cross-teacher")
    teacher_tokenizer(teacher)  # the model's folder holds its tokenizer: --model is also the teacher's tokenizer
    build_model(teacher, "teacher", len(AutoTokenizer.from_pretrained(str(teacher))), seed=1, size=(32, 2, 2, 64))
    return tiny, teacher


def atropos_line(gid: str, tokens: list[list[int]], masks: list[list[int]]) -> str:
    return json.dumps({
        "group_id": gid, "tokens": tokens, "scores": [1.0] * len(tokens),
        "masks": [[t if m else -100 for t, m in zip(ts, ms, strict=True)]
                  for ts, ms in zip(tokens, masks, strict=True)],
        "inference_logprobs": [[-0.7 if m else 1.0 for m in ms] for ms in masks]})


@pytest.mark.timeout(300)
def test_cross_tokenizer_teacher_worker_feeds_a_learner(tmp_path: Path, redis_url: str, keys: Keys,
                                                        models: tuple[TinyModels, Path]) -> None:
    from transformers import AutoTokenizer

    tiny, teacher = models
    student = AutoTokenizer.from_pretrained(str(tiny.tokenizer))
    plain, mask, _ = conversation(student)
    special, smask, _ = conversation(student, tool_in_answer=True)
    half, hmask = list(plain), list(mask)
    half[-2] = next(i for i in range(len(student)) if student.convert_ids_to_tokens(i) == "Ã")  # half of "é"
    f = tmp_path / "groups.jsonl"
    f.write_text("\n".join([atropos_line("multi", [plain, special], [mask, smask]),
                            atropos_line("half", [half], [hmask])]) + "\n")
    common = ["--redis-url", redis_url, "--namespace", keys.namespace]
    assert main(["push", str(f), *common]) == 0
    assert main(["worker", "teacher", "--backend", "hf", "--model", str(teacher), "--student-tokenizer",
                 str(tiny.tokenizer), "--cross-tokenizer", "--top-k", "5", "--burst", *common]) == 0
    assert main(["worker", "feeder", "--burst", "--max-wait", "0", *common]) == 0
    with Learner(redis_url, namespace=keys.namespace) as learner:
        lb = learner.next_batch(10)
        assert lb is not None
        groups = {g.group_id: g for g in lb.batch.groups}
        ok, fell_back = groups["multi"], groups["half"]
        assert ok.status is DistillStatus.OK and ok.schema == SCHEMA_VERSION and "tokenizer=" in ok.teacher_id
        assert all(t.cross for t in ok.teacher or ())
        # the lone byte 0xC3 is not text: the teacher reads it as its single-byte token, and the group is scored
        assert fell_back.status is DistillStatus.OK, fell_back.reason
        assert lb.batch.stats is not None and lb.batch.stats["cross.groups"] == 2
        tb = to_torch(lb.batch)
        adv = tb.advantages.numpy()
        assert np.isfinite(adv).all() and np.isfinite(tb.teacher_topk_logprobs.numpy()).all()
        multi = [i for i, g in enumerate(tb.group_index.tolist()) if lb.batch.groups[g].group_id == "multi"]
        assert (adv[multi] != 0).any() and tb.distill_mask[multi].sum() > 0
        assert (tb.distill_mask <= tb.loss_mask).all()
        (h,) = [i for i, g in enumerate(tb.group_index.tolist()) if lb.batch.groups[g].group_id == "half"]
        at = len(half) - 3  # the row predicting the lone byte: the last chunk before </s>, with teacher signal
        assert int(tb.chunk_last[h, at]) == 1 and float(tb.teacher_sampled_logprobs[h, at]) < 0
        assert adv[h, at] != 0
        # the example learner trains on the batch unchanged: PG on the advantages, top-k KD over distill_mask
        import torch

        from pipeline.demo.learner import LearnerConfig, train_step
        from pipeline.models.weights import load_causal_lm

        student_model = load_causal_lm(tiny.student)
        opt = torch.optim.SGD(student_model.parameters(), lr=1e-3)
        fig = train_step(student_model, opt, lb.batch, LearnerConfig(student=str(tiny.student),
                                                                     weights_dir=str(tmp_path / "w")))
        assert np.isfinite([fig.loss, fig.pg, fig.kd]).all() and fig.kd > 0
        learner.ack(lb)
