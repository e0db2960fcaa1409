"""Cross-tokenizer alignment (``pipeline.teacher.crosstok``) on two tokenizers of different families trained here:
the tiny byte-level BPE of the demo (512 ids) and a SentencePiece-style BPE (``▁`` spaces, byte fallback, 700 ids,
other merges). The exactness check runs a tiny teacher model over its own tokenization."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch

from pipeline.demo.tinymodels import build_model, build_tokenizer, corpus
from pipeline.teacher.crosstok import (
    RoundTripError,
    VocabBytes,
    align,
    chunk_logprobs,
    map_topk,
    retokenize,
    vocab_map,
)

ALPHABET = [*list("abcdefghij klmnopqrstuvwxyz  ,.!?0123456789\n"), "é", "ü", "中", "文", "🙂", "  ", "\t"]
SP_SPECIALS = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>"]


def sentencepiece_tokenizer(out: Path) -> Any:
    """A Llama-2-style tokenizer: BPE over ``▁``-marked words with byte fallback, trained on other text."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    bytes_alphabet = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=SP_SPECIALS + bytes_alphabet, show_progress=False)
    text = [line[::-1] + " the lazy cat sat on a mat" for line in corpus(2000, seed=3)]
    tok.train_from_iterator(text, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(out))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(out))


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, Path]:
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("crosstok")
    build_tokenizer(root / "student")
    student = AutoTokenizer.from_pretrained(str(root / "student"))
    teacher = sentencepiece_tokenizer(root / "teacher")
    return student, teacher, root


def random_text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(n)).strip() or "a"


def split_tokenization(tok: Any, text: str, rng: random.Random) -> list[int]:
    """A valid but not canonical tokenization: the text cut at random characters, each piece encoded alone."""
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 4))) if len(text) > 1 else []
    ids: list[int] = []
    for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
        ids += tok(text[a:b], add_special_tokens=False)["input_ids"]
    return ids


def chunk_bytes(vocab: VocabBytes, ids: Any, rng: tuple[int, int]) -> bytes:
    return b"".join(vocab.pieces[int(t)] or b"" for t in ids[rng[0]:rng[1]])


def test_vocab_bytes_undo_each_family_encoding(pair: tuple[Any, Any, Path]) -> None:
    student, teacher, _ = pair
    sv, tv = VocabBytes.of(student), VocabBytes.of(teacher)
    for tok, vocab in ((student, sv), (teacher, tv)):
        for text in ["hello world", "é中🙂 x", "12+34=46"]:
            ids = tok(text, add_special_tokens=False)["input_ids"]
            joined = b"".join(vocab.pieces[i] or b"" for i in ids)
            assert joined.removeprefix(b" " if vocab.prepends_space else b"") == text.encode()
    assert not sv.prepends_space and tv.prepends_space
    assert sv.pieces[student.eos_token_id] is None and student.eos_token_id in sv.special
    assert tv.special_id("<|user|>") is not None and sv.special_id("<|user|>") is not None


def test_chunks_cover_the_same_bytes_on_both_sides_and_tile_the_completion(pair: tuple[Any, Any, Path]) -> None:
    student, teacher, _ = pair
    sv, tv = VocabBytes.of(student), VocabBytes.of(teacher)
    rng = random.Random(0)
    one_to_one = total = 0
    for _ in range(200):
        text = random_text(rng, rng.randint(1, 60))
        ids = split_tokenization(student, text, rng) if rng.random() < 0.5 else \
            student(text, add_special_tokens=False)["input_ids"]
        r = retokenize(ids, sv, teacher, tv)
        a = align(r)
        assert a.student[0, 0] == 0 and a.student[-1, 1] == len(ids)
        assert a.teacher[0, 0] == 0 and a.teacher[-1, 1] == len(r.teacher_ids)
        assert (a.student[1:, 0] == a.student[:-1, 1]).all() and (a.teacher[1:, 0] == a.teacher[:-1, 1]).all()
        for s_rng, t_rng in zip(a.student.tolist(), a.teacher.tolist(), strict=True):
            assert s_rng[1] > s_rng[0] and t_rng[1] > t_rng[0]
            assert chunk_bytes(sv, ids, s_rng) == r.teacher_text(tv, *t_rng)
        one_to_one += int(a.one_to_one().sum())
        total += a.chunks
    assert 0 < one_to_one < total  # both kinds occur: the families cut text differently


def test_special_tokens_are_chunks_of_their_own_and_eos_maps_to_eos(pair: tuple[Any, Any, Path]) -> None:
    student, teacher, _ = pair
    sv, tv = VocabBytes.of(student), VocabBytes.of(teacher)
    body = student("12+34=46", add_special_tokens=False)["input_ids"]
    user, tool = sv.special_id("<|user|>"), sv.special_id("<|tool|>")
    assert user is not None and tool is not None
    ids = [*body, user, *body, tool, *body, student.eos_token_id]
    r = retokenize(ids, sv, teacher, tv)
    a = align(r)
    specials = {int(s0): (int(t0), int(t1)) for (s0, s1), (t0, t1) in zip(a.student, a.teacher, strict=True)
                if s1 - s0 == 1 and ids[s0] in sv.special}
    assert set(specials) == {len(body), 2 * len(body) + 1, 3 * len(body) + 2}
    t0, t1 = specials[len(body)]
    assert t1 - t0 == 1 and r.teacher_ids[t0] == tv.special_id("<|user|>")  # same content
    assert specials[2 * len(body) + 1][0] == specials[2 * len(body) + 1][1]  # <|tool|>: no counterpart
    t0, _ = specials[3 * len(body) + 2]
    assert r.teacher_ids[t0] == teacher.eos_token_id  # </s> -> </s>, the end of sequence
    assert a.unmapped == 1
    lp = chunk_logprobs(a, np.full(len(r.teacher_ids), -0.5))
    assert int(np.isnan(lp).sum()) == 1


def test_text_that_does_not_survive_the_teachers_tokenizer_is_refused_by_name(pair: tuple[Any, Any, Path]) -> None:
    student, teacher, root = pair
    from transformers import AutoTokenizer

    build_tokenizer(root / "ascii", all_bytes=False)  # a byte-level BPE with no token for a byte above 127
    ascii_teacher = AutoTokenizer.from_pretrained(str(root / "ascii"))
    sv, tv, av = VocabBytes.of(student), VocabBytes.of(teacher), VocabBytes.of(ascii_teacher)
    assert av.byte_id(0xC3) is None and av.byte_id(ord("4")) is not None
    half = byte_token(student, 0xC3)  # a byte-level token: half a character
    four = student("4", add_special_tokens=False)["input_ids"]
    with pytest.raises(RoundTripError, match=r"cross_tokenizer: the completion is not UTF-8 text at byte 1 of a "
                                             r"segment \(0xC3\) and the teacher has no token for that byte"):
        retokenize([*four, half, *four], sv, ascii_teacher, av)
    assert retokenize([*four, *four], sv, ascii_teacher, av).fallback_bytes == 0  # its text alone: fine
    with pytest.raises(RoundTripError, match="cross_tokenizer: the teacher's tokenizer changes the text"):
        retokenize(student("a\u00a0b", add_special_tokens=False)["input_ids"], sv, _NormalisingTeacher(teacher),
                   tv)


def byte_token(tok: Any, byte: int) -> int:
    """A byte-level BPE's token for one byte (GPT-2's printable stand-in for it)."""
    from pipeline.teacher.crosstok import _byte_decoder

    char = next(c for c, b in _byte_decoder().items() if b == byte)
    return int(tok.convert_tokens_to_ids(char))


@pytest.fixture(scope="module")
def byte_pair(pair: tuple[Any, Any, Path]) -> tuple[Any, Any, Path]:
    """Two byte-level BPEs over all 256 bytes, with other merges: the demo's 512 ids and 384 ids."""
    from transformers import AutoTokenizer

    student, _, root = pair
    build_tokenizer(root / "teacher384", 384)
    return student, AutoTokenizer.from_pretrained(str(root / "teacher384")), root


def lone_bytes_completion(student: Any) -> tuple[list[int], list[int]]:
    """``4``, a lone 0xC3 (a character's first byte followed by no continuation), ``1``, a lone continuation byte
    0xA9, ``2``, end of sequence; and the student's text pieces of its text tokens."""
    enc = [int(t) for t in student("4", add_special_tokens=False)["input_ids"]]
    one = [int(t) for t in student("1", add_special_tokens=False)["input_ids"]]
    two = [int(t) for t in student("2", add_special_tokens=False)["input_ids"]]
    text = [*enc, byte_token(student, 0xC3), *one, byte_token(student, 0xA9), *two]
    return [*text, int(student.eos_token_id)], text


def test_bytes_that_are_not_utf8_become_the_teachers_single_byte_tokens(byte_pair: tuple[Any, Any, Path]) -> None:
    student, teacher, _ = byte_pair
    sv, tv = VocabBytes.of(student), VocabBytes.of(teacher)
    ids, text = lone_bytes_completion(student)
    assert b"".join(sv.pieces[t] or b"" for t in text) == b"4\xc31\xa92"
    r = retokenize(ids, sv, teacher, tv)
    enc = [int(t) for t in teacher("4", add_special_tokens=False)["input_ids"]]
    expected = [*enc, byte_token(teacher, 0xC3), *teacher("1", add_special_tokens=False)["input_ids"],
                byte_token(teacher, 0xA9), *teacher("2", add_special_tokens=False)["input_ids"], teacher.eos_token_id]
    assert r.teacher_ids.tolist() == expected
    assert r.fallback_bytes == 2 and r.teacher_fallback.tolist() == [t in (expected[1], expected[3])
                                                                       for t in expected]
    a = align(r)
    for s_rng, t_rng in zip(a.student.tolist(), a.teacher.tolist(), strict=True):
        assert chunk_bytes(sv, ids, s_rng) == r.teacher_text(tv, *t_rng)
    assert a.chunks == 6 and a.unmapped == 0  # each byte its own chunk here, and the end of sequence
    # a valid character cut across two student tokens is text: the teacher's own tokenizer reads it
    e_acute = retokenize([byte_token(student, 0xC3), byte_token(student, 0xA9)], sv, teacher, tv)
    assert e_acute.fallback_bytes == 0
    assert e_acute.teacher_ids.tolist() == teacher("é", add_special_tokens=False)["input_ids"]


def test_a_sentencepiece_teacher_reads_such_bytes_as_its_byte_tokens(pair: tuple[Any, Any, Path]) -> None:
    student, teacher, _ = pair
    sv, tv = VocabBytes.of(student), VocabBytes.of(teacher)
    ids, _ = lone_bytes_completion(student)
    r = retokenize(ids, sv, teacher, tv)
    fallback = [teacher.convert_ids_to_tokens(int(t)) for t in r.teacher_ids[r.teacher_fallback]]
    assert fallback == ["<0xC3>", "<0xA9>"]
    a = align(r)
    for s_rng, t_rng in zip(a.student.tolist(), a.teacher.tolist(), strict=True):
        assert chunk_bytes(sv, ids, s_rng) == r.teacher_text(tv, *t_rng)  # the spaces SentencePiece put first: off


def test_random_bytes_tile_on_both_sides_and_every_invalid_byte_is_counted(byte_pair: tuple[Any, Any, Path]) -> None:
    student, teacher, _ = byte_pair
    sv, tv = VocabBytes.of(student), VocabBytes.of(teacher)
    rng = random.Random(5)
    text_ids = [i for i, p in enumerate(sv.pieces) if p is not None]
    total = 0
    for _ in range(100):
        ids = [rng.choice(text_ids) for _ in range(rng.randint(1, 12))]
        raw = b"".join(sv.pieces[t] or b"" for t in ids)
        r = retokenize(ids, sv, teacher, tv)
        invalid = len(raw) - len(raw.decode("utf-8", "ignore").encode())
        assert r.fallback_bytes == invalid
        assert r.teacher_text(tv, 0, len(r.teacher_ids)) == raw
        a = align(r)
        for s_rng, t_rng in zip(a.student.tolist(), a.teacher.tolist(), strict=True):
            assert chunk_bytes(sv, ids, s_rng) == r.teacher_text(tv, *t_rng)
        total += invalid
    assert total > 50  # random byte-level tokens: many are not UTF-8


def test_with_byte_fallback_chunk_sums_are_the_log_likelihood_of_that_tokenization(
        byte_pair: tuple[Any, Any, Path]) -> None:
    """Exactness on the byte fallback: the chunk logprobs sum to the teacher's log-likelihood of the fallback
    tokenization (valid runs by its tokenizer, each invalid byte its single-byte token), after its prompt."""
    from transformers import AutoModelForCausalLM

    student, teacher, root = byte_pair
    build_model(root / "teacher384-model", "teacher", len(teacher), seed=2, size=(32, 2, 2, 64))
    model = AutoModelForCausalLM.from_pretrained(str(root / "teacher384-model")).eval()
    sv, tv = VocabBytes.of(student), VocabBytes.of(teacher)
    ids, _ = lone_bytes_completion(student)
    r = retokenize(ids, sv, teacher, tv)
    a = align(r)
    prompt = teacher("<|user|>1+3=<|assistant|>", add_special_tokens=False)["input_ids"]
    full = torch.tensor([[*prompt, *r.teacher_ids.tolist()]])
    with torch.no_grad():
        logp = torch.log_softmax(model(full).logits[0, :-1].double(), -1)
    shipped = chunk_logprobs(a, logp.gather(1, full[0, 1:, None])[:, 0].numpy()[len(prompt) - 1:])
    own = [*teacher("4", add_special_tokens=False)["input_ids"], byte_token(teacher, 0xC3),
           *teacher("1", add_special_tokens=False)["input_ids"], byte_token(teacher, 0xA9),
           *teacher("2", add_special_tokens=False)["input_ids"], teacher.eos_token_id]
    seq = torch.tensor([[*prompt, *own]])
    with torch.no_grad():
        ref = torch.log_softmax(model(seq).logits[0, :-1].double(), -1)
    expected = float(ref.gather(1, seq[0, 1:, None])[len(prompt) - 1:].sum())
    assert float(np.nansum(shipped)) == pytest.approx(expected, abs=1e-4)
    assert not np.isnan(shipped).any() and len(shipped) == a.chunks


class _NormalisingTeacher:
    """A teacher tokenizer that normalises what it reads (NBSP to a space), as NFKC normalisers do."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok

    def __call__(self, text: str, **kw: Any) -> Any:
        return self.tok(text.replace("\u00a0", " "), **kw)


def test_chunk_sums_are_the_teachers_log_likelihood_of_the_text(pair: tuple[Any, Any, Path]) -> None:
    """Exactness: over random texts and both directions, the chunk logprobs sum to the teacher's own
    log-likelihood of the completion text under its tokenization, after its prompt (to 1e-4)."""
    from transformers import AutoModelForCausalLM

    student, teacher, root = pair
    torch.manual_seed(0)
    build_model(root / "teacher-model", "teacher", len(teacher), seed=1, size=(32, 2, 2, 64))
    model = AutoModelForCausalLM.from_pretrained(str(root / "teacher-model")).eval()
    sv, tv = VocabBytes.of(student), VocabBytes.of(teacher)
    rng = random.Random(1)
    prompt = teacher("<|user|>what is 2+2?<|assistant|>", add_special_tokens=False)["input_ids"]
    for _ in range(12):
        text = random_text(rng, rng.randint(5, 80))
        ids = split_tokenization(student, text, rng)
        r = retokenize([*ids, student.eos_token_id], sv, teacher, tv)
        a = align(r)
        full = torch.tensor([[*prompt, *r.teacher_ids.tolist()]])
        with torch.no_grad():
            logp = torch.log_softmax(model(full).logits[0, :-1].double(), -1)
        token_lp = logp.gather(1, full[0, 1:, None])[:, 0].numpy()[len(prompt) - 1:]
        shipped = chunk_logprobs(a, token_lp)
        # independently: the teacher's canonical encoding of the text, then its end of sequence
        own = [*teacher(text, add_special_tokens=False)["input_ids"], teacher.eos_token_id]
        seq = torch.tensor([[*prompt, *own]])
        with torch.no_grad():
            ref = torch.log_softmax(model(seq).logits[0, :-1].double(), -1)
        expected = float(ref.gather(1, seq[0, 1:, None])[len(prompt) - 1:].sum())
        assert float(np.nansum(shipped)) == pytest.approx(expected, abs=1e-4)
        assert a.last_positions()[-1] == len(ids)  # the end-of-sequence chunk ships on its own position


def test_topk_maps_by_equal_bytes_and_the_rest_is_tail(pair: tuple[Any, Any, Path]) -> None:
    student, teacher, _ = pair
    sv, tv = VocabBytes.of(student), VocabBytes.of(teacher)
    vmap = vocab_map(tv, sv)
    mapped = np.flatnonzero(vmap >= 0)
    assert len(mapped) > 50
    for t in mapped[:200]:
        tb, sb = tv.pieces[int(t)], sv.pieces[int(vmap[t])]
        assert (tb == sb) or (tb is None and sv.special.get(int(vmap[t])) == tv.special.get(int(t)))
    unmapped = int(np.flatnonzero(vmap < 0)[0])
    ids = np.array([[int(mapped[5]), unmapped, int(mapped[9])]])
    lp = np.log(np.array([[0.5, 0.3, 0.1]]))
    s_ids, s_lp, tail = map_topk(ids, lp, vmap)
    assert s_ids[0, 1] == -1 and s_lp[0, 1] == -np.inf
    assert s_ids[0, 0] == vmap[mapped[5]] and s_lp[0, 0] == pytest.approx(np.log(0.5))
    assert tail[0] == pytest.approx(np.log(0.4), rel=1e-5)  # 0.3 unmapped + 0.1 outside the top-3


def test_boundary_starts_name_the_teacher_row_that_predicts_the_same_bytes(pair: tuple[Any, Any, Path]) -> None:
    student, teacher, _ = pair
    sv, tv = VocabBytes.of(student), VocabBytes.of(teacher)
    ids = student("the lazy cat sat", add_special_tokens=False)["input_ids"]
    r = retokenize(ids, sv, teacher, tv)
    a = align(r)
    starts = a.boundary_starts(len(ids))
    assert starts[0] == 0 and (starts >= 0).sum() == a.chunks
    offsets_s = np.concatenate([[0], np.cumsum(r.student_len)])
    offsets_t = np.concatenate([[0], np.cumsum(r.teacher_len)])  # the prepended space already taken off
    for p in np.flatnonzero(starts >= 0):
        assert offsets_s[p] == offsets_t[starts[p]]
