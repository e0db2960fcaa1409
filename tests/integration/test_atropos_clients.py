"""atroposlib 0.4.0's own clients against ``distillq serve atropos``, with a real teacher worker in between.

An unmodified ``BaseEnv`` subclass (no LLM: it builds its groups with a local tokenizer, the tiny one the
repo trains) posts groups through its own ``env_manager`` loop; the Atropos example trainer's ``register_trainer``,
``get_batch`` and ``get_data`` (imported from the wheel's ``example_trainer`` package) fetch the batches;
``distillq worker teacher --backend hf`` scores them with the tiny teacher model in between, so the batches
carry ``distill_token_ids``/``distill_logprobs``, checked against an independent forward pass.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pipeline.config import RedisSettings
from pipeline.demo.tinymodels import TinyModels, ensure_tiny_models
from pipeline.models.weights import load_causal_lm
from pipeline.serve.atropos.app import create_app
from pipeline.serve.atropos.startup import ServeConfig
from pipeline.transport.keys import Keys
from schemas.atropos import ATROPOS_KEYS
from tests.integration.test_serve_atropos import FAST, ThreadedServer

atroposlib = pytest.importorskip("atroposlib", reason="atroposlib 0.4.0 not installed: pip install atroposlib==0.4.0")

pytestmark = pytest.mark.redis
ROOT = Path(__file__).resolve().parents[2]
K = 4
ITEMS = 4  # groups the env makes (2 sequences each): two batches of 4 sequences


@pytest.fixture(scope="module")
def tiny() -> TinyModels:
    return ensure_tiny_models()


class TeacherProc:
    """``distillq worker teacher --backend hf`` with the tiny teacher, as a process ended by its pid."""

    def __init__(self, redis_url: str, namespace: str, tiny: TinyModels, log: Path) -> None:
        self.argv = [sys.executable, "-m", "pipeline.cli.main", "worker", "teacher", "--backend", "hf", "--model",
                     str(tiny.teacher), "--student-tokenizer", str(tiny.tokenizer), "--top-k", str(K),
                     "--redis-url", redis_url, "--namespace", namespace]
        self.log = log

    def __enter__(self) -> TeacherProc:
        env = {**os.environ, "DISTILLQ_BLOCK_MS": "100", "DISTILLQ_SHUTDOWN_GRACE_S": "2"}
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def make_env(url: str, tokenizer: Path) -> Any:
    """A minimal, unmodified-API BaseEnv subclass: no inference server, groups built with the tokenizer alone."""
    from atroposlib.envs.base import APIServerConfig, BaseEnv, BaseEnvConfig, ScoredDataGroup

    class HandMadeEnv(BaseEnv):  # type: ignore[misc]
        name = "handmade"

        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **kw)
            self.i = 0
            self.sent: list[dict[str, Any]] = []

        async def setup(self) -> None:
            pass

        async def evaluate(self, *args: Any, **kwargs: Any) -> None:
            pass

        async def get_next_item(self) -> dict[str, str] | None:
            if self.i >= ITEMS:
                return None
            self.i += 1
            return {"question": f"{self.i}+{self.i}="}

        async def collect_trajectories(self, item: dict[str, str]) -> tuple[Any, list[Any]]:
            prompt = self.tokenizer.apply_chat_template([{"role": "user", "content": item["question"]}],
                                                        add_generation_prompt=True, tokenize=False)
            p_ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
            group = ScoredDataGroup(tokens=[], masks=[], scores=[], inference_logprobs=[], overrides=[])
            for text, score in (("4", 1.0), ("5", -1.0)):
                c_ids = self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
                group["tokens"].append(p_ids + c_ids)
                group["masks"].append([-100] * len(p_ids) + c_ids)  # the token id where trained
                group["scores"].append(score)
                group["inference_logprobs"].append([1.0] * len(p_ids) + [-0.1] * len(c_ids))
                group["overrides"].append({})
            group["generation_params"] = {"temperature": 1.0}
            return group, []

        def _post_json_with_compression(self, client: Any, url: str, payload: Any, *, minimum_size: int = 1024) -> Any:
            self.sent.extend(payload if isinstance(payload, list) else [payload])  # what BaseEnv puts on the wire
            return super()._post_json_with_compression(client, url, payload, minimum_size=minimum_size)

    cfg = BaseEnvConfig(group_size=2, tokenizer_name=str(tokenizer), rollout_server_url=url, use_wandb=False,
                        wandb_name="handmade", max_token_length=512, total_steps=10, steps_per_eval=0,
                        max_num_workers=2, ensure_scores_are_not_same=True)
    server = APIServerConfig(base_url="http://127.0.0.1:1/v1", model_name="none", api_key="x", health_check=False)
    return HandMadeEnv(cfg, [server])


def check_against_teacher(item: dict[str, Any], model: Any) -> None:
    """Every trained position: the actual token first, its logprob the teacher's, the rest its top k."""
    import torch

    for s, tok in enumerate(item["tokens"]):
        ids, lps = item["distill_token_ids"][s], item["distill_logprobs"][s]
        assert len(ids) == len(tok) and ids[0] == []
        with torch.inference_mode():
            ref = torch.log_softmax(model(torch.tensor([tok])).logits[0].float(), -1).numpy()
        for p in range(1, len(tok)):
            if item["masks"][s][p] == -100:
                assert ids[p] == [] and lps[p] == []  # no teacher row where nothing is trained
                continue
            assert ids[p][0] == tok[p] and len(ids[p]) in (K, K + 1)
            np.testing.assert_allclose(lps[p], ref[p - 1][ids[p]], atol=1e-4)  # row p - 1 predicts token p
            top = set(np.argsort(-ref[p - 1])[:K].tolist())
            assert set(ids[p]) - {tok[p]} <= top


@pytest.mark.slow
async def test_base_env_and_example_trainer_through_the_server_and_a_teacher(
    redis_url: str, keys: Keys, tiny: TinyModels, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import example_trainer.data as trainer_data
    from example_trainer.api import get_batch, register_trainer
    from example_trainer.config import TrainingConfig

    cfg = ServeConfig(redis=RedisSettings(redis_url=redis_url, namespace=keys.namespace), streams=FAST)
    with ThreadedServer(create_app(cfg)) as server, TeacherProc(redis_url, keys.namespace, tiny, tmp_path / "t.log"):
        url = server.url
        tc = TrainingConfig(model_name="tiny", atropos_url=url, batch_size=2, gradient_accumulation_steps=2,
                            seq_len=512, training_steps=10, save_path=str(tmp_path / "ckpt"))
        await asyncio.to_thread(register_trainer, tc)  # batch_size 2 x 2 = 4 sequences
        assert (await asyncio.to_thread(get_batch, url))["batch"] is None  # lets environments register
        env = make_env(url, tiny.tokenizer)
        task = asyncio.create_task(env.env_manager())
        raw: list[dict[str, Any]] = []

        def recording_get_batch(url: str = url) -> Any:
            data = get_batch(url)
            if data["batch"] is not None:
                raw.append(json.loads(json.dumps(data)))
            return data

        monkeypatch.setattr(trainer_data, "get_batch", recording_get_batch)
        try:
            trained: list[Any] = []
            deadline = time.monotonic() + 90
            while len(raw) < ITEMS // 2:  # the trainer's own loop: wait for data, drain it, train on it
                assert time.monotonic() < deadline and not task.done(), "no batches"
                got, _ = await asyncio.to_thread(trainer_data.get_data, 2, 512, url)
                trained += got
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    assert env.env_id == 0 and len(env.sent) == ITEMS
    sent = {json.dumps(g["tokens"]): g for g in env.sent}
    model = load_causal_lm(tiny.teacher)
    for data in raw:
        assert sum(len(item["tokens"]) for item in data["batch"]) == 4
        for item in data["batch"]:
            assert tuple(item) == (*ATROPOS_KEYS, "teacher")  # the reference's keys in its order, and who scored it
            assert item["teacher"]["pool"] == "default"
            posted = sent[json.dumps(item["tokens"])]
            for key in ("masks", "scores", "inference_logprobs", "overrides", "generation_params", "env_id"):
                assert item[key] == posted[key], key
            check_against_teacher(item, model)
    tokens, labels = trained[0][0], trained[0][1]  # the example trainer's tensors: 2 batches of 2 sequences
    assert len(tokens) == 2 and tokens[0].shape[0] == 2 and labels[0].shape == tokens[0].shape
