"""Weights through ``s3://`` against a local S3 server (moto's, in a thread; skipped when moto or s3fs is not
installed): ``publish_weights`` uploads a snapshot and deltas through fsspec/s3fs, a reader rebuilds each version
bit-exact, a corrupt object is refused by name and the reader keeps its version."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pipeline.demo.tinymodels import ensure_tiny_models
from pipeline.learner.publish import publish_weights
from pipeline.models.weights import CheckpointError, latest, load_causal_lm
from pipeline.weightstore import manifest as mf
from pipeline.weightstore.mirror import Mirror
from pipeline.weightstore.stores import FsspecStore, open_store

pytest.importorskip("s3fs")
moto_server = pytest.importorskip("moto.server")


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AWS_ACCESS_KEY_ID", "test")
        mp.setenv("AWS_SECRET_ACCESS_KEY", "test")
        mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
        mp.setenv("AWS_ENDPOINT_URL", f"http://{host}:{port}")
        import s3fs  # type: ignore[import-untyped]

        s3fs.S3FileSystem.clear_instance_cache()
        s3fs.S3FileSystem().mkdir("weights")
        yield f"s3://weights/run-{uuid.uuid4().hex[:8]}"
    server.stop()


def test_publish_to_s3_and_read_back(s3: str, tmp_path: Path) -> None:
    tiny = ensure_tiny_models().student
    model = load_causal_lm(tiny)
    reader = Mirror(open_store(s3), tmp_path / "reader")
    for v in (0, 1, 2):
        with torch.no_grad():
            next(model.parameters()).add_(0.01)
        staged = publish_weights(model, v, f"{s3}?keep=2&snapshot_every=10", publish=lambda _: None,
                                 tokenizer_dir=tiny)
        assert staged is not None and reader.sync() == v
        got = latest(tmp_path / "reader")
        assert got is not None and (got.path / "model.safetensors").read_bytes() == (
            staged / "model.safetensors").read_bytes()
    store = open_store(s3)
    assert isinstance(store, FsspecStore) and store.versions() == [0, 1, 2]  # v0 is the snapshot v1, v2 need
    m = mf.decode(store.manifest(2) or b"", 2)
    assert m.base == 1 and m.snapshot == 0
    with torch.no_grad():
        next(model.parameters()).add_(0.01)
    publish_weights(model, 3, s3, publish=lambda _: None, tokenizer_dir=tiny)  # the same uploader: a delta
    m3 = mf.decode(store.manifest(3) or b"", 3)
    assert m3.base == 2
    chunk = next(f for f in m3.files if f.name == "model.safetensors").chunks[0].name
    data = bytearray(store.get(chunk) or b"")
    data[0] ^= 0xFF
    store.put(chunk, bytes(data))
    with pytest.raises(CheckpointError) as e:
        reader.sync()
    assert e.value.version == 3 and e.value.kind == "corrupt"
    assert latest(tmp_path / "reader").version == 2  # type: ignore[union-attr]
