"""``distillq serve student``'s settings: each field is a flag, its environment variable, its default, its
help and a row of docs/cli.md (``pipeline.flags``; ``python -m pipeline.cli.docs`` regenerates the table);
``student_serve_config`` and ``session_store`` build what the server runs with from them.

Only ``--weights-sync`` has an environment variable (``DISTILLQ_WEIGHTS_SYNC``, shared with ``worker rollout``);
the other flags have none, so variables set for the workers on the same host (``DISTILLQ_METRICS_PORT``, ...)
do not reach the server. The checks that span flags (``--backend hf needs --model DIR``) and the ranges are
``pipeline.cli.commands.serve_student.usage_error``'s, with its messages.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import Field

from pipeline.flags import Flag, FlagSettings

if TYPE_CHECKING:  # the server's modules load when it runs, not when the CLI parser is built
    from pipeline.serve.student.service import StudentServeConfig
    from pipeline.serve.student.sessions import SessionStore

StudentBackendName = Literal["hf", "vllm"]
WeightsSync = Literal["vllm", "vllm-lora", "sglang"]  # pipeline.rollout.sync_engines.ENGINES


class StudentServeSettings(FlagSettings):
    """The student backend, where the server listens, and the groups it pushes (Redis: ``RedisSettings``)."""

    backend: StudentBackendName = Field("hf", description="`hf` (a local transformers model) or `vllm` (a vLLM server)")
    model: str | None = Field(None, description="hf: the model directory (weights and tokenizer); required for hf")
    url: str | None = Field(
        None, description="vllm: the server, `http://host:port` with or without `/v1`; several separated by commas, "
                          "used round-robin; required for vllm")
    vllm_model: Annotated[str | None, Flag(default_text="the first it serves")] = Field(
        None, description="vllm: the model name on that server")
    tokenizer: Annotated[str | None, Flag(default_text="`--model`")] = Field(
        None, description="the tokenizer directory; required with `--backend vllm`")
    served_model_name: Annotated[list[str] | None, Flag(
        metavar="NAME", default_text="hf: the `--model` path as given; vllm: the name the vLLM server serves it "
                                     "under, `--vllm-model` or the first it lists")] = Field(
        None, description="name clients use for the model, repeatable")
    max_model_len: Annotated[int | None, Flag(default_text="the model's")] = Field(
        None, description="context length reported by /v1/models and enforced")
    default_max_tokens: int = Field(256, description="`max_tokens` when a request sets none")
    host: str = Field("127.0.0.1", description="bind address (`0.0.0.0`: every interface)")
    port: int = Field(8100, description="port (`0`: any free port, written to `--port-file`)")
    port_file: Annotated[Path | None, Flag(parse=Path)] = Field(
        None, description="write the bound port here once listening")
    group_size: int = Field(1, description="rollouts per group unless a finish says otherwise")
    env_id: int = Field(0, description="`env_id` of the groups pushed")
    policy_version: int = Field(
        0, description="`policy_version` of the groups pushed (with `--weights-dir` the version comes from the "
                       "server)")
    weights_dir: Annotated[str | None, Flag(metavar="DIR|URL")] = Field(
        None, description="vllm: keep every `--url` server on the newest version a learner publishes there; each "
                          "group carries the version its requests ran on (a rollout whose requests straddle a reload "
                          "is dropped at finish, counted in `distillq_unattributed_samples_total`). A `redis://` or "
                          "`s3://` URL is mirrored into a local folder the servers must see ([weights.md](weights.md))")
    weights_cache: Annotated[str | None, Flag(metavar="DIR", default_text="a temporary folder")] = Field(
        None, description="with a `--weights-dir` URL: the local folder the newest version is rebuilt in, which the "
                          "`--url` servers load from (so they must see it)")
    weights_sync: Annotated[WeightsSync, Flag(env="WEIGHTS_SYNC")] = Field(
        "vllm", description="with `--weights-dir`: `vllm` (reload in place), `vllm-lora` (an adapter per version) or "
                            "`sglang`, as for `worker rollout`")
    session_ttl: float = Field(
        1800.0, description="seconds before an idle unfinished rollout is evicted (and an incomplete group pushed as "
                            "partial)")
    max_sessions: int = Field(4096, description="rollouts tracked at once (least recently used evicted first)")
    max_body_bytes: Annotated[int, Flag(default_text="33554432 (32 MiB)")] = Field(
        32 << 20, description="request bodies above this get 413 (at least 1024)")
    body_timeout_s: float = Field(
        30.0, description="seconds the server waits for a request's whole head (from the connection's start or the "
                          "previous response) and for each next bytes of its body; one slower gets 408 and the "
                          "connection is closed")
    metrics_port: Annotated[int, Flag(default_text="0 (off)")] = Field(0, description="Prometheus `/metrics` port")
    api_key_var: Annotated[str | None, Flag(metavar="VAR", default_text="none, no key")] = Field(
        None, description="the name of an environment variable holding a bearer token clients must send")


def student_serve_config(
    s: StudentServeSettings, served_names: tuple[str, ...], max_model_len: int, vocab_size: int | None
) -> StudentServeConfig:
    """What the server serves (``served_names``, ``max_model_len`` and ``vocab_size``, from the loaded backend)
    and ``s``' defaults for the groups it pushes."""
    from pipeline.serve.student.service import StudentServeConfig

    return StudentServeConfig(served_names=served_names, max_model_len=max_model_len, vocab_size=vocab_size,
                              default_max_tokens=s.default_max_tokens, group_size=s.group_size, env_id=s.env_id,
                              policy_version=s.policy_version)


def session_store(s: StudentServeSettings) -> SessionStore:
    """The rollouts tracked at once and how long an idle one lives."""
    from pipeline.serve.student.sessions import SessionStore

    return SessionStore(max_sessions=s.max_sessions, ttl_s=s.session_ttl)
