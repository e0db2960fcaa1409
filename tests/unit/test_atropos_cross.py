"""``to_atropos`` of a group scored by a teacher of another tokenizer: entries only where the teacher's view of the
student token is per token, empty top-k slots left out, the actual token first; such distill arrays are not read
back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pipeline.teacher.crossscore import CrossTokenizer
from schemas import DecodeError, DistillStatus, Limits, RolloutGroup, ScoredGroup, decode, encode
from schemas.arrays import UINT8, Array
from schemas.atropos import CROSS_KEY, rollout_from_atropos, rollout_group_from_atropos, to_atropos
from schemas.build import make_sequence, make_teacher, synthetic_rollout, synthetic_scored
from schemas.messages import SCHEMA_VERSION, TeacherPayload
from schemas.validate import validate
from tests.unit.test_crossscore import BigramTeacher, cross, group_of, score, tokenizers  # noqa: F401 (fixtures)

TOKENS = [1, 2, 3, 10, 11, 12, 13, 14]
MASK = [0, 0, 0, 1, 1, 1, 1, 1]
E = -100.0  # an empty slot's logprob
#: Per trained row (tokens 10..14): chunk_last, the chunk logprob, the top-k (id, logprob, mapped).
#:   token 10: a chunk of its own, in the mapped slots        -> its mapped slots, itself first
#:   token 11: first of the chunk 11-12, not mapped           -> []
#:   token 12: last of the chunk 11-12 (its logprob is both's) -> []
#:   token 13: a special the teacher has no counterpart for   -> []
#:   token 14: a chunk of its own, not mapped                 -> itself with the chunk logprob, then the mapped slots
ROWS = [
    (1, -0.5, [(20, -0.4, 1), (10, -0.5, 1), (0, E, 0)]),
    (0, 0.0, [(21, -0.7, 1), (0, E, 0), (0, E, 0)]),
    (1, -2.0, [(0, E, 0), (0, E, 0), (0, E, 0)]),
    (2, 0.0, [(0, E, 0), (0, E, 0), (0, E, 0)]),
    (1, -3.0, [(22, -0.2, 1), (23, -1.0, 1), (0, E, 0)]),
]
WANT_IDS = [[], [], [], [10, 20], [], [], [], [14, 22, 23]]
WANT_LPS = [[], [], [], [-0.5, -0.4], [], [], [], [-3.0, -0.2, -1.0]]


def cross_payload() -> TeacherPayload:
    ids = np.array([[i for i, _, _ in slots] for _, _, slots in ROWS], np.int32)
    lps = np.array([[lp for _, lp, _ in slots] for _, _, slots in ROWS], np.float32)
    mapped = np.array([[m for _, _, m in slots] for _, _, slots in ROWS], np.uint8)
    t = make_teacher(ids, lps, np.array([q for _, q, _ in ROWS], np.float32), rows=np.arange(2, 7))
    return TeacherPayload(k=t.k, topk_ids=t.topk_ids, topk_logprobs=t.topk_logprobs,
                          sampled_logprobs=t.sampled_logprobs, rows=t.rows,
                          chunk_last=Array.from_numpy(np.array([c for c, _, _ in ROWS], np.uint8), UINT8),
                          topk_mapped=Array.from_numpy(mapped, UINT8))


def cross_group(gid: str = "cross") -> ScoredGroup:
    """One sequence scored by a teacher of another tokenizer (a valid schema 3 group)."""
    seq = make_sequence(np.array(TOKENS, np.int32), np.array(MASK), logprobs=np.full(len(TOKENS), -1.0))
    g = ScoredGroup(group=RolloutGroup(group_id=gid, sequences=[seq]), status=DistillStatus.OK,
                    teacher=[cross_payload()], k=3, teacher_id="bigram tokenizer=teacher", schema=SCHEMA_VERSION)
    validate(g, Limits())
    return g


def test_only_per_token_entries_are_written_without_empty_slots() -> None:
    g = decode(encode(cross_group()), Limits())
    out = to_atropos(g)  # type: ignore[arg-type]
    assert out["distill_token_ids"] == [WANT_IDS]
    assert out["distill_logprobs"] == [[pytest.approx(e) for e in row] for row in [WANT_LPS]]
    assert out["teacher"] == {"pool": "default", "model": "bigram tokenizer=teacher", "k": 3, CROSS_KEY: True}
    assert out["distill_top_k"] == 3 and out["distill_status"] == "ok"


def test_a_same_tokenizer_group_is_written_as_before() -> None:
    out = to_atropos(synthetic_scored(synthetic_rollout(2, 8, group_id="same"), k=3))
    assert CROSS_KEY not in out["teacher"]
    assert all(len(e) in (3, 4) for seq in out["distill_token_ids"] for e in seq[1:] if e)
    assert rollout_from_atropos(out).group_id == "same"  # read back


def test_cross_entries_are_refused_read_back_but_the_rollout_is_kept() -> None:
    out = to_atropos(cross_group())
    with pytest.raises(DecodeError) as e:
        rollout_from_atropos(out)
    assert e.value.field == f"teacher.{CROSS_KEY}" and "another tokenizer" in e.value.reason
    back = rollout_group_from_atropos(out)
    assert back.sequences[0].tokens.numpy().tolist() == TOKENS
    plain = rollout_from_atropos({k: v for k, v in out.items() if k not in ("distill_token_ids", "distill_logprobs")})
    assert isinstance(plain, RolloutGroup)


@pytest.mark.timeout(120)
def test_a_scored_cross_group_has_the_actual_token_first_and_only_mapped_slots(
        tokenizers: tuple[Any, Any, Path, Path], cross: CrossTokenizer) -> None:  # noqa: F811
    student, teacher_tok, _, _ = tokenizers
    (g,) = score(cross, BigramTeacher(len(teacher_tok)), [group_of(student, tool_in_answer=True)])
    out = to_atropos(g)
    kinds = {"mapped": 0, "own_chunk": 0}
    for s, (seq, t) in enumerate(zip(g.group.sequences, g.teacher or [], strict=True)):
        assert t.chunk_last is not None and t.topk_mapped is not None
        toks = seq.tokens.numpy()
        rows = t.row_index(len(toks)).tolist()
        last, mapped = t.chunk_last.numpy(), t.topk_mapped.numpy().astype(bool)
        ids, lps, sampled = t.topk_ids.numpy(), t.topk_logprobs.numpy(), t.sampled_logprobs.numpy()
        entries, values = out["distill_token_ids"][s], out["distill_logprobs"][s]
        assert len(entries) == len(toks) and entries[0] == []
        for j, r in enumerate(rows):
            e, v = entries[r + 1], values[r + 1]
            slots = ids[j][mapped[j]].tolist()
            by_id = dict(zip(slots, lps[j][mapped[j]].tolist(), strict=True))
            own = last[j] == 1 and (j == 0 or rows[j - 1] != r - 1 or last[j - 1] != 0)  # a chunk of one token
            if int(toks[r + 1]) in by_id:
                kinds["mapped"] += 1
                assert e[0] == int(toks[r + 1]) and sorted(e) == sorted(slots)  # itself first, no padding
                assert v == [pytest.approx(by_id[i]) for i in e]
            elif own:
                kinds["own_chunk"] += 1
                assert e == [int(toks[r + 1]), *slots]
                assert v == [pytest.approx(float(sampled[j])), *(pytest.approx(by_id[i]) for i in slots)]
            else:
                assert e == [] and v == []
    assert kinds["own_chunk"] > 0  # (a random bigram teacher's top-k rarely holds the actual token: see above)
