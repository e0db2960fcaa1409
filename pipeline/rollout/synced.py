"""A student backend over several inference servers, each kept on the newest published weights.

    student = SyncedStudent([VLLMStudent(url, name, tok) ...], engines, weights_dir="/weights")
    await student.start()                    # first sync; then student.run(stop) in a task keeps them synced
    with attribution() as seen:              # pipeline.rollout.weight_sync
        comps = await student.generate(ids, GenParams(max_tokens=64), n=8)
    version = attribute(seen)                # None: the weights changed under the sample (resample it)

Each server is synced on its own (one slow or dead server never holds the others back): a server whose
reload fails, or that stops answering, leaves the rotation with one log line and a metric and is retried
with a growing delay; it rejoins only once it says it holds the newest version. A checkpoint that does
not fit the served model (architecture, config shapes, tensor names and shapes) is refused before any
server is touched; so is one that cannot be loaded (torn, a corrupt header, a NaN or an infinity in a tensor:
every tensor is read once per version before any server is told to load it), recorded in
``checkpoint_refusals`` (``pipeline.rollout.refusals``), and the servers keep the version they have.
Requests go round-robin to the servers in the rotation and wait while none is.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from typing import Any

import structlog

from pipeline import metrics
from pipeline.models.weights import (
    CONFIG,
    Checkpoint,
    CheckpointError,
    check_finite,
    check_fits,
    checkpoint_shapes,
    latest,
    published_versions,
    read_config,
)
from pipeline.rollout.refusals import CheckpointRefusals, FolderKey, folder_key
from pipeline.rollout.students.base import Completion, GenParams, StudentBackendError
from pipeline.rollout.students.vllm import VLLMStudent
from pipeline.rollout.sync_engines import Engine, EngineError, reference_of
from pipeline.rollout.weight_sync import ServerState, needs_sync, record, request_version

log = structlog.get_logger("distillq.weight_sync")


class SyncedStudent:
    """``StudentBackend`` over ``students[i]`` (generation) and ``engines[i]`` (weights) of the same servers."""

    def __init__(
        self,
        students: Sequence[VLLMStudent],
        engines: Sequence[Engine],
        weights_dir: str | None,
        *,
        poll_s: float = 0.5,
        wait_s: float = 600.0,
    ) -> None:
        if not students or len(students) != len(engines):
            raise ValueError("one engine per student server, at least one")
        self.students, self.engines = list(students), list(engines)
        self.weights_dir = weights_dir
        self.poll_s, self.wait_s = poll_s, wait_s
        self.states = [ServerState(e.url) for e in self.engines]
        self._next = 0
        self._changed = asyncio.Event()
        self.checkpoint_refusals = CheckpointRefusals()
        self._finite: FolderKey | None = None  # the folder state last read and found finite
        self._reference: dict[int, tuple[dict[str, Any], dict[str, tuple[int, ...]] | None] | None] = {}

    @property
    def tokenizer(self) -> Any:
        return self.students[0].tokenizer

    @property
    def synced(self) -> bool:
        return self.weights_dir is not None

    # -- generation --------------------------------------------------------------------------------

    async def generate(self, prompt_ids: list[int], params: GenParams, n: int = 1) -> list[Completion]:
        """Sample on a server in the rotation; records the request's version (``weight_sync.record``)."""
        tried: set[int] = set()
        while True:
            i = await self._pick(tried)
            st, eng, state = self.students[i], self.engines[i], self.states[i]
            try:
                if not self.synced:
                    return await st.generate(prompt_ids, params, n)
                if eng.lora:
                    version = state.version
                    st.model = eng.model_for(version) or st.model  # read synchronously by generate's body
                    comps = await st.generate(prompt_ids, params, n)
                    record(version)
                    return comps
                published = self._published()
                before = await eng.version(anything_published=published)
                comps = await st.generate(prompt_ids, params, n)
                after = await eng.version(anything_published=published)
                record(request_version(before, after))
                return comps
            except (StudentBackendError, EngineError) as e:
                if not await self._alive(i):
                    tried.add(i)
                    self._leave(i, f"request failed: {e}")
                    if len(tried) < len(self.states):
                        continue  # another server may answer
                raise StudentBackendError(str(e)) from e

    async def _pick(self, tried: set[int]) -> int:
        deadline = time.monotonic() + self.wait_s
        while True:
            n = len(self.states)
            for k in range(n):
                i = (self._next + k) % n
                if i not in tried and (self.states[i].usable() or not self.synced):
                    self._next = i + 1
                    return i
            if time.monotonic() > deadline:
                raise StudentBackendError(f"no student server in the rotation for {self.wait_s:.0f} s: "
                                          + "; ".join(f"{s.url}: {s.error or 'syncing'}" for s in self.states))
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), self.poll_s)

    async def _alive(self, i: int) -> bool:
        try:
            await self.engines[i].version(anything_published=self._published())
        except EngineError:
            return False
        return True

    # -- syncing -----------------------------------------------------------------------------------

    def _published(self) -> bool:
        return bool(self.weights_dir) and bool(published_versions(self.weights_dir or ""))

    def newest(self) -> Checkpoint | None:
        """The newest complete checkpoint, or ``None`` (nothing published, or a bad one: refused, logged once)."""
        if self.weights_dir is None:
            return None
        try:
            return latest(self.weights_dir)
        except CheckpointError as e:
            self._refuse(e)
            return None

    async def newest_loadable(self) -> Checkpoint | None:
        """``newest()`` with its tensors checked finite (read once per folder state, in a thread), or ``None``."""
        ckpt = self.newest()
        if ckpt is None:
            return None
        key = folder_key(ckpt)
        if key != self._finite:
            if self.checkpoint_refusals.known(key):
                return None
            try:
                await asyncio.to_thread(check_finite, ckpt)
            except CheckpointError as e:
                self._refuse(e, key)
                return None
            self._finite = key
        self.checkpoint_refusals.loaded()
        return ckpt

    def _refuse(self, error: CheckpointError, folder: FolderKey | None = None) -> None:
        held = [s.version for s in self.states if s.version is not None]
        before = self.checkpoint_refusals.count
        self.checkpoint_refusals.refuse(error, kept=max(held) if held else None, folder=folder)
        if self.checkpoint_refusals.count != before:
            metrics.WEIGHT_SYNCS.labels("bad_checkpoint").inc()

    async def start(self) -> None:
        """One round: every server synced (or out of the rotation) before the first request."""
        for s in self.states:
            s.in_rotation = not self.synced
        await self.load_references()
        await self.sync_once()
        for i, s in enumerate(self.states):
            if not s.in_rotation:
                log.warning("student_server_not_ready", url=s.url, error=s.error, index=i)

    async def run(self, stop: asyncio.Event) -> None:
        """Sync every ``poll_s`` until ``stop``."""
        while not stop.is_set():
            await self.sync_once()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.poll_s)

    async def sync_once(self) -> None:
        if not self.synced:
            return
        ckpt = await self.newest_loadable()
        await asyncio.gather(*(self._sync_server(i, ckpt) for i in range(len(self.states))))
        metrics.STUDENT_SERVERS_IN_ROTATION.set(sum(s.in_rotation for s in self.states))
        self._changed.set()

    async def _sync_server(self, i: int, ckpt: Checkpoint | None) -> None:
        state, eng = self.states[i], self.engines[i]
        if time.monotonic() < state.retry_at:
            return
        try:
            state.version = await eng.version(anything_published=self._published())
        except EngineError as e:
            self._leave(i, f"unreachable: {e}")
            return
        newest = ckpt.version if ckpt is not None else None
        if not needs_sync(state.version, newest):
            if state.version is None:  # labelled unsynced by a failed reload, and nothing newer to load
                if state.in_rotation or not state.error:
                    log.warning("student_server_out_of_rotation", url=state.url, error="holds no published version")
                state.in_rotation, state.error = False, "holds no published version"
                return
            if not state.in_rotation:
                log.info("student_server_back", url=state.url, version=state.version)
            state.in_rotation, state.failures, state.error = True, 0, ""
            return
        assert ckpt is not None
        if not self._fits(i, ckpt):
            return
        state.syncing = True
        t0 = time.perf_counter()
        try:
            await eng.sync(ckpt)
            version = await eng.version(anything_published=True)
            if version != ckpt.version:
                raise EngineError(f"{state.url} says version {version} after loading {ckpt.version}")
        except EngineError as e:
            metrics.WEIGHT_SYNCS.labels("failed").inc()
            self._leave(i, f"reload of v{ckpt.version} failed: {e}", force_log=True)
            return
        finally:
            state.syncing = False
        seconds = time.perf_counter() - t0
        metrics.WEIGHT_SYNCS.labels("ok").inc()
        metrics.WEIGHT_SYNC_SECONDS.observe(seconds)
        state.synced(ckpt.version)
        self.remember_reference(i, ckpt)
        log.info("student_server_synced", url=state.url, version=ckpt.version, seconds=round(seconds, 3),
                 bytes=ckpt.nbytes)

    def _fits(self, i: int, ckpt: Checkpoint) -> bool:
        """Refuse (log once per version, metric) a checkpoint that does not fit what server ``i`` serves."""
        state = self.states[i]
        ref = self._reference.get(i)
        try:
            if ref is not None:
                check_fits(ckpt, ref[0], ref[1])
            return True
        except CheckpointError as e:
            if ckpt.version not in state.refused:
                state.refused.add(ckpt.version)
                metrics.WEIGHT_SYNCS.labels("refused").inc()
                log.error("checkpoint_refused", url=state.url, version=ckpt.version, error=str(e),
                          action="server not touched, keeps serving its version")
            return False

    async def load_references(self) -> None:
        """Each server's served model (config and tensor shapes), read from its folder when visible here."""
        for i, eng in enumerate(self.engines):
            root = None
            with contextlib.suppress(EngineError):
                root = await eng.served_root()
            try:
                self._reference[i] = reference_of(root)
            except CheckpointError as e:
                log.warning("served_model_unreadable", url=eng.url, error=str(e))
                self._reference[i] = None
            if self._reference[i] is None and self.synced and not eng.lora:
                log.warning("served_model_not_visible", url=eng.url, root=root,
                            action="checkpoints checked against the first one loaded")

    def remember_reference(self, i: int, ckpt: Checkpoint) -> None:
        if self._reference.get(i) is None and ckpt.kind == "full":
            self._reference[i] = (read_config(ckpt.path / CONFIG), checkpoint_shapes(ckpt))

    def _leave(self, i: int, error: str, *, force_log: bool = False) -> None:
        state = self.states[i]
        if state.failed(error) or force_log or state.failures == 1:
            log.error("student_server_out_of_rotation", url=state.url, error=error,
                      retry_in_s=round(state.retry_at - time.monotonic(), 2))
        metrics.STUDENT_SERVERS_IN_ROTATION.set(sum(s.in_rotation for s in self.states))

    async def aclose(self) -> None:
        for st in self.students:
            await st.aclose()
        for eng in self.engines:
            await eng.aclose()
