"""A real vLLM OpenAI-compatible server (CPU build, in .venv-vllm) for integration tests."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.redis_server import free_port

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = Path(os.environ.get("DISTILLQ_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
START_TIMEOUT_S = 300.0
#: URL -> process id of each server running (its process group holds the engine core processes too).
PIDS: dict[str, int] = {}
needs_vllm = pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=f"vLLM not installed ({VLLM_PYTHON} missing)")


@contextlib.contextmanager
def vllm_server(model_dir: Path, served_name: str, log_path: Path, *extra: str, port: int | None = None,
                env: dict[str, str] | None = None) -> Iterator[str]:
    """Start ``vllm.entrypoints.openai.api_server`` on ``port`` (default: a free one), with ``env`` added to
    its environment; yield its URL; stop its whole session."""
    port = port or free_port()
    cmd = [
        str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", served_name,
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
        "--enforce-eager",  # skip torch.compile: faster start, same numbers
        *extra,
    ]  # fmt: skip
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "OMP_NUM_THREADS": "2", **(env or {})}
    t0 = time.monotonic()
    with log_path.open("ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vLLM exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
            if time.monotonic() - t0 > START_TIMEOUT_S:
                pytest.fail(f"vLLM not ready after {START_TIMEOUT_S} s:\n{log_path.read_text()[-4000:]}")
            try:
                if httpx.get(url + "/v1/models", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        print(f"\nvLLM CPU server ({served_name}) ready in {time.monotonic() - t0:.1f} s", file=sys.stderr)
        PIDS[url] = proc.pid
        yield url
    finally:
        PIDS.pop(url, None)
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        with contextlib.suppress(ProcessLookupError):  # engine core children live in the session started above
            os.killpg(proc.pid, signal.SIGKILL)
