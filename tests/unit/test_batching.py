"""Feeder stage logic without Redis."""

from __future__ import annotations

import time

import msgspec
import numpy as np
import pytest

from pipeline.stages.batching import (
    BatchingConfig,
    Pending,
    admit,
    build_batch,
    materialize,
    sequence_advantages,
    take_batch,
)
from pipeline.transport.claimcheck import decode_header, encode_header, group_kl, header_of
from schemas import BatchManifest, DecodeError, DistillStatus, GroupHeader, ScoredGroup, decode, encode
from schemas.build import synthetic_rollout, synthetic_scored


def scored(gid: str, lens: list[int], version: int = 0, status: DistillStatus = DistillStatus.OK) -> ScoredGroup:
    g = synthetic_rollout(len(lens), lens, group_id=gid, policy_version=version, seed=hash(gid) % 1000)
    if status is DistillStatus.OK:
        return synthetic_scored(g, k=4)
    return ScoredGroup(group=g, status=status, reason="teacher_error: x" if status is DistillStatus.DROPPED else None)


def header(gid: str, lens: list[int], **kw: object) -> GroupHeader:
    return header_of(scored(gid, lens, **kw))  # type: ignore[arg-type]


def pending(gid: str, lens: list[int], **kw: object) -> Pending:
    return Pending(f"0-{gid}", header(gid, lens, **kw), f"k:{gid}")


def test_staleness_and_missing_distill_rules() -> None:
    cfg = BatchingConfig(max_staleness=2)
    assert admit(header("a", [8], version=3), 5, cfg) is None
    assert admit(header("b", [8], version=2), 5, cfg) == "stale"
    assert admit(header("c", [8], status=DistillStatus.DROPPED), 0, cfg) is None  # default keep
    drop = BatchingConfig(missing_distill="drop")
    assert admit(header("d", [8], status=DistillStatus.SKIPPED), 0, drop) == "no_distill_skipped"


def test_token_budget_packs_whole_groups_oldest_first() -> None:
    cfg = BatchingConfig(max_batch_tokens=100, max_wait_s=3600)
    buf = [pending("g0", [30, 30]), pending("g1", [20, 10]), pending("g2", [50]), pending("g3", [10])]
    first = take_batch(buf, cfg)
    assert first is not None and [p.group_id for p in first] == ["g0", "g1"]  # 90; +50 would overflow
    assert sum(p.tokens for p in first) <= 100
    second = take_batch(buf, cfg)
    assert second is None  # g2+g3 = 60 tokens, budget not reached, not waited long enough
    flushed = take_batch(buf, cfg, flush=True)
    assert flushed is not None and [p.group_id for p in flushed] == ["g2", "g3"]
    assert buf == []


def test_oversized_group_forms_its_own_batch_and_group_count_limit() -> None:
    cfg = BatchingConfig(max_batch_tokens=50, max_wait_s=3600)
    buf = [pending("big", [80]), pending("small", [5])]
    got = take_batch(buf, cfg)
    assert got is not None and [p.group_id for p in got] == ["big"]
    cfg2 = BatchingConfig(max_batch_tokens=10_000, max_batch_groups=2, max_wait_s=3600)
    buf = [pending(f"g{i}", [5]) for i in range(5)]
    got2 = take_batch(buf, cfg2)
    assert got2 is not None and [p.group_id for p in got2] == ["g0", "g1"]


def test_max_wait_flushes_partial_batch() -> None:
    cfg = BatchingConfig(max_batch_tokens=1000, max_wait_s=0.05)
    buf = [pending("g0", [10])]
    assert take_batch(buf, cfg) is None
    buf[0].arrived = time.monotonic() - 1
    assert take_batch(buf, cfg) is not None


def test_length_bucketing_reduces_padding() -> None:
    lens = [[100], [10], [100], [10], [100], [10]]
    make = lambda: [pending(f"g{i}", ln) for i, ln in enumerate(lens)]  # noqa: E731
    plain = take_batch(make(), BatchingConfig(max_batch_tokens=1000, max_batch_groups=3, token_count="padded"))
    bucketed = take_batch(make(), BatchingConfig(max_batch_tokens=1000, max_batch_groups=3, token_count="padded",
                                                 length_bucketing=True))
    assert plain is not None and bucketed is not None
    assert [p.group_id for p in bucketed] == ["g0", "g2", "g4"]  # oldest, then similar lengths
    assert [p.group_id for p in plain] == ["g0", "g1", "g2"]


def test_advantages_are_reverse_kl_on_trainable_positions() -> None:
    g = scored("a", [12, 9])
    advs = sequence_advantages(g, kl_coef=0.5, reward_weight=0.0)
    kl_sum, kl_n = group_kl(g)
    for i, seq in enumerate(g.group.sequences):
        mask = seq.loss_mask.numpy().astype(bool)
        q = g.teacher[i].dense_sampled(seq.length)  # type: ignore[index]
        s = seq.logprobs.numpy()  # type: ignore[union-attr]
        expected = np.zeros(seq.length, np.float32)
        for p in range(1, seq.length):
            if mask[p]:
                expected[p] = 0.5 * (q[p - 1] - s[p])
        np.testing.assert_allclose(advs[i], expected, rtol=1e-6, atol=1e-6)
        assert (advs[i][~mask] == 0).all()
    assert kl_n == sum(int(s.loss_mask.numpy()[1:].sum()) for s in g.group.sequences)
    # The header's KL sum is exactly -sum(advantage / coef) over the trainable positions.
    assert kl_sum == pytest.approx(-sum(float(a.sum(dtype=np.float64)) for a in advs) / 0.5, rel=1e-5)


def test_reward_term_only_without_teacher_and_manifest_roundtrip() -> None:
    g = scored("d", [10, 10, 10], status=DistillStatus.DROPPED)
    advs = sequence_advantages(g, kl_coef=1.0, reward_weight=1.0)
    assert header_of(g).kl_tokens == 0
    scores = np.array([s.score for s in g.group.sequences])
    z = (scores - scores.mean()) / (scores.std() + 1e-6)
    for a, zi, s in zip(advs, z, g.group.sequences, strict=True):
        mask = s.loss_mask.numpy().astype(bool)
        np.testing.assert_allclose(a[mask], zi, rtol=1e-5)
    ok = scored("ok", [7, 9])
    cfg = BatchingConfig(reward_weight=1.0)
    built = build_batch([Pending("1-0", header_of(g), "k:d"), Pending("1-1", header_of(ok), "k:ok")], 0.1, 3, cfg)
    back = decode(encode(built.batch), expect=None)
    assert isinstance(back, BatchManifest)
    assert [(r.group_id, r.key, r.entry_id) for r in back.refs] == [("d", "k:d", "1-0"), ("ok", "k:ok", "1-1")]
    assert back.stats is not None and back.stats["no_distill_share"] == pytest.approx(0.5)
    assert back.stats["tokens"] == 30 + 16 and back.policy_version == 3 and back.reward_weight == 1.0
    kl_sum, kl_n = group_kl(ok)
    assert built.observed_kl == pytest.approx(kl_sum / kl_n)
    # The learner's view: advantages computed from the manifest's weights, as sequence_advantages does.
    batch = materialize(back, [g, ok])
    assert [x.group_id for x in batch.groups] == ["d", "ok"] and len(batch.advantages) == 5
    np.testing.assert_array_equal(batch.advantages[3].numpy(), sequence_advantages(ok, 0.1, 1.0)[0])
    assert batch.kl_coef == 0.1 and batch.stats == back.stats


def test_header_roundtrip_and_rejects_inconsistent_headers() -> None:
    g = scored("h", [12, 9], version=4)
    h = decode_header(encode_header(g, 123))
    assert (h.group_id, h.policy_version, h.sequences, h.tokens, h.longest, h.payload_bytes) == ("h", 4, 2, 21, 12, 123)
    assert h.status is DistillStatus.OK and (h.kl_sum, h.kl_tokens) == pytest.approx(group_kl(g))
    bad = [b"\xc1", encode(g), msgspec.msgpack.encode({**msgspec.structs.asdict(h), "tokens": 999}),
           msgspec.msgpack.encode({**msgspec.structs.asdict(h), "sequences": -1}), b"x" * 5000]
    for data in bad:
        with pytest.raises(DecodeError):
            decode_header(data)
    with pytest.raises(TypeError):
        encode_header(g.group)


def test_manifest_validation_names_the_field() -> None:
    gs = [scored(f"m{i}", [6, 7]) for i in range(2)]
    good = build_batch([Pending(str(i), header_of(g), f"k{i}") for i, g in enumerate(gs)], 0.1, 0,
                       BatchingConfig()).batch
    assert isinstance(decode(encode(good)), BatchManifest)
    cases = {
        "batch.refs": msgspec.structs.replace(good, refs=[]),
        "batch.refs[1]": msgspec.structs.replace(good, refs=[good.refs[0], good.refs[0]]),
        "batch.kl_coef": msgspec.structs.replace(good, kl_coef=float("nan")),
        "batch.tokens": msgspec.structs.replace(good, stats={**(good.stats or {}), "tokens": float("inf")}),
    }
    for fld, bad in cases.items():
        with pytest.raises(DecodeError) as e:
            decode(encode(bad))
        assert e.value.field == fld
    with pytest.raises(DecodeError) as e2:
        decode(encode(msgspec.structs.replace(good, refs=[msgspec.structs.replace(good.refs[0], key="")])))
    assert e2.value.field == "batch.refs[0]"
