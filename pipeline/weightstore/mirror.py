"""Following a store from a reader: the newest version rebuilt as a local folder in the published layout.

    mirror = Mirror(open_store(url), Path("/tmp/weights"))
    mirror.sync()      # the newest version fetched, verified and written to /tmp/weights/v0000000N + LATEST

The local folder is what every loader already reads (``pipeline.models.weights.latest``, a local student's
``load_weights``, a vLLM server's ``reload_weights``, SGLang's ``update_weights_from_disk``), so the readers
follow a URL without changing how they load.

A version is rebuilt from the version held (applying the deltas since it) or, when the reader holds none that its
chain passes through, from the chain's snapshot. Every stored chunk is checked against its sha256 before it is
decoded and every rebuilt file against the sha256 of the file the learner wrote; a missing chunk (a torn upload,
an evicted key) or a manifest that is gone (pruned) mid-way raises ``CheckpointError`` (``incomplete``), a wrong
checksum ``corrupt``, both naming the version; nothing is moved into place, so the folder's ``LATEST`` still names
the version held and every loader keeps it. The same refused manifest is not fetched again.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import structlog

from pipeline.models.weights import LATEST, MARKER, CheckpointError, folder_name, published_versions
from pipeline.weightstore import manifest as mf
from pipeline.weightstore.codec import CodecError, decode_chunk, sha256
from pipeline.weightstore.stores import WeightStore, redact

log = structlog.get_logger("distillq.weights")


class Mirror:
    def __init__(self, store: WeightStore, local_dir: str | Path, *, keep_local: int = 2) -> None:
        self.store, self.local = store, Path(local_dir)
        self.local.mkdir(parents=True, exist_ok=True)
        self.keep_local = max(keep_local, 1)
        self.held: mf.Manifest | None = None
        self.refused: dict[int, bytes] = {}  # version -> the manifest bytes refused
        self.last_seconds = 0.0
        self.last_bytes = 0

    @property
    def version(self) -> int | None:
        return self.held.version if self.held is not None else None

    def sync(self, version: int | None = None) -> int | None:
        """Bring the local folder to the store's newest version (or to ``version``); the version held afterwards
        (``None``: nothing published yet). ``CheckpointError`` naming the version when it cannot be rebuilt (the
        version held stays in place); a version refused once returns the held version quietly until a newer one
        comes."""
        newest = self.store.latest() if version is None else version
        if newest is None or (self.held is not None and newest == self.held.version):
            return self.version
        raw = self.store.manifest(newest)
        if raw is None:
            raise CheckpointError(f"{redact(self.store.url)}: v{newest} is named newest but has no manifest",
                                  "incomplete", newest)
        if self.refused.get(newest) == raw:
            return self.version
        try:
            self._rebuild(mf.decode(raw, newest))
        except CheckpointError as e:
            self.refused[newest] = raw
            e.version = newest if e.version is None else e.version
            log.error("weights_version_refused", url=redact(self.store.url), version=newest, kind=e.kind,
                      error=str(e), kept=self.version)
            raise
        return self.version

    def _chain(self, newest: mf.Manifest) -> list[mf.Manifest]:
        """The manifests to apply, oldest first: back from ``newest`` to the version held or to a snapshot."""
        chain = [newest]
        held = self.version
        while chain[-1].base is not None and chain[-1].base != held:
            base = chain[-1].base
            raw = self.store.manifest(base)
            if raw is None:
                raise CheckpointError(f"{redact(self.store.url)}: v{newest.version} is a delta whose chain needs "
                                      f"v{base}, which is gone (pruned)", "incomplete", newest.version)
            chain.append(mf.decode(raw, base))
        return chain[::-1]

    def _rebuild(self, newest: mf.Manifest) -> None:
        t0 = time.perf_counter()
        chain = self._chain(newest)
        base_dir = None  # the version held, when the chain starts from it (not from a snapshot)
        if self.held is not None and chain[0].base is not None:
            base_dir = self.local / folder_name(self.held.version)
        fetched = 0
        tmps: list[Path] = []
        try:
            for m in chain:
                out = self.local / f".tmp-{folder_name(m.version)}-{os.getpid()}"
                shutil.rmtree(out, ignore_errors=True)
                out.mkdir()
                tmps.append(out)
                fetched += self._write_version(m, base_dir, out)
                base_dir = out
            final = self.local / folder_name(newest.version)
            marker = {"version": newest.version, "kind": newest.kind,
                      "files": {f.name: f.size for f in newest.files}, "created_at": newest.created_at}
            (tmps[-1] / MARKER).write_text(json.dumps(marker, indent=1))
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmps[-1], final)
            pointer = self.local / f".tmp-{LATEST}-{os.getpid()}"
            pointer.write_text(json.dumps({"version": newest.version, "folder": final.name}))
            os.replace(pointer, self.local / LATEST)
        finally:
            for t in tmps:
                shutil.rmtree(t, ignore_errors=True)
        self.held = newest
        self.last_seconds, self.last_bytes = time.perf_counter() - t0, fetched
        self._prune_local()
        log.info("weights_fetched", url=redact(self.store.url), version=newest.version, applied=len(chain),
                 from_snapshot=chain[0].base is None, fetched_bytes=fetched, seconds=round(self.last_seconds, 3))

    def _write_version(self, m: mf.Manifest, base_dir: Path | None, out: Path) -> int:
        fetched = 0
        for entry in m.files:
            base = None
            if entry.mode == "delta":
                if base_dir is None or not (base_dir / entry.name).is_file():
                    raise CheckpointError(f"v{m.version}: {entry.name} is a delta against v{m.base}, which this "
                                          "reader does not hold", "incomplete", m.version)
                base = (base_dir / entry.name).open("rb")
            whole = hashlib.sha256()
            try:
                with (out / entry.name).open("wb") as f, ThreadPoolExecutor(2) as pool:
                    pending: list[Future[bytes]] = []  # fetched and decoded two at a time, written in order
                    for c in entry.chunks:
                        prev = base.read(c.raw) if base is not None else None
                        pending.append(pool.submit(self._chunk, m, entry, c, prev))
                        if len(pending) >= 3:
                            raw = pending.pop(0).result()
                            whole.update(raw)
                            f.write(raw)
                    for fu in pending:
                        raw = fu.result()
                        whole.update(raw)
                        f.write(raw)
                fetched += sum(c.stored for c in entry.chunks)
            finally:
                if base is not None:
                    base.close()
            if whole.hexdigest() != entry.sha256:
                raise CheckpointError(f"v{m.version}: {entry.name} rebuilt does not match the learner's sha256 "
                                      f"(a delta applied to other weights than its base v{m.base})", "corrupt",
                                      m.version)
        return fetched

    def _chunk(self, m: mf.Manifest, entry: mf.FileEntry, c: mf.ChunkRef, prev: bytes | None) -> bytes:
        """One chunk fetched, checked against its sha256 and decoded (``CheckpointError`` naming it otherwise)."""
        stored = self.store.get(c.name)
        if stored is None:
            raise CheckpointError(f"v{m.version}: chunk {c.name} of {entry.name} is missing (a torn upload or an "
                                  "evicted key)", "incomplete", m.version)
        if len(stored) != c.stored or sha256(stored) != c.sha256:
            raise CheckpointError(f"v{m.version}: chunk {c.name} of {entry.name} fails its sha256 ({len(stored)} "
                                  f"bytes, {c.stored} written)", "corrupt", m.version)
        try:
            return decode_chunk(stored, prev, entry.itemsize, c.raw)
        except CodecError as e:
            raise CheckpointError(f"v{m.version}: chunk {c.name}: {e}", "corrupt", m.version) from None

    def _prune_local(self) -> None:
        versions = published_versions(self.local)
        for v in versions[:-self.keep_local]:
            shutil.rmtree(self.local / folder_name(v), ignore_errors=True)
