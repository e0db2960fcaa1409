"""Settings classes as flags (``pipeline.flags``, ``workers/settings.py``, ``serve atropos``/``serve student``'s
settings): precedence flag > variable > default, bad values from either are usage errors naming the flag, the
configs built from a settings object carry its fields, the help is the description without its markdown, and
docs/cli.md's generated tables match the classes."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, get_args

import pytest

from pipeline.cli import docs
from pipeline.config import RedisSettings, StreamSettings
from pipeline.flags import FlagSettings, add_flags, doc_table, flag_of, from_args, help_text, plain
from pipeline.rollout.sync_engines import ENGINES
from pipeline.serve.atropos.settings import AtroposSettings, serve_config
from pipeline.serve.student.settings import StudentServeSettings, session_store, student_serve_config
from pipeline.serve.student.settings import WeightsSync as StudentWeightsSync
from workers import feeder, rollout, teacher
from workers.common import stream_settings
from workers.settings import (
    STAGE_SETTINGS,
    RolloutSettings,
    TeacherSettings,
    WeightsSync,
    WorkerSettings,
    gen_params,
    http_teacher_config,
    scoring_config,
    student_urls,
    vllm_engine_config,
)

ALL: tuple[type[FlagSettings], ...] = (WorkerSettings, *STAGE_SETTINGS.values(), AtroposSettings,
                                       StudentServeSettings)
ADD = {"teacher": teacher.add_arguments, "feeder": feeder.add_arguments, "rollout": rollout.add_arguments}


def parse(stage: str, *argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(exit_on_error=False)
    ADD[stage](p)
    return p.parse_args(list(argv))


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for cls in ALL:
        for field in cls.model_fields.values():
            if flag_of(field).env:
                monkeypatch.delenv(f"DISTILLQ_{flag_of(field).env}", raising=False)


def test_flag_beats_variable_beats_default(monkeypatch: pytest.MonkeyPatch) -> None:
    assert from_args(TeacherSettings, parse("teacher")).top_k == 20
    monkeypatch.setenv("DISTILLQ_TOP_K", "7")
    assert from_args(TeacherSettings, parse("teacher")).top_k == 7
    assert from_args(TeacherSettings, parse("teacher", "--top-k", "9")).top_k == 9
    assert TeacherSettings().top_k == 7  # without a command line: the variable, else the default
    monkeypatch.setenv("DISTILLQ_TOP_K", "")  # empty: unset
    assert from_args(TeacherSettings, parse("teacher")).top_k == 20


def test_repeatable_flags_replace_their_comma_separated_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DISTILLQ_TEACHER_URLS", "http://a:1,http://b:2")
    assert from_args(TeacherSettings, parse("teacher")).url == ["http://a:1", "http://b:2"]
    assert from_args(TeacherSettings, parse("teacher", "--url", "http://c:3")).url == ["http://c:3"]
    assert TeacherSettings().url == ["http://a:1", "http://b:2"]
    assert from_args(RolloutSettings, parse("rollout")).url is None


def test_auto_flag_overrides_a_number_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DISTILLQ_TEACHER_HF_CHUNK_POSITIONS", "64")
    assert from_args(TeacherSettings, parse("teacher")).hf_chunk_positions == 64
    assert from_args(TeacherSettings, parse("teacher", "--hf-chunk-positions", "auto")).hf_chunk_positions is None
    monkeypatch.setenv("DISTILLQ_TEACHER_HF_CHUNK_POSITIONS", "auto")
    assert TeacherSettings().hf_chunk_positions is None


@pytest.mark.parametrize(("stage", "env", "argv", "said"), [
    ("teacher", {}, ["--top-k", "0"], "argument --top-k: 0 is below 1"),
    ("teacher", {"DISTILLQ_TOP_K": "x"}, [], "argument --top-k: invalid integer 'x'"),
    ("teacher", {"DISTILLQ_TEACHER_ROWS": "bogus"}, [], "argument --rows: invalid choice 'bogus'"),
    ("feeder", {}, ["--token-count", "max"], "argument --token-count: invalid choice 'max'"),
    ("feeder", {"DISTILLQ_MAX_READY_BATCHES": "-1"}, [], "argument --max-ready-batches: -1 is below 0"),
    ("rollout", {"DISTILLQ_WEIGHTS_SYNC": "rsync"}, [], "argument --weights-sync: invalid choice 'rsync'"),
    ("rollout", {"DISTILLQ_READ_COUNT": "0"}, [], "argument --read-count: 0 is below 1"),
])
def test_bad_values_name_the_flag(
    stage: str, env: dict[str, str], argv: list[str], said: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(argparse.ArgumentError) as e:
        parse(stage, *argv)
    assert str(e.value).startswith(said), str(e.value)


def test_configs_built_from_flags_carry_them() -> None:
    s = from_args(TeacherSettings, parse("teacher", "--top-k", "5", "--retries", "1", "--rows", "all", "--fp16-topk",
                                         "--concurrency", "3", "--timeout", "7", "--model", "m", "--k-over-cap", "drop",
                                         "--max-batch-tokens", "99"))
    scoring = scoring_config(s)
    assert (scoring.default_k, scoring.retries, scoring.rows, scoring.fp16_topk, scoring.concurrent_calls,
            scoring.k_over_cap, scoring.max_batch_tokens) == (5, 1, "all", True, 3, "drop", 99)
    assert scoring_config(s.model_copy(update={"backend": "hf"})).concurrent_calls == 1  # hf: one call at a time
    http = http_teacher_config(s, ("http://x:1",))
    assert (http.k, http.max_concurrency, http.timeout_s, http.model, http.startup_timeout_s) == (5, 3, 7.0, "m", 60.0)
    e = from_args(TeacherSettings, parse("teacher", "--top-k", "4", "--vllm-max-logprobs", "8", "--dtype", "float16",
                                         "--tensor-parallel-size", "2", "--gpu-memory-utilization", "0.5",
                                         "--vllm-max-model-len", "64", "--vllm-max-num-batched-tokens", "128",
                                         "--vllm-enforce-eager"))
    engine = vllm_engine_config(e, "m", "py")
    assert (engine.model, engine.python, engine.k, engine.max_logprobs, engine.dtype, engine.tensor_parallel_size,
            engine.gpu_memory_utilization, engine.max_model_len, engine.max_num_batched_tokens,
            engine.enforce_eager) == ("m", "py", 4, 8, "float16", 2, 0.5, 64, 128, True)
    args = parse("feeder", "--max-wait", "0.5", "--max-staleness", "-1", "--token-count", "padded",
                 "--max-batch-groups", "3", "--max-batch-tokens", "77", "--missing-distill", "drop",
                 "--reward-weight", "0.25", "--length-bucketing")
    batching = feeder.config(args)
    assert (batching.max_wait_s, batching.max_staleness, batching.token_count, batching.max_batch_groups,
            batching.max_batch_tokens, batching.missing_distill, batching.reward_weight, batching.length_bucketing) == (
        0.5, None, "padded", 3, 77, "drop", 0.25, True)
    assert feeder.config(parse("feeder", "--max-staleness", "2")).max_staleness == 2
    r = from_args(RolloutSettings, parse("rollout", "--max-tokens", "9", "--top-p", "0.5", "--temperature", "0.7",
                                         "--url", "http://a:1, http://b:2", "--url", "http://c:3"))
    gen = gen_params(r)
    assert (gen.max_tokens, gen.top_p, gen.temperature) == (9, 0.5, 0.7)
    assert student_urls(r) == ["http://a:1", "http://b:2", "http://c:3"]
    streams = stream_settings(parse("feeder", "--read-count", "3", "--max-in-flight", "5"))
    assert (streams.read_count, streams.max_in_flight) == (3, 5)


def test_atropos_config_carries_its_flags() -> None:
    serve = argparse.ArgumentParser(exit_on_error=False)
    add_flags(serve, AtroposSettings)
    a = from_args(AtroposSettings, serve.parse_args(["--gzip-level", "9", "--lease-s", "3", "--batch-wait-s", "0.5",
                                                     "--consumer-name", "c", "--body-timeout-s", "4"]))
    redis, streams = RedisSettings(namespace="ns"), StreamSettings()
    cfg = serve_config(a, redis, streams)
    assert (cfg.gzip_level, cfg.lease_s, cfg.batch_wait_s, cfg.consumer_name, cfg.body_timeout_s) == (
        9, 3.0, 0.5, "c", 4.0)
    assert cfg.redis is redis and cfg.streams is streams
    with pytest.raises(argparse.ArgumentError, match="argument --gzip-level: 10 is above 9"):
        serve.parse_args(["--gzip-level", "10"])


def test_help_is_the_description_without_its_markdown() -> None:
    assert plain("carry `x` as float16 ([wire-format.md](wire-format.md#f))") == "carry x as float16"
    assert plain("`a` (child, arrays; [below](#b)), `c`") == "a (child, arrays), c"
    assert plain("see [learner.md](learner.md#x) for more") == "see learner.md for more"
    for cls in ALL:
        for name, field in cls.model_fields.items():
            text = help_text(field, flag_of(field))
            assert text.startswith(plain(field.description or "").replace("%", "%%")), (cls.__name__, name)
            assert "`" not in text and "](" not in text, (cls.__name__, name, text)


def test_choices_match_the_code_that_takes_them() -> None:
    assert get_args(WeightsSync) == ENGINES
    assert get_args(StudentWeightsSync) == ENGINES


def student(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(exit_on_error=False)
    add_flags(p, StudentServeSettings)
    return p.parse_args(list(argv))


def test_serve_student_flags_keep_their_names_and_defaults() -> None:
    assert vars(student()) == {
        "backend": "hf", "model": None, "url": None, "vllm_model": None, "tokenizer": None,
        "served_model_name": None, "max_model_len": None, "default_max_tokens": 256, "host": "127.0.0.1",
        "port": 8100, "port_file": None, "group_size": 1, "env_id": 0, "policy_version": 0, "weights_dir": None,
        "weights_cache": None,
        "weights_sync": "vllm", "session_ttl": 1800.0, "max_sessions": 4096, "max_body_bytes": 33554432,
        "body_timeout_s": 30.0, "metrics_port": 0, "api_key_var": None}
    args = student("--served-model-name", "a", "--served-model-name", "b", "--port-file", "p", "--port", "0")
    assert (args.served_model_name, args.port_file, args.port) == (["a", "b"], Path("p"), 0)
    with pytest.raises(argparse.ArgumentError, match="argument --backend: invalid choice 'tgi'"):
        student("--backend", "tgi")
    s = from_args(StudentServeSettings, student("--group-size", "0", "--port", "70000", "--session-ttl", "nan"))
    assert (s.group_size, s.port) == (0, 70000)  # ranges are serve_student.usage_error's, with its messages


def test_serve_student_weights_sync_comes_from_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DISTILLQ_WEIGHTS_SYNC", "sglang")
    assert student().weights_sync == "sglang" and student("--weights-sync", "vllm-lora").weights_sync == "vllm-lora"
    assert StudentServeSettings().weights_sync == "sglang"
    monkeypatch.setenv("DISTILLQ_METRICS_PORT", "9100")  # a worker's variable does not reach the server
    assert student().metrics_port == 0
    monkeypatch.setenv("DISTILLQ_WEIGHTS_SYNC", "rsync")
    with pytest.raises(argparse.ArgumentError, match="argument --weights-sync: invalid choice 'rsync'"):
        student()


def test_serve_student_configs_carry_its_flags() -> None:
    s = from_args(StudentServeSettings, student("--default-max-tokens", "9", "--group-size", "4", "--env-id", "2",
                                                "--policy-version", "3", "--session-ttl", "60", "--max-sessions", "5"))
    cfg = student_serve_config(s, ("m",), 64, 512)
    assert (cfg.served_names, cfg.default_max_tokens, cfg.group_size, cfg.env_id, cfg.policy_version,
            cfg.max_model_len, cfg.vocab_size) == (("m",), 9, 4, 2, 3, 64, 512)
    sessions = session_store(s)
    assert (sessions.ttl_s, sessions.max_sessions) == (60.0, 5)


def test_docs_tables_are_generated_from_the_settings_classes() -> None:
    text = docs.DOC.read_text(encoding="utf-8")
    assert docs.render(text) == text, "docs/cli.md is out of date: run python -m pipeline.cli.docs"
    for cls in docs.TABLES.values():
        for name in cls.model_fields:
            assert f"| `--{name.replace('_', '-')}` |" in text


def test_docs_check_fails_on_a_hand_edited_table(tmp_path: Any) -> None:
    edited = docs.DOC.read_text(encoding="utf-8").replace("| `--top-k` | `DISTILLQ_TOP_K` | 20 |",
                                                          "| `--top-k` | `DISTILLQ_TOP_K` | 30 |")
    path = tmp_path / "cli.md"
    path.write_text(edited, encoding="utf-8")
    assert docs.main(["--check", "--file", str(path)]) == 1
    assert docs.main(["--file", str(path)]) == 0 and docs.main(["--check", "--file", str(path)]) == 0
    assert "| `--top-k` | `DISTILLQ_TOP_K` | 20 |" in path.read_text(encoding="utf-8")


def test_example_learner_flags_build_its_config(capsys: pytest.CaptureFixture[str]) -> None:
    from pipeline.demo.learner import LearnerSettings, learner_config

    p = argparse.ArgumentParser()
    add_flags(p, LearnerSettings)
    with pytest.raises(SystemExit):
        p.parse_args(["--steps", "3"])
    assert "the following arguments are required: --student, --weights-dir" in capsys.readouterr().err
    s = from_args(LearnerSettings, p.parse_args(["--student", "s", "--weights-dir", "w", "--steps", "3",
                                                 "--lr-decay", "linear", "--batch-timeout", "5", "--eval-kl-prompts",
                                                 "2", "--checkpoint-dir", "c"]))
    cfg = learner_config(s, "redis://h:1/0", "ns")
    assert (cfg.student, cfg.weights_dir, cfg.steps, cfg.lr_decay, cfg.batch_timeout_s, cfg.eval_kl_prompts,
            cfg.checkpoint_dir, cfg.redis_url, cfg.namespace, cfg.lr) == (
        "s", "w", 3, "linear", 5.0, 2, "c", "redis://h:1/0", "ns", 2e-3)
    assert "| `--student` | | required | the student model folder it starts from |" in doc_table(LearnerSettings)
