"""Where versions are stored: a key-value interface (``WeightStore``) with two backends, Redis and any fsspec
filesystem (``s3://`` for object storage; ``memory://`` and ``file://`` for tests), opened from a URL by
``open_store``. A plain folder is not a store: it holds whole Hugging Face folders (``pipeline.models.weights``).

A store holds chunks (``put``/``get``), and per version a manifest written by ``commit`` after every chunk, with
the pointer to the newest version, at once: in Redis one ``MULTI`` transaction, on a filesystem the manifest
object (an object PUT is atomic; a local file is written aside and renamed) and then ``LATEST``.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Callable
from typing import Protocol, TypeVar
from urllib.parse import parse_qs, urlsplit, urlunsplit

from redis.exceptions import ConnectionError as RedisConnectionError

from pipeline.config import RedisSettings
from pipeline.errors import ConfigurationError, TransportError
from pipeline.transport.connection import TRANSIENT, connect_sync, retry_transient_sync
from pipeline.weightstore.keys import DEFAULT_PREFIX, WeightKeys

T = TypeVar("T")

#: URL schemes a weights location may have (anything else is refused); a location without one is a folder.
SCHEMES = ("redis", "rediss", "s3", "memory", "file")
#: Schemes refused by name when written without ``//`` too (``redis:6379`` is not meant as a folder).
OTHER_SCHEMES = ("http", "https", "gs", "gcs", "az", "abfs", "hf", "ftp", "sftp")


class WeightStore(Protocol):
    url: str

    def put(self, name: str, data: bytes) -> None: ...
    def get(self, name: str) -> bytes | None: ...
    def commit(self, version: int, manifest: bytes) -> None: ...
    def manifest(self, version: int) -> bytes | None: ...
    def latest(self) -> int | None: ...
    def versions(self) -> list[int]: ...
    def drop(self, version: int, names: list[str]) -> None: ...
    def used_bytes(self) -> int | None: ...
    def close(self) -> None: ...


def scheme_of(location: str) -> str | None:
    """The URL scheme of a weights location, ``None`` for a folder; ``ConfigurationError`` (one line) for a scheme
    that is not supported (``redis:`` would otherwise be a folder of that name)."""
    text = str(location)
    if "://" not in text:
        if ":" in text and text.split(":", 1)[0].lower() in (*SCHEMES, *OTHER_SCHEMES):
            raise ConfigurationError(f"weights location {text!r} looks like a URL without '//'; "
                                     f"use one of {', '.join(s + '://' for s in SCHEMES)} or a folder")
        return None
    scheme = text.split("://", 1)[0].lower()
    if scheme not in SCHEMES:
        raise ConfigurationError(f"weights location {text!r}: unsupported scheme {scheme!r}; use a folder or one of "
                                 + ", ".join(s + "://" for s in SCHEMES))
    return scheme


def is_url(location: object) -> bool:
    return location is not None and scheme_of(str(location)) is not None


def redact(url: str) -> str:
    """The URL without its password (for logs and ``stats``)."""
    parts = urlsplit(url)
    if parts.password:
        netloc = f"{parts.username or ''}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
        return urlunsplit(parts._replace(netloc=netloc))
    return url


#: Query parameters of a store URL that set how a learner writes it (readers ignore them).
WRITER_OPTIONS = ("keep", "snapshot_every")


def writer_options(url: str) -> dict[str, int]:
    """``keep`` and ``snapshot_every`` from a store URL's query (``redis://h:6379/1?keep=3&snapshot_every=10``);
    ``ConfigurationError`` for one that is not a positive integer."""
    out = {}
    for name, values in parse_qs(urlsplit(url).query).items():
        if name in WRITER_OPTIONS:
            if not values[-1].isdigit() or int(values[-1]) < 1:
                raise ConfigurationError(f"weights location {redact(url)}: {name} must be a positive integer")
            out[name] = int(values[-1])
    return out


def _without(url: str, names: tuple[str, ...]) -> str:
    parts = urlsplit(url)
    query = [(k, v) for k, vs in parse_qs(parts.query).items() if k not in names for v in vs]
    return urlunsplit(parts._replace(query="&".join(f"{k}={v}" for k, v in query)))


def bare_url(url: str) -> str:
    """The store a URL names, without the writer's options (``keep``, ``snapshot_every``)."""
    return _without(url, WRITER_OPTIONS)


def open_store(url: str) -> WeightStore:
    scheme = scheme_of(url)
    if scheme is None:
        raise ConfigurationError(f"{url!r} is a folder, not a weights store URL")
    writer_options(url)  # malformed options are refused by readers too
    bare = _without(url, WRITER_OPTIONS)
    if scheme in ("redis", "rediss"):
        return RedisStore(bare)
    return FsspecStore(bare)


class WeightStoreUnavailable(TransportError, RedisConnectionError):
    """The weights store's Redis did not answer for ``RedisStore.deadline_s`` (a redis-py ``ConnectionError``:
    transient, exit status 3)."""


class RedisStore:
    """``redis://host:port/db?prefix=NAME`` (prefix default ``distillq-weights``), on the process's connection
    settings (``rediss://`` takes the TLS files of ``DISTILLQ_SSL_*``). Every operation is safe to repeat and is
    retried over an outage for up to ``deadline_s`` (``retry_transient_sync``); then ``WeightStoreUnavailable``,
    one line naming the store."""

    #: How long one operation waits for the store's Redis to answer again.
    deadline_s: float = 60.0

    def __init__(self, url: str, settings: RedisSettings | None = None) -> None:
        parts = urlsplit(url)
        path = parts.path.strip("/")
        if path and not path.isdigit():  # redis-py would take "0/1" as database 0 and drop the rest
            raise ConfigurationError(f"weights location {redact(url)}: the path must be one database number "
                                     f"(redis://host:port/DB?prefix=NAME), not {parts.path!r}")
        query = parse_qs(parts.query)
        prefix = query.pop("prefix", [DEFAULT_PREFIX])[0]
        for name in WRITER_OPTIONS:
            query.pop(name, None)
        rest = "&".join(f"{k}={v}" for k, vs in query.items() for v in vs)
        self.url = url
        self.keys = WeightKeys(prefix)
        self.redis = connect_sync(urlunsplit(parts._replace(query=rest)), settings or RedisSettings())

    def _do(self, op: Callable[[], T]) -> T:
        try:
            return retry_transient_sync(op, deadline_s=self.deadline_s, what=redact(self.url))
        except TRANSIENT as e:
            raise WeightStoreUnavailable(f"weights store {redact(self.url)}: its Redis did not answer for "
                                         f"{self.deadline_s:g} s: {e}") from e

    def put(self, name: str, data: bytes) -> None:
        self._do(lambda: self.redis.set(self.keys.chunk(name), data))

    def get(self, name: str) -> bytes | None:
        got = self._do(lambda: self.redis.get(self.keys.chunk(name)))
        return bytes(got) if got is not None else None  # type: ignore[arg-type]

    def commit(self, version: int, manifest: bytes) -> None:
        def op() -> None:
            pipe = self.redis.pipeline(transaction=True)
            pipe.set(self.keys.manifest(version), manifest)
            pipe.zadd(self.keys.versions, {str(int(version)): int(version)})
            pipe.set(self.keys.latest, int(version))
            pipe.execute()

        self._do(op)

    def manifest(self, version: int) -> bytes | None:
        got = self._do(lambda: self.redis.get(self.keys.manifest(version)))
        return bytes(got) if got is not None else None  # type: ignore[arg-type]

    def latest(self) -> int | None:
        got = self._do(lambda: self.redis.get(self.keys.latest))
        return int(got) if got is not None else None  # type: ignore[arg-type]

    def versions(self) -> list[int]:
        got = self._do(lambda: self.redis.zrange(self.keys.versions, 0, -1))
        return sorted(int(v) for v in got)  # type: ignore[union-attr]

    def drop(self, version: int, names: list[str]) -> None:
        def forget() -> None:
            pipe = self.redis.pipeline(transaction=True)
            pipe.zrem(self.keys.versions, str(int(version)))
            pipe.delete(self.keys.manifest(version))
            pipe.execute()

        self._do(forget)  # the manifest goes first: no reader starts on a version whose chunks are going
        for i in range(0, len(names), 256):
            batch = [self.keys.chunk(n) for n in names[i:i + 256]]
            self._do(lambda batch=batch: self.redis.delete(*batch))  # type: ignore[misc]

    def used_bytes(self) -> int | None:
        """The weights Redis's ``used_memory`` (the whole server's, which is why it should be one of its own)."""
        return int(self._do(lambda: self.redis.info("memory"))["used_memory"])  # type: ignore[index]

    def close(self) -> None:
        self.redis.close()


class FsspecStore:
    """Any fsspec filesystem: ``s3://bucket/prefix`` (``pip install 'distillq[s3]'``; credentials and endpoint
    as s3fs reads them: ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``), ``file:///dir``,
    ``memory://name``.

        ROOT/chunks/v00000007/0.3    ROOT/manifests/v00000007.json    ROOT/LATEST
    """

    def __init__(self, url: str) -> None:
        try:
            import fsspec  # type: ignore[import-untyped]
        except ImportError:  # pragma: no cover - fsspec ships with the hf extra
            raise ConfigurationError("an s3:// weights location needs fsspec and s3fs: "
                                     "pip install 'distillq[s3]'") from None
        self.url = url
        try:
            fs, root = fsspec.core.url_to_fs(url)
        except ImportError as e:
            raise ConfigurationError(f"{url}: {e} (pip install 'distillq[s3]')") from None
        self.fs, self.root = fs, root.rstrip("/")
        self.local = "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))

    def _path(self, *parts: str) -> str:
        return "/".join((self.root, *parts))

    def _write(self, path: str, data: bytes) -> None:
        if self.local:  # a local file is written aside and renamed: a reader never sees half of it
            self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
            tmp = f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            self.fs.pipe_file(tmp, data)
            os.replace(tmp, path)
        else:
            self.fs.pipe_file(path, data)

    def _read(self, path: str) -> bytes | None:
        try:
            return bytes(self.fs.cat_file(path))
        except FileNotFoundError:
            return None

    def put(self, name: str, data: bytes) -> None:
        self._write(self._path("chunks", name), data)

    def get(self, name: str) -> bytes | None:
        return self._read(self._path("chunks", name))

    def commit(self, version: int, manifest: bytes) -> None:
        self._write(self._path("manifests", f"v{int(version):08d}.json"), manifest)
        self._write(self._path("LATEST"), str(int(version)).encode())

    def manifest(self, version: int) -> bytes | None:
        return self._read(self._path("manifests", f"v{int(version):08d}.json"))

    def latest(self) -> int | None:
        raw = self._read(self._path("LATEST"))
        return int(raw) if raw is not None and raw.strip().isdigit() else None

    def versions(self) -> list[int]:
        self.fs.invalidate_cache(self._path("manifests"))  # s3fs caches listings: a new manifest must show
        try:
            names = self.fs.ls(self._path("manifests"), detail=False)
        except FileNotFoundError:
            return []
        out = []
        for n in names:
            base = str(n).rsplit("/", 1)[-1]
            if base.startswith("v") and base.endswith(".json") and base[1:-5].isdigit():
                out.append(int(base[1:-5]))
        return sorted(out)

    def drop(self, version: int, names: list[str]) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self._path("manifests", f"v{int(version):08d}.json"))
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self._path("chunks", f"v{int(version):08d}"), recursive=True)

    def used_bytes(self) -> int | None:
        try:
            return int(self.fs.du(self.root))
        except (FileNotFoundError, NotImplementedError):
            return None

    def close(self) -> None:
        pass


def summary(url: str) -> dict[str, object]:
    """What a store holds, for ``distillq stats --weights-url``: the versions kept, the newest and its snapshot,
    the bytes their chunks take, and the server's memory (Redis) or the objects' size (fsspec)."""
    from pipeline.weightstore import manifest as mf

    store = open_store(url)
    try:
        versions = store.versions()
        held, newest, snapshot = 0, store.latest(), None
        for v in versions:
            raw = store.manifest(v)
            if raw is None:
                continue
            m = mf.decode(raw, v)
            held += m.stored_bytes
            if v == newest:
                snapshot = m.snapshot
        return {"url": redact(url), "versions": versions, "newest": newest, "snapshot": snapshot,
                "stored_bytes": held, "store_used_bytes": store.used_bytes()}
    finally:
        store.close()


def summary_line(s: dict[str, object]) -> str:
    versions = s["versions"]
    assert isinstance(versions, list)
    used = s["store_used_bytes"]
    if s["newest"] is None:
        return f"weights at {s['url']}: no version published yet (a learner's publish_weights writes the first)"
    kept = f"v{versions[0]}..v{versions[-1]} ({len(versions)})" if versions else "none"
    return (f"weights at {s['url']}: newest v{s['newest']} (snapshot v{s['snapshot']}), kept {kept}, "
            f"{int(s['stored_bytes']) / 2**20:.1f} MiB of chunks"  # type: ignore[call-overload]
            + (f", store memory {int(used) / 2**20:.1f} MiB" if isinstance(used, int) else ""))
