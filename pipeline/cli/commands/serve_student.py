"""``distillq serve student``: argparse glue for the verifiers-compatible student endpoint.

    distillq serve student --backend hf --model DIR [--port 8100] [--group-size 8]
    distillq serve student --backend vllm --url http://127.0.0.1:8000 --tokenizer DIR

Hook it into a ``serve`` subcommand parser with::

    p = serve_sub.add_parser("student", help="verifiers-compatible student endpoint")
    add_student_arguments(p)
    p.set_defaults(func=run_student)

The flags are ``StudentServeSettings``' fields (``pipeline.serve.student.settings``), the checks that span them
``usage_error``'s. ``python -m pipeline.cli.commands.serve_student ARGS`` runs it without the ``distillq`` entry
point. Either way a failure the user can act on is one line on stderr, ``distillq: MESSAGE``, and the exit
status docs/cli.md gives: 2 for an invalid flag or a backend that cannot be loaded, 3 when Redis cannot be
reached, 1 when the port cannot be bound. ``run_student`` raises them (``CliError``, pydantic's ``ValidationError``) and
``pipeline.stages.exits.run_command`` prints them, as for every command.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import math
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import structlog

from pipeline.cli.commands.common import ensure_reachable, run
from pipeline.config import add_redis_args, redis_settings_from_args
from pipeline.flags import add_flags, from_args
from pipeline.logs import configure_logging
from pipeline.serve.student.settings import StudentServeSettings, session_store, student_serve_config
from pipeline.stages.exits import EXIT_USAGE, CliError, fail, run_command

if TYPE_CHECKING:  # the server's modules load when it runs, not when the CLI parser is built
    from pipeline.rollout.students.base import StudentBackend
    from pipeline.serve.student.service import StudentServeConfig
    from pipeline.weightstore.follow import Follower

log = structlog.get_logger(__name__)


def add_student_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``serve student``: ``StudentServeSettings``' fields, then ``--redis-url``/``--namespace``."""
    add_flags(p, StudentServeSettings)
    add_redis_args(p)


def _hf_backend(args: argparse.Namespace) -> tuple[StudentBackend, StudentServeConfig]:
    from pipeline.rollout.students.hf import HFStudent

    student = HFStudent.from_pretrained(args.model)
    if args.tokenizer:
        from transformers import AutoTokenizer

        student = HFStudent(student.model, AutoTokenizer.from_pretrained(args.tokenizer))
    cfg = student.model.config
    max_len = args.max_model_len or int(getattr(cfg, "max_position_embeddings", 0) or 2048)
    names = tuple(args.served_model_name or [args.model])
    return student, _config(args, names, max_len, int(cfg.vocab_size))


def _vllm_models(root: str) -> list[dict[str, Any]]:
    import httpx

    try:
        resp = httpx.get(f"{root}/v1/models", timeout=30.0)
        resp.raise_for_status()
        data: list[dict[str, Any]] = resp.json().get("data", [])
    except (httpx.HTTPError, ValueError, AttributeError) as e:
        raise ValueError(f"cannot list the models of {root}: {type(e).__name__}: {e}") from e
    return data


def _vllm_backend(args: argparse.Namespace) -> tuple[StudentBackend, StudentServeConfig]:
    from transformers import AutoTokenizer

    from pipeline.rollout.students.vllm import VLLMStudent
    from pipeline.urls import server_root

    urls = [server_root(u.strip()) for u in args.url.split(",") if u.strip()]
    root = urls[0]
    models = _vllm_models(root)
    name = args.vllm_model or (models[0]["id"] if models else None)
    if not name:
        raise ValueError(f"{root}/v1/models lists no model; pass --vllm-model")
    info = next((m for m in models if m.get("id") == name), {})
    max_len = args.max_model_len or int(info.get("max_model_len") or 0)
    if not max_len:
        raise ValueError("the vLLM server reports no max_model_len; pass --max-model-len")
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    students = [VLLMStudent(u, name, tokenizer) for u in urls]
    config = _config(args, tuple(args.served_model_name or [name]), max_len, None)
    if len(students) == 1 and not args.weights_dir:
        return students[0], config
    from pipeline.rollout.sync_engines import make_engine
    from pipeline.rollout.synced import SyncedStudent

    engines = [make_engine(args.weights_sync, u, served_name=name) for u in urls]
    backend = SyncedStudent(students, engines, args.weights_dir)
    return backend, dataclasses.replace(config, versions_from_server=backend.synced)


def _config(args: argparse.Namespace, names: tuple[str, ...], max_len: int, vocab: int | None) -> StudentServeConfig:
    return student_serve_config(from_args(StudentServeSettings, args), names, max_len, vocab)


async def _serve(
    args: argparse.Namespace,
    backend: StudentBackend,
    config: StudentServeConfig,
    *,
    started: Callable[[Any], None] | None = None,
    follower: Follower | None = None,
) -> int:
    """Serve until the server stops (a signal; ``started`` gets the uvicorn server once it listens), then
    close the backend (the vLLM client's connections). ``follower``: a weights URL mirrored into the local folder
    the servers load from (``pipeline.weightstore.follow``), kept on the newest version meanwhile."""
    from pipeline.rollout.synced import SyncedStudent

    synced = backend if isinstance(backend, SyncedStudent) else None
    stop = asyncio.Event()
    async with contextlib.AsyncExitStack() as stack:
        if follower is not None:
            if synced is not None:
                follower.on_refused = lambda e: synced.checkpoint_refusals.refuse(e, kept=follower.version)
            await stack.enter_async_context(follower.running(stop))
        return await _serve_synced(args, backend, config, synced, stop, started)


async def _serve_synced(
    args: argparse.Namespace, backend: StudentBackend, config: StudentServeConfig, synced: Any, stop: asyncio.Event,
    started: Callable[[Any], None] | None,
) -> int:
    syncer = None
    try:
        if synced is not None:
            await synced.start()  # every server on the newest version before the first request
            syncer = asyncio.create_task(synced.run(stop))
        return await _serve_app(args, backend, config, started)
    finally:
        stop.set()
        if syncer is not None:
            await syncer
        aclose = getattr(backend, "aclose", None)
        if aclose is not None:
            await aclose()


async def _serve_app(
    args: argparse.Namespace, backend: StudentBackend, config: StudentServeConfig, started: Callable[[Any], None] | None
) -> int:
    import uvicorn

    from pipeline.serve.http import head_deadline
    from pipeline.serve.student.app import create_app
    from pipeline.serve.student.service import StudentService
    from pipeline.transport.sdk import AsyncGroupProducer

    rs = redis_settings_from_args(args)
    settings = from_args(StudentServeSettings, args)
    async with AsyncGroupProducer(rs.redis_url, namespace=rs.namespace) as producer:
        sessions = session_store(settings)
        service = StudentService(backend, config, producer.push, sessions=sessions)
        api_key = os.environ.get(args.api_key_var) if args.api_key_var else None
        app = create_app(service, maintain_every_s=min(30.0, max(settings.session_ttl / 4, 0.1)), api_key=api_key,
                         max_body_bytes=settings.max_body_bytes, body_timeout_s=settings.body_timeout_s)
        server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                                                http=head_deadline(settings.body_timeout_s)))
        stopped: list[int] = []
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
        for sig in previous:  # uvicorn re-raises the signal after its graceful shutdown: noted, not fatal
            signal.signal(sig, lambda s, _frame: stopped.append(s))
        try:
            task = asyncio.create_task(server.serve())
            while not server.started and not task.done():
                await asyncio.sleep(0.05)
            if not server.started:
                await task
                return 1
            _started(args, server, config, rs.namespace)
            if started is not None:
                started(server)
            await task
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    log.info("student.stopped", signal=signal.Signals(stopped[0]).name if stopped else None)
    return 0


def _started(args: argparse.Namespace, server: Any, config: StudentServeConfig, namespace: str) -> None:
    port = server.servers[0].sockets[0].getsockname()[1]
    if args.port_file:
        args.port_file.write_text(f"{port}\n")
    log.info("student.serving", url=f"http://{args.host}:{port}/v1", models=list(config.served_names),
             max_model_len=config.max_model_len, namespace=namespace)  # fmt: skip


def usage_error(args: argparse.Namespace) -> str | None:
    """What is wrong with the flags (checked before anything loads or connects), or None."""
    checks = (
        (args.group_size >= 1, "--group-size must be >= 1"),
        (args.max_sessions >= 1, "--max-sessions must be >= 1"),
        (args.max_body_bytes >= 1024, "--max-body-bytes must be >= 1024"),
        (math.isfinite(args.session_ttl) and args.session_ttl > 0, "--session-ttl must be a number of seconds > 0"),
        (math.isfinite(args.body_timeout_s) and args.body_timeout_s > 0,
         "--body-timeout-s must be a number of seconds > 0"),
        (args.default_max_tokens >= 1, "--default-max-tokens must be >= 1"),
        (args.max_model_len is None or args.max_model_len >= 2, "--max-model-len must be >= 2"),
        (0 <= args.port <= 65535, f"--port must be in 0..65535, got {args.port}"),
        (0 <= args.metrics_port <= 65535, f"--metrics-port must be in 0..65535, got {args.metrics_port}"),
        (args.backend != "hf" or bool(args.model), "--backend hf needs --model DIR"),
        (args.backend != "vllm" or bool(args.url and args.tokenizer), "--backend vllm needs --url and --tokenizer"),
        (args.backend == "vllm" or not args.weights_dir, "--weights-dir needs --backend vllm"),
    )
    for ok, message in checks:
        if not ok:
            return message
    if args.api_key_var and not os.environ.get(args.api_key_var):
        return f"--api-key-var {args.api_key_var}: the variable is not set"
    return None


def run_student(args: argparse.Namespace) -> int:
    """Check the flags and Redis, load the backend and serve until interrupted: 0 after a signal, 1 if the port
    cannot be bound. Raises ``CliError`` (2) for a configuration error, ``ValidationError`` (2) for an invalid
    setting and ``CliError`` (3) when Redis cannot be reached."""
    problem = usage_error(args)
    if problem is not None:
        raise CliError(problem, EXIT_USAGE)
    rs = redis_settings_from_args(args)  # a malformed --redis-url or DISTILLQ_* setting: ValidationError
    run(ensure_reachable(rs))  # before the model loads: a Redis that is away is said at once
    from pipeline.weightstore.follow import Follower

    # a redis:// or s3:// URL: mirrored into a local folder (--weights-cache)
    follower = Follower.open(args.weights_dir, local_dir=args.weights_cache)
    if follower is not None:
        args = argparse.Namespace(**{**vars(args), "weights_dir": str(follower.local_dir)})
    try:
        backend, config = _hf_backend(args) if args.backend == "hf" else _vllm_backend(args)
    except (ValueError, OSError) as e:
        raise CliError(" ".join(str(e).split()), EXIT_USAGE) from e
    from pipeline.metrics import serve_metrics

    serve_metrics(args.metrics_port)
    return asyncio.run(_serve(args, backend, config, follower=follower))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="distillq serve student", description=__doc__.split("\n")[0])
    add_student_arguments(parser)
    parser.add_argument("--log-level", default=None)
    parser.set_defaults(func=run_student, command="serve", server="student")  # as ``distillq serve student``
    args = parser.parse_args(argv)
    try:
        configure_logging(args.log_level)
    except ValueError as e:  # --log-level LOUD
        fail(str(e))
        return EXIT_USAGE
    return run_command(args)


if __name__ == "__main__":
    sys.exit(main())
