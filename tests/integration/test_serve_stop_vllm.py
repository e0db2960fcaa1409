"""Stop strings on ``/inference/v1/generate`` against a real vLLM (CPU build, ``.venv-vllm``) serving the tiny
student: ``--backend vllm`` passes them through and records exactly the tokens vLLM returns, and the hf
backend's checker (``pipeline.rollout.stop_strings``) ends the same sampled tokens where vLLM ends them."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from transformers import AutoTokenizer

from pipeline.demo.tinymodels import ensure_tiny_models
from pipeline.rollout.stop_strings import StopStringChecker
from pipeline.rollout.students.base import GenParams
from pipeline.rollout.students.hf import HFStudent
from pipeline.rollout.students.vllm import VLLMStudent
from tests.integration.test_serve_student import _never, generate_body, http, make_service, prompt_ids
from tests.integration.test_serve_student_requests import reference_cut, stop_strings_in
from tests.vllm_server import START_TIMEOUT_S, needs_vllm, vllm_server

NAME = "tiny-student"
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(START_TIMEOUT_S + 240), needs_vllm]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    model_dir = ensure_tiny_models().student.resolve()
    log_path = tmp_path_factory.mktemp("vllm-stop") / "server.log"
    extra = ("--max-model-len", "512", "--max-num-seqs", "16", "--gpu-memory-utilization", "0.1")
    with vllm_server(model_dir, NAME, log_path, *extra) as url:
        yield url


@pytest.fixture
async def backend(server: str) -> AsyncIterator[VLLMStudent]:
    s = VLLMStudent(server, NAME, AutoTokenizer.from_pretrained(str(ensure_tiny_models().student)))
    yield s
    await s.aclose()


def checker_cut(tok: Any, prompt: list[int], ids: list[int], stops: list[str], include: bool) -> tuple[int, str] | None:
    c = StopStringChecker(tok, prompt, stops, include_stop_str_in_output=include)
    for k, t in enumerate(ids, 1):
        hit = c.step(t)
        if hit is not None:
            return k, hit
    return None


async def test_vllm_stop_strings_are_passed_through_and_recorded_as_returned(backend: VLLMStudent) -> None:
    tok = backend.tokenizer
    hf = HFStudent.from_pretrained(ensure_tiny_models().student)
    prompt = prompt_ids(hf)
    checked = raw_checked = 0
    async with http(make_service(backend, _never)) as c:  # type: ignore[arg-type]
        for seed in range(10):
            body = generate_body(prompt, seed=seed, max_tokens=40, stop_token_ids=[], skip_special_tokens=True)
            plain = (await c.post("/inference/v1/generate", json=body)).json()["choices"][0]
            ids = plain["token_ids"]
            text = tok.decode(ids, skip_special_tokens=True)
            stops = stop_strings_in(text)
            if stops is None:
                continue
            want = reference_cut(tok, ids, stops)
            assert want is not None
            raw = [text[i : i + 2] for i in range(len(text) - 1) if "\ufffd" in text[i : i + 2]][:1]
            for include in (False, True):
                sid = f"v{seed}{include}"
                sp = {**body["sampling_params"], "stop": stops, "include_stop_str_in_output": include}
                resp = await c.post("/inference/v1/generate", headers={"X-Session-ID": sid},
                                    json={**body, "sampling_params": sp})
                assert resp.status_code == 200, resp.text
                ch = resp.json()["choices"][0]
                assert (len(ch["token_ids"]), ch["stop_reason"]) == want  # vLLM's cut, as the slow rule says
                assert ch["token_ids"] == ids[: want[0]] and ch["finish_reason"] == "stop"
                assert checker_cut(tok, prompt, ids, stops, include) == want  # the hf backend's checker agrees
                tracked = (await c.get(f"/sessions/{sid}")).json()
                assert tracked["branches"] == [{"tokens": len(prompt) + want[0], "sampled": want[0], "turns": 1}]
                if raw:  # a string with U+FFFD: the checker holds incomplete bytes back exactly as vLLM does
                    sp = {**sp, "stop": raw}
                    got = (await c.post("/inference/v1/generate", json={**body, "sampling_params": sp})).json()
                    ch = got["choices"][0]
                    expect = checker_cut(tok, prompt, ids, raw, include)
                    cut = (len(ch["token_ids"]), ch["stop_reason"]) if ch["stop_reason"] is not None else None
                    assert cut == expect and ch["token_ids"] == ids[: len(ch["token_ids"])]
                    raw_checked += 1
            checked += 1
    assert checked >= 5
    print(f"stop strings checked on {checked} completions, {raw_checked} with U+FFFD")


async def test_greedy_hf_and_vllm_stop_at_the_same_token(backend: VLLMStudent) -> None:
    hf = HFStudent.from_pretrained(ensure_tiny_models().student)
    tok = hf.tokenizer
    prompt = prompt_ids(hf, "7+8=")
    [v] = await backend.generate(prompt, GenParams(max_tokens=30, temperature=0.0))
    [h] = await hf.generate(prompt, GenParams(max_tokens=30, temperature=0.0))
    assert v.token_ids == h.token_ids  # the same greedy tokens from both backends
    text = tok.decode(v.token_ids, skip_special_tokens=True)
    assert len(text) >= 6
    for stops in ([text[4:6]], [text[3:5], text[1:3]], ["\u00e9\u00e9", text[-2:]]):
        [vs] = await backend.generate(prompt, GenParams(max_tokens=30, temperature=0.0, stop=tuple(stops)))
        [hs] = await hf.generate(prompt, GenParams(max_tokens=30, temperature=0.0, stop=tuple(stops)))
        assert (vs.token_ids, vs.finish_reason, vs.stop_reason) == (hs.token_ids, hs.finish_reason, hs.stop_reason)
        assert vs.stop_reason in stops


