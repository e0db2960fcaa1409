"""Weights through a store: the chunk codec, snapshots and deltas, retention, and the reader's refusals (a torn
upload, a corrupt chunk, a pruned chain), on fakeredis and fsspec's memory filesystem."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from pathlib import Path

import fakeredis
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from pipeline.errors import ConfigurationError
from pipeline.models.weights import CheckpointError, latest
from pipeline.weightstore import codec
from pipeline.weightstore import manifest as mf
from pipeline.weightstore.mirror import Mirror
from pipeline.weightstore.stores import FsspecStore, RedisStore, WeightStore, open_store, scheme_of
from pipeline.weightstore.writer import Uploader


@pytest.mark.parametrize("itemsize", [1, 2, 4])
def test_chunk_roundtrip_full_and_xor(itemsize: int) -> None:
    rng = np.random.default_rng(0)
    base = rng.integers(0, 256, 4096, dtype=np.uint8).tobytes()
    cur = bytearray(base)
    cur[100:110] = b"0123456789"
    for prev in (None, base):
        stored = codec.encode_chunk(bytes(cur), prev, itemsize)
        assert codec.decode_chunk(stored, prev, itemsize, len(cur)) == bytes(cur)
    assert len(codec.encode_chunk(bytes(cur), base, itemsize)) < 200  # ten bytes differ: the XOR is mostly zero


def test_decode_refuses_wrong_size_and_garbage() -> None:
    stored = codec.encode_chunk(b"x" * 100, None, 1)
    with pytest.raises(codec.CodecError):
        codec.decode_chunk(stored, None, 1, 99)
    with pytest.raises(codec.CodecError):
        codec.decode_chunk(b"not zstd", None, 1, 8)


def test_unsupported_scheme_is_refused_in_one_line() -> None:
    assert scheme_of("/weights") is None and scheme_of("weights/v1") is None
    assert scheme_of("redis://h:6379/0") == "redis" and scheme_of("s3://bucket/p") == "s3"
    for bad in ("ftp://h/x", "http://h/x", "redis:6379/0"):
        with pytest.raises(ConfigurationError) as e:
            scheme_of(bad)
        assert "\n" not in str(e.value)


def _fake_redis_store() -> RedisStore:
    store = RedisStore("redis://localhost:6379/3?prefix=w")
    store.redis = fakeredis.FakeRedis()
    return store


def _memory_store() -> FsspecStore:
    return FsspecStore(f"memory://w-{uuid.uuid4().hex[:8]}")


STORES: dict[str, Callable[[], WeightStore]] = {"redis": _fake_redis_store, "memory": _memory_store}


def _version(folder: Path, tensors: dict[str, torch.Tensor]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"model_type": "toy"}))
    return folder


def _weights(step: int, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(512, 1024, generator=g)
    # a sparse update per step, as an optimizer step is in bf16: most elements unchanged
    mask = torch.rand(512, 1024, generator=torch.Generator().manual_seed(1)) < 0.02
    return {"w": (w + mask * 0.01 * step).to(dtype), "b": torch.full((64,), float(step), dtype=dtype)}


def _publish(uploader: Uploader, tmp: Path, version: int) -> Path:
    return _version(tmp / "staging" / f"v{version}", _weights(version))


@pytest.mark.parametrize("kind", sorted(STORES))
def test_snapshot_then_deltas_rebuild_bit_exact(kind: str, tmp_path: Path) -> None:
    store: WeightStore = STORES[kind]()
    up = Uploader(store, snapshot_every=3, keep=2)
    reader = Mirror(store, tmp_path / "reader")
    reports = []
    for v in range(0, 5):  # from version 0, as a learner publishes its starting weights
        folder = _publish(up, tmp_path, v)
        reports.append(up.upload(v, folder))
        assert reader.sync() == v
        got = latest(tmp_path / "reader")
        assert got is not None and got.version == v
        for name in ("model.safetensors", "config.json"):
            assert (got.path / name).read_bytes() == (folder / name).read_bytes()
    assert [r.snapshot for r in reports] == [True, False, False, True, False]
    full = reports[0].stored_bytes
    assert all(r.stored_bytes < full / 5 for r in reports[1:3])  # deltas: a fraction of a snapshot
    # kept: the newest 2 and the snapshot the newest needs (v3); v0..v2 dropped with their chunks
    assert store.versions() == [3, 4]
    assert store.get("v00000001/0.0") is None


def test_reader_that_missed_versions_catches_up_from_the_snapshot(tmp_path: Path) -> None:
    store = _memory_store()
    up = Uploader(store, snapshot_every=10, keep=10)
    for v in range(1, 5):
        up.upload(v, _publish(up, tmp_path, v))
    late = Mirror(store, tmp_path / "late")
    assert late.sync() == 4  # snapshot v1 then the deltas 2, 3, 4
    assert (latest(tmp_path / "late").path / "model.safetensors").read_bytes() == (  # type: ignore[union-attr]
        tmp_path / "staging" / "v4" / "model.safetensors").read_bytes()


def test_torn_upload_is_never_seen(tmp_path: Path) -> None:
    store = _fake_redis_store()
    up = Uploader(store, snapshot_every=10, keep=3)
    reader = Mirror(store, tmp_path / "r")
    up.upload(1, _publish(up, tmp_path, 1))
    assert reader.sync() == 1
    store.put("v00000002/0.0", b"half an upload")  # a writer that died before its manifest
    assert reader.sync() == 1 and latest(tmp_path / "r").version == 1  # type: ignore[union-attr]


@pytest.mark.parametrize("fault", ["corrupt", "missing", "pruned"])
def test_bad_version_refused_by_name_reader_keeps_its_own(fault: str, tmp_path: Path) -> None:
    store = _fake_redis_store()
    up = Uploader(store, snapshot_every=4, keep=5)
    reader = Mirror(store, tmp_path / "r")
    up.upload(1, _publish(up, tmp_path, 1))
    assert reader.sync() == 1
    up.upload(2, _publish(up, tmp_path, 2))
    up.upload(3, _publish(up, tmp_path, 3))
    m = mf.decode(store.manifest(3) or b"", 3)
    chunk = m.files[[f.name for f in m.files].index("model.safetensors")].chunks[0].name
    if fault == "corrupt":
        data = bytearray(store.get(chunk) or b"")
        data[len(data) // 2] ^= 0xFF
        store.put(chunk, bytes(data))
    elif fault == "missing":
        store.redis.delete(store.keys.chunk(chunk))
    else:
        store.redis.delete(store.keys.manifest(2))  # the chain from the reader's v1 to v3 is broken
    with pytest.raises(CheckpointError) as e:
        reader.sync()
    assert e.value.version == 3 and e.value.kind == ("corrupt" if fault == "corrupt" else "incomplete")
    assert latest(tmp_path / "r").version == 1  # type: ignore[union-attr]
    assert reader.sync() == 1  # refused once: not fetched again, no second error
    up.upload(4, _publish(up, tmp_path, 4))  # a delta whose chain runs through the bad v3: refused too
    with pytest.raises(CheckpointError) as e:
        reader.sync()
    assert e.value.version in (3, 4) and latest(tmp_path / "r").version == 1  # type: ignore[union-attr]
    up.upload(5, _publish(up, tmp_path, 5))  # the next snapshot heals the reader
    assert reader.sync() == 5


def test_open_store_schemes() -> None:
    assert isinstance(open_store("memory://x"), FsspecStore)
    with pytest.raises(ConfigurationError):
        open_store("/a/folder")


def test_publish_weights_to_a_url_and_a_reader_loads_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeline.demo.tinymodels import ensure_tiny_models
    from pipeline.learner.publish import publish_weights
    from pipeline.models.weights import load_causal_lm, load_weights

    tiny = ensure_tiny_models().student
    model, reader_model = load_causal_lm(tiny), load_causal_lm(tiny)
    url = f"memory://pub-{uuid.uuid4().hex[:8]}"
    announced: list[int] = []
    mirror = Mirror(open_store(url), tmp_path / "reader")
    for v in (1, 2, 3):
        with torch.no_grad():
            next(model.parameters()).add_(0.01)
        publish_weights(model, v, url, keep=2, publish=announced.append, tokenizer_dir=tiny, dtype="bfloat16",
                        snapshot_every=2)
        assert mirror.sync() == v
        assert load_weights(reader_model, tmp_path / "reader") == v
        for (k, a), b in zip(model.state_dict().items(), reader_model.state_dict().values(), strict=True):
            assert torch.equal(a.to(torch.bfloat16).float(), b), k
    assert announced == [1, 2, 3]
    assert not (tmp_path / "redis:").exists()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigurationError):
        publish_weights(model, 4, "redis:6379/0", publish=announced.append)
    with pytest.raises(ConfigurationError):
        publish_weights(model, 4, "ftp://h/w", publish=announced.append)
    assert announced == [1, 2, 3] and not any(p.name.startswith(("redis", "ftp")) for p in tmp_path.iterdir())


def test_summary_names_versions_snapshot_and_bytes(tmp_path: Path) -> None:
    from pipeline.weightstore.stores import summary, summary_line

    url = f"memory://sum-{uuid.uuid4().hex[:8]}"
    up = Uploader(open_store(url), snapshot_every=2, keep=2)
    reports = [up.upload(v, _publish(up, tmp_path, v)) for v in range(4)]
    got = summary(url)
    assert got["versions"] == [2, 3] and got["newest"] == 3 and got["snapshot"] == 2
    assert got["stored_bytes"] == reports[2].stored_bytes + reports[3].stored_bytes
    assert "newest v3 (snapshot v2), kept v2..v3 (2)" in summary_line(got)


def test_an_empty_store_says_so_and_a_mistyped_redis_path_is_refused() -> None:
    from pipeline.weightstore.stores import summary, summary_line

    url = f"memory://empty-{uuid.uuid4().hex[:8]}"
    got = summary(url)
    assert summary_line(got) == (f"weights at {url}: no version published yet (a learner's publish_weights writes "
                                 "the first)")
    with pytest.raises(ConfigurationError, match=r"the path must be one database number .*not '/0/1'"):
        open_store("redis://127.0.0.1:6379/0/1")
    open_store("redis://127.0.0.1:6379/2").close()  # a database number: fine (no connection is made yet)
