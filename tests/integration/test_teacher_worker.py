"""Push -> `distillq worker teacher --backend hf --burst` -> scored stream, checked
against an independent transformers computation."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import numpy as np
import pytest
import redis

from pipeline.cli.main import main
from pipeline.demo.tinymodels import TinyModels, ensure_tiny_models
from pipeline.models.weights import load_causal_lm
from pipeline.transport.keys import Keys
from schemas import DistillStatus, ScoredGroup, decode

pytestmark = pytest.mark.redis
K = 5


@pytest.fixture(scope="module")
def tiny() -> TinyModels:
    return ensure_tiny_models()


def reference_topk(model: object, tokens: list[int], k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Independent per-sequence forward: logits-aligned top-k and sampled-token logprobs."""
    import torch

    with torch.inference_mode():
        logits = model(torch.tensor([tokens])).logits[0, :-1].float()  # type: ignore[operator]
        lp = torch.log_softmax(logits, -1)
        top = torch.topk(lp, k, dim=-1)
        sampled = lp.gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]
    return top.indices.numpy(), top.values.numpy(), sampled.numpy()


def atropos_line(tokens: list[int], prompt: int, overrides: object = None, gid: str = "") -> str:
    masks = [[-100] * prompt + t[prompt:] for t in tokens]
    lps = [[1.0] * prompt + [-0.5] * (len(t) - prompt) for t in tokens]
    obj = {"group_id": gid, "tokens": tokens, "masks": masks, "scores": [1.0] * len(tokens),
           "inference_logprobs": lps, "group_overrides": overrides}
    return json.dumps(obj)


@pytest.mark.slow
def test_teacher_worker_end_to_end(tmp_path: Path, redis_url: str, keys: Keys, tiny: TinyModels) -> None:
    rng = np.random.default_rng(0)
    seqs = lambda lens: [rng.integers(5, 400, n).tolist() for n in lens]  # noqa: E731
    groups = {
        "plain": (seqs([12, 30, 7]), None),
        "nullov": (seqs([9, 9]), None),
        "k3": (seqs([20, 5]), {"teacher_top_k": 3}),
        "k0": (seqs([6]), {"teacher_top_k": 0}),  # raised to 1
        "skip": (seqs([8, 8]), {"skip_teacher_top_k": True}),
        "bad": ([*seqs([10]), [1, 2, 3, 99999]], None),  # an id outside the teacher's vocabulary
        "huge": (seqs([10]), {"teacher_top_k": 100000}),  # above the cap, rule: drop
    }
    lines = [atropos_line(t, 3, ov, gid) for gid, (t, ov) in groups.items()]
    assert '"group_overrides": null' in lines[1]
    f = tmp_path / "groups.jsonl"
    f.write_text("\n".join(lines) + "\n")
    common = ["--redis-url", redis_url, "--namespace", keys.namespace]
    assert main(["push", str(f), *common]) == 0
    code = main(["worker", "teacher", "--backend", "hf", "--model", str(tiny.teacher), "--top-k", str(K),
                 "--student-tokenizer", str(tiny.student), "--k-over-cap", "drop", "--retries", "0", "--burst",
                 *common])
    assert code == 0
    r = redis.Redis.from_url(redis_url)
    out = {}
    for _, fields in r.xrange(keys.stream("scored")):
        s = decode(r.get(fields[b"p"]) or b"", expect=ScoredGroup)  # claim check: the payload's key
        out[s.group_id] = s
    assert set(out) == set(groups)  # every group flows on, failures included
    model = load_causal_lm(tiny.teacher)
    expected_k = {"plain": K, "nullov": K, "k3": 3, "k0": 1}
    for gid, k in expected_k.items():
        s = out[gid]
        assert s.status is DistillStatus.OK and s.k == k and s.teacher is not None
        for seq, t in zip(s.group.sequences, s.teacher, strict=True):
            tokens = seq.tokens.numpy().tolist()
            ids, lps = t.topk_ids.numpy(), t.topk_logprobs.numpy()
            rows = t.row_index(len(tokens))  # the trained rows only: nothing computed for the prompt
            np.testing.assert_array_equal(rows, np.flatnonzero(seq.loss_mask.numpy()[1:]))
            assert ids.shape == (rows.shape[0], k) and rows.shape[0] < len(tokens) - 1
            assert (np.diff(lps, axis=1) <= 0).all()  # sorted, highest first
            ref_ids, ref_lps, ref_sampled = (a[rows] for a in reference_topk(model, tokens, k))
            np.testing.assert_allclose(lps, ref_lps, atol=1e-5)
            np.testing.assert_allclose(t.sampled_logprobs.numpy(), ref_sampled, atol=1e-5)
            assert (ids == ref_ids).mean() > 0.99  # ties may order differently
    assert out["skip"].status is DistillStatus.SKIPPED and out["skip"].teacher is None
    assert out["bad"].status is DistillStatus.DROPPED and out["bad"].teacher is None
    assert "token id outside" in (out["bad"].reason or "")
    assert out["huge"].status is DistillStatus.DROPPED and (out["huge"].reason or "").startswith("k_over_cap")
    assert r.xlen(keys.stream("rollouts")) == 0


def test_teacher_refuses_mismatched_vocab_and_k_over_cap(tmp_path: Path, redis_url: str, keys: Keys,
                                                         tiny: TinyModels, capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoTokenizer

    other = tmp_path / "other-tok"
    tok = AutoTokenizer.from_pretrained(str(tiny.tokenizer))
    tok.add_tokens(["<extra_token>"])
    tok.save_pretrained(str(other))
    common = ["--redis-url", redis_url, "--namespace", keys.namespace, "--burst"]
    code = main(["worker", "teacher", "--backend", "hf", "--model", str(tiny.teacher),
                 "--student-tokenizer", str(other), "--top-k", "5", *common])
    assert code == 2
    assert "vocab" in capsys.readouterr().err.lower()
    code = main(["worker", "teacher", "--backend", "hf", "--model", str(tiny.teacher), "--top-k", "100000", *common])
    assert code == 2
    assert "--top-k 100000 exceeds DISTILLQ_MAX_K=256" in capsys.readouterr().err  # what readers accept
    monkeypatch.setenv("DISTILLQ_MAX_K", "1000000")
    code = main(["worker", "teacher", "--backend", "hf", "--model", str(tiny.teacher), "--top-k", "100000", *common])
    assert code == 2
    assert "exceeds the teacher's logprob cap" in capsys.readouterr().err


def test_teacher_check_reflects_heartbeat(redis_url: str, keys: Keys) -> None:
    assert main(["worker", "teacher", "--check", "--redis-url", redis_url, "--namespace", keys.namespace]) == 1
    r = redis.Redis.from_url(redis_url)
    import time

    r.set(keys.heartbeat("teacher", "w1"), json.dumps({"ts": time.time(), "pid": 1, "host": "elsewhere"}), px=5000)
    args = ["--redis-url", redis_url, "--namespace", keys.namespace]
    assert main(["worker", "teacher", "--check", *args]) == 1  # another host's worker: not this container's
    assert main(["worker", "teacher", "--check", "--any-host", *args]) == 0
    r.set(keys.heartbeat("teacher", "w2"), json.dumps({"ts": time.time(), "host": socket.gethostname()}), px=5000)
    assert main(["worker", "teacher", "--check", *args]) == 0
