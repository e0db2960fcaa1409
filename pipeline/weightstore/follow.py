"""A reader process following a weights location: a folder as it is, a URL through a local ``Mirror``.

    follower = Follower.open(args.weights_dir)          # None for a folder or no location
    local = follower.local_dir if follower else args.weights_dir
    async with follower.running(stop):                    # the mirror polled every poll_s in a task
        ...                                               # every loader reads ``local`` as it reads a folder

``version_source(published)`` wraps the policy-version source of a local student: when the learner announces a
version newer than the mirror holds, the mirror fetches it before the student reloads, so the version is loaded on
the first sample after it is published (the poll is for servers, which read the folder themselves). A version the
mirror refuses goes to ``on_refused`` (the student's ``checkpoint_refusals``: logged and counted once, shown by
the worker's heartbeat) and the mirror keeps the version it has.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import redis
import structlog

from pipeline.models.weights import CheckpointError
from pipeline.weightstore.mirror import Mirror
from pipeline.weightstore.stores import is_url, open_store, redact

log = structlog.get_logger("distillq.weights")

VersionSource = Callable[[], Awaitable[int]]


class Follower:
    def __init__(self, url: str, local_dir: str | Path | None = None, *, poll_s: float = 0.25,
                 on_refused: Callable[[CheckpointError], None] | None = None) -> None:
        self.url = url
        self._own_dir = local_dir is None
        self.local_dir = Path(local_dir or tempfile.mkdtemp(prefix="distillq-weights-"))
        self.mirror = Mirror(open_store(url), self.local_dir)
        self.poll_s, self.on_refused = poll_s, on_refused
        self._lock = asyncio.Lock()

    @classmethod
    def open(cls, location: str | None, local_dir: str | Path | None = None) -> Follower | None:
        """A follower for a URL (mirrored into ``local_dir``, by default a temporary folder); ``None`` for a folder
        or no location (``ConfigurationError``: a scheme not supported)."""
        if location is None or not is_url(location):
            return None
        return cls(str(location), local_dir)

    @property
    def version(self) -> int | None:
        return self.mirror.version

    async def sync(self) -> int | None:
        """The mirror brought to the newest version (in a thread); the version held. Never raises
        ``CheckpointError``: a refused version goes to ``on_refused``."""
        async with self._lock:
            try:
                return await asyncio.to_thread(self.mirror.sync)
            except CheckpointError as e:
                if self.on_refused is not None:
                    self.on_refused(e)
                return self.mirror.version
            except (OSError, TimeoutError, redis.RedisError) as e:  # the store away: keep what we have, try again
                log.warning("weights_store_unavailable", url=redact(self.url), error=str(e))
                return self.mirror.version

    def version_source(self, published: VersionSource) -> VersionSource:
        """``published`` for a local student: the version the mirror holds, fetched first when the learner
        announced a newer one."""

        async def read() -> int:
            announced = await published()
            held = self.mirror.version
            if held is None or announced > held:
                held = await self.sync()
            return held or 0

        return read

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.sync()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.poll_s)

    @contextlib.asynccontextmanager
    async def running(self, stop: asyncio.Event) -> AsyncIterator[Follower]:
        """Synced once, then polled until the block ends; the local folder removed afterwards if it was made here."""
        await self.sync()
        task = asyncio.create_task(self.run(stop))
        try:
            yield self
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            self.mirror.store.close()
            if self._own_dir:
                shutil.rmtree(self.local_dir, ignore_errors=True)
