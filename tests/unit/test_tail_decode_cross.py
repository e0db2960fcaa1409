"""``distillq tail --decode`` of a group scored by a teacher of another tokenizer: chunks and their
log-probabilities on their last token, mapped top-k slots only (no empty slot shown as id 0)."""

from __future__ import annotations

import argparse
import json

import pytest

from pipeline.cli.commands.tail import render
from pipeline.cli.summaries import decode_sequence, format_decoded
from pipeline.transport.producer import F_DATA, F_ID, F_TYPE
from schemas import encode
from schemas.atropos import CROSS_KEY
from schemas.build import synthetic_rollout, synthetic_scored
from tests.unit.test_atropos_cross import WANT_IDS, cross_group


class Tok:
    """Token ``i`` reads ``<i>``."""

    def decode(self, token_ids: list[int]) -> str:
        return "".join(f"<{i}>" for i in token_ids)

    def __len__(self) -> int:
        return 100


def test_chunks_are_shown_on_their_last_token_and_only_mapped_slots() -> None:
    d = decode_sequence(cross_group(), Tok(), top=5)
    assert d["cross"] is True
    rows = d["positions"]
    assert [r["pos"] for r in rows] == [3, 4, 5, 6, 7]
    assert [r["chunk"] for r in rows] == ["last", "inside", "last", "no_signal", "last"]
    assert [r["chunk_start"] for r in rows] == [3, 4, 4, 6, 7]
    assert [r["chunk_logprob"] for r in rows] == [-0.5, None, -2.0, None, -3.0]
    assert [r["student_chunk_logprob"] for r in rows] == [-1.0, None, -2.0, -1.0, -1.0]  # student: -1.0 per token
    assert all(r["teacher_logprob"] is None for r in rows)  # a chunk sum is no token's logprob
    assert [[e["id"] for e in r["topk"]] for r in rows] == [[20, 10], [21], [], [], [22, 23]]

    lines = format_decoded(d)
    text = "\n".join(lines)
    assert '"<0>"' not in text  # empty slots are padding
    assert "teacher top-2 mapped of 3" in text
    by_pos = {int(line.split()[0]): line for line in lines if line.strip().split(" ")[0].isdigit()}
    assert "4-5" in by_pos[5] and "-2.000" in by_pos[5] and by_pos[5].split().count("-2.000") == 2  # s and t
    assert "…" in by_pos[4] and "-2.000" not in by_pos[4]
    assert "6 none" in by_pos[6]
    assert '"<22>" -0.200  "<23>" -1.000' in by_pos[7]


def test_top_limits_the_mapped_slots_and_masked_positions_have_no_chunk() -> None:
    d = decode_sequence(cross_group(), Tok(), top=1, all_positions=True)
    rows = {r["pos"]: r for r in d["positions"]}
    assert rows[1]["chunk"] is None and rows[1]["topk"] == [] and rows[1]["chunk_start"] is None
    assert [e["id"] for e in rows[3]["topk"]] == [20]
    format_decoded(d)  # renders masked positions too


def test_a_same_tokenizer_group_keeps_its_per_token_view() -> None:
    g = synthetic_scored(synthetic_rollout(1, 8, vocab=100, group_id="same"), k=3)
    d = decode_sequence(g, Tok())
    assert d["cross"] is False
    assert all("chunk" not in r and r["teacher_logprob"] is not None and len(r["topk"]) == 3 for r in d["positions"])


@pytest.mark.parametrize("as_json", [True, False])
def test_the_tail_command_renders_a_cross_entry(as_json: bool) -> None:
    args = argparse.Namespace(group_id=None, status=None, format="summary", json=as_json, seq=0, top=5,
                              all_positions=False)
    fields = {F_TYPE: b"scored", F_ID: b"cross", F_DATA: encode(cross_group())}
    out = render(args, f"{1_700_000_000_000}-0", fields, Tok())
    assert out is not None
    if as_json:
        obj = json.loads(out)
        assert obj["decoded"]["positions"][4]["chunk_logprob"] == -3.0 and obj["cross"]["aligned_share"] == 0.8
    else:
        assert "aligned=0.8" in out and "7 " in out and '"<0>"' not in out


def test_tail_format_atropos_writes_a_cross_entry_per_token_only() -> None:
    args = argparse.Namespace(group_id=None, status=None, format="atropos", json=False, seq=0, top=5,
                              all_positions=False)
    fields = {F_TYPE: b"scored", F_ID: b"cross", F_DATA: encode(cross_group())}
    obj = json.loads(render(args, "1-0", fields) or "{}")
    assert obj["entry_id"] == "1-0" and obj["teacher"][CROSS_KEY] is True
    assert obj["distill_token_ids"] == [WANT_IDS]
