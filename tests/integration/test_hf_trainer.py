"""A transformers Trainer on the pipeline's batches (``pipeline.learner.hf_trainer``), against a real
redis-server: each batch trains one optimiser step and is acknowledged right after that step."""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from pipeline.learner.client import Learner
from pipeline.learner.data import ENTRY, LearnerDataset
from pipeline.transport.keys import Keys
from tests.integration.test_feeder import payload_keys
from tests.integration.test_learner_delivery import feed, push
from tests.streams import fast

pytestmark = [pytest.mark.redis, pytest.mark.timeout(180)]
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def tiny_llama() -> Any:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=1000, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg)


async def test_trainer_subclass_acks_each_batch_after_its_optimiser_step(
    r: aioredis.Redis, keys: Keys, redis_url: str, tmp_path: Path
) -> None:
    from pipeline.learner.hf_trainer import DistillTrainer
    from pipeline.learner.losses import importance_sampled_pg_loss, token_logprobs, topk_forward_kl

    await push(r, keys, [0] * 8)
    await feed(r, keys, max_batch_groups=2, max_staleness=None)
    model = tiny_llama()
    initial = copy.deepcopy(model)
    events: list[tuple[str, Any]] = []

    class Probe(DistillTrainer):
        def compute_loss(self, model: Any, inputs: dict[str, Any], return_outputs: bool = False,
                         num_items_in_batch: Any = None) -> Any:
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            events.append(("loss", (inputs[ENTRY], float(loss.detach()), self.state.global_step, inputs)))
            return loss

    def train() -> Any:
        with Learner(redis_url, namespace=keys.namespace, settings=fast()) as learner:
            dataset = LearnerDataset(learner, timeout_s=3)
            real_ack = learner.ack

            def ack(lb: Any) -> bool:
                events.append(("ack", (lb.entry_id, trainer.state.global_step)))
                return real_ack(lb)

            learner.ack = ack  # type: ignore[method-assign]
            args = transformers.TrainingArguments(
                output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=1, learning_rate=1e-3,
                report_to=[], logging_steps=1, save_strategy="no", use_cpu=True, disable_tqdm=True)
            trainer = Probe(model=model, args=args, dataset=dataset)
            out = trainer.train()
            return out, dataset.held

    out, held = await asyncio.to_thread(train)
    assert out.global_step == 4 and held == 0
    losses = [v for k, v in events if k == "loss"]
    acks = [v for k, v in events if k == "ack"]
    # Batch k is trained in step k (global_step k - 1 during its forward) and acked once that step ran.
    assert [(e, s) for e, _, s, _ in losses] == [(e, k) for k, (e, _) in enumerate(acks)]
    assert [s for _, s in acks] == [1, 2, 3, 4]
    assert len({e for e, _ in acks}) == 4
    # The first step's loss is the documented loss of the initial model on that batch.
    inputs = losses[0][3]
    logits = initial(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"].long()).logits[:, :-1]
    pg = importance_sampled_pg_loss(token_logprobs(logits, inputs["labels"]), inputs["student_logprobs"],
                                    inputs["advantages"], inputs["loss_mask"], clip=0.2)
    kd = topk_forward_kl(logits, inputs["teacher_topk_ids"], inputs["teacher_topk_logprobs"],
                         inputs["distill_mask"], mode="tail")
    assert abs(losses[0][1] - float((pg + kd).detach())) < 1e-5
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), initial.parameters(), strict=True))
    assert await r.xlen(keys.stream("batches")) == 0 and await payload_keys(r, keys) == []
