"""Tiny local models for tests and the demo (no model hub): a byte-level BPE tokenizer trained in
under a second on a synthetic arithmetic corpus, and Llama-architecture teacher/student models
sharing it. Built once and cached under a git-ignored folder (``.cache/tiny`` by default).

Attention head size is 32 so vLLM's CPU backend can load them too.

``ensure_real_vocab_model`` builds a model of real shape where it matters to a teacher: a Qwen-sized
vocabulary (151,936 rows of embeddings and lm_head) and 32,768 positions, with hidden size 64 so a CPU
scores thousands of tokens in seconds. Its folder carries the tiny tokenizer (512 tokens): the model's
vocabulary exceeds the tokenizer's, as Qwen's does.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pipeline.config import env
from pipeline.models.weights import share_files

DEFAULT_CACHE = Path(env("CACHE") or ".cache") / "tiny"
VOCAB_SIZE = 512
SPECIALS = ["<pad>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|tool|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}<|user|>{{ m['content'] }}"
    "{% elif m['role'] == 'tool' %}<|tool|>{{ m['content'] }}"
    "{% else %}<|assistant|>{{ m['content'] }}</s>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

#: name -> (hidden, layers, heads, intermediate)
SIZES: dict[str, tuple[int, int, int, int]] = {
    "teacher": (128, 4, 4, 256),
    "student": (64, 2, 2, 128),
}
#: The real-shape model: Qwen2/Qwen2.5/Qwen3's padded vocabulary and a long context.
REAL_VOCAB_SIZE = 151_936
REAL_MAX_POSITIONS = 32_768
REAL_SIZE = (64, 2, 2, 128)


@dataclass(frozen=True)
class TinyModels:
    root: Path
    tokenizer: Path
    teacher: Path
    student: Path


def is_heldout(a: int, b: int) -> bool:
    """About 1 in 8 problems is kept out of rollouts, for evaluation only."""
    return (a * 31 + b) % 8 == 0


def arithmetic_problem(rng: random.Random, split: str = "any") -> tuple[str, str]:
    """One synthetic task: a prompt and its answer (the demo's teacher learns these).

    ``split``: ``"train"`` (never a held-out problem), ``"heldout"``, or ``"any"``.
    """
    while True:
        a, b = rng.randint(0, 49), rng.randint(0, 49)
        if split == "any" or (split == "heldout") == is_heldout(a, b):
            return f"{a}+{b}=", f"{a + b}"


def all_problems() -> list[tuple[str, str]]:
    return [(f"{a}+{b}=", f"{a + b}") for a in range(50) for b in range(50)]


def corpus(n: int = 4000, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        p, a = arithmetic_problem(rng)
        lines.append(f"<|user|>{p}<|assistant|>{a}</s>")
    lines += ["The quick brown fox jumps over the lazy dog.", "Hello world! Tool output: 42"] * 50
    return lines


def _key(seed: int) -> str:
    spec = json.dumps({"v": 2, "vocab": VOCAB_SIZE, "sizes": SIZES, "seed": seed}, sort_keys=True)
    return hashlib.sha256(spec.encode()).hexdigest()[:12]


def build_tokenizer(out: Path, vocab_size: int = VOCAB_SIZE, *, all_bytes: bool = True) -> None:
    """The byte-level BPE tokenizer of ``vocab_size`` ids (the special tokens and the chat markup of ``SPECIALS`` and
    ``CHAT_TEMPLATE`` whatever the size), trained on ``corpus()``, saved as a transformers fast tokenizer.
    ``all_bytes`` False: the alphabet is the corpus's characters only (ASCII), not all 256 bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet() if all_bytes else [],
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", model_max_length=2048
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))


def build_model(
    out: Path,
    name: str,
    vocab_size: int,
    seed: int,
    *,
    max_positions: int = 1024,
    size: tuple[int, int, int, int] | None = None,
) -> None:
    """A random-weight ``LlamaForCausalLM`` of ``SIZES[name]`` (or ``size``), saved as safetensors."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers, heads, inter = size or SIZES[name]
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_positions,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(str(out), safe_serialization=True)
    share_files(out)


def ensure_tiny_models(cache: Path | None = None, seed: int = 0) -> TinyModels:
    """Build (or reuse from the cache) the tokenizer, teacher and student. About 2 s on 2 CPU cores."""
    root = (cache or DEFAULT_CACHE) / _key(seed)
    tm = TinyModels(root, root / "tokenizer", root / "teacher", root / "student")
    done = root / "DONE"
    if done.exists():
        return tm
    root.mkdir(parents=True, exist_ok=True)
    build_tokenizer(tm.tokenizer)
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(str(tm.tokenizer)))
    for i, (name, path) in enumerate((("teacher", tm.teacher), ("student", tm.student))):
        build_model(path, name, vocab, seed + i)
        # Each model dir carries the shared tokenizer, so `--model DIR` is enough to load both.
        AutoTokenizer.from_pretrained(str(tm.tokenizer)).save_pretrained(str(path))
    done.write_text("ok\n")
    return tm


def ensure_real_vocab_model(cache: Path | None = None, seed: int = 0) -> Path:
    """Build (or reuse from the cache) the real-vocabulary model; returns its folder (model + tokenizer).

    Random weights, hidden 64, 2 layers of 2 heads of 32, vocabulary 151,936, 32,768 positions; about
    80 MB of safetensors, built in a few seconds. Built in a temporary folder and renamed into place, so
    concurrent builders never see half a model.
    """
    spec = json.dumps(
        {"v": 1, "vocab": REAL_VOCAB_SIZE, "pos": REAL_MAX_POSITIONS, "size": REAL_SIZE, "seed": seed}, sort_keys=True
    )
    root = cache or DEFAULT_CACHE
    path = root / f"realvocab-{hashlib.sha256(spec.encode()).hexdigest()[:12]}"
    if (path / "DONE").exists():
        return path
    from transformers import AutoTokenizer

    tok_dir = ensure_tiny_models(cache, seed).tokenizer
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=root))
    tmp.chmod(0o755)
    try:
        build_model(tmp, "real", REAL_VOCAB_SIZE, seed, max_positions=REAL_MAX_POSITIONS, size=REAL_SIZE)
        AutoTokenizer.from_pretrained(str(tok_dir)).save_pretrained(str(tmp))
        (tmp / "DONE").write_text("ok\n")
        try:
            tmp.rename(path)
        except OSError:  # another builder got there first
            if not (path / "DONE").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return path
