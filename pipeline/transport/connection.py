"""Redis connections from one URL, with reconnect-and-backoff, and URL masking for logs."""

from __future__ import annotations

import asyncio
import os
import re
import socket
import ssl
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, cast
from urllib.parse import urlsplit

import redis.asyncio as aioredis
import structlog
from redis import Redis as SyncRedis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import (
    AuthenticationError,
    BusyLoadingError,
    ClusterDownError,
    MasterDownError,
    OutOfMemoryError,
    RedisClusterException,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry as SyncRetry

from pipeline.backoff import Backoff
from pipeline.config import RedisSettings
from pipeline.errors import TransportError
from pipeline.transport import bigio

__all__ = ["TRANSIENT", "Backoff", "ClusterUnreachableError", "connect", "connect_sync", "is_nogroup", "is_redis_full",
           "mask_url", "memory_use", "redis_error_line", "retry_transient", "retry_transient_sync"]

T = TypeVar("T")


class ClusterUnreachableError(TransportError, RedisConnectionError):
    """No node of a Redis Cluster answered, or the nodes that did left slots uncovered (a master away): transient,
    like a single Redis that cannot be reached. redis-py says this with a plain ``RedisClusterException``."""


#: Errors that mean "Redis is away" (or a cluster master is failing over); callers back off and retry.
TRANSIENT = (RedisConnectionError, RedisTimeoutError, BusyLoadingError, ClusterDownError, TryAgainError,
             MasterDownError, ConnectionError, OSError)
log = structlog.get_logger("distillq.connection")
_QUERY_SECRET = re.compile(r"(?P<key>(?:password|passwd|pass|pwd))=[^&]*", re.IGNORECASE)


def mask_url(url: str) -> str:
    """Any password in a Redis URL -> ``***``: ``user:secret@`` (also with ``/`` or ``@`` in it) and
    ``?password=...`` query parameters (never log a password)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    query = ""
    if "?" in rest:
        rest, query = rest.split("?", 1)
        query = "?" + _QUERY_SECRET.sub(lambda m: f"{m['key']}=***", query)
    if "@" in rest:
        auth, host = rest.rsplit("@", 1)
        user = auth.split(":", 1)[0]
        rest = f"{user}:***@{host}" if ":" in auth or user else f"***@{host}"
    return f"{scheme}://{rest}{query}"


CLUSTER_SCHEME = "redis+cluster://"


def is_cluster_url(url: str) -> bool:
    return url.startswith((CLUSTER_SCHEME, "rediss+cluster://"))


def is_cluster_client(redis: object) -> bool:
    """Whether ``redis`` is a RedisCluster (no MULTI; multi-key commands only within one slot)."""
    return type(redis).__name__ == "RedisCluster"


def _seeded(manager: Any) -> Any:
    """``manager`` (redis-py's ``NodesManager``) as one that always asks the URL's nodes too, and says "unreachable"
    as a transient error (``ClusterUnreachableError``).

    redis-py (5.3) drops a node from its startup list on every connection error and then closes every node's
    connections, so the other tasks' reads fail too and drop their nodes: one master killed under concurrent
    readers empties the list, and the client raises "Redis Cluster cannot be connected" for ever after (measured
    on a 3-master cluster). The URL's nodes are put back before each discovery."""
    from redis.asyncio.cluster import ClusterNode, NodesManager
    from redis.cluster import get_node_name

    class SeededNodesManager(NodesManager):
        __slots__ = ("seeds",)
        seeds: list[tuple[str, int]]

        async def initialize(self) -> None:
            for host, port in self.seeds:
                if get_node_name(host, port) not in self.startup_nodes:
                    node = ClusterNode(host, port, **self.connection_kwargs)
                    self.startup_nodes[node.name] = node
            try:
                await super().initialize()
            except RedisClusterException as e:
                if type(e) is RedisClusterException and str(e).startswith(
                        ("Redis Cluster cannot be connected", "All slots are not covered")):
                    raise ClusterUnreachableError(str(e)) from e
                raise

    seeded = SeededNodesManager(list(manager.startup_nodes.values()), manager.require_full_coverage,
                                manager.connection_kwargs, address_remap=manager.address_remap,
                                event_dispatcher=manager._event_dispatcher)
    seeded.seeds = [(node.host, node.port) for node in manager.startup_nodes.values()]
    return seeded


def _connect_cluster(settings: RedisSettings, kwargs: dict[str, object]) -> aioredis.Redis:
    """``redis+cluster://[user:pass@]host:port,host:port`` -> a RedisCluster (same command API)."""
    from urllib.parse import urlsplit

    from redis.asyncio.cluster import ClusterNode, RedisCluster

    tls = settings.redis_url.startswith("rediss+")
    rest = settings.redis_url.split("://", 1)[1]
    auth, _, hosts = rest.rpartition("@")
    hosts = hosts.split("/", 1)[0]
    nodes = []
    for hp in hosts.split(","):
        parts = urlsplit(f"//{hp}")
        nodes.append(ClusterNode(parts.hostname or "127.0.0.1", parts.port or 6379))
    user, _, password = auth.partition(":") if auth else ("", "", "")
    for name in ("retry_on_error",):
        kwargs.pop(name, None)
    if not tls:
        for name in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile"):
            kwargs.pop(name, None)
    # RedisCluster re-sends a command after a connection error or CLUSTERDOWN (cluster_error_retry_attempts, and
    # its pipelines need at least 1): harmless, since every operation distillq retries is written to be repeated.
    client: Any = RedisCluster(startup_nodes=nodes, username=user or None, password=password or None, ssl=tls,
                               **kwargs)
    client.nodes_manager = _seeded(client.nodes_manager)
    # RedisCluster is not a Redis subclass, but it offers the same API for every command distillq sends
    # (all multi-key operations stay within one hash slot); tests run the pipeline on a real cluster.
    return cast(aioredis.Redis, client)


#: TCP keepalive on every connection: the first probe after this many idle seconds, then one every
#: ``KEEPALIVE_INTERVAL_S``, the connection dropped after ``KEEPALIVE_PROBES`` unanswered ones. A Redis gone
#: without a FIN or RST (host down, a NAT or load balancer forgetting the flow) is noticed in about 30 s,
#: not after the kernel's default two hours.
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 15, 5, 3


def keepalive_options() -> dict[int, int]:
    """``socket_keepalive_options`` for redis-py: the options this platform's ``socket`` module has."""
    wanted = (("TCP_KEEPIDLE", KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
              ("TCP_KEEPCNT", KEEPALIVE_PROBES))
    return {getattr(socket, name): value for name, value in wanted if hasattr(socket, name)}


#: How often redis-py tries to establish a connection before a command fails (``connect``, ``connect_sync``).
CONNECT_RETRIES = 3


def _connect_backoff() -> ExponentialBackoff:
    """redis-py's wait between those tries (both clients'): 50 ms doubling, at most 2 s."""
    return ExponentialBackoff(cap=2.0, base=0.05)


def _options(settings: RedisSettings, url: str) -> dict[str, object]:
    """The client options of every connection to ``url``: bytes replies, the connect timeout, the TLS files of
    ``settings`` (``rediss://``), TCP keepalive (``keepalive_options``)."""
    kwargs: dict[str, object] = {"decode_responses": False,
                                 "socket_connect_timeout": settings.socket_connect_timeout}
    if url.startswith(("rediss://", "rediss+cluster://")):
        for name in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile"):
            value = getattr(settings, name)
            if value:
                kwargs[name] = value
    if not url.startswith("unix://"):  # redis-py's Unix connections take no TCP options
        kwargs.update(socket_keepalive=True, socket_keepalive_options=keepalive_options())
    return kwargs


def connect_sync(url: str, settings: RedisSettings, *, socket_timeout: float = 60.0) -> SyncRedis:
    """A synchronous client for ``url`` (one Redis, not a cluster) with ``connect``'s options: the TLS files of
    ``settings``, the connect timeout, keepalive, and redis-py retrying only the establishing of a connection.
    Commands are retried by ``retry_transient_sync``. The weights store's client (``pipeline.weightstore``)."""
    kwargs = _options(settings, url)
    kwargs.update(socket_timeout=socket_timeout, retry=SyncRetry(_connect_backoff(), retries=CONNECT_RETRIES))
    return SyncRedis.from_url(url, **kwargs)


def retry_transient_sync(op: Callable[[], T], *, deadline_s: float, what: str,
                         sleep: Callable[[float], None] = time.sleep) -> T:
    """``retry_transient`` for synchronous clients: ``op`` (safe to repeat) run until it succeeds, backing off
    (``pipeline.backoff``) on transient Redis errors for at most ``deadline_s``, ``redis_unavailable`` logged
    (``what`` names the server); then the last error is raised."""
    end = time.monotonic() + deadline_s
    backoff = Backoff()
    logged = float("-inf")
    while True:
        try:
            return op()
        except TRANSIENT as e:
            delay = backoff.next_delay()
            if time.monotonic() + delay > end:
                raise
            if time.monotonic() - logged >= FULL_LOG_EVERY_S:
                logged = time.monotonic()
                log.warning("redis_unavailable", server=what, error=str(e), retry_in=round(delay, 2),
                            gives_up_in_s=round(end - time.monotonic(), 1))
            sleep(delay)


def connect(settings: RedisSettings, *, max_connections: int | None = None) -> aioredis.Redis:
    """A client for ``settings.redis_url`` (``redis+cluster://h:p,h:p`` for Redis Cluster).

    Responses stay bytes (payloads are binary). No ``socket_timeout``: with one, redis-py 5.3 on Python
    3.11 reads under ``asyncio.timeout``, and a task cancelled while its reply arrives can swallow the
    cancellation and go on (203 of 2,000 cancelled blocking reads, measured); every stop path cancels
    reads. A Redis host that vanishes is noticed by the keepalive probes (``keepalive_options``) instead.

    Which layer retries: redis-py retries *establishing* a connection (``retry``: 3 tries, a fresh
    connection is harmless to repeat) and never re-sends a command (no ``retry_on_error``): after a
    connection error the command's effect is unknown, and a blind re-send of XADD, INCR or a script would
    apply it twice. Commands are retried by distillq (``retry_transient``, the run loops' back-off), around
    operations written to be safe to repeat (dedupe markers, acks by entry id)."""
    kwargs = _options(settings, settings.redis_url)
    kwargs["retry"] = Retry(_connect_backoff(), retries=CONNECT_RETRIES)
    if max_connections is not None:
        kwargs["max_connections"] = max_connections
    if is_cluster_url(settings.redis_url):
        return _connect_cluster(settings, kwargs)
    kwargs["connection_class"] = bigio.connection_class(settings.redis_url)  # sized for multi-MB entries
    kwargs["socket_read_size"] = bigio.READ_SIZE
    client: aioredis.Redis = aioredis.Redis.from_url(settings.redis_url, **kwargs)  # type: ignore[arg-type]
    return client


def is_redis_full(exc: BaseException) -> bool:
    """Whether ``exc`` is Redis refusing a write at ``maxmemory`` under ``noeviction`` (``-OOM command not
    allowed when used memory > 'maxmemory'``, also inside a script, a pipeline or a transaction)."""
    return isinstance(exc, OutOfMemoryError) or (
        isinstance(exc, ResponseError) and "used memory > 'maxmemory'" in str(exc))


def is_nogroup(exc: BaseException) -> bool:
    """Whether ``exc`` is Redis saying a stream's consumer group (or the stream) does not exist."""
    return isinstance(exc, ResponseError) and str(exc).startswith("NOGROUP")


async def memory_use(redis: aioredis.Redis) -> dict[str, int]:
    """``used_memory`` and ``maxmemory`` in bytes (``INFO memory``); empty if Redis cannot say."""
    try:
        info: dict[str, Any] = await redis.info("memory")
    except (*TRANSIENT, ResponseError):
        return {}
    return {k: int(info[k]) for k in ("used_memory", "maxmemory") if k in info}


#: While Redis stays full, ``redis_full`` is logged again every this many seconds.
FULL_LOG_EVERY_S = 30.0


async def retry_transient(
    op: Callable[[], Awaitable[T]],
    *,
    stop: asyncio.Event | None = None,
    deadline_s: float | None = None,
    on_error: Callable[[BaseException, float], None] | None = None,
    redis: aioredis.Redis | None = None,
    wait_when_full: bool = True,
) -> T:
    """Run ``op`` until it succeeds, backing off (``pipeline.backoff``) on transient Redis errors.

    This is the one layer that retries Redis commands (redis-py only retries establishing a connection,
    see ``connect``): ``op`` must be safe to run again after an error whose effect is unknown.

    Gives up (re-raising the last error) when ``stop`` is set or ``deadline_s`` has passed. Redis at
    ``maxmemory`` (``is_redis_full``) is backpressure, not a failure: with ``wait_when_full`` it is waited
    out past any deadline (until ``stop``), logged as ``redis_full`` with ``used_memory``/``maxmemory``
    (read through ``redis``, when given); otherwise it is raised at once.
    """
    loop = asyncio.get_running_loop()
    end = None if deadline_s is None else loop.time() + deadline_s
    backoff = Backoff()
    logged_full = logged_away = float("-inf")
    while True:
        try:
            return await op()
        except TRANSIENT as e:
            delay = backoff.next_delay()
            if (stop is not None and stop.is_set()) or (end is not None and loop.time() + delay > end):
                raise
            if on_error is not None:
                on_error(e, delay)
            elif loop.time() - logged_away >= FULL_LOG_EVERY_S:  # never silent while it waits
                logged_away = loop.time()
                log.warning("redis_unavailable", error=await explain_unavailable(e, redis), retry_in=round(delay, 2))
            await asyncio.sleep(delay)
        except ResponseError as e:
            if not (wait_when_full and is_redis_full(e)) or (stop is not None and stop.is_set()):
                raise
            delay = backoff.next_delay()
            if loop.time() - logged_full >= FULL_LOG_EVERY_S:
                logged_full = loop.time()
                mem = await memory_use(redis) if redis is not None else {}
                log.warning("redis_full", error=str(e).split(".")[0], retry_in=round(delay, 2), **mem)
            await asyncio.sleep(delay)


async def explain_unavailable(exc: BaseException, redis: aioredis.Redis | None) -> str:
    """``exc``'s text, or what the server says when it refuses new clients (``max number of clients reached``:
    redis-py reports only a failed write then)."""
    text = str(exc)
    kw = getattr(getattr(redis, "connection_pool", None), "connection_kwargs", None)
    if not isinstance(kw, dict) or "host" not in kw:
        return text
    greeting = await asyncio.to_thread(refusal_greeting, text, f"redis://{kw['host']}:{kw.get('port', 6379)}")
    return f"Redis refuses new connections: {greeting} (maxclients)" if greeting else text


def refusal_greeting(reason: str, url: str) -> str | None:
    """``max number of clients reached`` when ``reason`` is how redis-py reports a server over maxclients (a failed
    write, or the error itself) and the server at ``url`` says so on accept; else None."""
    if "max number of clients" not in reason and "while writing to socket" not in reason:
        return None
    greeting = server_greeting(url)  # a server over maxclients says so on accept, then closes
    return greeting if greeting is not None and "max number of clients" in greeting else None


def _os_reason(exc: BaseException) -> str | None:
    """The operating system's words for the first socket error in ``exc``'s chain ("Connection refused")."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, ssl.SSLError):  # an OSError whose errno is the TLS library's code, not the OS's
            return f"TLS: {cur}"
        if isinstance(cur, OSError):
            if isinstance(cur.errno, int) and cur.errno > 0:
                return os.strerror(cur.errno)
            if cur.strerror:
                return str(cur.strerror)
        cur = cur.__cause__ or cur.__context__
    return None


def redis_error_line(exc: BaseException, url: str | None) -> str:
    """One line for a Redis failure, any password in ``url`` masked: ``cannot reach Redis at URL: Connection
    refused``, ``Redis at URL refused the credentials: ...``, ``Redis at URL is full: ...``, ``Redis at URL replied
    with an error: ...``."""
    where = f" at {mask_url(url)}" if url else ""
    if isinstance(exc, AuthenticationError):
        return f"Redis{where} refused the credentials: {str(exc).rstrip('.')}"
    if is_redis_full(exc):
        return (f"Redis{where} is full: it refuses writes at its maxmemory (noeviction); free memory or raise "
                "maxmemory, then run this again (distillq stats shows used and maxmemory)")
    if isinstance(exc, ResponseError):
        return f"Redis{where} replied with an error: {exc}"
    reason = _os_reason(exc)
    if reason is None:
        text = str(exc).split(": Error ")[0] if isinstance(exc, RedisClusterException) else str(exc)
        reason = text.rstrip(".") or type(exc).__name__
    if url and (greeting := refusal_greeting(reason, url)) is not None:
        return (f"Redis{where} refuses new connections: {greeting} (maxclients): close idle clients (CLIENT "
                "LIST, CLIENT KILL) or raise maxclients, then run this again")
    return f"cannot reach Redis{where}: {reason}"


def server_greeting(url: str, timeout_s: float = 1.0) -> str | None:
    """What a Redis server at ``url`` sends unasked right after accepting a connection (an error line when it refuses
    the client: ``ERR max number of clients reached``), else None. Plain TCP only (``redis://``)."""
    parts = urlsplit(url)
    if parts.scheme != "redis" or parts.hostname is None:
        return None
    try:
        with socket.create_connection((parts.hostname, parts.port or 6379), timeout=timeout_s) as sock:
            sock.settimeout(timeout_s / 2)
            data = sock.recv(256)
    except OSError:
        return None
    text = data.decode("utf-8", "replace").strip()
    return text.removeprefix("-").removeprefix("ERR ") or None
