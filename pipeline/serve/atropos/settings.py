"""``distillq serve atropos``'s settings: each field is a flag, its environment variable, its default, its
help, the ``ServeConfig`` field it goes into, and a row of docs/cli.md (``pipeline.flags``)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from pipeline.flags import Flag, FlagSettings


class AtroposSettings(FlagSettings):
    """Where the Atropos API listens and how it hands out batches (Redis: ``RedisSettings``)."""

    host: Annotated[str, Flag(env="SERVE_HOST", doc=(
        "address to listen on; `0.0.0.0` for every interface (no authentication)"))] = Field(
        "127.0.0.1", description="address to listen on; 0.0.0.0 for every interface (no auth)")
    port: Annotated[int, Flag(env="SERVE_PORT", doc="port (the reference's)")] = Field(
        8000, description="port; 8000 is the reference's")
    lease_s: Annotated[float, Flag(to=("ServeConfig",), doc=(
        "lease of `GET /batch?lease=1` before the batch is handed out again"))] = Field(
        600.0, description="lease of GET /batch?lease=1 before the batch is handed out again")
    batch_wait_s: Annotated[float, Flag(env="ATROPOS_BATCH_WAIT_S", to=("ServeConfig",), doc=(
        "how long `GET /batch` waits when groups still being scored would complete a batch (0 to 60; 0: answer "
        "at once)"))] = Field(
        1.0, description="how long GET /batch waits when groups still being scored would complete a batch; 0: "
                         "answer at once")
    consumer_name: Annotated[str, Flag(to=("ServeConfig",), doc=(
        "consumer name on the `scored` stream; keep it stable across restarts (replicas on one namespace may "
        "share it)"))] = Field(
        "atropos-server", description="consumer name on the scored stream; keep it stable across restarts "
                                      "(replicas may share it)")
    body_timeout_s: Annotated[float, Flag(to=("ServeConfig",), doc=(
        "seconds the server waits for the next bytes of a request body; a body that stalls longer gets 408 "
        "and the connection is closed"))] = Field(
        30.0, gt=0, allow_inf_nan=False, description="seconds to wait for the next bytes of a request body "
                                                     "(then 408)")
    gzip_level: Annotated[int, Flag(metavar="1-9", to=("ServeConfig",))] = Field(
        1, ge=1, le=9, description="gzip level of responses (the reference uses 9, several times slower)")
    access_log: bool = Field(False, description="log every request (environments poll at 10 Hz)")
