"""Settings, validated with pydantic. Every field can come from the environment (``DISTILLQ_*``)."""

from __future__ import annotations

import argparse
import os

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from schemas.validate import Limits

#: Every variable distillq reads starts with it.
ENV_PREFIX = "DISTILLQ_"


def env(name: str, default: str | None = None) -> str | None:
    """The variable ``DISTILLQ_<name>``, else ``default``: the one place a setting is read from the environment
    by name (settings classes read theirs through pydantic-settings or ``pipeline.flags``). Nothing else in
    ``pipeline``, ``workers`` or ``distillq`` reads a ``DISTILLQ_*`` variable from ``os.environ``
    (tests/unit/test_env_reads.py)."""
    return os.environ.get(f"{ENV_PREFIX}{name}", default)


class RedisSettings(BaseSettings):
    """Where Redis is: one URL (``redis://``, ``rediss://`` for TLS; user/password in the URL)."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore")

    redis_url: str = "redis://127.0.0.1:6379/0"
    namespace: str = "distillq"
    ssl_ca_certs: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    socket_connect_timeout: float = Field(5.0, gt=0)

    @field_validator("redis_url")
    @classmethod
    def _scheme(cls, v: str) -> str:
        if not v.startswith(("redis://", "rediss://", "unix://", "redis+cluster://", "rediss+cluster://")):
            raise ValueError("redis_url must start with redis://, rediss://, unix:// or redis+cluster://")
        return v


def redis_settings(redis_url: str | None = None, namespace: str | None = None) -> RedisSettings:
    """Settings from the environment, with explicit values (when given) taking precedence."""
    given = {k: v for k, v in (("redis_url", redis_url), ("namespace", namespace)) if v}
    return RedisSettings(**given)  # type: ignore[arg-type]


def add_redis_args(p: argparse.ArgumentParser) -> None:
    """``--redis-url`` and ``--namespace``, as every command and worker that talks to Redis takes them."""
    p.add_argument("--redis-url", default=None, help="redis://[user:password@]host:port/db or rediss:// "
                   "(default: $DISTILLQ_REDIS_URL or redis://127.0.0.1:6379/0)")
    p.add_argument("--namespace", default=None, help="key namespace (default: $DISTILLQ_NAMESPACE or distillq)")


def redis_settings_from_args(args: argparse.Namespace) -> RedisSettings:
    """Settings from ``add_redis_args``' flags, falling back to the environment."""
    return redis_settings(getattr(args, "redis_url", None), getattr(args, "namespace", None))


class StreamSettings(BaseSettings):
    """How stages use streams: caps, blocking reads, reclaim, dead-lettering, dedupe."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore")

    max_backlog: int = Field(1000, ge=1, description="producers wait while a stream holds this many entries")
    backpressure_timeout_s: float = Field(300.0, gt=0)
    block_ms: int = Field(1000, ge=1)
    read_count: int = Field(8, ge=1)
    max_in_flight: int = Field(16, ge=1)
    claim_idle_ms: int = Field(60_000, ge=1, description="reclaim entries pending this long")
    claim_interval_ms: int = Field(5_000, ge=1)
    max_deliveries: int = Field(5, ge=1, description="dead-letter after this many failed deliveries")
    dedupe_ttl_s: int = Field(24 * 3600, ge=1)  # must outlast the longest worker outage
    payload_ttl_s: int = Field(7 * 24 * 3600, ge=60, description="a claim-checked payload key expires this long "
                               "after it was written unless a learner acked its batch first (orphans of a stream "
                               "deleted by hand go); must outlast the longest learner outage")
    heartbeat_interval_s: float = Field(5.0, gt=0)
    shutdown_grace_s: float = Field(30.0, ge=0)
    max_message_bytes: int = Field(512 << 20, ge=1024)
    max_k: int = Field(256, ge=1)
    vocab_size: int | None = None

    def limits(self) -> Limits:
        return Limits(max_bytes=self.max_message_bytes, max_k=self.max_k, vocab_size=self.vocab_size)
