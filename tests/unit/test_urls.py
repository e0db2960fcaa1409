"""Server URLs in either form (``http://h:p`` or the OpenAI-style ``http://h:p/v1``) for every HTTP backend."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import httpx
import numpy as np
import pytest

import pipeline.urls
from pipeline.rollout.students.base import GenParams
from pipeline.rollout.students.vllm import VLLMStudent
from pipeline.teacher.base import ScoreRequest, ScoreResult, TeacherConfigError
from pipeline.teacher.sglang_http import SGLangTeacher
from pipeline.teacher.vllm_http import HTTPTeacherConfig, VLLMTeacher
from pipeline.urls import server_root


@pytest.mark.parametrize("url", [
    "http://teacher:8000", "http://teacher:8000/", "http://teacher:8000/v1", "http://teacher:8000/v1/",
    "  http://teacher:8000/v1//  ", "HTTP://teacher:8000/v1",
])
def test_both_forms_give_the_server_root(url: str) -> None:
    assert server_root(url) == "http://teacher:8000"


@pytest.mark.parametrize(("url", "root"), [
    ("https://gateway.example/teacher/v1", "https://gateway.example/teacher"),  # a reverse proxy's prefix stays
    ("https://gateway.example/teacher/", "https://gateway.example/teacher"),
    ("http://[::1]:8000/v1", "http://[::1]:8000"),
    ("http://user:pw@h:1/v1", "http://user:pw@h:1"),
    ("http://h/v10", "http://h/v10"),  # only a whole /v1 segment is the API version
    ("http://h/apiv1", "http://h/apiv1"),
])
def test_paths_and_hosts(url: str, root: str) -> None:
    assert server_root(url) == root


@pytest.mark.parametrize("url", [
    "", "teacher:8000", "teacher:8000/v1", "ftp://h/v1", "http://", "http:///v1", "http://h:port/v1",
    "http://h:99999", "http://h/v1?x=1", "http://h/v1#frag", "http://h/?",
])
def test_invalid_urls_are_refused(url: str) -> None:
    with pytest.raises(ValueError, match="invalid server URL"):
        server_root(url)


def test_imports_nothing_from_the_project() -> None:
    """A base-layer module: every layer may import it, so it imports no project module."""
    tree = ast.parse(Path(pipeline.urls.__file__).read_text())
    names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [m for m in names if m.split(".")[0] in ("pipeline", "schemas", "workers")]


class Recorder:
    """MockTransport handler answering what the three backends ask, recording the paths asked for."""

    def __init__(self) -> None:
        self.paths: list[str] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        self.paths.append(path)
        if path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        if path == "/get_model_info":
            return httpx.Response(200, json={"model_path": "m"})
        body = json.loads(request.content)
        if path == "/v1/completions" and "prompt_logprobs" in body:
            if body["prompt_logprobs"] > 20:
                return httpx.Response(400, json={"error": {"message": "greater than max allowed: 20"}})
            items = {"6": {"logprob": -1.0, "rank": 1}, "5": {"logprob": -2.0, "rank": 2}}
            return httpx.Response(200, json={"choices": [{"prompt_logprobs": [None, items]}]})
        if path == "/v1/completions":
            choice = {"index": 0, "token_ids": [4], "finish_reason": "stop", "logprobs": {"token_logprobs": [-0.5]}}
            return httpx.Response(200, json={"choices": [choice]})
        if path == "/generate":
            meta = {"input_token_logprobs": [[None, 5, None], [-1.0, 6, None]],
                    "input_top_logprobs": [None, [[-1.0, 6, None], [-2.0, 5, None]]]}
            return httpx.Response(200, json={"meta_info": meta})
        return httpx.Response(404, json={"error": {"message": f"no route {path}"}})


@pytest.mark.parametrize("url", ["http://t:8000", "http://t:8000/v1/"])
@pytest.mark.parametrize("backend", ["vllm", "sglang"])
async def test_teachers_ask_the_same_paths(url: str, backend: str) -> None:
    rec = Recorder()
    async with httpx.AsyncClient(transport=httpx.MockTransport(rec)) as client:
        config = HTTPTeacherConfig(urls=(url,), k=2)
        teacher = VLLMTeacher(config, client=client) if backend == "vllm" else SGLangTeacher(config, client=client)
        await teacher.start()
        (out,) = await teacher.score([ScoreRequest(np.array([5, 6], np.int32), 2)])
    assert isinstance(out, ScoreResult) and out.topk_ids.tolist() == [[6, 5]]
    assert config.urls == ("http://t:8000",)
    want = {"vllm": {"/v1/models", "/v1/completions"}, "sglang": {"/get_model_info", "/generate"}}[backend]
    assert set(rec.paths) == want


def test_bad_teacher_url_is_a_config_error() -> None:
    with pytest.raises(TeacherConfigError, match="invalid server URL 'localhost:8000'"):
        HTTPTeacherConfig(urls=("http://t:1", "localhost:8000"))


@pytest.mark.parametrize("url", ["http://s:8000", "http://s:8000/", "http://s:8000/v1", "http://s:8000/v1/"])
async def test_student_asks_the_same_paths(url: str) -> None:
    rec = Recorder()
    student = VLLMStudent(url, "m", tokenizer=None, transport=httpx.MockTransport(rec))
    try:
        assert await student.models() == ["m"]
        (completion,) = await student.generate([1, 2, 3], GenParams(max_tokens=1))
    finally:
        await student.aclose()
    assert completion.token_ids == [4] and rec.paths == ["/v1/models", "/v1/completions"]
    with pytest.raises(ValueError, match="invalid server URL"):
        VLLMStudent("s:8000/v1", "m", tokenizer=None)
