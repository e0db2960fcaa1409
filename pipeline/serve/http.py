"""The HTTP plumbing both servers share (``serve student``, ``serve atropos``): the HTTP/1.1 protocol they run,
uvicorn's h11 protocol with a deadline on each request's head (``head_deadline``), and the capped, timed read of a
request body their middlewares do (``read_capped``, then ``replayed`` to hand the body on).

uvicorn times out neither a request line and headers sent a byte at a time nor a connection that sends part of a
head and stops (slowloris): its keep-alive timer runs only between requests and any byte cancels it. Here a
connection must send a whole request head within ``timeout_s`` of its start, or of the end of its previous
response; one that does not is answered 408 and closed, and ``request_head_timeout`` is logged. The body's pace is
the application's (``BodyCap``, ``GzipRequest``: no bytes for the same ``timeout_s``, 408)."""

from __future__ import annotations

import asyncio
from typing import Final

import h11
import structlog
from starlette.types import Message, Receive
from uvicorn.protocols.http.h11_impl import H11Protocol

log = structlog.get_logger()

#: After an error answer the server reads and drops what the client still sends for at most this long before it
#: closes: a close with unread bytes makes the kernel send a reset, and the client may then never read the answer.
LINGER_S: Final = 2.0


def answer(status: int, reason: str, text: str = "") -> bytes:
    """A whole ``connection: close`` response with a plain-text body."""
    body = text.encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


class HeadDeadline(H11Protocol):
    """``H11Protocol`` closing a connection whose request head is not whole within ``timeout_s``."""

    timeout_s: float = 30.0
    _head_timer: asyncio.TimerHandle | None = None
    _lingering = False

    def data_received(self, data: bytes) -> None:
        if not self._lingering:  # after an error answer, what the client still sends is dropped
            super().data_received(data)

    def send_400_response(self, msg: str) -> None:
        """A request h11 cannot parse: 431 for a head above uvicorn's ``h11_max_incomplete_event_size``, else
        400; either way answered in full before the close (``_close_after``), not reset under the client."""
        pending = len(self.conn.trailing_data[0])
        limit = self.config.h11_max_incomplete_event_size or h11._connection.DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
        if self.conn.their_state is h11.ERROR and pending > limit:
            self._close_after(answer(431, "Request Header Fields Too Large",
                                     f"request head is more than {limit} bytes"))
        else:
            self._close_after(answer(400, "Bad Request", msg))

    def _close_after(self, response: bytes) -> None:
        self._disarm()
        self._lingering = True
        self.transport.write(response)
        if self.transport.can_write_eof():
            self.transport.write_eof()  # the answer is all there is; the client reads it, then closes
        self.loop.call_later(LINGER_S, self.transport.close)

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
        self._close_after(answer(408, "Request Timeout"))


#: What ``read_capped`` returns when the client disconnects before the body ends.
GONE: Final = b"<disconnected>"
#: What ``read_capped`` returns when the body's next bytes do not come in time.
STALLED: Final = b"<stalled>"


def stalled_message(timeout_s: float) -> str:
    return f"request body incomplete: no bytes of it came for {timeout_s:g} s"


async def read_capped(receive: Receive, limit: int, timeout_s: float | None = None) -> bytes | None:
    """The whole request body, or None when it is longer than ``limit`` bytes (the rest is read and dropped),
    or ``GONE``, or ``STALLED`` when no part of it comes for ``timeout_s`` seconds (None: no limit)."""
    chunks: list[bytes] = []
    size, more = 0, True
    while more:
        try:
            async with asyncio.timeout(timeout_s):
                message = await receive()
        except TimeoutError:
            return STALLED
        if message["type"] == "http.disconnect":
            return GONE
        chunk = message.get("body", b"")
        size += len(chunk)
        if size <= limit:
            chunks.append(chunk)
        elif chunks:
            chunks.clear()
        more = message.get("more_body", False)
    return None if size > limit else b"".join(chunks)


def replayed(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that gives the app ``body`` whole, then what the client sends next (its disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


def head_deadline(timeout_s: float) -> type[H11Protocol]:
    """The protocol class to pass as ``uvicorn.Config(http=...)``: a request head has ``timeout_s`` seconds."""
    return type("HeadDeadlineH11", (HeadDeadline,), {"timeout_s": timeout_s})
