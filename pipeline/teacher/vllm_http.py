"""Teacher behind stock vLLM OpenAI-compatible servers (``/v1/completions`` with ``prompt_logprobs``).

One HTTP request per sequence (vLLM batches them continuously); requests go to the server with the
fewest in-flight requests, each server bounded by a semaphore. Server URLs may be given with or without
the OpenAI-style ``/v1`` suffix. Failures come back as ``ScoreFailure``: timeouts, connection errors,
408/429 and 5xx are retryable, other 4xx are not. Retrying is the caller's job (``pipeline.stages.scoring``).

vLLM answers with the logprobs of every prompt position; only the rows the request names
(``ScoreRequest.rows``) are built (``vllm_parse``), and a request naming none is answered without a call.

The server's cap on ``prompt_logprobs`` (``--max-logprobs``) is probed once at start and becomes
``max_k``; ``start`` raises ``TeacherConfigError`` when the configured ``k`` is above it. A request
with ``k`` above the cap is refused locally (``k_over_cap``); the scorer clamps or drops such groups
(``ScoringConfig.k_over_cap``).

``HTTPTeacher`` (transport, routing, error classification) is shared with ``sglang_http``.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, ClassVar, Final

import httpx
import msgspec
import numpy as np
import structlog

from pipeline.backoff import Backoff
from pipeline.teacher.base import (
    INVALID_LOGPROBS,
    K_OVER_CAP,
    MISALIGNED,
    ScoreFailure,
    ScoreOutcome,
    ScoreRequest,
    TeacherConfigError,
    empty_result,
    rows_problem,
)
from pipeline.teacher.vllm_parse import parse_completion
from pipeline.urls import server_root

#: Responses smaller than this are parsed on the event loop (a thread hop costs more than the parse).
PARSE_INLINE_BELOW: Final = 256 * 1024
_CAP_RE: Final = re.compile(r"greater than max allowed:?\s*(\d+)?", re.IGNORECASE)
#: NaN and Infinity literals outside strings, as Python's json module writes non-finite floats (not JSON).
_NON_FINITE: Final = re.compile(rb"[:\[,]\s*-?(?:NaN|Infinity)\s*[,\]}]")
#: ``prompt_logprobs`` sent by the cap probe; accepted means "no effective cap" up to this value.
PROBE_K: Final = 1 << 20

log = structlog.get_logger("distillq.teacher")
#: Seconds between two ``teacher_unreachable`` lines while start-up waits for a server.
STARTUP_LOG_EVERY_S: Final = 10.0


def unparseable(content: bytes, e: Exception) -> ScoreFailure:
    """Why an answer that does not parse is refused: ``invalid_logprobs`` when it holds NaN or Infinity (Python's
    json writes non-finite floats so, which is not JSON), else ``misaligned: unparseable response``."""
    if isinstance(e, msgspec.DecodeError) and _NON_FINITE.search(content):
        return ScoreFailure(f"{INVALID_LOGPROBS}: the teacher answered a non-finite number (NaN or Infinity) where "
                            "a logprob goes", retryable=False)
    return ScoreFailure(f"{MISALIGNED}: unparseable response ({type(e).__name__}: {e})", retryable=False)


@dataclass(frozen=True, slots=True)
class HTTPTeacherConfig:
    """Servers and limits of an HTTP teacher. ``urls``: each ``http://host:port`` or the OpenAI-style
    ``http://host:port/v1`` (normalised to the server root by ``pipeline.urls.server_root``)."""

    urls: tuple[str, ...]
    model: str | None = None  # served model name; learned from the first server when None
    k: int = 20  # the configured default k: start() refuses when the server cap is below it
    max_concurrency: int = 32  # in-flight requests per server
    timeout_s: float = 120.0  # per request (read/write/pool); connect has its own
    connect_timeout_s: float = 10.0
    startup_timeout_s: float = 0.0  # keep retrying unreachable servers at start for this long
    api_key: str | None = None

    def __post_init__(self) -> None:
        if not self.urls:
            raise ValueError("at least one teacher URL is needed")
        try:
            object.__setattr__(self, "urls", tuple(server_root(u) for u in self.urls))
        except ValueError as e:
            raise TeacherConfigError(f"teacher {e}") from e
        if self.k < 1 or self.max_concurrency < 1 or self.timeout_s <= 0:
            raise ValueError("k, max_concurrency and timeout_s must be positive")


@dataclass(slots=True)
class Server:
    """One teacher server and its load."""

    url: str
    sem: asyncio.Semaphore
    in_flight: int = 0
    requests: int = 0
    failures: int = 0


class ServerPool:
    """Least-loaded routing over several servers (ties broken round-robin)."""

    def __init__(self, urls: tuple[str, ...], max_concurrency: int) -> None:
        self.servers = [Server(u, asyncio.Semaphore(max_concurrency)) for u in urls]
        self._next = 0

    def pick(self) -> Server:
        n = len(self.servers)
        best = min(range(n), key=lambda i: (self.servers[i].in_flight, (i - self._next) % n))
        self._next = (best + 1) % n
        return self.servers[best]

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[Server]:
        server = self.pick()
        server.in_flight += 1
        try:
            async with server.sem:
                server.requests += 1
                yield server
        finally:
            server.in_flight -= 1


def classify_status(status: int, body: str) -> ScoreFailure:
    """Failure for an HTTP error response: 408/429/5xx retryable, other 4xx not."""
    text = " ".join(body.split())[:300]
    if _CAP_RE.search(body):
        return ScoreFailure(f"{K_OVER_CAP}: http {status}: {text}", retryable=False)
    return ScoreFailure(f"http {status}: {text}", retryable=status >= 500 or status in (408, 429))


def classify_exception(exc: Exception, timeout_s: float | None = None) -> ScoreFailure:
    """Failure for a transport exception: timeouts and connection errors are retryable. A timeout after the
    server took the request (read, write, or waiting for one of our busy connections) carries ``timeout_s``:
    the teacher is slow, not unreachable; a connect timeout is a connection error."""
    name = type(exc).__name__
    if isinstance(exc, httpx.ConnectTimeout):
        return ScoreFailure(f"connection error ({name}: {exc})", retryable=True)
    if isinstance(exc, httpx.TimeoutException):
        after = "" if timeout_s is None else f" after {timeout_s:g} s"
        return ScoreFailure(f"timeout{after} ({name})", retryable=True, timeout_s=timeout_s)
    if isinstance(exc, httpx.TransportError):
        return ScoreFailure(f"connection error ({name}: {exc})", retryable=True)
    return ScoreFailure(f"{name}: {exc}", retryable=False)


class HTTPTeacher:
    """Shared machinery of HTTP teachers; subclasses define the request body and the parser."""

    kind: ClassVar[str] = "http"

    def __init__(self, config: HTTPTeacherConfig, *, client: httpx.AsyncClient | None = None) -> None:
        self.config = config
        self.pool = ServerPool(config.urls, config.max_concurrency)
        self._client = client
        self._own_client = client is None
        self._model = config.model
        self._max_k = 0

    @property
    def identity(self) -> str:
        return f"{self.kind}:{self._model or '?'}"

    @property
    def max_k(self) -> int:
        return self._max_k

    @property
    def model(self) -> str | None:
        return self._model

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            c = self.config
            headers = {"Authorization": f"Bearer {c.api_key}"} if c.api_key else None
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(c.timeout_s, connect=c.connect_timeout_s),
                limits=httpx.Limits(max_connections=c.max_concurrency * len(c.urls), max_keepalive_connections=None),
                headers=headers,
            )
        return self._client

    async def close(self) -> None:
        if self._client is not None and self._own_client:
            await self._client.aclose()
            self._client = None

    async def start(self) -> None:
        """Learn the model name and ``max_k`` from every server; refuse a configured k above the cap."""
        try:
            await self._start()
        except BaseException:
            await self.close()
            raise

    async def _start(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.startup_timeout_s
        caps = []
        for server in self.pool.servers:
            tries, next_log, backoff = 0, 0.0, Backoff(base=0.25, cap=2.0)
            while True:
                try:
                    await self._check_model(server.url)
                    caps.append(await self._probe_cap(server.url))
                    if tries:
                        log.info("teacher_reachable", url=server.url, tries=tries + 1)
                    break
                except (httpx.TransportError, httpx.TimeoutException) as e:
                    tries += 1
                    left = deadline - loop.time()
                    if left <= 0:
                        raise TeacherConfigError(f"teacher {server.url} unreachable ({tries} tries in "
                                                 f"{self.config.startup_timeout_s:g} s): {e!r}") from e
                    delay = min(backoff.next_delay(), left)
                    if loop.time() >= next_log:  # at once, then every STARTUP_LOG_EVERY_S
                        log.warning("teacher_unreachable", url=server.url, error=repr(e), tries=tries,
                                    retry_in=round(delay, 2), gives_up_in_s=round(left, 1))
                        next_log = loop.time() + STARTUP_LOG_EVERY_S
                    await asyncio.sleep(delay)
        self._max_k = min(caps)
        if self.config.k > self._max_k:
            raise TeacherConfigError(
                f"configured teacher top-k {self.config.k} exceeds the server cap {self._max_k} "
                f"(raise the server's limit, e.g. vLLM --max-logprobs, or lower k)"
            )

    async def score(self, reqs: list[ScoreRequest]) -> list[ScoreOutcome]:
        return list(await asyncio.gather(*(self._score_one(r) for r in reqs)))

    async def _score_one(self, req: ScoreRequest) -> ScoreOutcome:
        if not 1 <= req.k <= self._max_k:
            return ScoreFailure(f"{K_OVER_CAP}: k={req.k} outside [1, {self._max_k}]", retryable=False)
        if req.tokens.shape[0] == 0:
            return ScoreFailure("empty sequence", retryable=False)
        problem = rows_problem(req)
        if problem is not None:
            return ScoreFailure(f"bad request: {problem}", retryable=False)
        if req.n_rows == 0:
            return empty_result(req.k)  # nothing to ask the server
        async with self.pool.slot() as server:
            try:
                resp = await self._http().post(server.url + self.endpoint, json=self.body(req))
            except httpx.HTTPError as e:
                server.failures += 1
                return classify_exception(e, self.config.timeout_s)
            if resp.status_code != 200:
                server.failures += 1
                return classify_status(resp.status_code, resp.text)
            content = resp.content
        try:
            if len(content) < PARSE_INLINE_BELOW:
                return self.parse(content, req)
            # A multi-MB answer (k = 256 over thousands of tokens parses in tenths of a second) is parsed in a
            # thread, so the worker's loop keeps its heartbeat, leases and other calls going meanwhile.
            return await asyncio.to_thread(self.parse, content, req)
        except (msgspec.DecodeError, ValueError, TypeError, IndexError, KeyError, OverflowError) as e:
            return unparseable(content, e)

    async def _get_json(self, url: str) -> Any:
        resp = await self._http().get(url)
        if resp.status_code != 200:
            raise TeacherConfigError(f"GET {url}: http {resp.status_code}: {resp.text[:300]}")
        return resp.json()

    # -- subclass hooks ------------------------------------------------------------------------------
    endpoint: ClassVar[str] = ""

    def body(self, req: ScoreRequest) -> dict[str, Any]:
        raise NotImplementedError

    def parse(self, content: bytes, req: ScoreRequest) -> ScoreOutcome:
        raise NotImplementedError

    async def _check_model(self, url: str) -> None:
        raise NotImplementedError

    async def _probe_cap(self, url: str) -> int:
        raise NotImplementedError


class VLLMTeacher(HTTPTeacher):
    """``TeacherBackend`` over one or more vLLM OpenAI-compatible servers."""

    kind = "vllm"
    endpoint = "/v1/completions"

    def body(self, req: ScoreRequest, k: int | None = None) -> dict[str, Any]:
        return {
            "model": self._model,
            "prompt": req.tokens.tolist(),
            "max_tokens": 1,
            "temperature": 0.0,
            "prompt_logprobs": req.k if k is None else k,
        }

    def parse(self, content: bytes, req: ScoreRequest) -> ScoreOutcome:
        return parse_completion(content, req)

    async def _check_model(self, url: str) -> None:
        data = await self._get_json(url + "/v1/models")
        names = [m.get("id") for m in data.get("data", [])]
        if self._model is None:
            if not names:
                raise TeacherConfigError(f"{url} serves no model")
            self._model = str(names[0])
        elif self._model not in names:
            raise TeacherConfigError(f"{url} does not serve model {self._model!r} (it serves {names})")

    async def _probe_cap(self, url: str) -> int:
        """The server's ``prompt_logprobs`` cap: from the error message, else by binary search."""
        first = await self._probe(url, PROBE_K)
        if first is None:
            return PROBE_K
        if first >= 0:
            return first
        lo, hi = 0, PROBE_K  # lo accepted (0 = none known), hi refused
        if await self._probe(url, self.config.k) is None:
            lo = self.config.k
        else:
            hi = self.config.k
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if await self._probe(url, mid) is None:
                lo = mid
            else:
                hi = mid
        return lo

    async def _probe(self, url: str, k: int) -> int | None:
        """``None`` when ``k`` is accepted, the cap when the refusal names it, else -1."""
        body = self.body(ScoreRequest(np.zeros(1, np.int32), k))
        resp = await self._http().post(url + self.endpoint, json=body)
        if resp.status_code == 200:
            return None
        m = _CAP_RE.search(resp.text)
        if m is None:
            raise TeacherConfigError(f"cap probe on {url} failed: http {resp.status_code}: {resp.text[:300]}")
        return int(m.group(1)) if m.group(1) else -1
