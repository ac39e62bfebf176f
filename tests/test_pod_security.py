"""Every pod we own meets Kubernetes' Pod Security Standards "restricted" profile, and checkov
(the field's infrastructure scanner) passes over infra/.

"restricted" is checked here by the rules of its definition (kubernetes.io/docs/concepts/
security/pod-security-standards, v1.32: the version namespace.yaml enforces), on every pod the
manifests make: the Deployments, StatefulSet and Job, the RayCluster's head and worker groups
(a CRD, which checkov's Kubernetes checks skip) and the KServe ServingRuntime's container. Each
rule also runs on a copy with the property removed and must fail there. The KFP task pods are
checked in the compiled pipeline: the user fields we set, the rest KFP 2.17's compiler adds.

What only a cluster shows: that each image starts with its root filesystem read-only (the
emptyDirs cover what we know each writes), and that the pods KServe and Knative inject
(storage initializer, queue-proxy) meet "restricted" with their charts' settings.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.test_infra import ENV_FILES, K8S, render

ROOT = Path(__file__).resolve().parents[1]
RESTRICTED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}
CHECKOV = Path(sys.prefix) / "checkov" / "bin" / "checkov"  # the Makefile's own venv for it


def restricted_problems(pod: dict, containers: list[dict] | None = None) -> list[str]:
    """What in `pod` (a PodSpec; or a ServingRuntime's spec with `containers`) breaks the
    "restricted" standard, plus our own rule that the root filesystem is read-only."""
    problems = []
    pod_ctx = pod.get("securityContext") or {}
    if pod.get("hostNetwork") or pod.get("hostPID") or pod.get("hostIPC"):
        problems.append("host namespaces")
    for volume in pod.get("volumes", []):
        kind = set(volume) - {"name"}
        if not kind <= RESTRICTED_VOLUMES:
            problems.append(f"volume {volume['name']}: {sorted(kind)}")
    everyone = (
        containers
        if containers is not None
        else (pod.get("containers", []) + pod.get("initContainers", []))
    )
    for c in everyone:
        ctx, name = c.get("securityContext") or {}, c["name"]
        if ctx.get("privileged"):
            problems.append(f"{name}: privileged")
        if ctx.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{name}: allowPrivilegeEscalation is not false")
        caps = ctx.get("capabilities") or {}
        if "ALL" not in caps.get("drop", []):
            problems.append(f"{name}: capabilities do not drop ALL")
        if set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            problems.append(f"{name}: adds capabilities {caps['add']}")
        if not ctx.get("runAsNonRoot", pod_ctx.get("runAsNonRoot")):
            problems.append(f"{name}: runAsNonRoot is not true")
        if ctx.get("runAsUser", pod_ctx.get("runAsUser")) == 0:
            problems.append(f"{name}: runAsUser 0")
        seccomp = (ctx.get("seccompProfile") or pod_ctx.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            problems.append(f"{name}: seccompProfile {seccomp}")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            problems.append(f"{name}: hostPort")
        if ctx.get("readOnlyRootFilesystem") is not True:
            problems.append(f"{name}: root filesystem writable")
    return problems


def pods(docs: list[dict]) -> dict[str, tuple[dict, list[dict] | None]]:
    """Every pod the objects make, by kind/name[/group]."""
    out = {}
    for doc in docs:
        kind, name, spec = doc["kind"], doc["metadata"]["name"], doc.get("spec", {})
        if kind == "RayCluster":
            out[f"{kind}/{name}/head"] = (spec["headGroupSpec"]["template"]["spec"], None)
            for group in spec["workerGroupSpecs"]:
                out[f"{kind}/{name}/{group['groupName']}"] = (group["template"]["spec"], None)
        elif kind == "ServingRuntime":
            out[f"{kind}/{name}"] = (spec, spec["containers"])
        elif "template" in spec:
            out[f"{kind}/{name}"] = (spec["template"]["spec"], None)
    return out


@pytest.fixture(scope="module")
def manifests(tmp_path_factory) -> list[dict]:
    dest = tmp_path_factory.mktemp("k8s") / "k8s"
    shutil.copytree(K8S, dest)
    for env_file, example in ENV_FILES.items():
        shutil.copy(dest / example, dest / env_file)
    return render(dest) + render(dest / "kserve")


def test_every_pod_we_own_is_restricted(manifests):
    found = pods(manifests)
    assert {
        "Deployment/mlflow",
        "Deployment/minio",
        "Job/minio-create-bucket",
        "StatefulSet/postgres",
        "RayCluster/bert-ray/head",
        "RayCluster/bert-ray/gpu",
        "RayCluster/bert-ray/cpu",
        "ServingRuntime/bert-serve-gpu",
        "ServingRuntime/bert-serve",
    } <= set(found)
    for where, (pod, containers) in found.items():
        assert restricted_problems(pod, containers) == [], where
        # each read-only container has a writable /tmp
        for c in containers or pod["containers"]:
            assert "/tmp" in {m["mountPath"] for m in c.get("volumeMounts", [])}, where
    # KubeRay's autoscaler sidecar on the head gets the same container rules
    (ray,) = [d for d in manifests if d["kind"] == "RayCluster"]
    sidecar = {"name": "autoscaler", **ray["spec"]["autoscalerOptions"]}
    head = ray["spec"]["headGroupSpec"]["template"]["spec"]
    assert restricted_problems(head, [sidecar]) == []


@pytest.mark.parametrize(
    "path, want",
    [
        (("securityContext", "runAsNonRoot"), "runAsNonRoot is not true"),
        (("securityContext", "seccompProfile"), "seccompProfile None"),
        (
            ("containers", 0, "securityContext", "allowPrivilegeEscalation"),
            "allowPrivilegeEscalation is not false",
        ),
        (("containers", 0, "securityContext", "capabilities"), "do not drop ALL"),
        (("containers", 0, "securityContext", "readOnlyRootFilesystem"), "writable"),
    ],
)
def test_the_rules_fail_where_a_field_is_removed(manifests, path, want):
    pod, _ = pods(manifests)["Deployment/mlflow"]
    broken = copy.deepcopy(pod)
    target = broken
    for key in path[:-1]:
        target = target[key]
    del target[path[-1]]
    assert any(want in p for p in restricted_problems(broken)), path
    hostile = copy.deepcopy(pod) | {"volumes": [{"name": "h", "hostPath": {"path": "/"}}]}
    assert restricted_problems(hostile) == ["volume h: ['hostPath']"]


def test_the_namespace_enforces_restricted_at_a_pinned_version(manifests):
    (namespace,) = [d for d in manifests if d["kind"] == "Namespace"]
    labels = namespace["metadata"]["labels"]
    for mode in ("enforce", "warn", "audit"):
        assert labels[f"pod-security.kubernetes.io/{mode}"] == "restricted"
        assert labels[f"pod-security.kubernetes.io/{mode}-version"] == "v1.32"


def test_kfp_task_pods_run_as_the_images_user():
    """The compiled pipeline gives every task the images' user (kfp-kubernetes
    set_security_context); KFP 2.17's compiler adds allowPrivilegeEscalation false, capabilities
    drop ALL and seccomp RuntimeDefault to every executor container and pod (backend/src/v2/
    compiler/argocompiler/security_context.go applySecurityContextToExecutorTemplate), so the
    task pods are "restricted" in a namespace that enforces it."""
    spec = list(yaml.safe_load_all((ROOT / "pipelines" / "bert_pipeline.yaml").read_text()))
    executors = spec[1]["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    assert set(executors) == set(spec[0]["deploymentSpec"]["executors"])
    dockerfile = (ROOT / "infra" / "docker" / "Dockerfile").read_text()
    uid = re.search(r"useradd --create-home --uid (\d+)", dockerfile)
    for name, executor in executors.items():
        assert executor["securityContext"] == {
            "runAsUser": uid.group(1),
            "runAsGroup": uid.group(1),
            "runAsNonRoot": True,
        }, name
        assert uid.group(1) != "0"


@pytest.mark.slow
def test_checkov_passes_over_infra_and_fails_a_pod_without_its_security_context(tmp_path):
    """checkov over a copy of infra/ with one more file: the MLflow Deployment with its security
    contexts removed. Only that file fails, and on the checks the removal breaks; the real files
    pass. Each skipped check in infra/checkov.yaml has its reason on its own line."""
    assert CHECKOV.is_file(), f"{CHECKOV} missing: `make venv` installs checkov there"
    config = yaml.safe_load((ROOT / "infra" / "checkov.yaml").read_text())
    lines = (ROOT / "infra" / "checkov.yaml").read_text().splitlines()
    for check in config["skip-check"]:
        (line,) = [x for x in lines if re.match(rf"\s*- {check}\s+#", x)]
        assert len(line.split("#", 1)[1].strip()) > 30, line  # a reason, not a label
    shutil.copytree(ROOT / "infra", tmp_path / "infra")
    docs = list(yaml.safe_load_all((ROOT / "infra/k8s/mlflow.yaml").read_text()))
    deployment = docs[0]
    deployment["metadata"]["name"] = "mlflow-unhardened"
    del deployment["spec"]["template"]["spec"]["securityContext"]
    del deployment["spec"]["template"]["spec"]["containers"][0]["securityContext"]
    (tmp_path / "infra/k8s/unhardened.yaml").write_text(yaml.safe_dump(deployment))
    out = subprocess.run(
        [CHECKOV, "--config-file", "infra/checkov.yaml", "-o", "json"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    reports = json.loads(out.stdout)
    failed = [f for r in reports for f in r["results"]["failed_checks"]]
    assert out.returncode == 1 and failed, out.stderr[-2000:]
    assert {f["file_path"] for f in failed} == {"/infra/k8s/unhardened.yaml"}
    broken = {f["check_id"] for f in failed}
    assert {"CKV_K8S_20", "CKV_K8S_22", "CKV_K8S_23", "CKV_K8S_28"} <= broken, broken
    assert {r["check_type"] for r in reports} == {"kubernetes", "dockerfile"}
