"""``DistillTrainer(publish_dir=...)`` against a real redis-server: after each optimiser step the batch is
acknowledged, then the weights are published as the next policy version, in that order, whatever callbacks
the user adds; the published folder holds the weights of that step."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from pipeline.learner.client import Learner
from pipeline.learner.data import LearnerDataset
from pipeline.transport.keys import Keys
from tests.integration.test_feeder import payload_keys
from tests.integration.test_hf_trainer import tiny_llama
from tests.integration.test_learner_delivery import feed, push
from tests.streams import fast

pytestmark = [pytest.mark.redis, pytest.mark.timeout(180)]
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


async def test_trainer_publishes_each_step_after_its_ack(
    r: aioredis.Redis, keys: Keys, redis_url: str, tmp_path: Path
) -> None:
    from pipeline.learner.hf_trainer import DistillTrainer
    from pipeline.models.weights import load_weights, published_versions

    await push(r, keys, [0] * 6)
    await feed(r, keys, max_batch_groups=2, max_staleness=None)
    await r.set(keys.policy_version, 5)
    model = tiny_llama()
    events: list[tuple[str, int]] = []
    snapshots: dict[int, dict[str, Any]] = {}

    from transformers import TrainerCallback

    class UserCallback(TrainerCallback):  # runs before the library's callback
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            events.append(("user_callback", state.global_step))

    def train() -> Any:
        with Learner(redis_url, namespace=keys.namespace, settings=fast()) as learner:
            real_ack, real_publish = learner.ack, learner.publish_policy_version

            def ack(lb: Any) -> bool:
                events.append(("ack", trainer.state.global_step))
                return real_ack(lb)

            def publish(v: int) -> None:
                events.append(("publish", v))
                snapshots[v] = {k: t.detach().clone() for k, t in model.state_dict().items()}
                real_publish(v)

            learner.ack = ack  # type: ignore[method-assign,assignment]
            learner.publish_policy_version = publish  # type: ignore[method-assign,assignment]
            args = transformers.TrainingArguments(
                output_dir=str(tmp_path / "out"), max_steps=3, per_device_train_batch_size=1, learning_rate=1e-3,
                report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True)
            trainer = DistillTrainer(model=model, args=args, dataset=LearnerDataset(learner, timeout_s=3),
                                     callbacks=[UserCallback()], publish_dir=tmp_path / "weights", publish_keep=10)
            return trainer.train()

    out = await asyncio.to_thread(train)
    assert out.global_step == 3
    lib = [e for e in events if e[0] != "user_callback"]
    assert lib == [("ack", 1), ("publish", 6), ("ack", 2), ("publish", 7), ("ack", 3), ("publish", 8)]
    assert int(await r.get(keys.policy_version)) == 8
    assert published_versions(tmp_path / "weights") == [6, 7, 8]
    loaded = tiny_llama()
    assert load_weights(loaded, tmp_path / "weights") == 8
    for k, v in loaded.state_dict().items():
        torch.testing.assert_close(v, snapshots[8][k], rtol=0, atol=0)
    assert any(not torch.equal(snapshots[6][k], snapshots[8][k]) for k in snapshots[6])
    assert await r.xlen(keys.stream("batches")) == 0 and await payload_keys(r, keys) == []
