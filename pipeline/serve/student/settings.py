"""``distillq serve student``'s settings: each field is a flag, its environment variable, its default, its
help, what it goes into (``ServeConfig``, ``SessionStore``, ``create_app``), and a row of docs/cli.md
(``pipeline.flags``; ``python -m pipeline.cli.docs`` regenerates the table).

Only ``--weights-sync`` has an environment variable (``DISTILLQ_WEIGHTS_SYNC``, shared with ``worker rollout``);
the other flags have none, so variables set for the workers on the same host (``DISTILLQ_METRICS_PORT``, ...)
do not reach the server. The checks that span flags (``--backend hf needs --model DIR``) and the ranges are
``pipeline.cli.commands.serve_student.usage_error``'s, with its messages.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field

from pipeline.flags import Flag, FlagSettings

StudentBackendName = Literal["hf", "vllm"]
WeightsSync = Literal["vllm", "vllm-lora", "sglang"]  # pipeline.rollout.sync_engines.ENGINES


class StudentServeSettings(FlagSettings):
    """The student backend, where the server listens, and the groups it pushes (Redis: ``RedisSettings``)."""

    backend: Annotated[StudentBackendName, Flag(doc="`hf` (a local transformers model) or `vllm` (a vLLM server)")] = (
        Field("hf", description="student backend"))
    model: Annotated[str | None, Flag(doc="hf: the model directory (weights and tokenizer); required for hf")] = Field(
        None, description="hf: model directory, weights and tokenizer; required for hf")
    url: Annotated[str | None, Flag(doc=(
        "vllm: the server, `http://host:port` with or without `/v1`; several separated by commas, used "
        "round-robin; required for vllm"))] = Field(
        None, description="vllm: the vLLM server, http://host:port with or without /v1; several separated by commas, "
                          "used round-robin; required for vllm")
    vllm_model: Annotated[str | None, Flag(default_text="the first it serves")] = Field(
        None, description="vllm: the model name on that server")
    tokenizer: Annotated[str | None, Flag(default_text="`--model`", doc=(
        "the tokenizer directory; required with `--backend vllm`"))] = Field(
        None, description="tokenizer directory; required with --backend vllm")
    served_model_name: Annotated[list[str] | None, Flag(
        metavar="NAME",
        default_text="hf: the `--model` path as given; vllm: the name the vLLM server serves it under, "
                     "`--vllm-model` or the first it lists")] = Field(
        None, description="name clients use for the model, repeatable")
    max_model_len: Annotated[int | None, Flag(default_text="the model's")] = Field(
        None, description="context length reported by /v1/models and enforced")
    default_max_tokens: Annotated[int, Flag(to=("ServeConfig",), doc="`max_tokens` when a request sets none")] = (
        Field(256, description="max_tokens when a request sets none"))
    host: Annotated[str, Flag(doc="bind address (`0.0.0.0`: every interface)")] = Field(
        "127.0.0.1", description="bind address (0.0.0.0: every interface)")
    port: Annotated[int, Flag(doc="port (`0`: any free port, written to `--port-file`)")] = Field(
        8100, description="port (0: any free port, see --port-file)")
    port_file: Annotated[Path | None, Flag(parse=Path)] = Field(
        None, description="write the bound port here once listening")
    group_size: Annotated[int, Flag(to=("ServeConfig",))] = Field(
        1, description="rollouts per group unless a finish says otherwise")
    env_id: Annotated[int, Flag(to=("ServeConfig",), doc="`env_id` of the groups pushed")] = Field(
        0, description="env_id of the groups pushed")
    policy_version: Annotated[int, Flag(to=("ServeConfig",), doc=(
        "`policy_version` of the groups pushed (with `--weights-dir` the version comes from the server)"))] = Field(
        0, description="policy_version of the groups pushed (with --weights-dir: the version the server reports)")
    weights_dir: Annotated[str | None, Flag(metavar="DIR", doc=(
        "vllm: keep every `--url` server on the newest version a learner publishes there; each group carries the "
        "version its requests ran on (a rollout whose requests straddle a reload is dropped at finish, counted in "
        "`distillq_unattributed_samples_total`)"))] = Field(
        None, description="vllm: keep every --url server on the newest version a learner publishes here and tag each "
                          "group with the version its requests ran on")
    weights_sync: Annotated[WeightsSync, Flag(env="WEIGHTS_SYNC", doc=(
        "with `--weights-dir`: `vllm` (reload in place), `vllm-lora` (an adapter per version) or `sglang`, as for "
        "`worker rollout`"))] = Field(
        "vllm", description="with --weights-dir: vllm (reload in place), vllm-lora (an adapter per version) or sglang")
    session_ttl: Annotated[float, Flag(to=("SessionStore.ttl_s",), doc=(
        "seconds before an idle unfinished rollout is evicted (and an incomplete group pushed as partial)"))] = Field(
        1800.0, description="seconds before an idle unfinished rollout (or an incomplete group) is dropped (flushed)")
    max_sessions: Annotated[int, Flag(to=("SessionStore",), doc=(
        "rollouts tracked at once (least recently used evicted first)"))] = Field(
        4096, description="rollouts tracked at once (LRU eviction)")
    max_body_bytes: Annotated[int, Flag(default_text="33554432 (32 MiB)", to=("create_app",), doc=(
        "request bodies above this get 413 (at least 1024)"))] = Field(
        32 << 20, description="request bodies above this many bytes are refused with 413")
    body_timeout_s: Annotated[float, Flag(to=("create_app",), doc=(
        "seconds the server waits for the next bytes of a request body; a body that stalls longer gets 408 and "
        "the connection is closed"))] = Field(
        30.0, description="seconds to wait for the next bytes of a request body (then 408)")
    metrics_port: Annotated[int, Flag(default_text="0 (off)", doc="Prometheus `/metrics` port")] = Field(
        0, description="Prometheus /metrics port")
    api_key_var: Annotated[str | None, Flag(metavar="VAR", default_text="none, no key", doc=(
        "the name of an environment variable holding a bearer token clients must send"))] = Field(
        None, description="name of an environment variable holding a key clients must send as a bearer token")
