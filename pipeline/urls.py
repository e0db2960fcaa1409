"""Inference-server URLs as users write them.

OpenAI-style clients (the OpenAI SDK, vLLM's docs, Atropos configs) take a base URL ending in ``/v1``;
others take the bare server address. ``server_root`` accepts both and returns the server's root, to which
the backends append their own paths (``/v1/completions``, ``/v1/models``, SGLang's ``/generate``).
"""

from __future__ import annotations

from urllib.parse import urlsplit

#: The OpenAI API version segment that a base URL may end with.
API_SEGMENT = "/v1"


def server_root(url: str) -> str:
    """The root of the server at ``url``, without a trailing ``/v1`` or slash.

    ``http://h:8000``, ``http://h:8000/``, ``http://h:8000/v1`` and ``http://h:8000/v1/`` all give
    ``http://h:8000``; a path prefix in front of ``/v1`` (a reverse proxy's) is kept:
    ``https://gw/teacher/v1`` gives ``https://gw/teacher``. Raises ``ValueError`` for anything that
    is not an ``http(s)://host[:port][/path]`` URL (no scheme, no host, a query or a fragment).
    """
    text = url.strip()
    try:
        parts = urlsplit(text)
        _ = parts.port  # raises for a port that is not a number in range
    except ValueError as e:
        raise ValueError(f"invalid server URL {url!r}: {e}") from e
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise ValueError(f"invalid server URL {url!r}: expected http://host:port or http://host:port/v1")
    if parts.query or parts.fragment or "?" in text or "#" in text:
        raise ValueError(f"invalid server URL {url!r}: a server URL takes no query or fragment")
    path = parts.path.rstrip("/")
    if path.endswith(API_SEGMENT):
        path = path.removesuffix(API_SEGMENT).rstrip("/")
    return f"{parts.scheme.lower()}://{parts.netloc}{path}"
