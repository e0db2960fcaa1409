"""Uploading a published folder to a store: a snapshot every ``snapshot_every`` versions, deltas between.

    uploader = Uploader(open_store("redis://weights:6379/0"), snapshot_every=10, keep=3)
    report = uploader.upload(version, Path("staging/v00000007"))   # folder in the HF layout

Each file of the folder (its checkpoint marker aside: readers write their own) is cut into ``CHUNK_BYTES`` chunks,
each encoded by ``pipeline.weightstore.codec`` (against the same chunk of the previous version when the file has
the same name and size there) and put; the manifest goes last (``WeightStore.commit``). A delta is written only
against the version this uploader wrote last and only while the store still names it newest with the same
manifest; otherwise (a restarted learner, another writer) the version is a snapshot. Then versions older than the
newest ``keep`` and than the snapshot the newest needs are dropped, manifest first.
"""

from __future__ import annotations

import hashlib
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import structlog

from pipeline.models.weights import MARKER, safetensors_shapes
from pipeline.weightstore import manifest as mf
from pipeline.weightstore.codec import CHUNK_BYTES, chunk_spans, encode_chunk, sha256
from pipeline.weightstore.stores import WeightStore

log = structlog.get_logger("distillq.weights")

DTYPE_SIZES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


@dataclass(frozen=True)
class UploadReport:
    version: int
    snapshot: bool
    full_bytes: int  # the folder's files, raw
    stored_bytes: int  # what was put for this version
    seconds: float
    kept: tuple[int, ...]  # versions in the store afterwards
    dropped: tuple[int, ...]


def itemsize_of(path: Path) -> int:
    """The element size a file's chunks are shuffled by: its tensors' (the smallest, if they differ) for a
    safetensors file, 1 for anything else."""
    if not path.name.endswith(".safetensors"):
        return 1
    import json
    import struct

    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    sizes = {DTYPE_SIZES.get(str(v.get("dtype")), 1) for k, v in header.items() if k != "__metadata__"}
    return min(sizes) if sizes else 1


class Uploader:
    def __init__(self, store: WeightStore, *, snapshot_every: int = 10, keep: int = 3, threads: int = 2) -> None:
        if snapshot_every < 1 or keep < 1:
            raise ValueError(f"snapshot_every and keep must be >= 1, got {snapshot_every}, {keep}")
        self.store, self.snapshot_every, self.keep, self.threads = store, snapshot_every, keep, threads
        self.last: mf.Manifest | None = None
        self.last_folder: Path | None = None
        self.last_report: UploadReport | None = None

    def _base(self) -> tuple[mf.Manifest, Path] | None:
        last, folder = self.last, self.last_folder
        if last is None or folder is None or not folder.is_dir() or last.depth + 1 >= self.snapshot_every:
            return None
        if self.store.latest() != last.version or self.store.manifest(last.version) != mf.encode(last):
            return None  # the store moved on without this uploader: start a new chain
        return last, folder

    def upload(self, version: int, folder: Path) -> UploadReport:
        """Put ``folder``'s files as ``version`` (a delta against the last upload when it can, see the module),
        commit its manifest, drop what retention allows; bytes and seconds in the report (and the log)."""
        t0 = time.perf_counter()
        version = int(version)
        base = self._base()
        kind = "full" if not (folder / "adapter_config.json").exists() else "lora"
        names = sorted(p.name for p in folder.iterdir() if p.is_file() and p.name != MARKER)
        base_files = {f.name: f for f in base[0].files} if base else {}
        entries = []
        with ThreadPoolExecutor(self.threads) as pool:
            for i, name in enumerate(names):
                path = folder / name
                if name.endswith(".safetensors"):
                    safetensors_shapes(path)  # a torn file is not uploaded
                prev = base_files.get(name)
                size = path.stat().st_size
                mode = "delta" if base and prev is not None and prev.size == size else "full"
                entries.append(self._file(pool, version, i, path, size, mode,
                                          base[1] / name if base and mode == "delta" else None))
        m = mf.Manifest(version=version, kind=kind, base=base[0].version if base else None,
                        snapshot=base[0].snapshot if base else version, depth=base[0].depth + 1 if base else 0,
                        files=entries, created_at=time.time())
        self.store.commit(version, mf.encode(m))
        self.last, self.last_folder = m, folder
        kept, dropped = self._prune(m)
        report = UploadReport(version, base is None, m.full_bytes, m.stored_bytes, time.perf_counter() - t0,
                              tuple(kept), tuple(dropped))
        self.last_report = report
        log.info("weights_uploaded", version=version, snapshot=report.snapshot, full_bytes=report.full_bytes,
                 stored_bytes=report.stored_bytes, seconds=round(report.seconds, 3), kept=kept, dropped=dropped)
        return report

    def _file(self, pool: ThreadPoolExecutor, version: int, index: int, path: Path, size: int, mode: str,
              base: Path | None) -> mf.FileEntry:
        itemsize = itemsize_of(path)
        whole = hashlib.sha256()
        spans = chunk_spans(size, CHUNK_BYTES - CHUNK_BYTES % max(itemsize, 1))

        def one(k: int, raw: bytes, prev: bytes | None) -> mf.ChunkRef:
            stored = encode_chunk(raw, prev, itemsize)
            name = f"v{version:08d}/{index}.{k}"
            self.store.put(name, stored)
            return mf.ChunkRef(name=name, raw=len(raw), stored=len(stored), sha256=sha256(stored))

        chunks: list[mf.ChunkRef] = []
        pending: list[Future[mf.ChunkRef]] = []  # at most 2 per thread in memory
        with path.open("rb") as f, (base.open("rb") if base is not None else _Nothing()) as b:
            for k, (_, n) in enumerate(spans):
                raw = f.read(n)
                whole.update(raw)
                prev = b.read(n) if b is not None else None
                pending.append(pool.submit(one, k, raw, prev))
                if len(pending) >= 2 * self.threads:
                    chunks.append(pending.pop(0).result())
        chunks.extend(fu.result() for fu in pending)
        return mf.FileEntry(name=path.name, size=size, sha256=whole.hexdigest(), itemsize=itemsize,
                            mode="delta" if base is not None else "full", chunks=chunks)

    def _prune(self, newest: mf.Manifest) -> tuple[list[int], list[int]]:
        versions = self.store.versions()
        last_k = versions[-self.keep:]
        oldest = min(last_k[0] if last_k else newest.version, newest.snapshot)
        dropped = []
        for v in versions:
            if v < oldest or v > newest.version:
                raw = self.store.manifest(v)
                names = mf.decode(raw, v).chunk_names() if raw is not None else []
                self.store.drop(v, names)
                dropped.append(v)
        return [v for v in versions if v not in dropped], dropped


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
