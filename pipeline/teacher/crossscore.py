"""Scoring a student sequence with a teacher of another tokenizer: the conversion both ways, pure.

No model and no Redis: ``CrossTokenizer`` holds both vocabularies (``pipeline.teacher.crosstok``) and
``convert`` turns one student sequence into a ``ScoreRequest`` over the teacher's ids plus a ``CrossPlan`` that
turns the teacher's ``ScoreResult`` back into a ``TeacherPayload`` in student positions (the wire contract in
``schemas.messages``: ``chunk_last``, ``topk_mapped``). The scoring stage (``pipeline.stages.scoring``) calls
the backend between the two.

The teacher's sequence is the student's whole sequence (prompt, completions, later turns) as text, cut into
segments at special tokens and at every ``loss_mask`` transition (``retokenize(loss_mask=)``), each text segment
encoded by the teacher's tokenizer, each special token mapped by content (the student's end of sequence to the
teacher's), and the teacher's BOS put first when its tokenizer adds one by default. It is not the teacher's chat
template over the messages: the bytes the teacher scores are exactly the bytes the student produced and saw.
Where both families use the same markup (ChatML for SmolLM2 and Qwen2) it is the teacher's template too.

A byte of the student's text that is not UTF-8 is given to the teacher as its single-byte token for that byte
(``crosstok``'s byte fallback; ``CrossStats.fallback_bytes`` counts those of trained chunks).

Per trained aligned chunk (``crosstok.align``): the sum of its teacher tokens' sampled logprobs on its last
student row (``chunk_last`` 1), or no signal for a special token the teacher has no counterpart for
(``chunk_last`` 2). At a trained row whose token starts on a boundary both tokenizations share (and whose teacher
token is not one that carries a space a SentencePiece-style teacher put before its segment), the teacher's
row predicting that teacher token, its top-k mapped to student ids by equal bytes (mapped entries first, in the
teacher's order; ``topk_mapped`` marks them); other rows' slots are empty (id 0, ``EMPTY_LOGPROB`` or the row's
lowest mapped logprob if lower, so a row stays sorted).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from pipeline.teacher.base import ScoreRequest, ScoreResult
from pipeline.teacher.crosstok import (
    CROSS_TOKENIZER,
    Alignment,
    RoundTripError,
    VocabBytes,
    align,
    chunk_logprobs,
    map_topk,
    retokenize,
    vocab_map,
)
from schemas.arrays import UINT8, Array
from schemas.build import make_teacher
from schemas.messages import CHUNK_LAST, CHUNK_NO_SIGNAL, TeacherPayload

#: The logprob of an empty top-k slot (readers ignore it; it only has to be a valid logprob).
EMPTY_LOGPROB: Final = -100.0


@dataclass(frozen=True)
class CrossTokenizer:
    """A student/teacher tokenizer pair: both byte tables, the teacher's tokenizer (to encode text), the map of
    teacher ids to student ids, and the teacher's BOS if its tokenizer adds one by default."""

    student: VocabBytes
    teacher_vocab: VocabBytes
    teacher: Any
    vmap: npt.NDArray[np.int32]
    bos_id: int | None
    name: str = ""

    @classmethod
    def of(cls, teacher: Any, student: Any, name: str = "") -> CrossTokenizer:
        """From two loaded transformers fast tokenizers."""
        sv, tv = VocabBytes.of(student), VocabBytes.of(teacher)
        return cls(sv, tv, teacher, vocab_map(tv, sv), _default_bos(teacher), name)

    @classmethod
    def load(cls, teacher_path: str | Path, student_path: str | Path) -> CrossTokenizer:
        """From two local tokenizer folders (nothing is downloaded for a local path)."""
        from transformers import AutoTokenizer

        teacher = AutoTokenizer.from_pretrained(str(teacher_path))
        student = AutoTokenizer.from_pretrained(str(student_path))
        return cls.of(teacher, student, Path(str(teacher_path)).name or str(teacher_path))

    def mapped_share(self) -> float:
        """The share of the teacher's ids with text or special content that map to a student id."""
        has = np.array([p is not None for p in self.teacher_vocab.pieces]) | \
            np.isin(np.arange(len(self.teacher_vocab)), list(self.teacher_vocab.special))
        return float((self.vmap[has] >= 0).mean()) if has.any() else 0.0

    def convert(self, tokens: npt.NDArray[Any], loss_mask: npt.NDArray[Any], k: int) -> CrossPlan:
        """The teacher's request for one student sequence, and how its answer maps back (``RoundTripError``
        with a ``cross_tokenizer: ...`` reason when the text does not survive the teacher's tokenizer)."""
        return convert(tokens, loss_mask, k, self)


def _default_bos(teacher: Any) -> int | None:
    bos = getattr(teacher, "bos_token_id", None)
    if bos is None:
        return None
    with_sp = list(teacher("a")["input_ids"])
    without = list(teacher("a", add_special_tokens=False)["input_ids"])
    return int(bos) if len(with_sp) > len(without) and with_sp and with_sp[0] == bos else None


@dataclass(frozen=True)
class CrossStats:
    """Per sequence or summed: trained student tokens, those in chunks with teacher signal, and at the rows whose
    top-k was looked up, the teacher's top-k probability mass and the part of it that mapped."""

    trained: int = 0
    aligned: int = 0
    topk_mass: float = 0.0
    mapped_mass: float = 0.0
    #: bytes of trained chunks that are not UTF-8 text, given to the teacher as single-byte tokens (byte fallback)
    fallback_bytes: int = 0

    def __add__(self, o: CrossStats) -> CrossStats:
        return CrossStats(self.trained + o.trained, self.aligned + o.aligned, self.topk_mass + o.topk_mass,
                          self.mapped_mass + o.mapped_mass, self.fallback_bytes + o.fallback_bytes)


@dataclass(frozen=True)
class CrossPlan:
    """One converted sequence. ``request``: the teacher's ids and the teacher rows wanted (those predicting the
    teacher tokens of trained chunks). The rest maps its answer back to the student's trained ``rows``."""

    request: ScoreRequest
    alignment: Alignment
    offset: int  # 1 when the teacher's BOS was put first: teacher token t of the alignment is request token t + 1
    rows: npt.NDArray[np.int32]  # the student's trained rows (the payload's rows)
    chunk_last: npt.NDArray[np.uint8]  # [R]
    last_chunk: npt.NDArray[np.int64]  # [R] the chunk whose last token row j predicts (-1 where chunk_last == 0)
    topk_at: npt.NDArray[np.int64]  # [R] index into the request's rows of the teacher row for the top-k, or -1
    vmap: npt.NDArray[np.int32]  # teacher id -> student id, -1 appended for ids outside the teacher's table
    fallback_bytes: int = 0  # teacher tokens of trained chunks that stand for a byte that is not UTF-8 text

    def payload(self, res: ScoreResult, *, fp16: bool = False) -> tuple[TeacherPayload, CrossStats]:
        """The payload in student positions from the teacher's answer to ``request`` (shapes checked before)."""
        r, k = self.rows.shape[0], self.request.k
        n_teacher = int(self.request.tokens.shape[0]) - self.offset
        dense = np.zeros(n_teacher, np.float64)  # teacher logprob per teacher token of the alignment
        req_rows = self.request.row_index()
        dense[req_rows.astype(np.int64) + 1 - self.offset] = res.sampled_logprobs
        chunk_lp = chunk_logprobs(self.alignment, dense)
        sampled = np.zeros(r, np.float32)
        last = self.chunk_last == CHUNK_LAST
        sampled[last] = chunk_lp[self.last_chunk[last]]
        ids = np.zeros((r, k), np.int32)
        lps = np.full((r, k), EMPTY_LOGPROB, np.float32)
        mapped = np.zeros((r, k), np.uint8)
        topk_mass = mapped_mass = 0.0
        at = np.flatnonzero(self.topk_at >= 0)
        if at.shape[0]:
            t_ids = res.topk_ids[self.topk_at[at]].astype(np.int64)
            t_lps = res.topk_logprobs[self.topk_at[at]].astype(np.float32)
            n_vocab = self.vmap.shape[0] - 1
            t_ids = np.where((t_ids >= 0) & (t_ids < n_vocab), t_ids, n_vocab)  # outside the table: unmapped
            s_ids, _, _ = map_topk(t_ids, t_lps, self.vmap)
            ok = s_ids >= 0
            order = np.argsort(~ok, axis=1, kind="stable")  # mapped first, each part in the teacher's order
            ok = np.take_along_axis(ok, order, 1)
            s_ids = np.take_along_axis(s_ids, order, 1)
            t_lps = np.take_along_axis(t_lps, order, 1)
            low = np.min(np.where(ok, t_lps, np.float32(0.0)), axis=1, keepdims=True)
            fill = np.minimum(np.float32(EMPTY_LOGPROB), low)
            ids[at] = np.where(ok, s_ids, 0)
            lps[at] = np.where(ok, t_lps, fill)
            mapped[at] = ok
            p = np.exp(t_lps.astype(np.float64))
            topk_mass, mapped_mass = float(p.sum()), float(p[ok].sum())
        t = make_teacher(ids, lps, sampled, fp16=fp16, rows=self.rows)
        payload = TeacherPayload(k=t.k, topk_ids=t.topk_ids, topk_logprobs=t.topk_logprobs,
                                 sampled_logprobs=t.sampled_logprobs, rows=t.rows,
                                 chunk_last=Array.from_numpy(self.chunk_last, UINT8),
                                 topk_mapped=Array.from_numpy(mapped, UINT8))
        return payload, CrossStats(r, int(self.aligned_rows()), topk_mass, mapped_mass, self.fallback_bytes)

    def aligned_rows(self) -> int:
        """Trained rows in chunks with teacher signal."""
        if not self.rows.shape[0]:
            return 0
        signal = np.zeros(self.alignment.chunks, np.bool_)
        signal[self.last_chunk[self.chunk_last == CHUNK_LAST]] = True
        return int(signal[self.chunk_of_rows()].sum())

    def chunk_of_rows(self) -> npt.NDArray[np.int64]:
        """The chunk of each trained row's token (``tokens[rows + 1]``)."""
        starts = self.alignment.student[:, 0]
        out: npt.NDArray[np.int64] = np.searchsorted(starts, self.rows.astype(np.int64) + 1, side="right") - 1
        return out


def convert(tokens: npt.NDArray[Any], loss_mask: npt.NDArray[Any], k: int, cross: CrossTokenizer) -> CrossPlan:
    """See ``CrossTokenizer.convert`` and the module docstring."""
    ids = np.asarray(tokens).astype(np.int64)
    mask = np.asarray(loss_mask).astype(np.bool_)
    n = ids.shape[0]
    r = retokenize(ids.tolist(), cross.student, cross.teacher, cross.teacher_vocab, loss_mask=mask)
    a = align(r)
    t_ids = r.teacher_ids.astype(np.int32)
    offset = 0
    if cross.bos_id is not None and not (t_ids.shape[0] and int(t_ids[0]) == cross.bos_id):
        t_ids = np.concatenate([np.array([cross.bos_id], np.int32), t_ids])
        offset = 1
    trained_chunk = mask[a.student[:, 0]] if a.chunks else np.zeros(0, np.bool_)
    t_lo, t_hi = a.teacher[trained_chunk, 0], a.teacher[trained_chunk, 1]
    if t_hi.shape[0] and offset == 0 and bool(np.any((t_lo == 0) & (t_hi > 0))):
        raise RoundTripError(f"{CROSS_TOKENIZER}: a trained token is the teacher's first token (no context to "
                             "score it in)")
    # teacher rows predicting the teacher tokens of trained chunks: token t (of the alignment) is request token
    # t + offset, predicted by row t + offset - 1
    counts = t_hi - t_lo
    tok = np.repeat(t_lo - np.cumsum(np.concatenate([[0], counts[:-1]])), counts) + np.arange(int(counts.sum()))
    req_rows = (tok + offset - 1).astype(np.int32)
    rows = np.flatnonzero(mask[1:]).astype(np.int32)
    chunk_last = np.zeros(rows.shape[0], np.uint8)
    last_chunk = np.full(rows.shape[0], -1, np.int64)
    trained_idx = np.flatnonzero(trained_chunk)
    last_row = a.student[trained_idx, 1] - 2  # the row predicting each trained chunk's last token
    j = np.searchsorted(rows, last_row)
    has_teacher = a.teacher[trained_idx, 1] > a.teacher[trained_idx, 0]
    chunk_last[j] = np.where(has_teacher, CHUNK_LAST, CHUNK_NO_SIGNAL)
    last_chunk[j] = trained_idx
    starts = a.boundary_starts(n)[rows.astype(np.int64) + 1]
    if starts.shape[0] and r.teacher_skip.shape[0]:
        # a teacher token carrying a space SentencePiece put before its segment: the teacher's row predicts bytes
        # the student's text does not have there, so no top-k from it
        starts = np.where((starts >= 0) & (r.teacher_skip[np.maximum(starts, 0)] > 0), -1, starts)
    topk_at = np.full(rows.shape[0], -1, np.int64)
    at = starts >= 0
    topk_at[at] = np.searchsorted(req_rows, starts[at] + offset - 1)
    vmap = np.append(cross.vmap, np.int32(-1)).astype(np.int32)
    request = ScoreRequest(t_ids, k, req_rows)
    fallback = int(r.teacher_fallback[tok].sum()) if tok.shape[0] else 0
    return CrossPlan(request, a, offset, rows, chunk_last, last_chunk, topk_at, vmap, fallback)
