"""The HTTP/1.1 protocol both servers run (``serve student``, ``serve atropos``): uvicorn's h11 protocol with a
deadline on each request's head.

uvicorn times out neither a request line and headers sent a byte at a time nor a connection that sends part of a
head and stops (slowloris): its keep-alive timer runs only between requests and any byte cancels it. Here a
connection must send a whole request head within ``timeout_s`` of its start, or of the end of its previous
response; one that does not is answered 408 and closed, and ``request_head_timeout`` is logged. The body's pace is
the application's (``BodyCap``, ``GzipRequest``: no bytes for the same ``timeout_s``, 408)."""

from __future__ import annotations

import asyncio

import h11
import structlog
from uvicorn.protocols.http.h11_impl import H11Protocol

log = structlog.get_logger()

REQUEST_TIMEOUT = b"HTTP/1.1 408 Request Timeout\r\nconnection: close\r\ncontent-length: 0\r\n\r\n"


class HeadDeadline(H11Protocol):
    """``H11Protocol`` closing a connection whose request head is not whole within ``timeout_s``."""

    timeout_s: float = 30.0
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[arg-type]
        self._arm()

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:  # a whole head came (or the peer closed, or sent garbage)
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:  # kept alive: the next head
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._head_timer = self.loop.call_later(self.timeout_s, self._late)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _late(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        log.warning("request_head_timeout", client=":".join(map(str, self.client or ())), timeout_s=self.timeout_s)
        self.transport.write(REQUEST_TIMEOUT)
        self.transport.close()


def head_deadline(timeout_s: float) -> type[H11Protocol]:
    """The protocol class to pass as ``uvicorn.Config(http=...)``: a request head has ``timeout_s`` seconds."""
    return type("HeadDeadlineH11", (HeadDeadline,), {"timeout_s": timeout_s})
