"""``distillq serve SERVER``: HTTP servers in front of the pipeline's streams.

    distillq serve atropos [--host 127.0.0.1] [--port 8000] [--redis-url URL] [--namespace NS] [--lease-s 600]
    distillq serve student --backend hf --model DIR [--port 8100] [--group-size N]

``atropos``: the Atropos API (``pipeline.serve.atropos.app``): environments POST scored groups, which go
onto ``rollouts`` for the teacher workers; trainers GET ``/batch`` and receive the scored groups with
``distill_token_ids``/``distill_logprobs`` filled. Every server is one ``add_<server>`` function below,
listed in ``SERVERS``. ``python -m pipeline.cli.main serve SERVER ...`` is the same without the
console script.

``student``: the verifiers-compatible student endpoint (``pipeline.serve.student.app``): verifiers' train
client generates through it, one tracker per ``X-Session-ID`` records each rollout, and finished rollouts
of a task are pushed onto ``rollouts`` as a group.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

import structlog

from pipeline.cli.commands.common import add_command
from pipeline.config import StreamSettings, add_redis_args, redis_settings_from_args
from pipeline.flags import add_flags, from_args
from pipeline.serve.atropos.settings import AtroposSettings, serve_config
from pipeline.stages.exits import EXIT_USAGE, CliError


def add_atropos(servers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = add_command(servers, "atropos", "the Atropos API server, backed by the pipeline's streams",
                    "Atropos-compatible API: point an environment's rollout_server_url and a trainer's Atropos URL "
                    "at it. State lives in Redis. Run no feeder on its namespace (docs/integrations.md).")
    add_flags(p, AtroposSettings)
    add_redis_args(p)
    p.set_defaults(func=run_atropos)


def run_atropos(args: argparse.Namespace) -> int:
    import uvicorn

    from pipeline.cli.commands.common import ensure_reachable, run
    from pipeline.serve.atropos.app import create_app
    from pipeline.serve.http import head_deadline

    if not (math.isfinite(args.batch_wait_s) and 0 <= args.batch_wait_s <= 60):
        raise CliError(f"--batch-wait-s must be a number of seconds from 0 to 60, got {args.batch_wait_s}",
                       EXIT_USAGE)
    cfg = serve_config(from_args(AtroposSettings, args), redis_settings_from_args(args), StreamSettings())
    run(ensure_reachable(cfg.redis))  # Redis away: one line and exit status 3, not a traceback after retries
    structlog.get_logger("distillq.serve.atropos").info("atropos_listening", url=f"http://{args.host}:{args.port}",
                                                        namespace=cfg.redis.namespace)
    uvicorn.run(create_app(cfg), host=args.host, port=args.port, access_log=args.access_log, log_config=None,
                timeout_graceful_shutdown=10, http=head_deadline(cfg.body_timeout_s))
    return 0


def add_student(servers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from pipeline.cli.commands.serve_student import add_student_arguments, run_student

    p = add_command(servers, "student", "a verifiers-compatible student endpoint that records each rollout",
                    "Serves /inference/v1/generate, /v1/chat/completions and /v1/models as verifiers 0.4 calls them; "
                    "finished rollouts (POST /sessions/{id}/finish) go onto rollouts as groups "
                    "(docs/integrations.md).")
    add_student_arguments(p)
    p.set_defaults(func=run_student)


#: One function per server, each adding its subcommand (``distillq serve NAME``).
SERVERS: tuple[Callable[[argparse._SubParsersAction[argparse.ArgumentParser]], None], ...] = (add_atropos, add_student)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = add_command(sub, "serve", "HTTP servers in front of the pipeline's streams (atropos, student)")
    servers = p.add_subparsers(dest="server", required=True, metavar="SERVER")
    for add in SERVERS:
        add(servers)
