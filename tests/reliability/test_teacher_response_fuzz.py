"""Bad input from the teacher: 1,000 malformed HTTP responses per backend (vLLM ``/v1/completions``,
SGLang ``/generate``), built by mutating valid ones, fed through the real ``HTTPTeacher`` request path
(``httpx.MockTransport``) and the ``Scorer`` the teacher stage uses. A malformed answer must end as a
group dropped with a ``misaligned`` reason (or ``invalid_logprobs`` for a value that cannot be a logprob:
NaN, infinite, above 0, a sentinel), or as a payload the feeder accepts: never as a retryable
"teacher error" (the scorer would ask the same broken server again) nor as a status-ok group that the next
stage dead-letters."""

from __future__ import annotations

import asyncio
import copy
import json
import random
import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx
import numpy as np
import pytest
import structlog

from pipeline.stages.scoring import Scorer, ScoringConfig
from pipeline.teacher.sglang_http import SGLangTeacher
from pipeline.teacher.vllm_http import HTTPTeacher, HTTPTeacherConfig, VLLMTeacher
from schemas import DecodeError, DistillStatus, RolloutGroup, ScoredGroup, decode, encode
from schemas.build import make_sequence, trained_rows
from tests.reliability.harness import report
from tests.reliability.mutations import LIMITS

pytestmark = [pytest.mark.reliability]

N = 1000
K = 3
TOKENS = np.array([11, 12, 13, 14, 15], np.int32)
LOSS_MASK = [0, 0, 1, 1, 1]
#: The first row the learner trains on: the SGLang teacher asks for logprobs from there on.
START = int(trained_rows(make_sequence(TOKENS, LOSS_MASK, prompt_len=2))[0])


def vllm_answer(tokens: list[int], k: int) -> Any:
    entries: list[Any] = [None] + [{str(t + j): {"logprob": -0.1 - j, "rank": j + 1, "decoded_token": "x"}
                                    for j in range(k)} for t in tokens[1:]]
    return {"id": "c", "choices": [{"index": 0, "text": "", "prompt_logprobs": entries}]}


def sglang_answer(tokens: list[int], k: int, start: int) -> Any:
    """SGLang's answer to ``logprob_start_len = start``: entry j is token start + j."""
    own: list[Any] = [[None, tokens[start], None]] + [[-0.1, t, None] for t in tokens[start + 1:]]
    top: list[Any] = [None] + [[[-0.1 - j, t + j, None] for j in range(k)] for t in tokens[start + 1:]]
    return {"text": "", "meta_info": {"input_token_logprobs": own, "input_top_logprobs": top}}


def leaves(tree: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Paths to every value in a JSON tree (containers included)."""
    out = [path]
    if isinstance(tree, dict):
        for k, v in tree.items():
            out += leaves(v, (*path, k))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            out += leaves(v, (*path, i))
    return out


def replace(tree: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    node = tree
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value
    return tree


def delete(tree: Any, path: tuple[Any, ...]) -> Any:
    node = tree
    for p in path[:-1]:
        node = node[p]
    del node[path[-1]]
    return tree


def rename_key(tree: Any, rng: random.Random) -> Any:
    """A token-id key replaced by a huge, negative or non-numeric one (vLLM's string keys)."""
    dicts = [p for p in leaves(tree) if p and isinstance(_at(tree, p), dict) and all(
        k.lstrip("-").isdigit() for k in _at(tree, p))]
    node = _at(tree, rng.choice(dicts))
    old = rng.choice(list(node))
    node[rng.choice(["99999999999", "-5", "abc", "1e3", "", str(2**70)])] = node.pop(old)
    return tree


def _at(tree: Any, path: tuple[Any, ...]) -> Any:
    for p in path:
        tree = tree[p]
    return tree


WEIRD = [None, True, "x", -1, 2**40, 2**70, -(2**33), 1e300, [], {}, [[1, 2]], {"logprob": "x"}, 0.5, 1e-300]


def mutate(answer: Any, rng: random.Random) -> tuple[str, bytes]:
    tree = copy.deepcopy(answer)
    kind = rng.randrange(6)
    paths = leaves(tree)[1:]
    if kind == 0:
        return "truncated", json.dumps(tree).encode()[: rng.randrange(1, 60)]
    if kind == 1:
        return "not_json", rng.choice([b"", b"<html>502 Bad Gateway</html>", b"null", b"[" * 50_000, b"\xff\xfe"])
    if kind == 2:
        return "deleted", json.dumps(delete(tree, rng.choice(paths))).encode()
    if kind == 3 and isinstance(tree.get("choices"), list):
        return "renamed_key", json.dumps(rename_key(tree, rng)).encode()
    for _ in range(rng.randint(1, 3)):
        tree = replace(tree, rng.choice(leaves(tree)[1:] or [()]), rng.choice(WEIRD))
    return "replaced", json.dumps(tree).encode()


class Server:
    """The MockTransport handler: model info, the cap probe, then whatever ``next`` holds."""

    def __init__(self) -> None:
        self.next = b""

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path in ("/v1/models", "/get_model_info"):
            return httpx.Response(200, json={"data": [{"id": "m"}], "model_path": "m"})
        body = json.loads(request.content)
        if body.get("prompt_logprobs", 0) > 20:
            return httpx.Response(400, json={"error": {"message": "greater than max allowed: 20"}})
        return httpx.Response(200, content=self.next)


async def fuzz(make: Callable[[HTTPTeacherConfig, httpx.AsyncClient], HTTPTeacher],
               answer: Any, seed: int) -> tuple[Counter[str], list[str]]:
    """Score one group per malformed answer through the real ``Scorer`` (as the teacher stage does)."""
    rng = random.Random(seed)
    server = Server()
    teacher = make(HTTPTeacherConfig(urls=("http://teacher",), model="m", k=K),
                   httpx.AsyncClient(transport=httpx.MockTransport(server)))
    await teacher.start()
    scorer = Scorer(teacher, ScoringConfig(default_k=K, retries=0))
    group = RolloutGroup(group_id="g", sequences=[make_sequence(TOKENS, LOSS_MASK, prompt_len=2)])
    outcomes: Counter[str] = Counter()
    problems: list[str] = []
    for _ in range(N):
        kind, server.next = mutate(answer, rng)
        with warnings.catch_warnings(), structlog.testing.capture_logs():  # quiet: 1,000 drop warnings
            warnings.simplefilter("ignore", RuntimeWarning)  # as in production: an overflow warns, no error
            (scored,) = await scorer.score_groups([group])
        if scored.status is DistillStatus.DROPPED:
            reason = scored.reason or ""
            kind_of = next((f"dropped_{c}" for c in ("misaligned", "invalid_logprobs") if reason.startswith(c)), None)
            outcomes[kind_of or "dropped_other"] += 1
            if kind_of is None:  # a 200 answer that makes no sense is misaligned (or holds no valid logprob)
                problems.append(f"{kind}: dropped as {reason[:150]}")
            continue
        try:
            decode(encode(scored), LIMITS, expect=ScoredGroup)
            outcomes["ok_valid"] += 1  # a harmless mutation (a rank, the text, a close logprob)
        except DecodeError as e:
            outcomes["ok_rejected_by_feeder"] += 1
            problems.append(f"{kind}: status ok but the feeder would dead-letter it: {e}"[:200])
    await teacher.close()
    return outcomes, problems


class WrongOutcome(Exception):
    """A malformed answer was neither a misaligned drop nor a valid payload."""


@pytest.mark.parametrize("backend", ["vllm", "sglang"])
def test_malformed_teacher_responses_become_misaligned_drops(backend: str) -> None:
    tokens = TOKENS.tolist()
    if backend == "vllm":
        outcomes, problems = asyncio.run(fuzz(lambda c, h: VLLMTeacher(c, client=h), vllm_answer(tokens, K), 1))
    else:
        outcomes, problems = asyncio.run(fuzz(lambda c, h: SGLangTeacher(c, client=h, max_k=20),
                                              sglang_answer(tokens, K, START), 2))
    kinds = Counter(p.split(": ", 1)[1].split(" ", 3)[2] if "dropped as" in p else "ok_rejected" for p in problems)
    report(f"teacher_response_fuzz_{backend}", responses=N, **outcomes, problems=len(problems),
           problem_kinds=dict(kinds))
    assert sum(outcomes.values()) == N
    assert outcomes["dropped_misaligned"] > N // 2
    assert outcomes["ok_valid"] > 0  # some harmless mutations pass: the unmutated answer itself is accepted
    if problems:
        raise WrongOutcome(problems[:4])
