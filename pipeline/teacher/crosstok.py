"""Cross-tokenizer alignment: a student's tokens and a teacher's tokens of the same text, aligned by bytes.

Pure (numpy and the tokenizers' vocabularies; no model, no Redis). The teacher-scoring side of a pair whose
tokenizers differ uses it in three steps:

1. ``VocabBytes.of(tokenizer)`` once per tokenizer at start-up: the UTF-8 bytes of every id (byte-level BPE:
   the GPT-2 byte alphabet undone; SentencePiece style: ``▁`` is a space and ``<0xNN>`` a byte), and which ids
   are special (added special tokens such as ``<|im_end|>``: markup, not text).
2. ``retokenize(student_ids, student_vocab, teacher, teacher_vocab)``: the student's completion as text, split at
   its special tokens into text segments, each segment encoded by the teacher's tokenizer on its own, each special
   token mapped to the teacher's special token of the same content (or the student's end-of-sequence to the
   teacher's). Where a segment's bytes are not UTF-8 (a byte-level student writing a byte that does not form a
   character), its valid runs are encoded apart and each invalid byte becomes the teacher's single-byte token for
   it (**byte fallback**: a byte-level BPE has all 256, a SentencePiece-style tokenizer its ``<0xNN>`` tokens;
   ``Retokenized.teacher_fallback`` marks them). A segment with a byte the teacher has no token for, or that the
   teacher's tokenizer does not give back byte for byte, fails the round trip (``RoundTripError``: the group's
   payload is dropped with the reason ``cross_tokenizer: ...``).
   With ``loss_mask=`` it does it for a whole sequence (prompt, completions, later turns), also cutting at every
   ``loss_mask`` transition so that no chunk straddles trained and untrained tokens (the teacher worker's
   ``--cross-tokenizer``, ``pipeline.teacher.crossscore``).
3. ``align(...)``: the two tokenizations' byte boundaries; every boundary both share closes an **aligned chunk**
   (a run of student tokens covering exactly the bytes of a run of teacher tokens). ``chunk_logprobs`` sums the
   teacher's token logprobs per chunk: the sum over a completion's chunks is the teacher's log-likelihood of the
   completion text under its own tokenization, exactly (with byte fallback: of that tokenization, which is one of
   the byte string's tokenizations, so a lower bound of the teacher's probability of the bytes).

Rules at the edges:
- **The first completion token.** The teacher's prompt is tokenized apart from the completion (its own chat
  template over the same turns, or the decoded prompt text), so the prompt/completion border is a boundary of
  both: the first chunk starts at the first completion token and is conditioned on the teacher's prompt.
- **Special tokens.** A special token of the completion is a chunk of its own: one student token, one teacher
  token (same content, or end-of-sequence for end-of-sequence). One the teacher has no counterpart for is a chunk
  with no teacher token: it carries no signal (``Alignment.unmapped``), and the text on both sides of it is
  aligned apart.
- **Top-k.** At a student position whose token starts at a shared boundary, the teacher's next-token distribution
  predicts the same bytes: its top-k ids are mapped to student ids by equal bytes (``vocab_map``), the mass of the
  entries that do not map is the tail (``map_topk``). Elsewhere a row carries the chunk signal only.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import numpy as np
import numpy.typing as npt

from pipeline.errors import WireFormatError

#: The reason prefix of a group whose text does not survive the teacher's tokenizer.
CROSS_TOKENIZER = "cross_tokenizer"


class RoundTripError(WireFormatError, ValueError):
    """The student's text does not come back byte for byte through the teacher's tokenizer, or has a byte that is not
    UTF-8 text and that the teacher has no single-byte token for."""


@cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character standing for each byte, inverted."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _decoder_kinds(tokenizer: Any) -> set[str]:
    """The ``type`` names in the fast tokenizer's decoder (``ByteLevel``, ``Metaspace``, ``ByteFallback``...)."""
    spec = json.loads(tokenizer.backend_tokenizer.to_str()).get("decoder") or {}
    kinds: set[str] = set()
    stack = [spec]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if "type" in node:
                kinds.add(str(node["type"]))
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return kinds


def _piece_bytes(piece: str, byte_level: bool) -> bytes | None:
    if byte_level:
        table = _byte_decoder()
        try:
            return bytes(table[c] for c in piece)
        except KeyError:
            return None
    if _is_byte_piece(piece):
        try:
            return bytes([int(piece[3:5], 16)])
        except ValueError:
            return None
    return piece.replace("▁", " ").encode("utf-8")


@dataclass(frozen=True)
class VocabBytes:
    """Every id's bytes (``None`` for a special token or an id with no text) and the special tokens' contents."""

    pieces: list[bytes | None]
    special: dict[int, str]
    eos_id: int | None
    #: True where encoding a text puts a space before it (SentencePiece's ``prepend_scheme``).
    prepends_space: bool = False
    _by_content: dict[str, int] = field(default_factory=dict, repr=False)
    #: byte value -> the id whose text is that one byte (byte-level BPE: all 256; SentencePiece: ``<0xNN>``)
    _by_byte: dict[int, int] = field(default_factory=dict, repr=False)

    @classmethod
    def of(cls, tokenizer: Any) -> VocabBytes:
        """The table of a transformers fast tokenizer (byte-level BPE or SentencePiece style)."""
        kinds = _decoder_kinds(tokenizer)
        byte_level = "ByteLevel" in kinds
        size = len(tokenizer)
        marked = set(tokenizer.all_special_tokens) | {str(t) for t in _added_special(tokenizer)}
        special = {int(i): str(t) for t, i in tokenizer.get_vocab().items()
                   if t in marked and not _is_byte_piece(str(t))}
        pieces: list[bytes | None] = [None] * size
        for i, piece in enumerate(tokenizer.convert_ids_to_tokens(list(range(size)))):
            if i not in special and piece is not None:
                pieces[i] = _piece_bytes(piece, byte_level)
        prepends = not byte_level and bool(tokenizer("a", add_special_tokens=False)["input_ids"]) and \
            (pieces[tokenizer("a", add_special_tokens=False)["input_ids"][0]] or b"").startswith(b" ")
        eos = tokenizer.eos_token_id
        by_byte: dict[int, int] = {}
        for i, p in enumerate(pieces):
            if p is not None and len(p) == 1:
                by_byte.setdefault(p[0], i)
        return cls(pieces, special, int(eos) if eos is not None else None, prepends,
                   {content: i for i, content in special.items()}, by_byte)

    def special_id(self, content: str) -> int | None:
        return self._by_content.get(content)

    def byte_id(self, byte: int) -> int | None:
        """The id whose text is the single byte ``byte`` (``None``: the vocabulary has no such token)."""
        return self._by_byte.get(byte)

    def __len__(self) -> int:
        return len(self.pieces)


def _added_special(tokenizer: Any) -> list[str]:
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return [str(t) for t in decoder.values() if getattr(t, "special", False)]


def _is_byte_piece(piece: str) -> bool:
    """SentencePiece's byte fallback: ``<0xNN>`` (a byte, not markup, even where it is registered as special)."""
    return len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">")


@dataclass(frozen=True)
class Retokenized:
    """The teacher's tokens of a student completion, and each side's token lengths in bytes.

    ``teacher_ids`` starts where the completion starts (the teacher's prompt is not in it). ``parts``: the
    completion's text segments and special tokens in order, each as ``(student [start, end), teacher [start,
    end), is_text)`` token ranges; a special token the teacher has no counterpart for has an empty teacher range.
    """

    teacher_ids: npt.NDArray[np.int32]
    student_len: npt.NDArray[np.int64]
    teacher_len: npt.NDArray[np.int64]
    parts: list[tuple[tuple[int, int], tuple[int, int], bool]]
    #: leading bytes of a teacher token that are not the student's text (1: the space SentencePiece puts before
    #: a segment's first token), so a token's text is ``pieces[id][skip:]``
    teacher_skip: npt.NDArray[np.int64]
    #: teacher tokens that stand for one byte of a segment that is not UTF-8 (byte fallback), ``[len(teacher_ids)]``
    teacher_fallback: npt.NDArray[np.bool_]

    @property
    def fallback_bytes(self) -> int:
        """Bytes given to the teacher as single-byte tokens because they are not UTF-8 text."""
        return int(self.teacher_fallback.sum())

    def teacher_text(self, vocab: VocabBytes, start: int, end: int) -> bytes:
        """The student text that teacher tokens ``[start, end)`` cover."""
        return b"".join((vocab.pieces[int(t)] or b"")[int(k):]
                        for t, k in zip(self.teacher_ids[start:end], self.teacher_skip[start:end], strict=True))


def _text(ids: Sequence[int], vocab: VocabBytes) -> bytes:
    parts = [vocab.pieces[t] if 0 <= t < len(vocab) else None for t in ids]
    for t, p in zip(ids, parts, strict=True):
        if p is None:
            raise RoundTripError(f"{CROSS_TOKENIZER}: student token {t} has no text")
    return b"".join(p for p in parts if p is not None)


def _encode(text: str, raw: bytes, teacher: Any, vocab: VocabBytes) -> tuple[list[int], list[int], int]:
    enc = [int(t) for t in teacher(text, add_special_tokens=False)["input_ids"]]
    pieces = [vocab.pieces[t] if 0 <= t < len(vocab) else None for t in enc]
    if any(p is None for p in pieces):
        raise RoundTripError(f"{CROSS_TOKENIZER}: the teacher's tokenizer turned text into a special token")
    lens = [len(p) for p in pieces if p is not None]
    got = b"".join(p for p in pieces if p is not None)
    skip = 0
    if got != raw and vocab.prepends_space and got == b" " + raw and lens and lens[0] >= 1:
        lens[0] -= 1  # the space SentencePiece puts before a text is not the student's
        got, skip = raw, 1
    if got != raw:
        raise RoundTripError(f"{CROSS_TOKENIZER}: the teacher's tokenizer changes the text "
                             f"({raw[:40]!r} -> {got[:40]!r})")
    return enc, lens, skip


def _encode_bytes(raw: bytes, teacher: Any, vocab: VocabBytes) -> tuple[list[int], list[int], list[int], list[bool]]:
    """The teacher's tokens of one text segment's bytes, their lengths in bytes, skips and fallback marks: each
    run of valid UTF-8 encoded by the teacher's tokenizer (``_encode``), each byte outside such a run the
    teacher's single-byte token for it (``RoundTripError`` where it has none)."""
    ids: list[int] = []
    lens: list[int] = []
    skips: list[int] = []
    fallback: list[bool] = []
    pos = 0
    while pos < len(raw):
        try:
            raw[pos:].decode("utf-8")
            good, bad = len(raw), len(raw)
        except UnicodeDecodeError as e:
            good, bad = pos + e.start, pos + e.end
        if good > pos:
            enc, run_lens, skip = _encode(raw[pos:good].decode("utf-8"), raw[pos:good], teacher, vocab)
            ids += enc
            lens += run_lens
            skips += [skip] + [0] * (len(enc) - 1) if enc else []
            fallback += [False] * len(enc)
        for at in range(good, bad):
            t = vocab.byte_id(raw[at])
            if t is None:
                raise RoundTripError(f"{CROSS_TOKENIZER}: the completion is not UTF-8 text at byte {at} of a "
                                     f"segment (0x{raw[at]:02X}) and the teacher has no token for that byte")
            ids.append(t)
            lens.append(1)
            skips.append(0)
            fallback.append(True)
        pos = bad
    return ids, lens, skips, fallback


def retokenize(student_ids: Sequence[int], student: VocabBytes, teacher: Any, teacher_vocab: VocabBytes,
               loss_mask: Sequence[int] | npt.NDArray[np.generic] | None = None) -> Retokenized:
    """The teacher's tokenization of the student's ``student_ids`` (see the module's rules). With ``loss_mask``
    ``[L]`` (a whole sequence: prompt, completions, later turns), text segments are also cut at every change of
    the mask, so each trained span starts and ends on a boundary of both tokenizations and no aligned chunk
    straddles trained and untrained tokens (each run of equal mask is encoded apart)."""
    ids = [int(t) for t in student_ids]
    mask = None if loss_mask is None else np.asarray(loss_mask).astype(np.bool_)
    if mask is not None and mask.shape != (len(ids),):
        raise ValueError(f"loss_mask has shape {mask.shape}, expected ({len(ids)},)")
    s_len = np.zeros(len(ids), dtype=np.int64)
    t_ids: list[int] = []
    t_len: list[int] = []
    t_skip: list[int] = []
    t_fallback: list[bool] = []
    parts: list[tuple[tuple[int, int], tuple[int, int], bool]] = []
    i = 0
    while i < len(ids):
        if ids[i] in student.special:
            match = teacher_vocab.special_id(student.special[ids[i]])
            if match is None and ids[i] == student.eos_id:
                match = teacher_vocab.eos_id
            j = len(t_ids)
            if match is not None:
                t_ids.append(int(match))
                t_len.append(0)
                t_skip.append(0)
                t_fallback.append(False)
            parts.append(((i, i + 1), (j, len(t_ids)), False))
            i += 1
            continue
        end = i
        while end < len(ids) and ids[end] not in student.special and (mask is None or mask[end] == mask[i]):
            end += 1
        enc, lens, skips, fallback = _encode_bytes(_text(ids[i:end], student), teacher, teacher_vocab)
        s_len[i:end] = [len(student.pieces[t] or b"") for t in ids[i:end]]
        j = len(t_ids)
        t_ids.extend(enc)
        t_len.extend(lens)
        t_skip.extend(skips)
        t_fallback.extend(fallback)
        parts.append(((i, end), (j, len(t_ids)), True))
        i = end
    return Retokenized(np.asarray(t_ids, dtype=np.int32), s_len, np.asarray(t_len, dtype=np.int64), parts,
                       np.asarray(t_skip, dtype=np.int64), np.asarray(t_fallback, dtype=np.bool_))


@dataclass(frozen=True)
class Alignment:
    """Aligned chunks: ``student[c]`` and ``teacher[c]`` are ``[start, end)`` token ranges covering the same bytes.

    A chunk with an empty teacher range is a special token the teacher has no counterpart for (``unmapped``)."""

    student: npt.NDArray[np.int64]  # [C, 2]
    teacher: npt.NDArray[np.int64]  # [C, 2]

    @property
    def chunks(self) -> int:
        return int(self.student.shape[0])

    @property
    def unmapped(self) -> int:
        return int(np.sum(self.teacher[:, 1] == self.teacher[:, 0]))

    def last_positions(self) -> npt.NDArray[np.int64]:
        """The last student position of every chunk (where its signal is shipped)."""
        return self.student[:, 1] - 1

    def one_to_one(self) -> npt.NDArray[np.bool_]:
        """Chunks of one student and one teacher token: there the per-token signal is exact."""
        one: npt.NDArray[np.bool_] = (self.student[:, 1] - self.student[:, 0] == 1) & \
            (self.teacher[:, 1] - self.teacher[:, 0] == 1)
        return one

    def boundary_starts(self, n_student: int) -> npt.NDArray[np.int64]:
        """For each student position, the teacher position whose token starts at the same byte (``-1``: none):
        the first token of every chunk with a teacher side."""
        out = np.full(n_student, -1, dtype=np.int64)
        has = self.teacher[:, 1] > self.teacher[:, 0]
        out[self.student[has, 0]] = self.teacher[has, 0]
        return out


def _cut(s_len: npt.NDArray[np.int64], t_len: npt.NDArray[np.int64]) -> tuple[npt.NDArray[np.int64], ...]:
    """Chunk ends (exclusive, relative token indexes) of one text segment on each side: every byte offset both
    cumulative sums reach closes a chunk; a zero-length token joins the chunk its end falls in."""
    s_end, t_end = np.cumsum(s_len), np.cumsum(t_len)
    if s_end[-1] != t_end[-1]:
        raise AssertionError("the two tokenizations of one segment cover different bytes")
    shared = np.intersect1d(s_end[s_end > 0], t_end[t_end > 0])
    s_cut = np.searchsorted(s_end, shared, side="right")
    t_cut = np.searchsorted(t_end, shared, side="right")
    s_cut[-1], t_cut[-1] = len(s_len), len(t_len)
    return s_cut, t_cut


def align(r: Retokenized) -> Alignment:
    """The aligned chunks of a ``Retokenized`` pair: each text segment cut at every byte offset both sides share,
    each special token a chunk of its own."""
    s_chunks: list[npt.NDArray[np.int64]] = []
    t_chunks: list[npt.NDArray[np.int64]] = []
    for (s0, s1), (t0, t1), is_text in r.parts:
        if not is_text:
            s_chunks.append(np.array([[s0, s1]], dtype=np.int64))
            t_chunks.append(np.array([[t0, t1]], dtype=np.int64))
            continue
        s_cut, t_cut = _cut(r.student_len[s0:s1], r.teacher_len[t0:t1])
        s_starts = np.concatenate([[0], s_cut[:-1]])
        t_starts = np.concatenate([[0], t_cut[:-1]])
        s_chunks.append(np.stack([s0 + s_starts, s0 + s_cut], axis=1))
        t_chunks.append(np.stack([t0 + t_starts, t0 + t_cut], axis=1))
    if not s_chunks:
        empty = np.zeros((0, 2), dtype=np.int64)
        return Alignment(empty, empty.copy())
    return Alignment(np.concatenate(s_chunks), np.concatenate(t_chunks))


def chunk_logprobs(a: Alignment, teacher_logprobs: npt.NDArray[np.floating[Any]]) -> npt.NDArray[np.float64]:
    """The teacher's log-probability of each chunk's text: the sum of its teacher tokens' logprobs
    (``teacher_logprobs[t]``: the teacher's logprob of completion token ``t``). ``nan`` for an unmapped chunk."""
    lp = np.asarray(teacher_logprobs, dtype=np.float64)
    csum = np.concatenate([[0.0], np.cumsum(lp)])
    out: npt.NDArray[np.float64] = csum[a.teacher[:, 1]] - csum[a.teacher[:, 0]]
    out[a.teacher[:, 1] == a.teacher[:, 0]] = np.nan
    return out


def vocab_map(teacher: VocabBytes, student: VocabBytes) -> npt.NDArray[np.int32]:
    """For each teacher id, the student id with the same bytes (``-1``: none); special tokens by content."""
    by_bytes: dict[bytes, int] = {}
    for i, p in enumerate(student.pieces):
        if p is not None:
            by_bytes.setdefault(p, i)
    out = np.full(len(teacher), -1, dtype=np.int32)
    for i, p in enumerate(teacher.pieces):
        if p is not None:
            out[i] = by_bytes.get(p, -1)
    for i, content in teacher.special.items():
        match = student.special_id(content)
        if match is not None and i < len(out):
            out[i] = match
    return out


Mapped = tuple[npt.NDArray[np.int32], npt.NDArray[np.float32], npt.NDArray[np.float32]]


def map_topk(topk_ids: npt.NDArray[np.integer[Any]], topk_logprobs: npt.NDArray[np.floating[Any]],
             vmap: npt.NDArray[np.int32]) -> Mapped:
    """Teacher top-k rows ``[R, k]`` in student ids: ids ``-1`` where an entry does not map (its logprob
    ``-inf``), and the tail: the log of the probability mass not mapped into the student's vocabulary (the
    unmapped entries plus everything outside the teacher's top-k), ``[R]``."""
    ids = vmap[np.asarray(topk_ids, dtype=np.int64)]
    lp = np.asarray(topk_logprobs, dtype=np.float32)
    mapped = ids >= 0
    out_lp = np.where(mapped, lp, -np.inf).astype(np.float32)
    kept = np.where(mapped, np.exp(lp.astype(np.float64)), 0.0).sum(axis=1)
    tail = np.log(np.clip(1.0 - kept, 1e-30, None)).astype(np.float32)
    return ids.astype(np.int32), out_lp, tail
