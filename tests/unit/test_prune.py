"""Depth pruning (``pipeline.models.prune``, ``distillq models prune``) on tiny local models: block-influence scores
find a layer that does nothing, the pruned model loads and generates with its KV cache exactly as the source does
with the dropped layers skipped, ``--by alternate`` is the real pair's student, and what cannot be pruned is
refused in one line with exit status 2."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeline.cli.main import main
from pipeline.demo.tinymodels import ensure_tiny_models
from pipeline.errors import ConfigurationError
from pipeline.models import prune
from pipeline.models.weights import load_causal_lm

pytestmark = pytest.mark.timeout(600)

PROMPTS = [
    {"id": "a", "messages": [{"role": "user", "content": "12+30="}]},
    {"id": "b", "messages": [{"role": "user", "content": "What is the capital of France?"}], "answer": "Paris"},
    {"id": "c", "prompt": "The quick brown fox jumps over the lazy dog."},
    {"id": "d", "messages": [{"role": "user", "content": "7+41="}]},
    {"id": "e", "prompt": "Hello world! Tool output: 42"},
    {"id": "f", "messages": [{"role": "user", "content": "Which month comes after May?"}]},
]


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny models run fastest on one thread, and a loaded machine makes two threads many times slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def teacher() -> Path:
    """The tiny 4-layer Llama (random weights), read only."""
    return ensure_tiny_models().teacher


@pytest.fixture
def prompts_file(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS) + "\n")
    return path


def identity_at(src: Path, layer: int, out: Path) -> Path:
    """A copy of ``src`` whose decoder layer ``layer`` adds nothing to the residual stream (o_proj and down_proj
    zero): its output equals its input."""
    model = load_causal_lm(src)
    with torch.no_grad():
        model.model.layers[layer].self_attn.o_proj.weight.zero_()
        model.model.layers[layer].mlp.down_proj.weight.zero_()
    model.save_pretrained(str(out))
    shutil.copy(src / "tokenizer.json", out)
    shutil.copy(src / "tokenizer_config.json", out)
    for extra in ("chat_template.jinja", "special_tokens_map.json"):
        if (src / extra).exists():
            shutil.copy(src / extra, out)
    return out


def greedy_with_cache(model: Any, ids: list[int], new: int) -> list[int]:
    out = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         max_new_tokens=new, min_new_tokens=new, do_sample=False, use_cache=True, pad_token_id=0)
    return [int(t) for t in out[0, len(ids):]]


@torch.inference_mode()
def greedy_skipping(model: Any, ids: list[int], new: int, skip: set[int]) -> list[int]:
    """Greedy tokens of ``model`` with the decoder layers ``skip`` passing their input through unchanged, every
    step a full forward of the whole sequence (no cache): the reference a pruned model must reproduce."""

    def passthrough(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        x = args[0] if args else kwargs["hidden_states"]
        return (x, *output[1:]) if isinstance(output, tuple) else x

    handles = [model.model.layers[i].register_forward_hook(passthrough, with_kwargs=True) for i in skip]
    try:
        seq = list(ids)
        for _ in range(new):
            logits = model(input_ids=torch.tensor([seq]), use_cache=False).logits
            seq.append(int(logits[0, -1].argmax()))
    finally:
        for h in handles:
            h.remove()
    return seq[len(ids):]


def test_scores_one_per_layer_and_a_layer_that_does_nothing_scores_zero_and_goes_first(
    teacher: Path, prompts_file: Path, tmp_path: Path
) -> None:
    src = identity_at(teacher, 2, tmp_path / "src")
    model = load_causal_lm(src)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(src))
    items = prune.read_prompts(prompts_file).items
    scores, tokens = prune.block_influence(model, tokenizer, items)
    assert len(scores) == 4
    assert tokens == sum(len(prune.prompt_ids(tokenizer, p)) for p in items) > 6
    assert scores[2] < 1e-5
    assert all(s > 0.01 for i, s in enumerate(scores) if i != 2), scores

    result = prune.prune_folder(src, tmp_path / "out", drop=1, prompts=prune.read_prompts(prompts_file))
    assert result.dropped == [2] and result.kept == [0, 1, 3]
    record = json.loads((tmp_path / "out" / prune.PRUNE_FILE).read_text())
    assert record == result.record
    assert record["method"] == "block-influence" and record["source"] == str(src.resolve())
    assert (record["layers"], record["drop"], record["dropped"], record["kept"]) == (4, 1, [2], [0, 1, 3])
    assert record["scores"] == pytest.approx(scores, abs=1e-9) and record["score"] == prune.SCORE_DEFINITION
    assert record["prompts"] == {"source": str(prompts_file.resolve()), "count": 6, "tokens": tokens,
                                 "sha256": hashlib.sha256(prompts_file.read_bytes()).hexdigest()}
    assert record["dtype"] == "float32"


def test_pruned_model_loads_and_generates_with_its_cache_as_the_source_without_those_layers(
    teacher: Path, prompts_file: Path, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    result = prune.prune_folder(teacher, tmp_path / "out", drop=2, prompts=prune.read_prompts(prompts_file))
    assert len(result.dropped) == 2 and sorted(result.dropped + result.kept) == [0, 1, 2, 3]
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 2
    pruned = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
    assert len(pruned.model.layers) == 2
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "out"))
    assert len(tokenizer) == len(AutoTokenizer.from_pretrained(str(teacher)))

    source = load_causal_lm(teacher)
    ids = prune.prompt_ids(tokenizer, PROMPTS[0]["messages"])
    reference = greedy_skipping(source, ids, 12, set(result.dropped))
    assert reference != greedy_skipping(source, ids, 12, set())  # the dropped layers mattered
    assert greedy_with_cache(pruned, ids, 12) == reference

    # in memory, never reloaded: the kept layers 1 and 3 renumbered 0 and 1 for the cache
    in_memory = prune.remove_layers(load_causal_lm(teacher), [0, 2])
    assert [layer.self_attn.layer_idx for layer in in_memory.model.layers] == [0, 1]
    assert in_memory.config.num_hidden_layers == 2
    assert greedy_with_cache(in_memory, ids, 12) == greedy_skipping(source, ids, 12, {0, 2})


def test_a_qwen2_model_keeps_its_layer_types_and_its_cache_works() -> None:
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=2, num_key_value_heads=1, use_sliding_window=True, max_window_layers=2,
                      sliding_window=4, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()  # type: ignore[no-untyped-call]
    assert model.config.layer_types == ["full_attention", "full_attention", "sliding_attention", "sliding_attention"]
    ids = list(range(3, 12))
    reference = greedy_skipping(model, ids, 8, {0, 3})
    pruned = prune.remove_layers(model, [0, 3])
    assert pruned.config.layer_types == ["full_attention", "sliding_attention"]
    assert pruned.config.num_hidden_layers == 2
    assert greedy_with_cache(pruned, ids, 8) == reference


def test_alternate_is_the_real_pair_student(teacher: Path, tmp_path: Path) -> None:
    result = prune.prune_folder(teacher, tmp_path / "out", drop=None, by="alternate")
    assert result.kept == prune.kept_layers(4) == [0, 2] and result.dropped == [1, 3]
    assert result.record["scores"] is None and result.record["prompts"] is None
    from transformers import AutoModelForCausalLM

    ours = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).state_dict()
    source = load_causal_lm(teacher).state_dict()
    renumbered = {0: 0, 2: 1}  # the even layers, renumbered; every other tensor as it was
    expected = {}
    for name, tensor in source.items():
        parts = name.split(".")
        if not name.startswith("model.layers."):
            expected[name] = tensor
        elif int(parts[2]) in renumbered:
            expected[".".join([*parts[:2], str(renumbered[int(parts[2])]), *parts[3:]])] = tensor
    assert ours.keys() == expected.keys()
    assert all(torch.equal(ours[k], expected[k]) for k in ours)


def test_the_same_inputs_give_the_same_files(teacher: Path, prompts_file: Path, tmp_path: Path) -> None:
    a = prune.prune_folder(teacher, tmp_path / "a", drop=1, prompts=prune.read_prompts(prompts_file))
    b = prune.prune_folder(teacher, tmp_path / "b", drop=1, prompts=prune.read_prompts(prompts_file))
    assert a.record == b.record
    for name in ("prune.json", "model.safetensors", "config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_the_cli_prints_the_choice_and_writes_the_record(
    teacher: Path, prompts_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    assert main(["models", "prune", str(teacher), str(out), "--drop", "1", "--prompts", str(prompts_file),
                 "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads((out / prune.PRUNE_FILE).read_text())
    assert printed["drop"] == 1 and len(printed["scores"]) == 4
    assert printed["dropped"] == prune.lowest(printed["scores"], 1)


def test_lowest_takes_the_lower_index_among_equal_scores() -> None:
    assert prune.lowest([0.3, 0.1, 0.2, 0.1], 1) == [1]
    assert prune.lowest([0.3, 0.1, 0.2, 0.1], 3) == [1, 2, 3]
    assert prune.alternate_dropped(30) == list(range(1, 30, 2))


def test_prompts_file_lines_are_checked(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(PROMPTS[0]) + "\n" + json.dumps({"id": "x", "answer": "1"}) + "\n")
    with pytest.raises(ConfigurationError, match=r"bad\.jsonl:2: .*'messages'"):
        prune.read_prompts(bad)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ConfigurationError, match="no prompt"):
        prune.read_prompts(empty)


def gpt2_folder(path: Path) -> Path:
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2)).save_pretrained(
        str(path))
    return path


@pytest.mark.parametrize(("case", "expected"), [
    ("drop-0", "--drop 0: at least one layer must be dropped"),
    ("drop-negative", "--drop -1: at least one layer must be dropped"),
    ("drop-all", "--drop 4: the model has 4 decoder layers; at least one must stay"),
    ("no-drop", "--drop N is needed with --by block-influence"),
    ("alternate-count", "--by alternate drops 2 of 4 layers, not --drop 1"),
    ("missing-src", "does not exist"),
    ("not-a-model", "has no config.json"),
    ("gpt2", "cannot prune a gpt2 model: depth pruning needs a Llama/Qwen2/Mistral-style model"),
    ("out-not-empty", "exists and is not an empty folder"),
    ("bad-prompts", "cannot read the prompts file"),
])
def test_refusals_are_one_line_and_exit_2(
    case: str, expected: str, teacher: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    src, extra = teacher, ["--drop", "1"]
    if case == "drop-0":
        extra = ["--drop", "0"]
    elif case == "drop-negative":
        extra = ["--drop=-1"]
    elif case == "drop-all":
        extra = ["--drop", "4"]
    elif case == "no-drop":
        extra = []
    elif case == "alternate-count":
        extra = ["--by", "alternate", "--drop", "1"]
    elif case == "missing-src":
        src = tmp_path / "nowhere"
    elif case == "not-a-model":
        src = tmp_path
    elif case == "gpt2":
        src = gpt2_folder(tmp_path / "gpt2")
    elif case == "out-not-empty":
        out.mkdir()
        (out / "keep.txt").write_text("mine\n")
    elif case == "bad-prompts":
        extra += ["--prompts", str(tmp_path / "nope.jsonl")]
    capsys.readouterr()
    assert main(["models", "prune", str(src), str(out), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("distillq: models prune: ") and expected in err[-1], err
    assert not any(line.startswith("distillq:") for line in err[:-1])
    if case == "out-not-empty":
        assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    else:
        assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out-")]  # no temporary folder left
