"""Publish a learner's weights where every sampler can load them, then announce the version.

    from pipeline.learner.publish import publish_weights
    publish_weights(model, version, "/weights", keep=3)          # or learner.publish_weights(model, version, DIR)

writes ``/weights/v{version:08d}/`` in the Hugging Face layout (``config.json``, safetensors shards,
the tokenizer files of the model's folder; a PEFT model writes its adapter folder instead), atomically:
into a temporary folder, every file fsynced, renamed into place, then ``LATEST`` points at it, and only
then the version goes to Redis (``policy_version``). Versions older than the newest ``keep`` are deleted
(the newest ``keep`` are never touched, so a server still loading the previous one finds it).

Data parallel: call it on every rank. Under FSDP the full state dict is gathered (a collective every rank
must join, offloaded to CPU); rank 0 writes and publishes, and every rank returns once it has (a barrier).
DDP replicas are identical: rank 0 writes its own, no gather. Without ``torch.distributed``, pass
``rank`` (only rank 0 writes). The folder layout and the readers: ``pipeline.models.weights``.

The location may be a URL instead of a folder (``redis://host:port/db``, ``s3://bucket/prefix``: docs/weights.md):
the folder is then written into a local staging folder of this process and uploaded to the store
(``pipeline.weightstore.writer``: a snapshot every ``snapshot_every`` versions, deltas between, the newest
``keep`` kept; ``?keep=K&snapshot_every=N`` in the URL override both) before the version is announced; a scheme
that is not supported raises ``ConfigurationError``.
``dtype`` (``"bfloat16"``, ...) casts the floating tensors written, whatever the location.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis
import structlog

from pipeline.config import redis_settings
from pipeline.learner.checks import LearnerConnectionError
from pipeline.models.weights import (
    ADAPTER_CONFIG,
    CONFIG,
    LATEST,
    MARKER,
    folder_name,
    fsync_dir,
    published_versions,
    share_files,
    version_of_folder,
)  # fmt: skip
from pipeline.transport.connection import connect, redis_error_line
from pipeline.transport.keys import Keys
from pipeline.weightstore.stores import bare_url, is_url, open_store, redact, writer_options
from pipeline.weightstore.writer import Uploader, UploadReport

log = structlog.get_logger("distillq.publish")

#: Files copied from the model's own folder when present, so the checkpoint folder is self-contained.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
    "tokenizer.model", "added_tokens.json", "chat_template.jinja", "chat_template.json",
)  # fmt: skip
TMP_PREFIX = ".tmp-"


def unwrap(model: Any) -> Any:
    """The model under DDP / ``torch.compile`` wrappers (FSDP is gathered, not unwrapped)."""
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if inner is None or _is_fsdp(model):
            return model
        model = inner


def _dist() -> tuple[bool, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return True, dist.get_rank()
    return False, 0


def _is_fsdp(model: Any) -> bool:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    if isinstance(model, FullyShardedDataParallel):
        return True
    return any(isinstance(p, DTensor) for p in model.parameters())  # FSDP2 (fully_shard)


def gather_state_dict(model: Any) -> dict[str, Any] | None:
    """The full state dict on CPU for the rank that writes, ``None`` elsewhere. Under FSDP this is a
    collective: every rank must call it."""
    distributed, rank = _dist()
    if distributed and _is_fsdp(model):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return dict(sd) if rank == 0 else None
    if rank != 0:
        return None
    return {k: v.detach().contiguous().cpu() for k, v in unwrap(model).state_dict().items()}


def _is_peft(model: Any) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def write_checkpoint(
    model: Any,
    version: int,
    directory: str | Path,
    *,
    state_dict: dict[str, Any] | None = None,
    tokenizer_dir: str | Path | None = None,
    max_shard_size: str = "2GB",
    keep: int = 3,
) -> Path:
    """Write ``version`` atomically into ``directory`` and point ``LATEST`` at it; prune. Returns the folder."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    final = d / folder_name(version)
    tmp = d / f"{TMP_PREFIX}{folder_name(version)}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    inner = unwrap(model)
    kind = "lora" if _is_peft(inner) else "full"
    if kind == "lora":
        inner.save_pretrained(str(tmp), safe_serialization=True)
    else:
        sd = state_dict if state_dict is not None else gather_state_dict(model)
        inner.save_pretrained(str(tmp), state_dict=sd, safe_serialization=True, max_shard_size=max_shard_size)
        _copy_tokenizer(tokenizer_dir or getattr(inner, "name_or_path", None), tmp)
    if not (tmp / (ADAPTER_CONFIG if kind == "lora" else CONFIG)).exists():
        raise RuntimeError(f"{type(inner).__name__}.save_pretrained wrote no {CONFIG} into {tmp}")
    share_files(tmp)
    files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
    marker = {"version": int(version), "kind": kind, "files": files, "created_at": time.time()}
    (tmp / MARKER).write_text(json.dumps(marker, indent=1))
    for p in tmp.iterdir():
        _fsync_file(p)
    fsync_dir(tmp)
    if final.exists():  # the same version again (a restarted learner): the new folder replaces it
        old = d / f"{TMP_PREFIX}old-{folder_name(version)}-{os.getpid()}"
        os.replace(final, old)
        shutil.rmtree(old, ignore_errors=True)
    os.replace(tmp, final)
    fsync_dir(d)
    pointer_tmp = d / f"{TMP_PREFIX}{LATEST}-{os.getpid()}"
    pointer_tmp.write_text(json.dumps({"version": int(version), "folder": final.name}))
    _fsync_file(pointer_tmp)
    os.replace(pointer_tmp, d / LATEST)
    fsync_dir(d)
    prune(d, keep)
    return final


def prune(directory: Path, keep: int) -> list[int]:
    """Delete version folders older than the newest ``keep`` (and temporary folders of older versions)."""
    versions = published_versions(directory)
    if keep < 1 or len(versions) <= keep:
        return []
    oldest_kept = versions[-keep]
    gone = [v for v in versions if v < oldest_kept]
    for v in gone:
        shutil.rmtree(directory / folder_name(v), ignore_errors=True)
    for p in directory.iterdir():  # writes that died before their rename
        name = p.name.removeprefix(TMP_PREFIX).split("-")[0]
        dead = version_of_folder(name)
        if p.name.startswith(TMP_PREFIX) and dead is not None and dead < oldest_kept:
            shutil.rmtree(p, ignore_errors=True)
    if gone:
        log.info("weights_pruned", versions=gone, kept=versions[-keep:])
    return gone


def publish_weights(
    model: Any,
    version: int,
    directory: str | Path,
    keep: int = 3,
    *,
    redis_url: str | None = None,
    namespace: str | None = None,
    publish: Callable[[int], None] | None = None,
    tokenizer_dir: str | Path | None = None,
    rank: int | None = None,
    max_shard_size: str = "2GB",
    snapshot_every: int = 10,
    dtype: str | None = None,
) -> Path | None:
    """Write ``model``'s weights as ``version`` into ``directory`` (a folder or a URL) and publish the version.

    Call on every rank (see the module doc). ``publish``: how to announce the version (default: set
    ``policy_version`` in the Redis of ``redis_url``/``namespace``, or ``DISTILLQ_REDIS_URL``). ``rank``:
    this process's rank when ``torch.distributed`` is not used. ``snapshot_every``: with a URL, a full snapshot
    every that many versions, deltas between. ``dtype``: the floating tensors cast to it (default: as they are).
    Returns the folder written (with a URL: the local staging copy) on the writing rank, ``None`` on the others;
    the ``weights_published`` log line gives the full and stored bytes and the seconds taken.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    url = str(directory) if is_url(directory) else None  # ConfigurationError for a scheme not supported
    distributed, dist_rank = _dist()
    my_rank = dist_rank if distributed or rank is None else rank
    inner = unwrap(model)
    state = None
    if not _is_peft(inner) and (distributed or my_rank == 0):
        state = gather_state_dict(model)  # under FSDP every rank joins the gather; rank 0 gets the tensors
        if state is not None and dtype is not None:
            state = _cast(state, dtype)
    path = None
    if my_rank == 0:
        t0 = time.perf_counter()
        report: UploadReport | None = None
        if url is None:
            path = write_checkpoint(model, version, directory, state_dict=state, tokenizer_dir=tokenizer_dir,
                                    max_shard_size=max_shard_size, keep=keep)
        else:
            options = writer_options(url)  # ?keep=K&snapshot_every=N in the URL win over the arguments
            uploader, staging = _uploader(url, options.get("snapshot_every", snapshot_every), options.get("keep", keep))
            path = write_checkpoint(model, version, staging, state_dict=state, tokenizer_dir=tokenizer_dir,
                                    max_shard_size=max_shard_size, keep=2)
            try:
                report = uploader.upload(version, path)
            except redis.RedisError as e:  # the weights' own Redis, not the pipeline's: named by its URL
                raise LearnerConnectionError(redis_error_line(e, bare_url(url))) from e
        (publish or _redis_publisher(redis_url, namespace))(int(version))
        seconds = round(time.perf_counter() - t0, 3)
        if report is None:
            log.info("weights_published", version=int(version), path=str(path), seconds=seconds)
        else:
            log.info("weights_published", version=int(version), url=redact(url or ""), snapshot=report.snapshot,
                     full_bytes=report.full_bytes, stored_bytes=report.stored_bytes, seconds=seconds)
    if distributed:
        import torch.distributed as dist

        dist.barrier()  # every rank returns once the version is out
    return path


#: One uploader per store URL in this process (it holds the last version uploaded, the base of the next delta).
_UPLOADERS: dict[str, tuple[Uploader, Path]] = {}


def last_upload(url: str) -> UploadReport | None:
    """The report of this process's last ``publish_weights`` to ``url``: full and stored bytes, seconds, versions
    kept (``None`` before the first)."""
    got = _UPLOADERS.get(bare_url(url))
    return got[0].last_report if got is not None else None


def _uploader(url: str, snapshot_every: int, keep: int) -> tuple[Uploader, Path]:
    url = bare_url(url)  # one uploader per store, whatever options its URL carries
    got = _UPLOADERS.get(url)
    if got is None:
        import atexit
        import tempfile

        staging = Path(tempfile.mkdtemp(prefix="distillq-publish-"))
        atexit.register(shutil.rmtree, staging, ignore_errors=True)
        got = _UPLOADERS[url] = (Uploader(open_store(url), snapshot_every=snapshot_every, keep=keep), staging)
    got[0].snapshot_every, got[0].keep = snapshot_every, keep
    return got


def _cast(state: dict[str, Any], dtype: str) -> dict[str, Any]:
    import torch

    to = getattr(torch, dtype, None)
    if not isinstance(to, torch.dtype) or not to.is_floating_point:
        raise ValueError(f"dtype must name a floating torch dtype (bfloat16, float16, float32), got {dtype!r}")
    out: dict[str, Any] = {}
    cast: dict[int, Any] = {}  # tensors that share storage (tied embeddings) stay shared, so they are written once
    for k, v in state.items():
        if not v.is_floating_point():
            out[k] = v
            continue
        key = v.untyped_storage().data_ptr()
        if key not in cast:
            cast[key] = v.to(to)
        out[k] = cast[key]
    return out


def _redis_publisher(redis_url: str | None, namespace: str | None) -> Callable[[int], None]:
    settings = redis_settings(redis_url, namespace)

    async def put(version: int) -> None:
        redis = connect(settings)
        try:
            await redis.set(Keys(settings.namespace).policy_version, version)
        finally:
            await redis.aclose()

    return lambda version: asyncio.run(put(version))


def _copy_tokenizer(source: str | Path | None, dest: Path) -> None:
    if not source or not Path(source).is_dir():
        return
    for name in TOKENIZER_FILES:
        f = Path(source) / name
        if f.is_file() and not (dest / name).exists():
            shutil.copyfile(f, dest / name)


def _fsync_file(path: Path) -> None:
    if path.is_file():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
