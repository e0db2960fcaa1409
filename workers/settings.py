"""Each worker stage's settings, one class per stage: every field is a flag of ``distillq worker STAGE``, its
environment variable, its default, its help and a row of docs/cli.md (``pipeline.flags``;
``python -m pipeline.cli.docs`` regenerates the tables). Below each class, the functions that build the stage's
configs from it, field by field.

``WorkerSettings``: the flags every stage takes (besides ``--redis-url``/``--namespace``, ``RedisSettings``).
``TeacherSettings``, ``FeederSettings``, ``RolloutSettings``: each stage's own. ``TeacherSettings()`` reads
the environment alone, for code that runs a stage without a command line.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import Field, field_validator

from pipeline.flags import Flag, FlagSettings, int_at_least
from pipeline.rollout.rewards import reward_names

if TYPE_CHECKING:  # the stages' modules load when a stage runs, not when its parser is built
    from pipeline.rollout.students.base import GenParams
    from pipeline.stages.batching import BatchingConfig
    from pipeline.stages.scoring import ScoringConfig
    from pipeline.teacher.vllm_engine import VLLMEngineConfig
    from pipeline.teacher.vllm_http import HTTPTeacherConfig

TeacherBackendName = Literal["vllm", "vllm-engine", "sglang", "hf", "synthetic"]
Dtype = Literal["auto", "float32", "bfloat16", "float16"]
WeightsSync = Literal["vllm", "vllm-lora", "sglang"]  # pipeline.rollout.sync_engines.ENGINES


def auto_or_positive(text: str) -> int | None:
    """``auto`` -> None, else an integer >= 1."""
    return None if text == "auto" else int_at_least(1)(text)


class WorkerSettings(FlagSettings):
    """Flags every worker stage takes."""

    burst: bool = Field(
        False, description="drain the input stream (rollout: prompts, teacher: rollouts, feeder: scored), then exit 0")
    check: bool = Field(
        False, description="exit 0 if a worker of this stage on this host holds a live heartbeat (written in the "
                           "last three beat intervals, 15 s by default: the key expires then) and reports nothing "
                           "wrong, else 1 (prints why; a container health check). A teacher whose "
                           "backend's latest calls all failed reports it (`1 teacher worker(s) alive but unhealthy: "
                           "teacher-0: teacher backend failing: last 4 call(s) failed, latest: connection error ...`) "
                           "until a call succeeds")
    any_host: bool = Field(False, description="with `--check`: a worker of the stage on any host counts")
    metrics_port: Annotated[int, Flag(env="METRICS_PORT", metavar="PORT", default_text="0 (off)")] = Field(
        0, description="Prometheus `/metrics` port")
    metrics_host: Annotated[str, Flag(env="METRICS_HOST", metavar="HOST")] = Field(
        "127.0.0.1", description="address the metrics endpoint binds")
    consumer_name: Annotated[str | None, Flag(
        env="CONSUMER_NAME", metavar="NAME", default_text="`<stage>-<host>-<pid>-<random>`")] = Field(
        None, description="stable name: a restarted worker then resumes its own pending entries at once")
    max_in_flight: Annotated[int, Flag(env="MAX_IN_FLIGHT", metavar="N")] = Field(
        16, ge=1, description="messages handled at once (teacher); twice `--read-count`, so the next batch waits for "
                              "the teacher while the last one's outputs are written")
    read_count: Annotated[int, Flag(env="READ_COUNT", metavar="N")] = Field(
        8, ge=1, description="entries per read (teacher, feeder)")
    shards: Annotated[str | None, Flag(env="SHARDS", metavar="LIST", default_text="all")] = Field(
        None, description="which shards of a sharded input stream to read, e.g. `0,2` (teacher, feeder)")


class TeacherSettings(FlagSettings):
    """``distillq worker teacher``: the teacher backend and how groups are scored."""

    pool: Annotated[str, Flag(env="TEACHER_POOL", metavar="NAME")] = Field(
        "default", description="the teacher pool this worker serves: it scores the groups whose "
                               "`group_overrides.teacher` names it; the pool `default` scores those that name none "
                               "([teacher-pools.md](teacher-pools.md))")

    backend: Annotated[TeacherBackendName, Flag(env="TEACHER_BACKEND")] = Field(
        "vllm", description="`vllm`, `sglang` (HTTP servers), `vllm-engine` (vLLM's engine in a child process of the "
                            "worker, top-k as arrays; [below](#the-vllm-engine-backend)), `hf` (local transformers "
                            "model), `synthetic` (deterministic fake payloads, for tests and benchmarks)")
    model: Annotated[str | None, Flag(
        env="TEACHER_MODEL", metavar="NAME_OR_PATH", default_text="none, a vLLM server's first model")] = Field(
        None, description="served model name (vllm, sglang) or local path (hf, vllm-engine)")
    url: Annotated[list[str] | None, Flag(env="TEACHER_URLS")] = Field(
        None, description="teacher server URL, `http://host:port` or the OpenAI-style `http://host:port/v1` (both "
                          "work); repeat for several servers")
    tokenizer: Annotated[str | None, Flag(env="TEACHER_TOKENIZER", metavar="PATH", default_text="`--model`")] = Field(
        None, description="teacher tokenizer, for the vocabulary check")
    student_tokenizer: Annotated[str | None, Flag(
        env="STUDENT_TOKENIZER", metavar="PATH", default_text="no check")] = Field(
        None, description="compare vocabularies with this tokenizer at startup; refuse to start if they differ "
                          "(unless `--cross-tokenizer`)")
    cross_tokenizer: bool = Field(
        False, description="score a student of another tokenizer (needs `--student-tokenizer` and a teacher "
                           "`--tokenizer` or local `--model`): each sequence's text is re-tokenized for the teacher "
                           "and its answer mapped back to student positions, per aligned chunk "
                           "([cross-tokenizer.md](cross-tokenizer.md)); with `--rows trained` only")
    top_k: Annotated[int, Flag(env="TOP_K", metavar="K")] = Field(
        20, ge=1, description="default k; a group's `group_overrides.teacher_top_k` replaces it (values below 1 "
                              "become 1)")
    max_batch_tokens: Annotated[int, Flag(env="TEACHER_MAX_BATCH_TOKENS", metavar="N")] = Field(
        16384, ge=1, description="padded tokens per teacher call (the hf backend packs sequences: real tokens per "
                                 "forward)")
    concurrency: Annotated[int, Flag(env="TEACHER_CONCURRENCY", metavar="N")] = Field(
        8, ge=1, description="teacher calls in flight per worker, over all its batches in flight (the hf backend "
                             "makes one call at a time)")
    timeout: Annotated[float, Flag(env="TEACHER_TIMEOUT_S", metavar="SECONDS")] = Field(
        120, description="seconds per request (HTTP backends)")
    retries: Annotated[int, Flag(metavar="N")] = Field(
        3, ge=0, description="extra attempts for a retryable teacher failure; then the group's payload is dropped")
    k_over_cap: Annotated[Literal["clamp", "drop"], Flag(env="K_OVER_CAP")] = Field(
        "clamp", description="a group asking for more than the server's logprob cap: `clamp` to the cap, or `drop` "
                             "its payload")
    fp16_topk: bool = Field(
        False, description="carry top-k logprobs as float16 ([wire-format.md](wire-format.md#float16-top-k-logprobs))")
    rows: Annotated[Literal["trained", "all"], Flag(env="TEACHER_ROWS")] = Field(
        "trained", description="teacher rows scored and shipped: `trained` (rows `r` with `loss_mask[r+1] == 1`; "
                               "prompt, earlier-turn and tool-output rows are neither computed nor sent) or `all` "
                               "([wire-format.md](wire-format.md#teacherpayload))")
    hf_chunk_positions: Annotated[int | None, Flag(
        env="TEACHER_HF_CHUNK_POSITIONS", metavar="N|auto", parse=auto_or_positive, cli_default="auto")] = Field(
        None, ge=1, description="hf backend: rows per lm_head/log-softmax chunk (memory about 2 x N x vocabulary x 4 "
                                "bytes; 311 MB for 256 rows at 151,936); `auto`: a quarter of the free GPU memory, or "
                                "a tenth of the available host memory up to 1 GiB, between 16 and 8192 rows")
    hf_min_shared_prefix: Annotated[int, Flag(env="TEACHER_HF_MIN_SHARED_PREFIX", metavar="N")] = Field(
        32, ge=0, description="hf backend: shortest common prefix of a call's sequences run once (the group's prompt, "
                              "then each continuation from its KV cache); 0 turns sharing off")
    device: Annotated[str, Flag(env="TEACHER_DEVICE", metavar="DEVICE")] = Field(
        "cpu", description="hf backend: torch device (`cpu`, `cuda`, `cuda:1`, ...)")
    dtype: Annotated[Dtype, Flag(env="TEACHER_DTYPE")] = Field(
        "auto", description="hf and vllm-engine: weight dtype, `float32`, `bfloat16`, `float16`; the log-softmax is "
                            "float32 whatever it is. `auto`: bfloat16 on a GPU and float32 on CPU (hf), the model's "
                            "own (vllm-engine)")
    vllm_python: Annotated[str | None, Flag(
        env="VLLM_PYTHON", metavar="PATH", default_text="the worker's own Python")] = Field(
        None, description="vllm-engine: a Python with vLLM installed, run for the engine process (vLLM pins its own "
                          "torch, so it may be another environment's, e.g. `.venv-vllm/bin/python`)")
    vllm_max_logprobs: Annotated[int, Flag(env="VLLM_MAX_LOGPROBS", metavar="K")] = Field(
        256, ge=1, description="vllm-engine: the engine's logprob cap (vLLM's `max_logprobs`); `--top-k` above it "
                               "refuses to start")
    tensor_parallel_size: Annotated[int, Flag(env="VLLM_TENSOR_PARALLEL_SIZE", metavar="N")] = Field(
        1, ge=1, description="vllm-engine: GPUs per engine (vLLM's `tensor_parallel_size`)")
    gpu_memory_utilization: Annotated[float, Flag(env="VLLM_GPU_MEMORY_UTILIZATION", metavar="FRACTION")] = Field(
        0.9, description="vllm-engine: fraction of GPU memory vLLM may take (of node memory on vLLM's CPU build)")
    vllm_max_model_len: Annotated[int | None, Flag(
        env="VLLM_MAX_MODEL_LEN", metavar="N", default_text="the model's")] = Field(
        None, ge=1, description="vllm-engine: longest sequence")
    vllm_max_num_batched_tokens: Annotated[int | None, Flag(
        env="VLLM_MAX_NUM_BATCHED_TOKENS", metavar="N", default_text="vLLM's")] = Field(
        None, ge=1, description="vllm-engine: tokens per engine step; prompt logprobs materialise `[tokens, "
                                "vocabulary]` float32 logits per step (5 GB at 8,192 x 151,936), so this bounds that "
                                "memory")
    vllm_enforce_eager: bool = Field(False, description="vllm-engine: no CUDA graphs or compilation (faster start)")
    on_drop: Annotated[Literal["pass", "dlq"], Flag(env="ON_DROP")] = Field(
        "pass", description="groups whose payload was dropped: `pass` them on without payload, or `dlq`: dead-letter "
                            "them")
    synthetic_latency: Annotated[float, Flag(metavar="SECONDS")] = Field(
        0.0, description="synthetic backend: seconds per call")

    @field_validator("hf_chunk_positions", mode="before")
    @classmethod
    def _auto(cls, v: Any) -> Any:
        return None if v == "auto" else v


def scoring_config(s: TeacherSettings) -> ScoringConfig:
    """How the scoring stage calls the teacher: one call at a time for ``hf``, ``--concurrency`` otherwise."""
    from pipeline.stages.scoring import ScoringConfig

    return ScoringConfig(default_k=s.top_k, max_batch_tokens=s.max_batch_tokens, retries=s.retries,
                         k_over_cap=s.k_over_cap, fp16_topk=s.fp16_topk, rows=s.rows,
                         concurrent_calls=1 if s.backend == "hf" else s.concurrency)


def http_teacher_config(s: TeacherSettings, urls: tuple[str, ...]) -> HTTPTeacherConfig:
    """The ``vllm``/``sglang`` backends' servers and limits; unreachable servers are retried for 60 s at start."""
    from pipeline.teacher.vllm_http import HTTPTeacherConfig

    return HTTPTeacherConfig(urls=urls, model=s.model, k=s.top_k, max_concurrency=s.concurrency, timeout_s=s.timeout,
                             startup_timeout_s=60.0)


def vllm_engine_config(s: TeacherSettings, model: str, python: str) -> VLLMEngineConfig:
    """The ``vllm-engine`` backend's engine, run by ``python``."""
    from pipeline.teacher.vllm_engine import VLLMEngineConfig

    return VLLMEngineConfig(
        model=model, python=python, k=s.top_k, max_logprobs=s.vllm_max_logprobs,
        tensor_parallel_size=s.tensor_parallel_size, gpu_memory_utilization=s.gpu_memory_utilization, dtype=s.dtype,
        max_model_len=s.vllm_max_model_len, max_num_batched_tokens=s.vllm_max_num_batched_tokens,
        enforce_eager=s.vllm_enforce_eager)


class FeederSettings(FlagSettings):
    """``distillq worker feeder``: how scored groups become batches."""

    max_batch_tokens: Annotated[int, Flag(env="MAX_BATCH_TOKENS", metavar="N")] = Field(
        65536, description="token budget per batch")
    max_batch_groups: Annotated[int | None, Flag(metavar="N", default_text="no limit")] = Field(
        None, description="groups per batch at most")
    token_count: Literal["sum", "padded"] = Field(
        "sum", description="how a batch's tokens count: `sum` of lengths, or `padded` (sequences x longest)")
    max_staleness: Annotated[int, Flag(env="MAX_STALENESS", metavar="N")] = Field(
        4, description="drop groups more than this many policy versions old (-1: never); stamped on each batch, and "
                       "the learner client checks the same bound again at delivery "
                       "([learner.md](learner.md#versions-staleness-and-acknowledgements))")
    missing_distill: Annotated[Literal["keep", "drop"], Flag(env="MISSING_DISTILL")] = Field(
        "keep", description="groups without teacher payload: `keep` (task reward only) or `drop`")
    reward_weight: Annotated[float, Flag(metavar="W")] = Field(
        0.0, description="weight of the group-normalised task reward in the advantages")
    length_bucketing: bool = Field(False, description="fill batches with groups of similar length")
    max_wait: Annotated[float, Flag(metavar="SECONDS")] = Field(
        2.0, description="flush a partial batch when its oldest group has waited this many seconds")
    kl_coef: Annotated[float, Flag(metavar="C")] = Field(
        1.0, description="constant KL coefficient (the initial one if adaptive)")
    kl_target: Annotated[float | None, Flag(metavar="KL", default_text="none, constant `--kl-coef`")] = Field(
        None, description="adaptive KL controller with this target, Ziegler et al.")
    kl_horizon: Annotated[float, Flag(metavar="N")] = Field(10_000, description="adaptive KL controller horizon")
    max_buffered_groups: Annotated[int, Flag(metavar="N")] = Field(
        1024, description="scored groups held while waiting for a batch")
    max_ready_batches: Annotated[int, Flag(env="MAX_READY_BATCHES", metavar="N")] = Field(
        8, ge=0, description="wait (groups pending, leases renewed) while `batches` holds this many batches the "
                             "learner has not acknowledged, so batches are not built far ahead of the learner; `0`: "
                             "only `DISTILLQ_MAX_BACKLOG`")


def batching_config(s: FeederSettings) -> BatchingConfig:
    """How scored groups become batches; ``--max-staleness -1`` is no bound."""
    from pipeline.stages.batching import BatchingConfig

    return BatchingConfig(
        max_batch_tokens=s.max_batch_tokens, max_batch_groups=s.max_batch_groups, token_count=s.token_count,
        max_staleness=None if s.max_staleness < 0 else s.max_staleness, missing_distill=s.missing_distill,
        reward_weight=s.reward_weight, length_bucketing=s.length_bucketing, max_wait_s=s.max_wait)


def _rewards() -> str:
    names = [f"`{n}`" for n in reward_names()]
    return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else "".join(names)


class RolloutSettings(FlagSettings):
    """``distillq worker rollout``: the student, sampling, rewards and weight sync."""

    backend: Annotated[Literal["vllm", "hf"], Flag(env="STUDENT_BACKEND")] = Field(
        "vllm", description="`vllm` (a student server) or `hf` (a local transformers model)")
    model: Annotated[str | None, Flag(env="STUDENT_MODEL", metavar="NAME_OR_PATH")] = Field(
        None, description="required: served model name (vllm) or local path (hf)")
    url: Annotated[list[str] | None, Flag(env="STUDENT_URL", metavar="URL[,URL...]")] = Field(
        None, description="student server URL, with or without `/v1` (required for vllm); repeat, or separate by "
                          "commas, for several servers (round-robin, each synced on its own)")
    tokenizer: Annotated[str | None, Flag(env="STUDENT_TOKENIZER", metavar="PATH", default_text="`--model`")] = Field(
        None, description="student tokenizer")
    group_size: Annotated[int, Flag(env="GROUP_SIZE", metavar="N")] = Field(8, description="completions per prompt")
    max_tokens: Annotated[int, Flag(env="MAX_TOKENS", metavar="N")] = Field(
        256, description="tokens per completion at most")
    temperature: Annotated[float, Flag(metavar="T")] = Field(1.0, description="sampling temperature")
    top_p: Annotated[float, Flag(metavar="P")] = Field(1.0, description="nucleus sampling")
    reward: Annotated[str, Flag(env="REWARD", metavar="NAME")] = Field(
        "none", description=f"reward function: {_rewards()}")
    max_jobs: Annotated[int, Flag(env="MAX_JOBS", metavar="N")] = Field(4, description="prompts sampled at once")
    max_ahead: Annotated[int | None, Flag(env="MAX_AHEAD", metavar="N", default_text="no bound")] = Field(
        None, ge=0, description="sample at most N policy versions ahead of the learner: a prompt starts only while "
                                "the namespace's started groups < (learner version + 1 + N) x `--groups-per-step`, "
                                "so no group trains more than N versions stale "
                                "([learner.md](learner.md#keeping-sampling-paced-to-the-learner))")
    groups_per_step: Annotated[int, Flag(env="GROUPS_PER_STEP", metavar="G")] = Field(
        8, ge=1, description="with `--max-ahead`: groups one learner step trains (the feeder's `--max-batch-groups`)")
    teacher: Annotated[str | None, Flag(env="ROLLOUT_TEACHER", metavar="NAME", default_text="`default`")] = Field(
        None, description="the teacher pool of the groups of prompts that name none (a prompt's `teacher`, or its "
                          "`group_overrides.teacher`, wins) ([teacher-pools.md](teacher-pools.md))")
    weights_dir: Annotated[str | None, Flag(env="WEIGHTS_DIR", metavar="DIR|URL")] = Field(
        None, description="keep the student on the newest version a learner publishes there (`publish_weights`): hf "
                          "reloads it in process; vllm reloads every `--url` server in place and tags each group with "
                          "the version the server reports ([learner.md](learner.md#policy-version-and-weight-sync)). "
                          "A `redis://` or `s3://` URL is mirrored into a local folder the servers must see "
                          "([weights.md](weights.md))")
    weights_cache: Annotated[str | None, Flag(env="WEIGHTS_CACHE", metavar="DIR", default_text="a temporary dir")] = (
        Field(None, description="with a `--weights-dir` URL: the local folder the newest version is rebuilt in, "
                                "which the `--url` servers load from (so they must see it)"))
    weights_sync: Annotated[WeightsSync, Flag(env="WEIGHTS_SYNC")] = Field(
        "vllm", description="how servers load a version: `vllm` (`reload_weights`; the server needs "
                            "`VLLM_SERVER_DEV_MODE=1`), `vllm-lora` (an adapter per version; `--enable-lora`, "
                            "`VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`) or `sglang` (`/update_weights_from_disk`)")
    device: Annotated[str, Flag(env="DEVICE", metavar="DEVICE")] = Field(
        "cpu", description="hf backend: torch device of the student model, e.g. `cuda` (tokens are sampled on the CPU "
                           "from the device's logits)")
    dtype: Annotated[Dtype, Flag(env="STUDENT_DTYPE")] = Field(
        "auto", description="hf backend: the student's weight dtype, `float32`, `bfloat16`, `float16`; logits are "
                            "float32 whatever it is. `auto`: bfloat16 on a GPU, float32 on CPU")


def gen_params(s: RolloutSettings) -> GenParams:
    """What each completion is sampled with."""
    from pipeline.rollout.students.base import GenParams

    return GenParams(max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p)


def student_urls(s: RolloutSettings) -> list[str]:
    """``--url`` (repeated, or comma-separated) as one list of URLs."""
    return [u.strip() for arg in s.url or () for u in arg.split(",") if u.strip()]


#: The settings of each stage, in ``distillq worker STAGE``'s order.
STAGE_SETTINGS: dict[str, type[FlagSettings]] = {
    "teacher": TeacherSettings, "feeder": FeederSettings, "rollout": RolloutSettings,
}
