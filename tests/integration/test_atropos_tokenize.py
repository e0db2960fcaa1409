"""atroposlib 0.4.0's ``tokenize_for_trainer`` and the transformers version: under 5.x ``apply_chat_template``
returns a ``BatchEncoding`` by default, so the helper hands back ``{"tokens": BatchEncoding, "masks": [...]}``
and a ``BaseEnv`` using it never gets a group to the server (it cannot even serialise it). The workaround in
docs/integrations.md (``return_dict=False`` bound on the tokenizer) gives the tokens and masks 4.x gives.

Verified (the probe below, on the repo's tiny tokenizer): transformers 4.57.3 works; 5.0.0 and 5.24.0 (the one
installed) do not without the workaround. Other installs can be probed by listing their ``pip --target``
directories in ``DISTILLQ_TEST_TRANSFORMERS_DIRS`` (``os.pathsep``-separated).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from typing import Any

import pytest
import transformers
from transformers import PreTrainedTokenizerFast

from pipeline.demo.tinymodels import ensure_tiny_models

pytest.importorskip("atroposlib", reason="atroposlib 0.4.0 not installed: pip install atroposlib==0.4.0")
from atroposlib.utils.tokenize_for_trainer import tokenize_for_trainer

CHAT = [{"role": "system", "content": "add"}, {"role": "user", "content": "1+1="},
        {"role": "assistant", "content": "2"}]
#: A tokenizer built the same way under 4.x and 5.x (a 5.x-saved config names a class 4.x lacks).
PROBE = """
import json, sys
from pathlib import Path
import transformers
from transformers import PreTrainedTokenizerFast
from atroposlib.utils.tokenize_for_trainer import tokenize_for_trainer
d = Path(sys.argv[1])
tok = PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"), bos_token="<s>", eos_token="</s>",
                              pad_token="<pad>")
tok.chat_template = (d / "chat_template.jinja").read_text()
out = tokenize_for_trainer(tok, json.loads(sys.argv[2]))
tokens = out["tokens"]
ok = isinstance(tokens, list) and all(isinstance(t, int) for t in tokens) and len(out["masks"]) == len(tokens)
print(json.dumps({"transformers": transformers.__version__, "works": ok,
                  "result": {"tokens": tokens, "masks": out["masks"]} if ok else None}))
"""


def tokenizer() -> Any:
    d = ensure_tiny_models().tokenizer
    tok = PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"), bos_token="<s>", eos_token="</s>",
                                  pad_token="<pad>")
    tok.chat_template = (d / "chat_template.jinja").read_text()
    return tok


def expected() -> dict[str, list[int]]:
    """What the helper is meant to return, computed without it: the rendered chat's ids, the prompt masked."""
    tok = tokenizer()
    full = tok.encode(tok.apply_chat_template(CHAT, tokenize=False), add_special_tokens=False)
    prefix = tok.encode(tok.apply_chat_template(CHAT[:-1], tokenize=False, add_generation_prompt=True),
                        add_special_tokens=False)
    assert full[: len(prefix)] == prefix and len(full) > len(prefix)
    return {"tokens": full, "masks": [-100] * len(prefix) + full[len(prefix):]}


def works(out: dict[str, Any]) -> bool:
    tokens = out["tokens"]
    return isinstance(tokens, list) and all(isinstance(t, int) for t in tokens) and len(out["masks"]) == len(tokens)


def test_the_helper_under_the_installed_transformers_and_the_workaround() -> None:
    major = int(transformers.__version__.split(".")[0])
    out = tokenize_for_trainer(tokenizer(), CHAT)
    if major >= 5:  # broken: a BatchEncoding for tokens, masks of the wrong length, nothing JSON can carry
        assert not works(out) and type(out["tokens"]).__name__ == "BatchEncoding"
        with pytest.raises(TypeError, match="BatchEncoding is not JSON serializable"):
            json.dumps(out)
    else:
        assert out == expected()
    fixed = tokenizer()  # the workaround from docs/integrations.md
    fixed.apply_chat_template = functools.partial(fixed.apply_chat_template, return_dict=False)
    assert tokenize_for_trainer(fixed, CHAT) == expected()
    assert tokenize_for_trainer(fixed, CHAT, train_on_all_assistant_turns=True) == expected()
    assert isinstance(fixed.apply_chat_template(CHAT, tokenize=False), str)  # rendering text is unchanged


def _probe(path: str | None) -> dict[str, Any]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if path:
        env["PYTHONPATH"] = os.pathsep.join([path, env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", PROBE, str(ensure_tiny_models().tokenizer), json.dumps(CHAT)],
                         check=True, capture_output=True, text=True, timeout=120, env=env)
    result: dict[str, Any] = json.loads(run.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.parametrize("path", [None, *filter(None, os.environ.get("DISTILLQ_TEST_TRANSFORMERS_DIRS", "")
                                                .split(os.pathsep))])
def test_which_transformers_versions_the_helper_works_with(path: str | None) -> None:
    """The helper works with transformers 4.x and not 5.x (as a separate process, per install)."""
    got = _probe(path)
    version = got["transformers"]
    if path is None:
        assert version == transformers.__version__
    assert got["works"] == (int(version.split(".")[0]) < 5), got
    if got["works"]:
        assert got["result"] == expected()


