"""Bad input for ``distillq push``: 2,000 malformed reference-format (ScoredDataGroup JSON) lines built by
mutating valid ones. Each must be reported with its line number and reason; a file holding any bad line
pushes nothing; a good file pushes everything."""

from __future__ import annotations

import copy
import json
import random
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from pipeline.cli.commands.push import parse_file
from pipeline.cli.main import main as cli
from pipeline.transport.keys import Keys
from schemas.atropos import to_atropos
from schemas.build import synthetic_rollout, synthetic_scored
from tests.redis_server import RedisServer
from tests.reliability.harness import report

pytestmark = [pytest.mark.reliability, pytest.mark.redis]

LINES = 2000
Obj = dict[str, Any]
Edit = Callable[[Obj, random.Random], Any]


def base(i: int, scored: bool) -> Obj:
    g = synthetic_rollout(2, 8, prompt_len=3, group_id=f"base-{i}", seed=i)
    return to_atropos(synthetic_scored(g, k=3, seed=i) if scored else g)


def _cell(o: Obj, key: str, rng: random.Random) -> tuple[list[Any], int]:
    row: list[Any] = o[key][rng.randrange(len(o[key]))]
    return row, rng.randrange(len(row))


def missing_key(o: Obj, rng: random.Random) -> None:
    del o[rng.choice(["tokens", "masks", "scores"])]


def wrong_container(o: Obj, rng: random.Random) -> None:
    o[rng.choice(["tokens", "masks", "scores"])] = rng.choice(["abc", 5, {"a": 1}, True])


def count_mismatch(o: Obj, rng: random.Random) -> None:
    o[rng.choice(["masks", "scores"])].pop()  # Atropos accepts inference_logprobs of other lengths: so do we


def row_length_mismatch(o: Obj, rng: random.Random) -> None:
    row, _ = _cell(o, "masks", rng)
    row.pop() if rng.random() < 0.5 else row.append(row[-1])


def item_not_a_number(o: Obj, rng: random.Random) -> None:
    row, p = _cell(o, rng.choice(["tokens", "masks"]), rng)
    row[p] = rng.choice(["7", True, None, [1], {"x": 1}, 1.5])


def token_id_out_of_range(o: Obj, rng: random.Random) -> None:
    row, p = _cell(o, "tokens", rng)
    row[p] = rng.choice([-1, -(2**40), 2**31, 2**62, 2**64 + 5, -(2**70)])


def non_finite(o: Obj, rng: random.Random) -> None:
    value = rng.choice([float("nan"), float("inf"), float("-inf")])
    if rng.random() < 0.3:
        o["scores"][0] = value
    else:
        row, p = _cell(o, "inference_logprobs", rng)
        row[p] = value


def empty_sequence(o: Obj, rng: random.Random) -> None:
    s = rng.randrange(len(o["tokens"]))
    o["tokens"][s], o["masks"][s], o["inference_logprobs"][s] = [], [], []


def field_wrong_type(o: Obj, rng: random.Random) -> None:
    key, value = rng.choice([("env_id", "1"), ("env_id", 1.5), ("policy_version", True), ("group_id", 5),
                             ("group_id", ["a"]), ("group_overrides", "x"), ("group_overrides", [1]),
                             ("group_overrides", {"teacher_top_k": "5"}), ("created_at", "now")])
    o[key] = value


class Whole:
    """An edit's result that replaces the whole line (any JSON value, null included)."""

    def __init__(self, value: Any) -> None:
        self.value = value


def not_an_object(o: Obj, rng: random.Random) -> Whole:
    return Whole(rng.choice([[1, 2], "x", 42, None, [o], True]))


def distill_missing_half(o: Obj, rng: random.Random) -> None:
    del o[rng.choice(["distill_token_ids", "distill_logprobs"])]


def distill_shape(o: Obj, rng: random.Random) -> None:
    s = rng.randrange(len(o["tokens"]))
    case = rng.randrange(3)
    if case == 0:
        o["distill_token_ids"][s].pop()  # one entry fewer than tokens
    elif case == 1:
        o["distill_token_ids"][s][0] = [1, 2, 3]  # entry 0 must be empty
    else:  # ids and logprobs disagree at a position that has a teacher row (untrained ones are [])
        q = rng.choice([q for q, e in enumerate(o["distill_token_ids"][s]) if e])
        o["distill_logprobs"][s][q] = o["distill_logprobs"][s][q][:-1]


def distill_values(o: Obj, rng: random.Random) -> None:
    s = rng.randrange(len(o["tokens"]))
    p = rng.choice([q for q, e in enumerate(o["distill_token_ids"][s]) if e])  # a position with a teacher row
    if rng.random() < 0.5:
        o["distill_logprobs"][s][p][0] = rng.choice([float("nan"), float("inf"), "x"])
    else:
        o["distill_token_ids"][s][p][0] = rng.choice([-5, 2**31, 2**65, "1"])


def distill_k_over_cap(o: Obj, rng: random.Random) -> None:
    o["distill_top_k"] = rng.randint(257, 10**6)


GUARANTEED: dict[str, tuple[Edit, bool]] = {  # name -> (edit, on a scored line)
    f.__name__: (f, scored) for f, scored in [
        (missing_key, False), (wrong_container, False), (count_mismatch, False), (row_length_mismatch, False),
        (item_not_a_number, False), (token_id_out_of_range, False), (non_finite, False), (empty_sequence, False),
        (field_wrong_type, False), (not_an_object, False), (distill_missing_half, True), (distill_shape, True),
        (distill_values, True), (distill_k_over_cap, True),
    ]
}


def truncated_text(line: str, rng: random.Random) -> str:
    return line[: rng.randrange(1, len(line))]


def char_flips(line: str, rng: random.Random) -> str:
    chars = list(line)
    for _ in range(rng.randint(1, 3)):
        chars[rng.randrange(len(chars))] = rng.choice('{}[]",:-0123456789aeNI ')
    return "".join(chars)


def corpus(seed: int = 11) -> list[tuple[str, str, str, bool]]:
    """(category, stream, line, guaranteed invalid) for ``LINES`` malformed lines."""
    rng = random.Random(seed)
    bases = {scored: [base(i, scored) for i in range(16)] for scored in (False, True)}
    out = []
    names = [*GUARANTEED, "truncated_text", "char_flips"]
    for i in range(LINES):
        name = names[i % len(names)]
        edit, scored = GUARANTEED.get(name, (None, rng.random() < 0.5))
        obj = copy.deepcopy(bases[scored][i % 16])
        stream = "scored" if scored else "rollouts"
        if edit is not None:
            result = edit(obj, rng)
            out.append((name, stream, json.dumps(result.value if isinstance(result, Whole) else obj), True))
        else:
            text = (truncated_text if name == "truncated_text" else char_flips)(json.dumps(obj), rng)
            out.append((name, stream, text, name == "truncated_text"))
    return out


def test_push_reports_every_malformed_line(private_redis: RedisServer, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    crashes: list[str] = []
    accepted: Counter[str] = Counter()
    reported = 0
    lines = corpus()
    for name, stream, line, sure in lines:
        try:
            msgs, errors = parse_file([line], stream, 0)
        except Exception as e:  # push must report, never crash
            crashes.append(f"{name}: {type(e).__name__}: {e}"[:300])
            continue
        if errors:
            assert not msgs and len(errors) == 1 and errors[0].startswith("line 1: "), (name, errors)
            reported += 1
        elif sure:
            accepted[name] += 1
    namespace = "pushfuzz"
    common = ["--redis-url", private_redis.url, "--namespace", namespace]
    goods = [json.dumps(base(1000 + i, False)) for i in range(20)]
    bad_file, good_file = tmp_path / "bad.jsonl", tmp_path / "good.jsonl"
    bad_file.write_text("\n".join([*goods, *(line for _, _, line, sure in lines if sure)]) + "\n")
    good_file.write_text("\n".join(goods) + "\n")
    capsys.readouterr()
    bad_code = cli(["push", str(bad_file), *common])
    bad_err = capsys.readouterr().err
    r = redis.Redis.from_url(private_redis.url)
    pushed_from_bad = r.xlen(Keys(namespace).stream("rollouts"))
    good_code = cli(["push", str(good_file), *common])
    pushed_from_good = r.xlen(Keys(namespace).stream("rollouts"))
    r.close()
    n_sure = sum(1 for *_, sure in lines if sure)
    report("push_fuzz", lines=len(lines), guaranteed_bad=n_sure, reported=reported, crashes=len(crashes),
           guaranteed_bad_accepted=sum(accepted.values()), bad_file_exit=bad_code,
           pushed_from_bad_file=pushed_from_bad, good_file_exit=good_code, pushed_from_good_file=pushed_from_good)
    assert not crashes, crashes[:5]
    assert not accepted, accepted
    assert reported >= n_sure
    assert bad_code == 1 and pushed_from_bad == 0
    assert f"nothing pushed: {n_sure} bad line(s)" in " ".join(bad_err.split())
    assert good_code == 0 and pushed_from_good == len(goods)


@pytest.mark.parametrize("line", ["[" * 100_000 + "]" * 100_000,
                                  '{"tokens": [[' + "9" * 5000 + ']], "masks": [[1]], "scores": [1]}'],
                         ids=["deep_nesting", "5000_digit_integer"])
def test_push_reports_pathological_json(line: str) -> None:
    msgs, errors = parse_file([line], "rollouts", 0)
    assert not msgs and len(errors) == 1 and errors[0].startswith("line 1: ")
