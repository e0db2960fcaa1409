"""Chunked reverse-KL advantages for a teacher of another tokenizer (``pipeline.learner.crosstok``)."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from pipeline.learner.crosstok import chunk_ids, chunk_reverse_kl_advantages  # noqa: E402
from pipeline.learner.losses import reverse_kl_advantages  # noqa: E402

NAN = math.nan


def test_chunk_ids_count_chunks_from_their_last_positions() -> None:
    last = torch.tensor([[0, 1, 1, 0, 0, 1]], dtype=torch.bool)
    assert chunk_ids(last).tolist() == [[0, 0, 1, 2, 2, 2]]


def test_every_token_of_a_chunk_gets_the_chunks_advantage() -> None:
    s = torch.tensor([[-1.0, -2.0, -0.5, -0.25, -0.25, -3.0]])
    last = torch.tensor([[0, 1, 1, 0, 0, 1]], dtype=torch.bool)
    q = torch.tensor([[NAN, -2.5, -1.0, NAN, NAN, -4.0]])
    adv = chunk_reverse_kl_advantages(q, last, s, torch.ones_like(s), coef=2.0)
    # chunks: {0,1}: q -2.5, s -3.0 -> 2*0.5; {2}: -1 - -0.5 -> 2*-0.5; {3,4,5}: -4 - -3.5 -> 2*-0.5
    assert adv.tolist() == [[1.0, 1.0, -1.0, -1.0, -1.0, -1.0]]
    # summed over chunks (one reading per chunk, at its last position) it is the whole completion's q - s
    assert float(adv[last].sum()) / 2.0 == pytest.approx(float(q.nan_to_num().sum() - s.sum()))


def test_one_token_chunks_are_the_same_tokenizer_advantages() -> None:
    g = torch.Generator().manual_seed(0)
    s = -torch.rand(3, 7, generator=g)
    q = -torch.rand(3, 7, generator=g)
    mask = (torch.rand(3, 7, generator=g) > 0.3).float()
    ours = chunk_reverse_kl_advantages(q, torch.ones(3, 7, dtype=torch.bool), s, mask)
    assert torch.allclose(ours, reverse_kl_advantages(q, s, mask))


def test_a_chunk_without_teacher_signal_and_unmasked_positions_get_zero() -> None:
    s = torch.tensor([[-1.0, -1.0, -1.0]])
    last = torch.tensor([[1, 1, 1]], dtype=torch.bool)
    q = torch.tensor([[-2.0, NAN, -0.5]])
    adv = chunk_reverse_kl_advantages(q, last, s, torch.tensor([[1.0, 1.0, 0.0]]))
    assert adv.tolist() == [[-1.0, 0.0, 0.0]]
    with pytest.raises(ValueError, match="shape mismatch"):
        chunk_reverse_kl_advantages(q[:, :2], last, s, s)
