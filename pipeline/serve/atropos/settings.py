"""``distillq serve atropos``'s settings: each field is a flag, its environment variable, its default, its
help and a row of docs/cli.md (``pipeline.flags``); ``serve_config`` builds the server's ``ServeConfig`` from
them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

from pydantic import Field

from pipeline.flags import Flag, FlagSettings

if TYPE_CHECKING:  # the server's modules load when it runs, not when the CLI parser is built
    from pipeline.config import RedisSettings, StreamSettings
    from pipeline.serve.atropos.startup import ServeConfig


class AtroposSettings(FlagSettings):
    """Where the Atropos API listens and how it hands out batches (Redis: ``RedisSettings``)."""

    host: Annotated[str, Flag(env="SERVE_HOST")] = Field(
        "127.0.0.1", description="address to listen on; `0.0.0.0` for every interface (no authentication)")
    port: Annotated[int, Flag(env="SERVE_PORT")] = Field(8000, description="port (the reference's)")
    lease_s: float = Field(600.0, description="lease of `GET /batch?lease=1` before the batch is handed out again")
    batch_wait_s: Annotated[float, Flag(env="ATROPOS_BATCH_WAIT_S")] = Field(
        1.0, description="how long `GET /batch` waits when groups still being scored would complete a batch (0 to 60; "
                         "0: answer at once)")
    consumer_name: str = Field(
        "atropos-server", description="consumer name on the `scored` stream; keep it stable across restarts (replicas "
                                      "on one namespace may share it)")
    body_timeout_s: float = Field(
        30.0, gt=0, allow_inf_nan=False, description="seconds the server waits for a request's whole head (from the "
                                                     "connection's start or the previous response) and for each next "
                                                     "bytes of its body; one slower gets 408 and the connection is "
                                                     "closed")
    gzip_level: Annotated[int, Flag(metavar="1-9")] = Field(
        1, ge=1, le=9, description="gzip level of responses (the reference uses 9, several times slower)")
    access_log: bool = Field(False, description="log every request (environments poll at 10 Hz)")


def serve_config(s: AtroposSettings, redis: RedisSettings, streams: StreamSettings) -> ServeConfig:
    """The server's config: ``s``' lease, wait, consumer name, body timeout and gzip level, and where Redis is."""
    from pipeline.serve.atropos.startup import ServeConfig

    return ServeConfig(redis=redis, streams=streams, lease_s=s.lease_s, batch_wait_s=s.batch_wait_s,
                       consumer_name=s.consumer_name, body_timeout_s=s.body_timeout_s, gzip_level=s.gzip_level)
