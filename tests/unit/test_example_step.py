"""The example learner's step (``pipeline.demo.learner.train_step``) makes one pass over the lm_head for both of
its losses; its update and figures equal those of the two losses computed apart (``chunked.token_logprobs`` with
``importance_sampled_pg_loss``, and ``chunked.topk_forward_kl``), on a batch with a group the teacher dropped (its
rows train the policy gradient only)."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
import torch
from msgspec.structs import replace

from pipeline.demo.learner import LearnerConfig, train_step
from pipeline.learner import losses
from pipeline.learner.chunked import token_logprobs, topk_forward_kl
from pipeline.learner.torch_batch import to_torch
from schemas import DistillStatus, Sequence, TrainBatch
from schemas.arrays import Array
from schemas.build import synthetic_rollout, synthetic_scored

VOCAB = 64


def _student() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg)


def _batch(model: Any) -> TrainBatch:
    groups = [synthetic_scored(synthetic_rollout(2, 12, vocab=VOCAB, seed=i, group_id=f"g{i}"), 5, vocab=VOCAB,
                               seed=i) for i in range(3)]
    groups[1] = replace(groups[1], status=DistillStatus.DROPPED, teacher=None, reason="test")
    # the sampler's logprobs near the model's own, so that the PPO clip holds some tokens and not others
    seqs = [s for g in groups for s in g.group.sequences]
    with torch.no_grad():
        for g in groups:
            new: list[Sequence] = []
            for s in g.group.sequences:
                ids = torch.tensor(s.tokens.numpy(), dtype=torch.long)[None]
                lp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].double(), -1)
                own = lp.gather(-1, ids[0, 1:, None])[:, 0].numpy()
                noise = np.random.default_rng(len(new)).uniform(-0.3, 0.3, own.shape)
                new.append(replace(s, logprobs=Array.from_numpy(np.r_[0.0, own + noise].astype(np.float32))))
            g.group.sequences[:] = new
    adv = [Array.from_numpy(np.random.default_rng(i).normal(size=s.length).astype(np.float32))
           for i, s in enumerate(seqs)]
    return TrainBatch(batch_id="b", groups=groups, advantages=adv)


def _reference(model: Any, batch: TrainBatch, cfg: LearnerConfig) -> tuple[float, float, float]:
    """The two losses apart, each with its own pass over the head; the same clip and SGD update."""
    tb = to_torch(batch)
    h = model.get_decoder()(input_ids=tb.input_ids, attention_mask=tb.attention_mask.long()).last_hidden_state[:, :-1]
    w = model.get_output_embeddings().weight
    new = token_logprobs(h, w, tb.labels, tb.loss_mask)
    pg = losses.importance_sampled_pg_loss(new, tb.student_logprobs, tb.advantages, tb.loss_mask, cfg.clip)
    kd = topk_forward_kl(h, w, tb.teacher_topk_ids, tb.teacher_topk_logprobs, tb.distill_mask, mode="tail")
    loss = cfg.pg_weight * pg + cfg.kd_weight * kd
    loss.backward()  # type: ignore[no-untyped-call]
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with torch.no_grad():
        for p in model.parameters():
            assert p.grad is not None
            p.sub_(0.1 * p.grad)
    return float(loss.detach()), float(pg.detach()), float(kd.detach())


@pytest.mark.parametrize("pg_weight", [0.0, 1.0])
def test_one_head_pass_equals_the_two_losses_apart(pg_weight: float) -> None:
    model = _student()
    batch = _batch(model)
    tb = to_torch(batch)
    assert (tb.distill_mask.sum() > 0) and bool((tb.loss_mask > tb.distill_mask).any())  # the dropped group's rows
    cfg = LearnerConfig(student="unused", weights_dir="unused", pg_weight=pg_weight)
    ref_model = copy.deepcopy(model)
    fig = train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), batch, cfg)
    loss, pg, kd = _reference(ref_model, batch, cfg)
    assert fig.loss == pytest.approx(loss, rel=1e-5) and fig.pg == pytest.approx(pg, rel=1e-5, abs=1e-7)
    assert fig.kd == pytest.approx(kd, rel=1e-5) and kd > 0
    start, moved = _student().state_dict(), 0.0
    for (name, a), b in zip(model.named_parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=name)
        moved = max(moved, float((a.detach() - start[name]).abs().max()))
    assert moved > 1e-4  # the update moved the weights: the comparison is not of two untouched models
