"""Scoring a student of another tokenizer (``pipeline.teacher.crossscore`` through ``Scorer(cross=...)``): two
byte-level BPE tokenizers of different sizes and merges trained here, a multi-turn sequence (prompt, trained
assistant turns, an untrained tool turn, specials), and a deterministic bigram teacher over the teacher's ids."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from msgspec.structs import replace

pytest.importorskip("transformers")

from pipeline.demo.tinymodels import build_tokenizer, corpus
from pipeline.stages.batching import BatchingConfig, Pending, build_batch, materialize
from pipeline.stages.scoring import Scorer, ScoringConfig
from pipeline.teacher.base import ScoreOutcome, ScoreRequest, ScoreResult
from pipeline.teacher.crossscore import CrossTokenizer
from pipeline.teacher.vocab import VocabMismatchError, check_same_vocab
from pipeline.transport.claimcheck import header_of
from schemas import DistillStatus, Limits, RolloutGroup, ScoredGroup, crosschunks, decode, encode
from schemas.arrays import FLOAT16, UINT8, Array
from schemas.build import make_sequence
from schemas.messages import BASE_SCHEMA, CHUNK_LAST, CHUNK_NO_SIGNAL, SCHEMA_VERSION, TeacherPayload
from schemas.validate import DecodeError, validate_teacher_part

TEACHER_SPECIALS = ["<|endoftext|>", "<s>", "</s>", "<|user|>", "<|assistant|>"]  # no <|tool|>
K = 8


def teacher_tokenizer(out: Path, *, ascii_only: bool = False) -> None:
    """Another byte-level BPE: 800 ids, merges learnt on other text, and a BOS its tokenizer adds by default.
    ``ascii_only``: its alphabet is the bytes below 128 (no token for a byte above 127)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from pipeline.teacher.crosstok import _byte_decoder

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = [c for c, b in _byte_decoder().items() if b < 128] if ascii_only else pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=800, special_tokens=TEACHER_SPECIALS, show_progress=False,
                                  initial_alphabet=alphabet)
    text = [line[::-1] + " the answer is calc(12, 34) and we call tools" for line in corpus(2000, seed=5)]
    tok.train_from_iterator(text, trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(str(out))


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, Path, Path]:
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("crossscore")
    build_tokenizer(root / "student")
    teacher_tokenizer(root / "teacher")
    return (AutoTokenizer.from_pretrained(str(root / "student")), AutoTokenizer.from_pretrained(str(root / "teacher")),
            root / "student", root / "teacher")


@pytest.fixture(scope="module")
def cross(tokenizers: tuple[Any, Any, Path, Path]) -> CrossTokenizer:
    _, _, s_path, t_path = tokenizers
    return CrossTokenizer.load(t_path, s_path)


class BigramTeacher:
    """The teacher's next-token distribution depends on the previous token only: ``log_softmax(W[prev])``."""

    identity = "bigram"
    max_k = 64

    def __init__(self, vocab: int, seed: int = 0) -> None:
        w = np.random.default_rng(seed).normal(size=(vocab, vocab)) * 2.0
        self.logp = w - np.log(np.exp(w).sum(axis=1, keepdims=True))
        self.calls: list[ScoreRequest] = []

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def row(self, prev: int, k: int) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.float32]]:
        order = np.argsort(-self.logp[prev], kind="stable")[:k]
        return order.astype(np.int32), self.logp[prev, order].astype(np.float32)

    async def score(self, reqs: list[ScoreRequest]) -> list[ScoreOutcome]:
        self.calls += reqs
        out: list[ScoreOutcome] = []
        for req in reqs:
            rows = req.row_index().astype(np.int64)
            toks = req.tokens.astype(np.int64)
            ids = np.zeros((len(rows), req.k), np.int32)
            lps = np.zeros((len(rows), req.k), np.float32)
            for j, r in enumerate(rows):
                ids[j], lps[j] = self.row(int(toks[r]), req.k)
            sampled = self.logp[toks[rows], toks[rows + 1]].astype(np.float32)
            out.append(ScoreResult(ids, lps, sampled))
        return out


def ids_of(tok: Any, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def conversation(student: Any, *, tool_in_answer: bool = False) -> tuple[list[int], list[int], list[tuple[int, int]]]:
    """A multi-turn sequence, its loss mask and its trained spans ``[start, end)``: a user prompt, an assistant
    call (trained), a tool answer (untrained; ``<|tool|>`` has no teacher counterpart), a user turn and a final
    assistant answer (trained). ``tool_in_answer``: the final answer holds a student-only special token."""
    sp = {t: student.convert_tokens_to_ids(t) for t in ("<|user|>", "<|assistant|>", "<|tool|>", "</s>")}
    toks: list[int] = []
    mask: list[int] = []
    spans: list[tuple[int, int]] = []

    def add(ids: list[int], trained: bool) -> None:
        if trained:
            spans.append((len(toks), len(toks) + len(ids)))
        toks.extend(ids)
        mask.extend([int(trained)] * len(ids))

    add([sp["<|user|>"], *ids_of(student, "what is 12+34? use the tool"), sp["<|assistant|>"]], False)
    add([*ids_of(student, "call calc(12, 34)"), sp["</s>"]], True)
    add([sp["<|tool|>"], *ids_of(student, "46"), sp["<|user|>"], *ids_of(student, "so?"), sp["<|assistant|>"]],
        False)
    answer = ids_of(student, "The answer is 46.")
    if tool_in_answer:
        answer = [*answer[:2], sp["<|tool|>"], *answer[2:]]
    add([*answer, sp["</s>"]], True)
    return toks, mask, spans


def group_of(student: Any, *, tool_in_answer: bool = False, gid: str = "g", rng_seed: int = 0) -> RolloutGroup:
    toks, mask, _ = conversation(student, tool_in_answer=tool_in_answer)
    rng = np.random.default_rng(rng_seed)
    lp = np.where(np.array(mask) > 0, -rng.uniform(0.1, 3.0, len(toks)), 0.0).astype(np.float32)
    seq = make_sequence(toks, mask, logprobs=lp)
    return RolloutGroup(group_id=gid, sequences=[seq, seq])


def score(cross: CrossTokenizer, teacher: BigramTeacher, groups: list[RolloutGroup]) -> list[ScoredGroup]:
    scorer = Scorer(teacher, ScoringConfig(default_k=K), cross=cross, limits=Limits(vocab_size=len(cross.student)))
    return asyncio.run(scorer.score_groups(groups))


def test_chunk_sums_over_a_trained_span_are_the_teachers_log_likelihood_of_its_text(
        tokenizers: tuple[Any, Any, Path, Path], cross: CrossTokenizer) -> None:
    student, teacher_tok, _, _ = tokenizers
    teacher = BigramTeacher(len(teacher_tok))
    (g,) = score(cross, teacher, [group_of(student)])
    assert g.status is DistillStatus.OK, g.reason
    toks, _, spans = conversation(student)
    t = g.teacher[0]  # type: ignore[index]
    req = teacher.calls[0]
    req_ids = req.tokens.tolist()
    assert req_ids[0] == teacher_tok.bos_token_id  # the teacher's tokenizer adds a BOS: it comes first
    sampled = t.dense_sampled(len(toks))
    eos = teacher_tok.eos_token_id
    for start, end in spans:
        text = b"".join(cross.student.pieces[i] or b"" for i in toks[start:end - 1]).decode()
        own = [*ids_of(teacher_tok, text), eos]  # the teacher's own tokenization of the span, then its eos
        at = next(i for i in range(1, len(req_ids)) if req_ids[i:i + len(own)] == own)
        expected = float(sum(teacher.logp[a, b] for a, b in zip(req_ids[at - 1:], own, strict=False)))
        assert float(sampled[start - 1:end - 1].sum()) == pytest.approx(expected, abs=1e-4)
        assert len(own) != end - start or text != "call calc(12, 34)"  # the two tokenizations differ somewhere
    assert g.schema == SCHEMA_VERSION and "tokenizer=teacher" in g.teacher_id


def test_every_trained_row_is_held_and_each_trained_span_ends_a_chunk(
        tokenizers: tuple[Any, Any, Path, Path], cross: CrossTokenizer) -> None:
    student, teacher_tok, _, _ = tokenizers
    plain, special = score(cross, BigramTeacher(len(teacher_tok)),
                           [group_of(student), group_of(student, tool_in_answer=True, gid="h")])
    for g in (plain, special):
        assert g.status is DistillStatus.OK, g.reason
        toks, mask, spans = conversation(student, tool_in_answer=g is special)
        t = g.teacher[0]  # type: ignore[index]
        assert t.rows is not None and t.chunk_last is not None
        assert t.rows.numpy().tolist() == [r for r in range(len(toks) - 1) if mask[r + 1]]
        last = dict(zip(t.rows.numpy().tolist(), t.chunk_last.numpy().tolist(), strict=True))
        for _, end in spans:
            assert last[end - 2] in (CHUNK_LAST, CHUNK_NO_SIGNAL)
        sampled = t.sampled_logprobs.numpy()
        cl = t.chunk_last.numpy()
        assert (sampled[cl != CHUNK_LAST] == 0.0).all() and (sampled[cl == CHUNK_LAST] < 0).all()
    # the student-only <|tool|> inside the answer: a chunk of its own with no signal, its advantage 0
    toks, _, _ = conversation(student, tool_in_answer=True)
    p = toks.index(student.convert_tokens_to_ids("<|tool|>"), conversation(student)[2][1][0])
    t = special.teacher[0]  # type: ignore[index]
    j = t.rows.numpy().tolist().index(p - 1)  # type: ignore[union-attr]
    assert t.chunk_last.numpy()[j] == CHUNK_NO_SIGNAL  # type: ignore[union-attr]
    adv = materialize(manifest([special]), [special]).advantages[0].numpy()
    assert adv[p] == 0.0 and (adv[np.array(conversation(student)[1] + [0]) > 0] != 0).any()


def test_topk_only_at_shared_boundaries_and_mapped_ids_have_the_teacher_entries_bytes(
        tokenizers: tuple[Any, Any, Path, Path], cross: CrossTokenizer) -> None:
    student, teacher_tok, _, _ = tokenizers
    teacher = BigramTeacher(len(teacher_tok))
    (g,) = score(cross, teacher, [group_of(student)])
    toks, _, _ = conversation(student)
    t = g.teacher[0]  # type: ignore[index]
    req = teacher.calls[0].tokens.astype(np.int64)
    sv, tv = cross.student, cross.teacher_vocab
    def offsets(ids: list[int], vocab: Any, marker: Any) -> list[int]:
        """Byte offsets of every token in the text; a special token takes ``marker(id)`` bytes."""
        out, at = [], 0
        for i in ids:
            out.append(at)
            at += len(vocab.pieces[i]) if vocab.pieces[i] is not None else marker(i)
        return out
    # a special token with a teacher counterpart is one marker byte on both sides; <|tool|> has none: no bytes
    s_off = offsets(toks, sv, lambda i: int(tv.special_id(sv.special[i]) is not None))
    t_ids = req[1:].tolist()  # without the BOS
    t_off = offsets(t_ids, tv, lambda i: 1)
    mapped = t.topk_mapped.numpy().astype(bool)  # type: ignore[union-attr]
    rows = t.rows.numpy()  # type: ignore[union-attr]
    with_topk = 0
    for j, r in enumerate(rows.tolist()):
        starts = [i for i, o in enumerate(t_off) if o == s_off[r + 1]]
        if not mapped[j].any():
            continue
        with_topk += 1
        assert starts, f"row {r}: top-k where no teacher token starts at the same byte"
        prev = int(req[starts[0]])  # the teacher row predicting that token: its input is the token before (BOS +1)
        t_top, t_lp = teacher.row(prev, K)
        keep = [(tv.pieces[i] if tv.pieces[i] is not None else tv.special[i], lp) for i, lp in zip(t_top, t_lp,
                strict=True) if cross.vmap[i] >= 0]
        ids = t.topk_ids.numpy()[j][mapped[j]]
        got = [(sv.pieces[i] if sv.pieces[i] is not None else sv.special[i], lp)
               for i, lp in zip(ids, t.topk_logprobs.numpy()[j][mapped[j]], strict=True)]
        assert got == [(b, pytest.approx(lp)) for b, lp in keep]
        assert (t.topk_ids.numpy()[j][~mapped[j]] == 0).all() and mapped[j].tolist() == sorted(mapped[j], reverse=True)
    assert with_topk > 0


def half_character_group(student: Any, cross: CrossTokenizer) -> tuple[RolloutGroup, int]:
    """The conversation whose final answer ends half-way through a character (a lone 0xC3 before ``</s>``), and
    the position of that byte."""
    toks, mask, _ = conversation(student)
    half = next(i for i, p in enumerate(cross.student.pieces) if p == "é".encode()[:1])
    toks[-2], mask[-2] = half, 1
    lp = np.where(np.array(mask) > 0, -1.0, 0.0).astype(np.float32)
    return RolloutGroup(group_id="half", sequences=[make_sequence(toks, mask, logprobs=lp)]), len(toks) - 2


def test_a_byte_that_is_not_utf8_is_scored_as_the_teachers_byte_token(
        tokenizers: tuple[Any, Any, Path, Path], cross: CrossTokenizer) -> None:
    from pipeline.stages.teacher_stage import TeacherStage

    student, teacher_tok, _, _ = tokenizers
    group, p = half_character_group(student, cross)
    teacher = BigramTeacher(len(teacher_tok))
    stage = TeacherStage(Scorer(teacher, ScoringConfig(default_k=K), cross=cross,
                                limits=Limits(vocab_size=len(cross.student))))
    (g,) = asyncio.run(stage.scorer.score_groups([group]))
    assert g.status is DistillStatus.OK, g.reason
    byte_c3 = cross.teacher_vocab.byte_id(0xC3)
    assert byte_c3 is not None and teacher_tok.convert_ids_to_tokens(byte_c3) == "Ã"
    req = teacher.calls[0].tokens.tolist()
    at = len(req) - 2  # the teacher's sequence ends ..., <0xC3>, </s> too
    assert req[at:] == [byte_c3, teacher_tok.eos_token_id]
    t = g.teacher[0]  # type: ignore[index]
    row = t.rows.numpy().tolist().index(p - 1)  # type: ignore[union-attr]
    assert t.chunk_last.numpy()[row] == CHUNK_LAST  # type: ignore[union-attr]
    # the byte's chunk: the teacher's logprob of its byte token after the token before it (a one-token chunk here)
    assert float(t.sampled_logprobs.numpy()[row]) == pytest.approx(float(teacher.logp[req[at - 1], byte_c3]),
                                                                   abs=1e-5)
    adv = materialize(manifest([g]), [g]).advantages[0].numpy()
    assert adv[p] == pytest.approx(0.7 * (float(teacher.logp[req[at - 1], byte_c3]) + 1.0), abs=1e-5)
    assert stage.scorer.stats.cross_fallback_bytes == 1 and stage.report()["cross_fallback_bytes"] == 1


def test_a_byte_the_teacher_has_no_token_for_drops_the_group(
        tokenizers: tuple[Any, Any, Path, Path], tmp_path: Path) -> None:
    student, _, s_path, _ = tokenizers
    teacher_tokenizer(tmp_path / "ascii", ascii_only=True)
    ascii_cross = CrossTokenizer.load(tmp_path / "ascii", s_path)
    assert ascii_cross.teacher_vocab.byte_id(0xC3) is None
    bad, _ = half_character_group(student, ascii_cross)
    scorer = Scorer(BigramTeacher(len(ascii_cross.teacher_vocab)), ScoringConfig(default_k=K), cross=ascii_cross,
                    limits=Limits(vocab_size=len(ascii_cross.student)))
    good, dropped = asyncio.run(scorer.score_groups([group_of(student), bad]))
    assert good.status is DistillStatus.OK, good.reason
    assert dropped.status is DistillStatus.DROPPED and dropped.teacher is None
    assert dropped.reason is not None and dropped.reason.startswith(
        "cross_tokenizer: the completion is not UTF-8 text at byte ")
    assert "(0xC3) and the teacher has no token for that byte" in dropped.reason
    assert dropped.reason.endswith("(sequence 0)")
    assert scorer.stats.reasons["cross_tokenizer"] == 1 and scorer.stats.cross_fallback_bytes == 0


def with_field(g: ScoredGroup, **kw: Any) -> ScoredGroup:
    t = g.teacher[0]  # type: ignore[index]
    return replace(g, teacher=[replace(t, **kw), *g.teacher[1:]])  # type: ignore[index]


def test_validation_accepts_cross_payloads_and_names_the_field_of_a_bad_one(
        tokenizers: tuple[Any, Any, Path, Path], cross: CrossTokenizer) -> None:
    student, teacher_tok, _, _ = tokenizers
    (g,) = score(cross, BigramTeacher(len(teacher_tok)), [group_of(student)])
    limits = Limits()
    validate_teacher_part(g, limits)
    back = decode(encode(g), limits=limits)  # the fast structural path and the full one agree
    assert isinstance(back, ScoredGroup) and back.teacher[0].cross  # type: ignore[index]
    t: TeacherPayload = g.teacher[0]  # type: ignore[index]
    last, mapped = t.chunk_last.numpy().copy(), t.topk_mapped.numpy().copy()  # type: ignore[union-attr]
    sampled = t.sampled_logprobs.numpy().copy()

    def u8(a: npt.NDArray[Any]) -> Array:
        return Array.from_numpy(a.astype(np.uint8), UINT8)

    def rejects(bad: ScoredGroup, field: str) -> None:
        for check in (lambda: validate_teacher_part(bad, limits), lambda: decode(encode(bad), limits=limits)):
            with pytest.raises(DecodeError) as info:
                check()
            assert info.value.field.endswith(field), info.value

    three = last.copy()
    three[0] = 3
    rejects(with_field(g, chunk_last=u8(three)), ".chunk_last")
    inside = last.copy()
    inside[np.flatnonzero(last == CHUNK_LAST)[-1]] = 0  # the last trained row is inside a chunk: not the end of a span
    sampled_fixed = sampled.copy()
    sampled_fixed[np.flatnonzero(last == CHUNK_LAST)[-1]] = 0.0
    from schemas.arrays import FLOAT32
    rejects(with_field(g, chunk_last=u8(inside), sampled_logprobs=Array.from_numpy(sampled_fixed, FLOAT32)),
            ".chunk_last")
    stray = sampled.copy()
    stray[np.flatnonzero(last != CHUNK_LAST)[0]] = -0.5
    rejects(with_field(g, sampled_logprobs=Array.from_numpy(stray, FLOAT32)), ".sampled_logprobs")
    row = int(np.flatnonzero(mapped.any(axis=1) & ~mapped.all(axis=1))[0])
    flipped = mapped.copy()
    flipped[row] = flipped[row][::-1]  # empty slots first
    rejects(with_field(g, topk_mapped=u8(flipped)), ".topk_mapped")
    rejects(with_field(g, topk_mapped=u8(mapped * 2)), ".topk_mapped")
    rejects(with_field(g, topk_mapped=None), ".topk_mapped")
    rejects(with_field(g, topk_mapped=u8(mapped[:, :-1])), ".topk_mapped")
    rejects(with_field(g, chunk_last=u8(last[:-1])), ".chunk_last")


def manifest(groups: list[ScoredGroup], kl_coef: float = 0.7) -> Any:
    pending = [Pending(f"0-{i}", header_of(g), key=f"k{i}") for i, g in enumerate(groups)]
    return build_batch(pending, kl_coef, 0, BatchingConfig()).batch


def test_feeder_chunk_advantages_equal_the_learners_and_the_header_kl_is_per_chunk(
        tokenizers: tuple[Any, Any, Path, Path], cross: CrossTokenizer) -> None:
    torch = pytest.importorskip("torch")
    from pipeline.learner.crosstok import chunk_reverse_kl_advantages
    from pipeline.learner.torch_batch import PAD_LOGPROB, to_torch

    student, teacher_tok, _, _ = tokenizers
    groups = score(cross, BigramTeacher(len(teacher_tok)),
                   [group_of(student, rng_seed=1), group_of(student, tool_in_answer=True, gid="h", rng_seed=2)])
    m = manifest(groups)
    batch = materialize(m, groups)
    assert batch.schema == SCHEMA_VERSION
    tb = to_torch(batch)
    seqs = [(g, i, s) for g in groups for i, s in enumerate(g.group.sequences)]
    for b, (g, i, s) in enumerate(seqs):
        q, last = crosschunks.dense(s, g.teacher[i])  # type: ignore[index]
        n = s.length
        ref = chunk_reverse_kl_advantages(torch.tensor(q)[None], torch.tensor(last)[None],
                                          torch.tensor(s.logprobs.numpy())[None],  # type: ignore[union-attr]
                                          torch.tensor(s.loss_mask.numpy().astype(np.float32))[None], coef=0.7)[0]
        got = batch.advantages[b].numpy()
        np.testing.assert_allclose(got, ref.numpy(), atol=1e-6)
        assert np.isfinite(got).all() and (got[s.loss_mask.numpy() == 0] == 0).all()
        assert (got[s.loss_mask.numpy() > 0] != 0).sum() > 0
        np.testing.assert_allclose(tb.advantages[b, : n - 1].numpy(), got[1:])
        # TorchBatch.chunk_last: the payload's values at its rows, 0 elsewhere; with it a learner sums the student's
        # logprobs per chunk and gets the batch's advantages back
        t = g.teacher[i]  # type: ignore[index]
        rows = t.rows.numpy()  # type: ignore[union-attr]
        assert tb.chunk_last[b, rows].numpy().tolist() == t.chunk_last.numpy().tolist()  # type: ignore[union-attr]
        assert int(tb.chunk_last[b].sum()) == int(t.chunk_last.numpy().astype(int).sum())  # type: ignore[union-attr]
        q_c = torch.where(tb.chunk_last[b] == CHUNK_NO_SIGNAL, torch.nan, tb.teacher_sampled_logprobs[b])
        mine = chunk_reverse_kl_advantages(q_c[None], tb.chunk_last[b][None], tb.student_logprobs[b][None],
                                           tb.loss_mask[b][None], coef=0.7)[0]
        np.testing.assert_allclose(mine.numpy(), tb.advantages[b].numpy(), atol=1e-6)
    assert (tb.chunk_last.numpy() == CHUNK_NO_SIGNAL).sum() == 2  # the student-only <|tool|> in group h's two sequences
    # the KL of the header: sum over chunks with signal of s_c - q_c, and the trained tokens in them
    total = n_tok = 0.0
    for g, i, s in seqs[:2]:
        q, last = crosschunks.dense(s, g.teacher[i])  # type: ignore[index]
        ids = np.cumsum(last) - last
        lp = np.where(s.loss_mask.numpy() > 0, s.logprobs.numpy(), 0.0)  # type: ignore[union-attr]
        for c in np.unique(ids[last & ~np.isnan(q)]):
            total += lp[ids == c].sum() - q[last & (ids == c)][0]
            n_tok += int((s.loss_mask.numpy()[ids == c] > 0).sum())
    h = header_of(groups[0])
    assert h.kl_sum == pytest.approx(total, abs=1e-4) and h.kl_tokens == n_tok and h.schema == SCHEMA_VERSION
    assert 0 < h.cross_aligned <= h.cross_tokens and h.cross_topk_rows > 0
    assert m.stats["cross.groups"] == 2 and 0 < m.stats["cross.aligned_share"] <= 1
    assert 0 < m.stats["cross.topk_mapped_mass"] <= 1
    # to_torch: empty slots are padding; rows without a mapped slot carry no distillation
    t = groups[0].teacher[0]  # type: ignore[index]
    mapped = t.topk_mapped.numpy().astype(bool)  # type: ignore[union-attr]
    rows = t.rows.numpy()  # type: ignore[union-attr]
    assert (tb.distill_mask[0, rows].numpy() == mapped.any(axis=1)).all() and tb.distill_mask[0].sum() > 0
    lps = tb.teacher_topk_logprobs[0, rows].numpy()
    assert (lps[~mapped] == PAD_LOGPROB).all() and (lps[mapped] > -100).all()


def test_same_tokenizer_groups_keep_the_base_schema() -> None:
    from schemas.build import synthetic_rollout, synthetic_scored

    g = synthetic_scored(synthetic_rollout())
    assert g.schema == BASE_SCHEMA and header_of(g).schema == BASE_SCHEMA and not g.teacher[0].cross  # type: ignore[index]


def test_without_the_flag_a_mismatched_pair_is_refused_naming_both_sizes(
        tokenizers: tuple[Any, Any, Path, Path], cross: CrossTokenizer) -> None:
    student, teacher_tok, s_path, t_path = tokenizers
    with pytest.raises(VocabMismatchError) as info:
        check_same_vocab(t_path, s_path)
    assert f"teacher {len(teacher_tok.get_vocab())} tokens" in str(info.value)
    assert f"student {len(student.get_vocab())} tokens" in str(info.value)
    assert 0 < cross.mapped_share() < 1 and cross.bos_id == teacher_tok.bos_token_id


def test_tail_shows_the_teacher_tokenizer_and_the_shares_of_a_cross_group(
        tokenizers: tuple[Any, Any, Path, Path], cross: CrossTokenizer) -> None:
    from pipeline.cli.summaries import one_line, summarize_message

    student, teacher_tok, _, _ = tokenizers
    (g,) = score(cross, BigramTeacher(len(teacher_tok)), [group_of(student)])
    summary = summarize_message(g)
    shares = summary["cross"]
    h = header_of(g)
    assert shares["aligned_share"] == round(h.cross_aligned / h.cross_tokens, 4) and 0 < shares["aligned_share"] <= 1
    assert 0 < shares["topk_mapped_mass"] <= 1
    line = one_line({**summary, "entry_id": "1-0", "bytes": 0})
    assert "tokenizer=teacher" in line and f"aligned={shares['aligned_share']}" in line


def test_the_worker_flag_needs_both_tokenizers_and_the_trained_rows(
        tokenizers: tuple[Any, Any, Path, Path]) -> None:
    import argparse

    from pipeline.teacher.base import TeacherConfigError
    from workers.teacher import add_arguments, cross_tokenizer

    _, _, s_path, t_path = tokenizers
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--cross-tokenizer", "--tokenizer", str(t_path), "--student-tokenizer", str(s_path)])
    assert cross_tokenizer(args).bos_id is not None
    with pytest.raises(TeacherConfigError, match="--rows all"):
        cross_tokenizer(p.parse_args(["--cross-tokenizer", "--tokenizer", str(t_path), "--student-tokenizer",
                                      str(s_path), "--rows", "all"]))
    with pytest.raises(TeacherConfigError, match="--student-tokenizer"):
        cross_tokenizer(p.parse_args(["--cross-tokenizer", "--tokenizer", str(t_path)]))


def test_the_header_of_a_cross_group_round_trips_and_a_bad_mass_is_refused(
        tokenizers: tuple[Any, Any, Path, Path], cross: CrossTokenizer) -> None:
    import msgspec

    from pipeline.transport.claimcheck import decode_header, encode_header

    student, teacher_tok, _, _ = tokenizers
    (g,) = score(cross, BigramTeacher(len(teacher_tok)), [group_of(student)])
    h = decode_header(encode_header(g))
    want = header_of(g)
    assert replace(h, created_at=0.0) == replace(want, created_at=0.0) and h.schema == SCHEMA_VERSION
    assert h.cross_tokens > 0 and h.cross_topk_mass > 0
    for mass in (float("nan"), -0.1, h.cross_topk_rows + 1.0):
        with pytest.raises(DecodeError, match="cross_topk_mass"):
            decode_header(msgspec.msgpack.encode(replace(h, cross_topk_mass=mass)))


def test_float16_top_k_and_teacher_ids_beyond_its_tokenizer(
        tokenizers: tuple[Any, Any, Path, Path], cross: CrossTokenizer) -> None:
    """A model whose vocabulary exceeds its tokenizer's (as Qwen's does): ids past the table never map."""
    student, teacher_tok, _, _ = tokenizers
    teacher = BigramTeacher(len(teacher_tok) + 300, seed=3)
    teacher.logp[:, len(teacher_tok):] += 6.0  # the padded ids dominate every top-k
    teacher.logp -= np.log(np.exp(teacher.logp).sum(axis=1, keepdims=True))
    scorer = Scorer(teacher, ScoringConfig(default_k=K, fp16_topk=True), cross=cross)
    (g,) = asyncio.run(scorer.score_groups([group_of(student)]))
    assert g.status is DistillStatus.OK, g.reason
    validate_teacher_part(g, Limits(vocab_size=len(cross.student)))
    t = g.teacher[0]  # type: ignore[index]
    assert t.topk_logprobs.dtype == FLOAT16
    mapped = t.topk_mapped.numpy().astype(bool)  # type: ignore[union-attr]
    ids = t.topk_ids.numpy()
    assert (ids[mapped] < len(cross.student)).all() and (ids[~mapped] == 0).all()
    # the padded ids took most slots: fewer mapped slots than with the plain teacher, and the share reflects it
    (plain,) = score(cross, BigramTeacher(len(teacher_tok), seed=3), [group_of(student)])
    assert mapped.sum() < plain.teacher[0].topk_mapped.numpy().sum()  # type: ignore[index, union-attr]
    assert scorer.stats.cross_mapped_mass < 0.5 * scorer.stats.cross_topk_mass


def test_a_sentencepiece_teacher_gives_no_top_k_where_its_token_carries_the_space_it_put_first(
        tokenizers: tuple[Any, Any, Path, Path], tmp_path: Path) -> None:
    from pipeline.teacher.crosstok import retokenize
    from tests.unit.test_crosstok import sentencepiece_tokenizer

    student = tokenizers[0]
    sp = sentencepiece_tokenizer(tmp_path / "sp")
    pair = CrossTokenizer.of(sp, student, "sp")
    toks, mask, _ = conversation(student)
    plan = pair.convert(np.array(toks), np.array(mask), K)
    r = retokenize(toks, pair.student, sp, pair.teacher_vocab, loss_mask=mask)
    skipped = set((np.flatnonzero(r.teacher_skip > 0) + plan.offset - 1).tolist())  # rows predicting such tokens
    looked_up = set(plan.request.rows[plan.topk_at[plan.topk_at >= 0]].tolist())  # type: ignore[index]
    assert skipped and looked_up and not (skipped & looked_up)
    assert int((plan.chunk_last == CHUNK_LAST).sum()) > 0
