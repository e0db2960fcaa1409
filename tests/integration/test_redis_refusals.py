"""Redis refusing clients, as each refusal reaches a user (a redis-server of this test's own, reconfigured): at
``maxclients`` every command says so in one line (exit status 3) and a worker logs it while it waits; under
``CLIENT PAUSE`` ``distillq stats`` answers within its bound and says Redis is not answering."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from collections.abc import Iterator

import pytest

from tests.integration.test_exit_status import DISTILLQ, ROOT, events, said
from tests.redis_server import RedisServer

pytestmark = [pytest.mark.redis, pytest.mark.slow, pytest.mark.timeout(120)]


@pytest.fixture
def server() -> Iterator[RedisServer]:
    s = RedisServer().start()
    yield s
    s.stop()


def command(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTILLQ_")}
    return subprocess.run([*DISTILLQ, *argv], cwd=ROOT, env={**env, "DISTILLQ_LOG_JSON": "1"}, capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL, check=False)


def redis_cli(server: RedisServer, *args: str) -> str:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    with sock:
        parts = [a.encode() for a in args]
        sock.sendall(b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts))
        return sock.recv(4096).decode()


def test_maxclients_is_named_by_commands_and_by_a_worker_waiting_for_it(server: RedisServer) -> None:
    assert redis_cli(server, "CONFIG", "SET", "maxclients", "1").startswith("+OK")
    holder = socket.create_connection(("127.0.0.1", server.port), timeout=5)  # the one client allowed
    try:
        p = command("stats", "--redis-url", server.url)
        assert p.returncode == 3, p.stderr[-2000:]
        assert said(p) == [f"distillq: Redis at {server.url} refuses new connections: max number of clients reached "
                           "(maxclients): close idle clients (CLIENT LIST, CLIENT KILL) or raise maxclients, then run "
                           "this again"], p.stderr[-2000:]
        worker = subprocess.Popen([*DISTILLQ, "worker", "feeder", "--redis-url", server.url], cwd=ROOT,
                                  env={**os.environ, "DISTILLQ_LOG_JSON": "1"}, stderr=subprocess.PIPE, text=True,
                                  stdin=subprocess.DEVNULL)
        time.sleep(8)
        worker.terminate()
        _, err = worker.communicate(timeout=30)
        waits = events(err, "redis_unavailable")
        assert waits and waits[0]["error"] == "Redis refuses new connections: max number of clients reached " \
                                              "(maxclients)", err[-2000:]
    finally:
        holder.close()


def test_stats_under_client_pause_answers_within_its_bound(server: RedisServer) -> None:
    assert redis_cli(server, "CLIENT", "PAUSE", "30000", "ALL").startswith("+OK")
    t0 = time.monotonic()
    p = command("stats", "--redis-url", server.url)
    took = time.monotonic() - t0
    assert p.returncode == 3 and took < 25, (took, p.stderr[-2000:])
    assert said(p) == [f"distillq: Redis at {server.url} did not answer within 10 s: paused (CLIENT PAUSE), busy with "
                       "a long command (SLOWLOG GET shows it) or overloaded"], p.stderr[-2000:]
