"""Depth pruning of a local causal LM: decoder layers removed whole, chosen by measured importance or by position.

Methods (``METHODS``):

- ``block-influence`` (ShortGPT's Block Influence): for each decoder layer, 1 - cos(layer input, layer output) of
  the hidden state at every token, averaged over every token of the prompts (one forward per prompt, float32,
  no padding). A layer that barely turns the residual stream scores near 0; the ``drop`` lowest-scoring layers go
  (ties: the lower index first).
- ``alternate``: every other layer kept (0, 2, 4, ...) (``kept_layers``; ``distillq demo --real
  --student-prune alternate``); nothing is measured.

The model must be Llama/Qwen2/Mistral-style: ``model.model.layers`` a ``ModuleList`` of decoder layers, each with
a ``self_attn`` (``decoder_layers``). The kept layers stay in order; each one's ``self_attn.layer_idx`` is
renumbered 0..kept - 1 (the KV cache is indexed by it), and the config's ``num_hidden_layers`` and per-layer
``layer_types`` follow. Embeddings, final norm and lm_head are unchanged.

``prune_folder`` loads a model folder in float32, prunes it and writes OUT (built in a temporary folder beside
it and renamed into place): the model (``save_pretrained``, safetensors, float32), its tokenizer, and
``prune.json`` (``PRUNE_FILE``): method, source, layer count, the dropped and kept layers in the source's
numbering, every layer's score (``null`` for ``alternate``) and the prompts measured on (where, how many, their
tokens, the file's sha256). The same inputs give the same choice and byte-identical weights.

Prompts: JSONL, one object a line with ``messages`` (chat messages, rendered with the tokenizer's chat template
and its generation prompt) or ``prompt`` (text), as ``distillq enqueue`` reads them; other fields are ignored.
The ``distillq models prune`` default is the train split of the demo's real-pair prompts
(``pipeline.demo.realtasks.train_prompts``).

Anything that cannot be pruned (no SRC, an unknown architecture, ``drop`` below 1 or not below the layer count, an
unreadable prompts file, OUT not empty) raises ``ConfigurationError`` with one line saying why, before anything is
written.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pipeline.errors import ConfigurationError

Method = Literal["block-influence", "alternate"]
#: One prompt: chat messages, or a text.
PromptItem = list[dict[str, Any]] | str
METHODS: tuple[Method, ...] = ("block-influence", "alternate")
PRUNE_FILE = "prune.json"
#: What a block-influence score is, as prune.json states it.
SCORE_DEFINITION = "1 - cos(layer input, layer output) of each token's hidden state, mean over the prompts' tokens"


@dataclass(frozen=True)
class Prompts:
    """Prompts to measure on: each a list of chat messages or a text; ``source`` and ``sha256`` say where from."""

    items: list[PromptItem]
    source: str
    sha256: str


@dataclass(frozen=True)
class PruneResult:
    """What ``prune_folder`` wrote: the folder and the content of its ``prune.json``."""

    out: Path
    record: dict[str, Any]

    @property
    def dropped(self) -> list[int]:
        return list(self.record["dropped"])

    @property
    def kept(self) -> list[int]:
        return list(self.record["kept"])


def read_prompts(path: Path) -> Prompts:
    """Every prompt of a JSONL file (``messages`` or ``prompt`` on each non-blank line); ``ConfigurationError`` for
    a file that cannot be read, a line that is not such an object, or no prompt at all."""
    try:
        data = path.read_bytes()
        text = data.decode("utf-8")
    except OSError as e:
        raise ConfigurationError(f"cannot read the prompts file {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ConfigurationError(f"the prompts file {path} is not UTF-8 text (byte {e.start})") from None
    items: list[PromptItem] = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise ConfigurationError(f"{path}:{n}: not JSON: {e}") from None
        if isinstance(row, dict) and isinstance(row.get("messages"), list) and row["messages"]:
            items.append(row["messages"])
        elif isinstance(row, dict) and isinstance(row.get("prompt"), str) and row["prompt"]:
            items.append(row["prompt"])
        else:
            raise ConfigurationError(f"{path}:{n}: a prompt line needs 'messages' (a non-empty list) or 'prompt' "
                                     "(a non-empty text)")
    if not items:
        raise ConfigurationError(f"the prompts file {path} holds no prompt")
    return Prompts(items, str(path.resolve()), hashlib.sha256(data).hexdigest())


def decoder_layers(model: Any) -> Any:
    """``model.model.layers`` (a ``torch.nn.ModuleList`` of layers with ``self_attn``), or ``ConfigurationError``
    naming the model type when the model is not built that way."""
    import torch

    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not len(layers) or not all(
            hasattr(layer, "self_attn") for layer in layers):
        kind = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        raise ConfigurationError(f"cannot prune a {kind} model: depth pruning needs a Llama/Qwen2/Mistral-style "
                                 "model (decoder layers at model.model.layers)")
    return layers


def prompt_ids(tokenizer: Any, prompt: PromptItem) -> list[int]:
    """Token ids of one prompt: chat messages through the chat template (with the generation prompt), a text as
    the tokenizer encodes it."""
    if isinstance(prompt, str):
        return list(tokenizer(prompt)["input_ids"])
    ids: list[int] = tokenizer.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True,
                                                   return_dict=False)
    return list(ids)


def block_influence(model: Any, tokenizer: Any, prompts: Sequence[PromptItem]) -> tuple[list[float], int]:
    """One score per decoder layer (``SCORE_DEFINITION``) and the number of tokens they average over."""
    import torch

    layers = decoder_layers(model)
    totals = [0.0] * len(layers)
    current: list[Any] = [None] * len(layers)  # per layer: 1 - cos of the prompt being run, one value a token

    def hook(i: int) -> Callable[..., None]:
        def record(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            x_in = args[0] if args else kwargs["hidden_states"]
            x_out = output[0] if isinstance(output, tuple) else output
            cos = torch.nn.functional.cosine_similarity(x_in.float(), x_out.float(), dim=-1)
            current[i] = (1.0 - cos).double().sum()
        return record

    handles = [layer.register_forward_hook(hook(i), with_kwargs=True) for i, layer in enumerate(layers)]
    tokens = 0
    device = next(model.parameters()).device
    try:
        with torch.inference_mode():
            for prompt in prompts:
                ids = prompt_ids(tokenizer, prompt)
                if not ids:
                    continue
                model(input_ids=torch.tensor([ids], device=device), use_cache=False)
                for i, value in enumerate(current):
                    totals[i] += float(value)
                tokens += len(ids)
    finally:
        for h in handles:
            h.remove()
    if not tokens:
        raise ConfigurationError("the prompts have no tokens to measure on")
    return [t / tokens for t in totals], tokens


def lowest(scores: Sequence[float], drop: int) -> list[int]:
    """Indices of the ``drop`` lowest scores (the lower index first among equal scores), ascending."""
    return sorted(sorted(range(len(scores)), key=lambda i: (scores[i], i))[:drop])


#: ``--by alternate`` keeps every ``KEEP_EVERY``-th decoder layer (the real pair's student before block influence)
KEEP_EVERY = 2


def kept_layers(n_layers: int, every: int = KEEP_EVERY) -> list[int]:
    """Layer indices ``--by alternate`` keeps: 0, every, 2 * every, ..."""
    return list(range(0, n_layers, every))


def alternate_dropped(n_layers: int) -> list[int]:
    """The layers ``--by alternate`` leaves out: every layer ``kept_layers`` does not keep."""
    keep = set(kept_layers(n_layers))
    return [i for i in range(n_layers) if i not in keep]


def check_drop(drop: int, n_layers: int) -> None:
    if drop < 1:
        raise ConfigurationError(f"--drop {drop}: at least one layer must be dropped")
    if drop >= n_layers:
        raise ConfigurationError(f"--drop {drop}: the model has {n_layers} decoder layers; at least one must stay")


def remove_layers(model: Any, dropped: Sequence[int]) -> Any:
    """``model`` itself with the decoder layers ``dropped`` removed: the rest in order, each attention's
    ``layer_idx`` renumbered, the config's ``num_hidden_layers`` and ``layer_types`` updated."""
    import torch

    layers = decoder_layers(model)
    n = len(layers)
    gone = set(dropped)
    if not gone <= set(range(n)):
        raise ConfigurationError(f"layers {sorted(gone - set(range(n)))} are not among the model's {n}")
    check_drop(len(gone), n)
    keep = [i for i in range(n) if i not in gone]
    new_layers = torch.nn.ModuleList([layers[i] for i in keep])
    for new_idx, layer in enumerate(new_layers):
        for part in (layer, layer.self_attn):  # the attention's index (and the layer's, where it keeps one)
            if hasattr(part, "layer_idx"):
                setattr(part, "layer_idx", new_idx)  # noqa: B010  (mypy types module attributes as Tensor | Module)
    model.model.layers = new_layers
    for config in {id(c): c for c in (model.config, getattr(model.model, "config", model.config))}.values():
        config.num_hidden_layers = len(keep)
        layer_types = getattr(config, "layer_types", None)
        if isinstance(layer_types, list) and len(layer_types) == n:
            config.layer_types = [layer_types[i] for i in keep]
    return model


def _source_layer_count(src: Path) -> int:
    if not src.exists():
        raise ConfigurationError(f"no model at {src}: it does not exist")
    if not (src / "config.json").is_file():
        raise ConfigurationError(f"no model at {src}: it has no config.json")
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(str(src))
    except (ValueError, OSError, KeyError) as e:
        raise ConfigurationError(f"cannot read the model config at {src}: {str(e).splitlines()[0]}") from None
    n = getattr(config, "num_hidden_layers", None)
    if not isinstance(n, int):
        raise ConfigurationError(f"cannot prune a {config.model_type} model: its config gives no layer count")
    return n


def record_text(record: dict[str, Any]) -> str:
    """``prune.json``'s text: one key a line, each value compact JSON."""
    return "{\n" + ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in record.items()) + "\n}\n"


def _check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigurationError(f"{out} exists and is not an empty folder: remove it or choose another")


def prune_folder(
    src: Path,
    out: Path,
    *,
    drop: int | None,
    by: Method = "block-influence",
    prompts: Prompts | None = None,
    progress: Callable[[str], None] | None = None,
) -> PruneResult:
    """Prune the model folder ``src`` into ``out`` (``drop`` layers; with ``alternate``, ``drop`` may be None and
    must otherwise equal the number ``alternate`` leaves out). ``prompts``: for ``block-influence``, default
    required (the demo's real pair passes ``pipeline.demo.realtasks.train_prompts()``). Returns the record
    written as ``out/prune.json``."""
    if by not in METHODS:
        raise ConfigurationError(f"unknown pruning method {by!r}; choose from {', '.join(METHODS)}")
    src, out = Path(src), Path(out)
    n = _source_layer_count(src)
    if by == "alternate":
        if drop is not None and drop != len(alternate_dropped(n)):
            raise ConfigurationError(f"--by alternate drops {len(alternate_dropped(n))} of {n} layers, "
                                     f"not --drop {drop}")
        check_drop(len(alternate_dropped(n)), n)
    elif drop is None:
        raise ConfigurationError("--drop N is needed with --by block-influence")
    else:
        check_drop(drop, n)
    _check_out(out)

    from transformers import AutoTokenizer

    from pipeline.models.weights import load_causal_lm

    if progress:
        progress(f"loading {src}")
    model = load_causal_lm(src)
    decoder_layers(model)  # refuses an unknown architecture before any measuring
    tokenizer = AutoTokenizer.from_pretrained(str(src))
    scores: list[float] | None = None
    measured_on: dict[str, Any] | None = None
    if by == "alternate":
        dropped = alternate_dropped(n)
    else:
        assert drop is not None
        if prompts is None:
            raise ConfigurationError("--by block-influence measures on prompts: pass a prompts file")
        if progress:
            progress(f"measuring block influence on {len(prompts.items)} prompts")
        scores, tokens = block_influence(model, tokenizer, prompts.items)
        dropped = lowest(scores, drop)
        measured_on = {"source": prompts.source, "count": len(prompts.items), "tokens": tokens,
                       "sha256": prompts.sha256}
    record: dict[str, Any] = {
        "method": by, "source": str(src.resolve()), "layers": n, "drop": len(dropped), "dropped": dropped,
        "kept": [i for i in range(n) if i not in dropped], "scores": scores,
        "score": SCORE_DEFINITION if scores is not None else None, "prompts": measured_on, "dtype": "float32",
    }
    if progress:
        progress(f"dropping layers {dropped}, writing {out}")
    _write(remove_layers(model, dropped), tokenizer, record, out)
    return PruneResult(out, record)


def _write(model: Any, tokenizer: Any, record: dict[str, Any], out: Path) -> None:
    """The model, its tokenizer and prune.json into a temporary folder beside ``out``, renamed into place."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    tmp.chmod(0o755)
    try:
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        (tmp / PRUNE_FILE).write_text(record_text(record))
        _check_out(out)
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
