"""The vLLM prompt_logprobs parser on raw response bytes: sorted rows, only the wanted positions read, and
every kind of misaligned answer reported as such."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import numpy as np
import pytest

from pipeline.teacher.base import ScoreFailure, ScoreRequest, ScoreResult
from pipeline.teacher.vllm_parse import parse_completion

K = 4
TOKENS = np.array([9, 5001, 5002, 5003, 5004, 5005], np.int32)


def entry(token: int, k: int = K, *, own: bool = True) -> dict[str, Any]:
    """vLLM's item dict: the prompt token first (outside the top k here), then the top k shuffled."""
    top = {str(1000 + j): {"logprob": -0.5 - j, "rank": j + 1, "decoded_token": "\"{\\"} for j in (2, 0, 3, 1)[:k]}
    top.update({str(1000 + j): {"logprob": -0.5 - j, "rank": j + 1, "decoded_token": "x"} for j in range(4, k)})
    return ({str(token): {"logprob": -50.0, "rank": 9000, "decoded_token": None}} if own else {}) | top


def body(entries: list[Any]) -> bytes:
    return json.dumps({"id": "c", "choices": [{"index": 0, "prompt_logprobs": entries}]}).encode()


def good() -> list[Any]:
    return [None, *(entry(int(t)) for t in TOKENS[1:])]


@pytest.mark.parametrize("rows", [None, [4], [1, 3]])
def test_parser_builds_sorted_rows(rows: list[int] | None) -> None:
    req = ScoreRequest(TOKENS, K, None if rows is None else np.array(rows, np.int32))
    out = parse_completion(body(good()), req)
    assert isinstance(out, ScoreResult)
    assert out.topk_ids.dtype == np.int32 and out.topk_logprobs.dtype == np.float32
    np.testing.assert_array_equal(out.topk_ids, np.tile([1000, 1001, 1002, 1003], (req.n_rows, 1)))
    np.testing.assert_array_equal(out.topk_logprobs, np.tile([-0.5, -1.5, -2.5, -3.5], (req.n_rows, 1)))
    np.testing.assert_array_equal(out.sampled_logprobs, np.full(req.n_rows, -50.0, np.float32))


def _bad_entry(e: list[Any], what: str) -> list[Any]:
    if what == "missing_token":
        e[3] = entry(77)
    elif what == "too_few":
        e[3] = entry(int(TOKENS[3]), K - 2)
    elif what == "too_many":
        e[3] = entry(int(TOKENS[3]), K + 2)
    elif what == "null":
        e[3] = None
    elif what == "huge_id":
        e[3][str(2**31)] = {"logprob": -0.1, "rank": 1, "decoded_token": "x"}
        del e[3]["1003"]
    elif what == "entry0":
        e[0] = entry(int(TOKENS[0]))
    elif what == "count":
        e.pop()
    return e


@pytest.mark.parametrize("rows", [None, [2], [1, 2, 3]])
@pytest.mark.parametrize(("what", "reason"), [
    ("missing_token", "position 3 lacks the prompt token 5003"),
    ("too_few", "position 3 has 3 items (k=4)"),
    ("too_many", "position 3 has 7 items (k=4)"),
    ("null", "position 3 has null (k=4)"),
    ("huge_id", "token id 2147483648 outside"),
    ("entry0", "entry 0 is not null"),
    ("count", "5 prompt_logprobs entries for 6 tokens"),
])
def test_parser_reports_misaligned_answers(rows: list[int] | None, what: str, reason: str) -> None:
    req = ScoreRequest(TOKENS, K, None if rows is None else np.array(rows, np.int32))
    out = parse_completion(body(_bad_entry(good(), what)), req)
    assert isinstance(out, ScoreFailure) and not out.retryable
    assert out.reason.startswith(f"misaligned: {reason}"), out.reason


def test_parser_reads_only_wanted_positions() -> None:
    """A position not asked for is not looked at (beyond the entry count and valid JSON)."""
    bad = _bad_entry(good(), "missing_token")
    for rows in ([0, 1, 3], [4]):  # position 3 is row 2
        out = parse_completion(body(bad), ScoreRequest(TOKENS, K, np.array(rows, np.int32)))
        assert isinstance(out, ScoreResult) and out.topk_ids.shape == (len(rows), K)
    with pytest.raises(msgspec.ValidationError):  # the teacher reports this as misaligned: unparseable
        parse_completion(body([None, {"5001": {"logprob": "x"}}, *good()[2:]]), ScoreRequest(TOKENS, K))


def test_an_answer_with_nan_is_invalid_logprobs_not_misaligned() -> None:
    import msgspec

    from pipeline.teacher.vllm_http import unparseable

    nan = b'{"choices": [{"prompt_logprobs": [null, {"5": {"logprob": NaN, "rank": 1}}]}]}'
    with pytest.raises(msgspec.DecodeError) as caught:
        msgspec.json.decode(nan)
    got = unparseable(nan, caught.value)
    assert got.reason == ("invalid_logprobs: the teacher answered a non-finite number (NaN or Infinity) where a "
                          "logprob goes") and not got.retryable
    junk = b'{"choices": [oops]}'
    with pytest.raises(msgspec.DecodeError) as caught:
        msgspec.json.decode(junk)
    assert unparseable(junk, caught.value).reason.startswith("misaligned: unparseable response (DecodeError: ")
    bad_inf = b'{"x": -Infinity}'
    with pytest.raises(msgspec.DecodeError) as caught:
        msgspec.json.decode(bad_inf)
    assert unparseable(bad_inf, caught.value).reason.startswith("invalid_logprobs")
