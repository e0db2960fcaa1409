"""The policy-gradient loss's default PPO clip keeps training on stale batches stable.

A synthetic on-policy distillation run at the pipeline's default staleness bound (3 policy versions): a tabular
student (16 contexts, 32 tokens) samples its batches from the policy of 3 steps back, the advantage is the
sampled-token reverse KL to a fixed teacher (``reverse_kl_advantages``), and plain SGD steps on
``importance_sampled_pg_loss``. Unclipped, the importance ratio weighs every token without limit, and the trained
policy runs away from the one that sampled its batch: the sampler-trainer KL reaches about 1 nat and the reverse
KL to the teacher stalls (0.5-1.1 nats after 60 steps, seeds 0-7). With the default clip (0.2) the
sampler-trainer KL stays within about 0.4 and the reverse KL falls below 0.1 (0.02-0.08).
"""

from __future__ import annotations

import inspect

import pytest
import torch

from pipeline.learner import chunked as C
from pipeline.learner import losses as L

STALENESS = 3  # the feeder's default --max-staleness, and the demos'


def run(clip: float | None, *, staleness: int = STALENESS, steps: int = 60, lr: float = 30.0,
        seed: int = 0) -> tuple[float, float, float]:
    """(largest sampler-trainer KL, the reverse KL to the teacher at the start, at the end), in nats."""
    g = torch.Generator().manual_seed(seed)
    contexts, vocab, batch = 16, 32, 64
    teacher = torch.log_softmax(torch.randn(contexts, vocab, generator=g) * 2.0, -1)
    theta = torch.zeros(contexts, vocab, requires_grad=True)
    opt = torch.optim.SGD([theta], lr=lr)
    versions = [theta.detach().clone()]
    drift = 0.0
    ones = torch.ones(1, batch)

    def reverse_kl(logits: torch.Tensor) -> float:
        lp = torch.log_softmax(logits, -1)
        return float((lp.exp() * (lp - teacher)).sum(-1).mean())

    start = reverse_kl(theta.detach())
    for _ in range(steps):
        sampler = torch.log_softmax(versions[max(0, len(versions) - 1 - staleness)], -1)
        ctx = torch.randint(0, contexts, (batch,), generator=g)
        tok = torch.multinomial(sampler[ctx].exp(), 1, generator=g).squeeze(1)
        old = sampler[ctx, tok]
        adv = L.reverse_kl_advantages(teacher[ctx, tok], old, torch.ones(batch))
        new = torch.log_softmax(theta, -1)[ctx, tok]
        if clip is None:
            loss = L.importance_sampled_pg_loss(new[None], old[None], adv[None], ones, None)
        else:
            loss = L.importance_sampled_pg_loss(new[None], old[None], adv[None], ones)  # the default clip
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        versions.append(theta.detach().clone())
        with torch.no_grad():
            cur = torch.log_softmax(theta, -1)
            drift = max(drift, float((cur.exp() * (cur - sampler)).sum(-1).mean()))  # KL(trainer || sampler)
    return drift, start, reverse_kl(theta.detach())


def test_the_default_clip_is_ppo_0_2_in_both_forms() -> None:
    assert L.DEFAULT_CLIP == 0.2
    for fn in (L.importance_sampled_pg_loss, C.importance_sampled_pg_loss):
        assert inspect.signature(fn).parameters["clip"].default == L.DEFAULT_CLIP


def test_clipped_stays_near_the_sampler_on_stale_batches_unclipped_runs_away() -> None:
    torch.set_num_threads(1)
    drift_raw, start, end_raw = run(None)
    drift_clip, start_clip, end_clip = run(0.2)
    print(f"staleness {STALENESS}: sampler-trainer KL max {drift_raw:.3f} unclipped, {drift_clip:.3f} clipped; "
          f"reverse KL {start:.3f} -> {end_raw:.3f} unclipped, -> {end_clip:.3f} clipped")
    assert start == start_clip
    # clipped: bounded drift from the sampler, and it distils
    assert drift_clip < 0.5
    assert end_clip < start / 10
    # unclipped: more than twice the drift, and far less learning from the same batches
    assert drift_raw > 2 * drift_clip
    assert end_raw > 4 * end_clip


def test_on_fresh_batches_the_clip_changes_little() -> None:
    """On-policy (staleness 0) with one step per batch every ratio is 1 when the gradient is taken: the clip
    changes nothing."""
    torch.set_num_threads(1)
    _, start, end_raw = run(None, staleness=0, steps=30, lr=10.0)
    _, _, end_clip = run(0.2, staleness=0, steps=30, lr=10.0)
    assert end_raw < start / 2 and end_clip < start / 2
    assert end_raw == pytest.approx(end_clip, rel=1e-4)
