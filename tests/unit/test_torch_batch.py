"""TrainBatch -> TorchBatch: padding, next-token alignment, mixed k, groups without a teacher payload."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import msgspec
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import schemas  # noqa: E402
from pipeline.learner import losses as L  # noqa: E402
from pipeline.learner.torch_batch import PAD_LOGPROB, TorchBatch, to_torch  # noqa: E402
from schemas.build import make_sequence, synthetic_rollout, synthetic_scored, synthetic_teacher  # noqa: E402

VOCAB = 1000


def _batch() -> schemas.TrainBatch:
    """Five groups: k=5, k=3 in float16, skipped, dropped, and one without student logprobs (k=2)."""
    g0 = synthetic_scored(synthetic_rollout(3, [10, 7, 13], vocab=VOCAB, prompt_len=3, seed=1), 5, seed=10)
    r1 = synthetic_rollout(2, [6, 9], vocab=VOCAB, prompt_len=2, seed=2)
    g1 = schemas.ScoredGroup(
        group=r1,
        status=schemas.DistillStatus.OK,
        teacher=[synthetic_teacher(s, 3, vocab=VOCAB, seed=20 + i, fp16=True) for i, s in enumerate(r1.sequences)],
        k=3,
    )
    g2 = schemas.ScoredGroup(
        group=synthetic_rollout(1, 4, vocab=VOCAB, prompt_len=1, seed=3),
        status=schemas.DistillStatus.SKIPPED,
    )
    g3 = schemas.ScoredGroup(
        group=synthetic_rollout(1, 8, vocab=VOCAB, prompt_len=2, seed=4),
        status=schemas.DistillStatus.DROPPED,
        reason="misaligned",
    )
    tok = np.arange(1, 12, dtype=np.int32)
    r4 = schemas.RolloutGroup(group_id="nolp", sequences=[make_sequence(tok, (np.arange(11) >= 5).astype(np.uint8))])
    g4 = synthetic_scored(r4, 2, seed=30)
    groups = [g0, g1, g2, g3, g4]
    rng = np.random.default_rng(0)
    seqs = [s for g in groups for s in g.group.sequences]
    adv = [schemas.Array.from_numpy(rng.normal(size=s.length).astype(np.float32)) for s in seqs]
    batch = schemas.TrainBatch(batch_id="b1", groups=groups, advantages=adv)
    # Through the wire, so every array is a read-only view into the message bytes.
    return schemas.decode(schemas.encode(batch), expect=schemas.TrainBatch)


@pytest.fixture(scope="module")
def batch() -> schemas.TrainBatch:
    return _batch()


@pytest.fixture(scope="module")
def tb(batch: schemas.TrainBatch) -> TorchBatch:
    return to_torch(batch, pad_id=7)


def test_shapes_and_dtypes(tb: TorchBatch) -> None:
    b, t, k = 8, 13, 5
    assert tb.num_sequences == b
    expected = {
        "input_ids": ((b, t), torch.int64),
        "attention_mask": ((b, t), torch.bool),
        "labels": ((b, t - 1), torch.int64),
        "loss_mask": ((b, t - 1), torch.float32),
        "student_logprobs": ((b, t - 1), torch.float32),
        "advantages": ((b, t - 1), torch.float32),
        "teacher_topk_ids": ((b, t - 1, k), torch.int64),
        "teacher_topk_logprobs": ((b, t - 1, k), torch.float32),
        "teacher_sampled_logprobs": ((b, t - 1), torch.float32),
        "chunk_last": ((b, t - 1), torch.uint8),
        "distill_mask": ((b, t - 1), torch.float32),
        "group_index": ((b,), torch.int64),
        "seq_lengths": ((b,), torch.int64),
    }
    for name, (shape, dtype) in expected.items():
        x = getattr(tb, name)
        assert (tuple(x.shape), x.dtype) == (shape, dtype), name
    assert tb.group_index.tolist() == [0, 0, 0, 1, 1, 2, 3, 4]
    assert tb.seq_lengths.tolist() == [10, 7, 13, 6, 9, 4, 8, 11]


def test_every_field_is_next_token_aligned(batch: schemas.TrainBatch, tb: TorchBatch) -> None:
    i = 0
    for g in batch.groups:
        for j, seq in enumerate(g.group.sequences):
            n = seq.length
            tok = seq.tokens.numpy().astype(np.int64)
            assert tb.input_ids[i, :n].numpy().tolist() == tok.tolist()
            assert (tb.input_ids[i, n:] == 7).all() and (tb.labels[i, n - 1 :] == 7).all()
            assert tb.attention_mask[i].sum().item() == n and tb.attention_mask[i, :n].all()
            assert np.array_equal(tb.labels[i, : n - 1].numpy(), tok[1:])
            mask = seq.loss_mask.numpy()[1:].astype(np.float32)
            assert np.array_equal(tb.loss_mask[i, : n - 1].numpy(), mask)
            assert (tb.loss_mask[i, n - 1 :] == 0).all()
            lp = seq.logprobs.numpy()[1:] if seq.logprobs is not None else np.zeros(n - 1, np.float32)
            assert np.array_equal(tb.student_logprobs[i, : n - 1].numpy(), lp)
            assert np.array_equal(tb.advantages[i, : n - 1].numpy(), batch.advantages[i].numpy()[1:])
            if g.teacher is None:
                assert (tb.distill_mask[i] == 0).all() and (tb.chunk_last[i] == 0).all()
                assert (tb.teacher_topk_logprobs[i] == PAD_LOGPROB).all()
            else:
                p = g.teacher[j]
                rows = p.row_index(n).copy()  # the trained rows only (the payloads are made that way)
                assert p.rows is not None and np.array_equal(rows, np.flatnonzero(mask))
                assert np.array_equal(tb.distill_mask[i, : n - 1].numpy(), mask)
                assert np.array_equal(tb.teacher_topk_ids[i, rows, : p.k].numpy(), p.topk_ids.numpy())
                assert np.array_equal(
                    tb.teacher_topk_logprobs[i, rows, : p.k].numpy(), p.topk_logprobs.numpy().astype(np.float32)
                )
                assert np.array_equal(tb.teacher_sampled_logprobs[i, rows].numpy(), p.sampled_logprobs.numpy())
                untrained = np.setdiff1d(np.arange(tb.labels.shape[1]), rows)  # rows without a teacher row
                assert (tb.teacher_topk_logprobs[i, untrained] == PAD_LOGPROB).all()
                assert (tb.teacher_topk_ids[i, untrained] == 0).all()
                assert (tb.teacher_sampled_logprobs[i, untrained] == 0).all()
                # one tokenizer: every held row is a chunk of its own, the rest (untrained, padding) 0
                assert (tb.chunk_last[i, rows] == 1).all() and (tb.chunk_last[i, untrained] == 0).all()
                # Slots past this group's k and rows past the sequence are empty.
                assert (tb.teacher_topk_logprobs[i, :, p.k :] == PAD_LOGPROB).all()
                assert (tb.teacher_topk_ids[i, :, p.k :] == 0).all()
                assert (tb.teacher_topk_logprobs[i, n - 1 :] == PAD_LOGPROB).all()
            i += 1
    assert (tb.distill_mask <= tb.loss_mask).all()


def test_all_rows_payloads_give_the_same_tensors_at_every_trained_position(batch: schemas.TrainBatch) -> None:
    """A schema 1 payload (every row) and a trained-rows payload of the same teacher agree where it trains."""
    dense_groups = [
        msgspec.structs.replace(g, teacher=[synthetic_teacher(s, t.k, vocab=VOCAB, seed=0, all_rows=True)
                                            for s, t in zip(g.group.sequences, g.teacher, strict=True)])
        if g.teacher is not None else g
        for g in batch.groups
    ]
    sparse_groups = [
        msgspec.structs.replace(g, teacher=[synthetic_teacher(s, t.k, vocab=VOCAB, seed=0)
                                            for s, t in zip(g.group.sequences, g.teacher, strict=True)])
        if g.teacher is not None else g
        for g in batch.groups
    ]
    dense = to_torch(msgspec.structs.replace(batch, groups=dense_groups))
    sparse = to_torch(msgspec.structs.replace(batch, groups=sparse_groups))
    at = sparse.distill_mask.bool()
    assert torch.equal(dense.distill_mask, sparse.distill_mask) and at.any()
    # synthetic_teacher draws the same values for a trained row whichever layout it makes only when the
    # rows coincide; compare what the losses read: ids present and logprobs sorted at every trained row.
    assert (sparse.teacher_topk_logprobs[at][:, 0] > PAD_LOGPROB / 2).all()
    assert (sparse.teacher_topk_logprobs[~at] == PAD_LOGPROB).all()


@pytest.mark.parametrize(("topk_dtype", "index_dtype"), [(torch.bfloat16, torch.int32), (torch.float32, torch.int32)])
def test_half_precision_topk_and_int32_ids(batch: schemas.TrainBatch, tb: TorchBatch, topk_dtype: torch.dtype,
                                           index_dtype: torch.dtype) -> None:
    half = to_torch(batch, pad_id=7, topk_dtype=topk_dtype, index_dtype=index_dtype)
    assert half.teacher_topk_logprobs.dtype == topk_dtype and half.teacher_topk_ids.dtype == index_dtype
    assert torch.equal(half.teacher_topk_ids.long(), tb.teacher_topk_ids)
    full = tb.teacher_topk_logprobs
    filled = full > PAD_LOGPROB / 2
    err = (half.teacher_topk_logprobs.float()[filled] - full[filled]).abs()
    rel = 2.0 ** -8 if topk_dtype == torch.bfloat16 else 0.0
    assert (err <= rel * full[filled].abs() + 1e-6).all()
    assert (half.teacher_topk_logprobs.float()[~filled] <= PAD_LOGPROB / 2).all()  # empty slots stay empty
    with pytest.raises(ValueError, match="topk_dtype"):
        to_torch(batch, topk_dtype=torch.float16)


def test_losses_on_padded_mixed_k_batch_are_finite(tb: TorchBatch) -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(*tb.labels.shape, VOCAB, generator=gen).requires_grad_(True)
    m = tb.distill_mask
    ids, lps = tb.teacher_topk_ids, tb.teacher_topk_logprobs
    parts = [L.topk_forward_kl(logits, ids, lps, m, mode) for mode in ("unnormalized", "renormalized", "tail")]
    parts += [L.generalized_jsd(logits, ids, lps, m, beta) for beta in (0.0, 0.5, 1.0)]
    adv = L.reverse_kl_advantages(tb.teacher_sampled_logprobs, tb.student_logprobs, m, coef=0.1)
    new = L.token_logprobs(logits, tb.labels)
    parts.append(L.importance_sampled_pg_loss(new, tb.student_logprobs, adv + tb.advantages, tb.loss_mask, 0.2))
    total = torch.stack(parts).sum()
    total.backward()
    assert all(torch.isfinite(p) and p.item() != 0 for p in parts)
    assert logits.grad is not None and torch.isfinite(logits.grad).all()
    assert (logits.grad[tb.loss_mask == 0] == 0).all()


def test_chunk_sums_over_one_tokenizer_rows_are_the_per_token_figures(tb: TorchBatch) -> None:
    """``chunk_last`` of a same-tokenizer batch makes every held row its own chunk: the chunk advantages are the
    per-token reverse-KL advantages, and the chunk of each trained position is that position alone."""
    from pipeline.learner.crosstok import chunk_ids, chunk_reverse_kl_advantages

    m = tb.distill_mask
    per_chunk = chunk_reverse_kl_advantages(tb.teacher_sampled_logprobs, tb.chunk_last, tb.student_logprobs, m, 0.3)
    per_token = L.reverse_kl_advantages(tb.teacher_sampled_logprobs, tb.student_logprobs, m, coef=0.3)
    assert torch.allclose(per_chunk, per_token, atol=1e-6) and (per_token != 0).any()
    ids = chunk_ids(tb.chunk_last)
    at = m.bool()
    counts = torch.zeros_like(ids).scatter_add_(1, ids, at.long())
    assert (counts.gather(1, ids)[at] == 1).all()


def test_device_argument_and_to(batch: schemas.TrainBatch) -> None:
    tb = to_torch(batch, device=torch.device("cpu"))
    moved = tb.to("cpu")
    for f in dataclasses.fields(TorchBatch):
        assert getattr(moved, f.name).device.type == "cpu"
        assert torch.equal(getattr(moved, f.name), getattr(tb, f.name))
    with pytest.raises(dataclasses.FrozenInstanceError):
        tb.labels = tb.labels  # type: ignore[misc]


def test_tensors_are_writable_copies(batch: schemas.TrainBatch) -> None:
    tb = to_torch(batch)
    tb.teacher_topk_logprobs.zero_()  # would fail (or corrupt the message) if it aliased read-only bytes
    assert batch.groups[0].teacher is not None
    assert (batch.groups[0].teacher[0].topk_logprobs.numpy() < 0).all()


def test_single_token_sequences_give_empty_time_axis() -> None:
    seq = make_sequence(np.array([5], np.int32), np.zeros(1, np.uint8))
    group = schemas.ScoredGroup(
        group=schemas.RolloutGroup(group_id="one", sequences=[seq]), status=schemas.DistillStatus.SKIPPED
    )
    adv = [schemas.Array.from_numpy(np.zeros(1, np.float32))]
    tb = to_torch(schemas.TrainBatch(batch_id="x", groups=[group], advantages=adv))
    assert tb.input_ids.shape == (1, 1) and tb.labels.shape == (1, 0) and tb.teacher_topk_ids.shape == (1, 0, 1)


def test_malformed_batches_raise(batch: schemas.TrainBatch) -> None:
    with pytest.raises(ValueError, match="no sequences"):
        to_torch(schemas.TrainBatch(batch_id="e", groups=[], advantages=[]))
    with pytest.raises(ValueError, match="advantage arrays"):
        to_torch(schemas.TrainBatch(batch_id="e", groups=batch.groups, advantages=batch.advantages[:-1]))
    bad = [*batch.advantages[:-1], schemas.Array.from_numpy(np.zeros(3, np.float32))]
    with pytest.raises(ValueError, match="advantages"):
        to_torch(schemas.TrainBatch(batch_id="e", groups=batch.groups, advantages=bad))


def test_kl_control_and_schemas_do_not_need_torch() -> None:
    code = "import sys; sys.modules['torch'] = None; import pipeline.stages.kl_control, schemas; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
