"""ops/k8s: every overlay renders (kubectl kustomize), every object validates against the Kubernetes schemas
(kubernetes-validate, strict), every KEDA ScaledObject carries what KEDA's docs require of its scaler, workers get
more time to stop than they drain, and weights travel through redis:// or s3://, never a volume."""

from __future__ import annotations

import base64
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]  # PyYAML (kubernetes-validate depends on it)

from pipeline.config import StreamSettings

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "ops" / "k8s"
OVERLAYS = ("default", "redis-cluster", "cpu")
COMPONENTS = ("serve-atropos", "serve-student", "servicemonitor")
#: The Kubernetes version the objects are validated against (kubectl 1.32's).
K8S_VERSION = "1.32.0"
#: Kinds with no schema in kubernetes-validate (CRDs): checked by the tests below instead.
CRD_KINDS = {"ScaledObject", "PodMonitor"}

#: What KEDA's scaler docs (keda.sh/docs/2.16/scalers/redis-streams, .../redis-cluster-streams) require of a trigger:
#: `stream` always; one of the address forms; `consumerGroup` for pendingEntriesCount and lagCount (without it the
#: scaler falls back to XLEN); `activationLagCount` "required if lagCount is provided".
KEDA_ADDRESS_FORMS = {
    "redis-streams": ({"address"}, {"addressFromEnv"}, {"host", "port"}, {"hostFromEnv", "portFromEnv"}),
    "redis-cluster-streams": ({"addresses"}, {"addressesFromEnv"}, {"hosts", "ports"},
                              {"hostsFromEnv", "portsFromEnv"}),
}
KEDA_REQUIRED = {"redis-streams": {"stream"}, "redis-cluster-streams": {"stream"}}
KEDA_METRICS = ("lagCount", "pendingEntriesCount", "streamLength")
KEDA_NEEDS_GROUP = {"lagCount", "pendingEntriesCount"}
KEDA_NEEDS_WITH = {"lagCount": "activationLagCount"}
#: Integer-valued metadata (KEDA parses them with strconv.ParseInt).
KEDA_INTS = ("lagCount", "activationLagCount", "pendingEntriesCount", "streamLength", "databaseIndex")


def kubectl() -> str:
    found = shutil.which("kubectl")
    if found is None:
        pytest.skip("kubectl not found: the manifests are rendered with `kubectl kustomize` (kubectl >= 1.27)")
    return found


def render(path: Path) -> list[dict[str, Any]]:
    res = subprocess.run([kubectl(), "kustomize", str(path)], capture_output=True, text=True, timeout=60, check=False)
    assert res.returncode == 0, res.stderr
    return [d for d in yaml.safe_load_all(res.stdout) if d]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {o: render(K8S / "overlays" / o) for o in OVERLAYS}


def with_components(tmp_path: Path) -> list[dict[str, Any]]:
    """The default overlay with every optional component."""
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(K8S / "overlays" / "default", tmp_path)],  # kustomize takes no absolute root
        "components": [os.path.relpath(K8S / "components" / c, tmp_path) for c in COMPONENTS]}))
    return render(tmp_path)


def pod_specs(docs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    return [(f"{d['kind']}/{d['metadata']['name']}", d["spec"]["template"]["spec"]) for d in docs
            if d["kind"] in ("Deployment", "StatefulSet", "Job")]


def workers(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """name -> pod spec, for every pod running `distillq worker STAGE`."""
    out = {}
    for name, spec in pod_specs(docs):
        for c in spec["containers"]:
            line = " ".join(c.get("command", []) + c.get("args", []))
            if "distillq worker " in line:
                out[name] = spec
    return out


def env_of(docs: list[dict[str, Any]], container: dict[str, Any]) -> dict[str, str]:
    """The literal env a container gets from its ConfigMaps/Secrets (envFrom) and `env` values."""
    maps = {(d["kind"], d["metadata"]["name"]): d for d in docs if d["kind"] in ("ConfigMap", "Secret")}
    out: dict[str, str] = {}
    for src in container.get("envFrom", []):
        for kind, ref in (("ConfigMap", "configMapRef"), ("Secret", "secretRef")):
            if ref in src and (kind, src[ref]["name"]) in maps:
                m = maps[(kind, src[ref]["name"])]
                if kind == "Secret":
                    out.update({k: base64.b64decode(v).decode() for k, v in m.get("data", {}).items()})
                else:
                    out.update(m.get("data", {}))
    out.update({e["name"]: e["value"] for e in container.get("env", []) if "value" in e})
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_overlay_renders_and_validates_strictly(overlay: str, rendered: dict[str, list[dict[str, Any]]]) -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate (the test extra)")
    docs = rendered[overlay]
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "StatefulSet", "Job", "PodDisruptionBudget", "ScaledObject", "ConfigMap"} <= kinds
    for d in docs:
        if d["kind"] in CRD_KINDS:
            continue
        kv.validate(d, K8S_VERSION, strict=True)  # raises ValidationError naming the field


@pytest.mark.timeout(120)
def test_the_optional_components_render_and_validate(tmp_path: Path) -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate (the test extra)")
    docs = with_components(tmp_path)
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert {("Deployment", "serve-atropos"), ("Deployment", "serve-student"), ("PodMonitor", "distillq")} <= names
    for d in docs:
        if d["kind"] not in CRD_KINDS:
            kv.validate(d, K8S_VERSION, strict=True)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_scaledobject_has_what_keda_requires(overlay: str, rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered[overlay]
    targets = {d["metadata"]["name"]: d for d in docs if d["kind"] in ("Deployment", "StatefulSet")}
    scaled = [d for d in docs if d["kind"] == "ScaledObject"]
    assert {s["spec"]["scaleTargetRef"]["name"] for s in scaled} == {
        "teacher-default", "teacher-math", "rollout-worker"}
    expected_type = "redis-cluster-streams" if overlay == "redis-cluster" else "redis-streams"
    for s in scaled:
        spec = s["spec"]
        assert s["apiVersion"] == "keda.sh/v1alpha1"
        target = targets[spec["scaleTargetRef"]["name"]]  # the target exists
        assert target["kind"] == "Deployment"
        assert 0 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
        containers = [c["name"] for c in target["spec"]["template"]["spec"]["containers"]]
        assert spec["scaleTargetRef"]["envSourceContainerName"] in containers
        # a pod at zero must be woken by any group waiting (a pool without a worker never scores it)
        assert spec["cooldownPeriod"] >= 60
        for t in spec["triggers"]:
            meta = t["metadata"]
            assert t["type"] == expected_type
            assert KEDA_REQUIRED[t["type"]] <= meta.keys(), meta
            forms = [f for f in KEDA_ADDRESS_FORMS[t["type"]] if f <= meta.keys()]
            assert len(forms) == 1, f"{s['metadata']['name']}: exactly one address form of {t['type']}: {meta}"
            metrics = [m for m in KEDA_METRICS if m in meta]
            assert len(metrics) == 1, meta
            if metrics[0] in KEDA_NEEDS_GROUP:
                assert meta.get("consumerGroup"), meta
            need = KEDA_NEEDS_WITH.get(metrics[0])
            if need:
                assert need in meta, f"{need} is required with {metrics[0]} (KEDA docs)"
            for k in KEDA_INTS:
                if k in meta:
                    assert isinstance(meta[k], str) and int(meta[k]) >= 0, (k, meta[k])
            if metrics[0] == "lagCount" and spec["minReplicaCount"] == 0:
                assert meta["activationLagCount"] == "0", "a pool at zero must wake for one group"
        lag = [t for t in spec["triggers"] if "lagCount" in t["metadata"]]
        pending = [t for t in spec["triggers"] if "pendingEntriesCount" in t["metadata"]]
        # one lag and one pending trigger per stream key (per shard)
        assert sorted(t["metadata"]["stream"] for t in lag) == sorted(t["metadata"]["stream"] for t in pending)
        assert len({t["metadata"]["stream"] for t in lag}) == len(lag)
        # the env KEDA reads the address from is set on the scale target's container
        container = next(c for c in target["spec"]["template"]["spec"]["containers"]
                         if c["name"] == spec["scaleTargetRef"]["envSourceContainerName"])
        env = env_of(docs, container)
        for t in spec["triggers"]:
            for k, v in t["metadata"].items():
                if k.endswith("FromEnv"):
                    assert v in env, f"{s['metadata']['name']}: {k}: {v} is not in the target's env"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_workers_get_more_time_to_stop_than_they_drain(overlay: str, rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered[overlay]
    found = workers(docs)
    assert {"Deployment/teacher-default", "Deployment/teacher-math", "Deployment/rollout-worker",
            "Deployment/feeder"} <= found.keys()
    for name, spec in found.items():
        worker = next(c for c in spec["containers"] if "worker" in " ".join(c.get("command", []) + c.get("args", [])))
        env = env_of(docs, worker)
        drain = float(env.get("DISTILLQ_SHUTDOWN_GRACE_S", StreamSettings().shutdown_grace_s))
        # the drain, plus a heartbeat interval to write the last acks and exit
        assert spec["terminationGracePeriodSeconds"] >= drain + StreamSettings().heartbeat_interval_s, name
        stage = next(w for w in ("teacher", "rollout", "feeder")
                     if f"distillq worker {w}" in " ".join(worker.get("command", []) + worker.get("args", [])))
        assert worker["livenessProbe"]["exec"]["command"] == ["distillq", "worker", stage, "--check"], name
        assert worker["startupProbe"]["exec"]["command"] == ["distillq", "worker", stage, "--check"], name
        assert worker["livenessProbe"]["timeoutSeconds"] >= 5
    pdbs = {d["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"] for d in docs
            if d["kind"] == "PodDisruptionBudget"}
    assert {"teacher", "rollout-worker", "feeder", "learner"} <= pdbs


@pytest.mark.timeout(60)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gpus_are_requested_where_models_run(overlay: str, rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered[overlay]
    gpus = {}
    for name, spec in pod_specs(docs):
        gpus[name] = sum(int(c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0))
                         for c in spec.get("initContainers", []) + spec["containers"])
        for c in spec["containers"]:
            assert "requests" in c.get("resources", {}), f"{name}/{c['name']} has no resource requests"
    heavy = ("Deployment/teacher-default", "Deployment/teacher-math", "Deployment/rollout-worker",
             "StatefulSet/learner")
    if overlay == "cpu":
        assert not any(gpus.values()), gpus
    else:
        assert all(gpus[h] >= 1 for h in heavy), gpus
    for d in docs:
        containers = d["spec"]["template"]["spec"]["containers"] if d["kind"] == "Deployment" else []
        if any(c["name"] == "worker" for c in containers):
            ann = d["spec"]["template"]["metadata"].get("annotations", {})
            assert ann.get("prometheus.io/scrape") == "true" and ann.get("prometheus.io/port") == "9100", d["metadata"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_weights_travel_through_a_store_never_a_volume(overlay: str, rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered[overlay]
    seen = 0
    for name, spec in pod_specs(docs):
        for c in spec.get("initContainers", []) + spec["containers"]:
            words = shlex.split(" ".join(c.get("command", [])[2:] if c.get("command", [])[:2] == ["sh", "-c"]
                                         else c.get("command", []) + c.get("args", [])))
            env = env_of(docs, c)
            for flag in ("--weights-dir",):
                if flag in words:
                    value = words[words.index(flag) + 1].replace("$WEIGHTS_LOCATION", env.get("WEIGHTS_LOCATION", ""))
                    assert value.startswith(("redis://", "rediss://", "s3://")), f"{name}: {flag} {value}"
                    seen += 1
        for v in spec.get("volumes", []):
            assert set(v) & {"emptyDir", "configMap"}, f"{name}: volume {v} (weights go through the store)"
    assert seen >= 2  # the rollout workers read it, the learner publishes to it
    claims = {d["metadata"]["name"]: [t["metadata"]["name"] for t in d["spec"].get("volumeClaimTemplates", [])]
              for d in docs if d["kind"] == "StatefulSet"}
    assert claims.get("learner") == ["checkpoint"]  # its own restart state, mounted by nobody else
    assert not any(d["kind"] == "PersistentVolumeClaim" for d in docs)


@pytest.mark.timeout(120)
def test_the_docs_commands_run() -> None:
    """Every bash block of docs/kubernetes.md runs, as written, from the repository root."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "docs" / "kubernetes.md").read_text(), re.S)
    assert len(blocks) >= 2
    kubectl()
    for block in blocks:
        res = subprocess.run(["bash", "-euo", "pipefail", "-c", block.replace("python ", f"{sys.executable} ")],
                             cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
        assert res.returncode == 0, f"{block}\n{res.stderr}"
        if "kubectl kustomize" in block:
            assert res.stdout.count("kind: ScaledObject") == 3 * block.count("kubectl kustomize")
        if "Keys(" in block:  # the keys it prints are those the triggers name
            watched = {t["metadata"]["stream"] for d in render(K8S / "overlays" / "default")
                       if d["kind"] == "ScaledObject" and d["metadata"]["name"].startswith("teacher-")
                       for t in d["spec"]["triggers"]}
            assert set(re.findall(r"'(\{[^']+\})'", res.stdout)) == watched
