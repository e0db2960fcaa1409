"""An HTTP proxy in front of one server, for tests: once armed, it kills the server's process group with
SIGKILL as soon as the server has answered a ``/pause`` (a weight reload is then cut between its pause and its
resume). Plain request/response forwarding (no streaming), one thread per request."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

from tests.redis_server import free_port

HOP = {"host", "content-length", "connection", "transfer-encoding", "content-encoding", "keep-alive"}


class KillOnPauseProxy:
    def __init__(self, target: str, pid: Callable[[], int | None]) -> None:
        self.target, self.pid = target, pid
        self.armed, self.killed_at = False, 0.0
        self.client = httpx.Client(timeout=300.0)
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                proxy.forward(self)

            def do_POST(self) -> None:
                proxy.forward(self)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> KillOnPauseProxy:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.client.close()

    def forward(self, h: BaseHTTPRequestHandler) -> None:
        body = h.rfile.read(int(h.headers.get("Content-Length") or 0))
        headers = {k: v for k, v in h.headers.items() if k.lower() not in HOP}
        try:
            resp = self.client.request(h.command, self.target + h.path, content=body, headers=headers)
        except httpx.HTTPError:
            h.send_error(502)
            return
        if h.path.startswith("/pause") and self.armed and (pid := self.pid()) is not None:
            self.armed = False
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            self.killed_at = time.time()
        h.send_response(resp.status_code)
        for k, v in resp.headers.items():
            if k.lower() not in HOP:
                h.send_header(k, v)
        h.send_header("Content-Length", str(len(resp.content)))
        h.end_headers()
        h.wfile.write(resp.content)
