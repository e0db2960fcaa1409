"""Slow request heads against a server on 127.0.0.1 (``pipeline.serve.http``): heads begun and left, a head sent a
byte at a time, and a head stalled after a kept-alive request; each must be answered 408 and closed by the server
within ``timeout_s`` (and a margin), never held open."""

from __future__ import annotations

import socket
import time

PARTIAL = b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


def read_until_closed(s: socket.socket) -> bytes:
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def read_response(s: socket.socket) -> bytes:
    """One whole response with a ``content-length`` (head and body) off a kept-alive connection."""
    out = b""
    while b"\r\n\r\n" not in out:
        out += s.recv(65536)
    head, _, body = out.partition(b"\r\n\r\n")
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        body += s.recv(65536)
    return head + b"\r\n\r\n" + body


def check_heads_time_out(port: int, timeout_s: float, ok_get: str, sockets: int = 50) -> None:
    """``sockets`` connections each send part of a head, one sends a head a byte every ``timeout_s / 5`` and one
    sends ``GET ok_get`` (kept alive) and then part of a second head: each is answered 408 and closed by the
    server between ``timeout_s`` (less a margin) and ``timeout_s`` + 5 s after its head began."""
    begun = []
    for _ in range(sockets):
        s = socket.create_connection(("127.0.0.1", port), timeout=timeout_s + 30)
        s.sendall(PARTIAL)
        begun.append((s, time.monotonic()))
    try:
        trickle = socket.create_connection(("127.0.0.1", port), timeout=timeout_s + 30)
        t_trickle = time.monotonic()
        sent = 0
        trickle.setblocking(False)
        answer = b""
        while time.monotonic() - t_trickle < timeout_s + 5:
            if sent < len(PARTIAL):
                try:
                    trickle.send(PARTIAL[sent : sent + 1])
                    sent += 1
                except (BrokenPipeError, ConnectionResetError):
                    sent = len(PARTIAL)  # closed by the server: its answer is read below
            try:
                chunk = trickle.recv(65536)
            except BlockingIOError:
                time.sleep(timeout_s / 5)
                continue
            if not chunk:
                break
            answer += chunk
        waited = time.monotonic() - t_trickle
        trickle.close()
        assert answer.startswith(b"HTTP/1.1 408"), (answer[:200], sent)
        assert timeout_s - 0.5 < waited < timeout_s + 5, waited  # every byte came within the timeout: no matter
        for s, t0 in begun:
            with s:
                answer = read_until_closed(s)
                waited = time.monotonic() - t0
            assert answer.startswith(b"HTTP/1.1 408 Request Timeout"), answer[:200]
            assert timeout_s - 0.5 < waited < timeout_s + 5 + 2 * timeout_s, waited
    finally:
        for s, _ in begun:
            s.close()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s + 30) as s:
        s.sendall(b"GET %s HTTP/1.1\r\nHost: x\r\n\r\n" % ok_get.encode())
        first = read_response(s)
        assert first.startswith(b"HTTP/1.1 200"), first[:200]
        s.sendall(PARTIAL)  # the next head on the kept-alive connection, begun and left
        t0 = time.monotonic()
        rest = read_until_closed(s)
        waited = time.monotonic() - t0
    assert rest.startswith(b"HTTP/1.1 408"), rest[:200]
    assert timeout_s - 0.5 < waited < timeout_s + 5, waited
