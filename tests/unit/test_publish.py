"""publish_weights: one complete Hugging Face folder per version, atomically, pruned; the readers' checks."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from pipeline.demo.tinymodels import ensure_tiny_models
from pipeline.learner.publish import publish_weights, write_checkpoint
from pipeline.models.weights import (
    LATEST,
    MARKER,
    CheckpointError,
    check_fits,
    checkpoint_shapes,
    folder_name,
    latest,
    load_causal_lm,
    load_weights,
    read_config,
)  # fmt: skip


@pytest.fixture(scope="module")
def student() -> Any:
    return load_causal_lm(ensure_tiny_models().student)


def publish(model: Any, version: int, d: Path, keep: int = 3) -> list[int]:
    out: list[int] = []
    publish_weights(model, version, d, keep=keep, publish=out.append, tokenizer_dir=ensure_tiny_models().student)
    return out


def test_folder_per_version_loadable_by_transformers_and_pruned(student: Any, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    announced = [publish(student, v, tmp_path, keep=2) for v in range(4)]
    assert announced == [[0], [1], [2], [3]]
    assert sorted(p.name for p in tmp_path.iterdir()) == [LATEST, folder_name(2), folder_name(3)]
    ckpt = latest(tmp_path)
    assert ckpt is not None and ckpt.version == 3 and ckpt.kind == "full"
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(ckpt.files)
    again = AutoModelForCausalLM.from_pretrained(str(ckpt.path))  # the layout every engine reads
    AutoTokenizer.from_pretrained(str(ckpt.path))
    for (k, a), b in zip(student.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b), k


def test_hf_student_reads_the_newest_version(student: Any, tmp_path: Path) -> None:
    assert load_weights(student, tmp_path) is None  # nothing published yet
    other = load_causal_lm(ensure_tiny_models().student)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(0.5)
    publish(student, 1, tmp_path)
    publish(other, 2, tmp_path)
    fresh = load_causal_lm(ensure_tiny_models().student)
    assert load_weights(fresh, tmp_path) == 2
    for a, b in zip(other.state_dict().values(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_keep_never_prunes_the_newest(student: Any, tmp_path: Path) -> None:
    for v in (5, 6, 7):
        publish(student, v, tmp_path, keep=1)
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith("v")] == [folder_name(v)]
    with pytest.raises(ValueError, match="keep"):
        publish_weights(student, 8, tmp_path, keep=0, publish=lambda v: None)


def test_half_written_folders_are_never_loaded(student: Any, tmp_path: Path) -> None:
    path = write_checkpoint(student, 1, tmp_path)
    shard = path / "model.safetensors"
    full = shard.read_bytes()
    shard.write_bytes(full[: len(full) // 2])  # torn data
    with pytest.raises(CheckpointError, match="bytes"):
        latest(tmp_path)
    shard.write_bytes(full[:8] + b"\xff" * 8 + full[16:])  # torn header, same size
    with pytest.raises(CheckpointError, match="header"):
        latest(tmp_path)
    shard.write_bytes(full)
    (path / MARKER).unlink()  # the marker is written last: without it the folder is incomplete
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        latest(tmp_path)
    with pytest.raises(CheckpointError):
        load_weights(load_causal_lm(ensure_tiny_models().student), tmp_path)


def test_a_writer_killed_midway_leaves_the_previous_version(student: Any, tmp_path: Path) -> None:
    publish(student, 1, tmp_path)
    tmp = tmp_path / ".tmp-v00000002-999"  # what a kill before the rename leaves
    tmp.mkdir()
    (tmp / "model.safetensors").write_bytes(b"\0" * 10)
    ckpt = latest(tmp_path)
    assert ckpt is not None and ckpt.version == 1
    publish(student, 9, tmp_path, keep=1)
    assert not tmp.exists()  # cleaned up with the versions it was older than


def test_check_fits_names_every_difference(tmp_path: Path) -> None:
    tiny = ensure_tiny_models()
    write_checkpoint(load_causal_lm(tiny.teacher), 1, tmp_path)
    ckpt = latest(tmp_path)
    assert ckpt is not None
    served = read_config(tiny.student / "config.json")
    with pytest.raises(CheckpointError, match="hidden_size 128 != served 64") as e:
        check_fits(ckpt, served, None)
    assert "num_hidden_layers 4 != served 2" in str(e.value)
    check_fits(ckpt, read_config(ckpt.path / "config.json"), checkpoint_shapes(ckpt))  # itself: fits
    shapes = dict(checkpoint_shapes(ckpt))
    shapes["model.embed_tokens.weight"] = (999, 128)
    with pytest.raises(CheckpointError, match="another shape"):
        check_fits(ckpt, read_config(ckpt.path / "config.json"), shapes)


def test_rank_other_than_zero_writes_nothing(student: Any, tmp_path: Path) -> None:
    out: list[int] = []
    assert publish_weights(student, 1, tmp_path, rank=1, publish=out.append) is None
    assert out == [] and not tmp_path.joinpath(LATEST).exists()


# peft 0.21 calls a transformers 5 API that warns of its renaming
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_lora_adapter_folder(tmp_path: Path) -> None:
    peft = pytest.importorskip("peft")
    base = load_causal_lm(ensure_tiny_models().student)
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    path = publish_weights(model, 3, tmp_path, publish=lambda v: None)
    ckpt = latest(tmp_path)
    assert path is not None and ckpt is not None and ckpt.kind == "lora"
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(ckpt.files)
    assert json.loads((ckpt.path / "adapter_config.json").read_text())["r"] == 4
    with pytest.raises(CheckpointError, match="LoRA"):
        load_weights(base, tmp_path)


def test_files_are_fsynced_before_the_pointer(student: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    order: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (order.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (order.append(f"replace {Path(b).name}"), real_replace(a, b))[1])
    write_checkpoint(student, 1, tmp_path)
    assert order.index(f"replace {folder_name(1)}") < order.index(f"replace {LATEST}")
    assert order[: order.index(f"replace {folder_name(1)}")].count("fsync") >= 3  # the files and their folder


def test_published_files_are_readable_by_other_users(student: Any, tmp_path: Path) -> None:
    """A model server or worker of another uid reads the versions (safetensors alone writes its files 0600)."""
    umask = os.umask(0o022)
    try:
        publish(student, 1, tmp_path)
    finally:
        os.umask(umask)
    ckpt = latest(tmp_path)
    assert ckpt is not None
    modes = {p.name: p.stat().st_mode & 0o777 for p in ckpt.path.iterdir()}
    assert modes["model.safetensors"] == 0o644 and set(modes.values()) == {0o644}, modes
    tiny = ensure_tiny_models()
    assert (tiny.student / "model.safetensors").stat().st_mode & 0o044 == 0o044


def test_an_unreachable_weights_redis_is_named_by_its_own_url(student: Any) -> None:
    """The weights' Redis is not the pipeline's: a learner that cannot publish to it says which one (exit status 3
    through run_command, as for any Redis it cannot reach)."""
    from pipeline.learner.checks import LearnerConnectionError
    from tests.redis_server import free_port

    url = f"redis://127.0.0.1:{free_port()}/0"
    with pytest.raises(LearnerConnectionError, match=f"^cannot reach Redis at {url}: Connection refused$"):
        publish_weights(student, 1, url, publish=lambda v: None, tokenizer_dir=ensure_tiny_models().student)
