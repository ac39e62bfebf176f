"""Offline checks of infra/: Kubernetes manifests (kustomize + schemas), Dockerfiles, secrets.

No cluster and no Docker engine here, so the manifests are rendered with `kubectl kustomize`
(kustomize is built into kubectl; a small reader of the kustomization stands in without it),
every built-in resource is validated against the Kubernetes JSON schemas bundled by
kubernetes-validate (strict: unknown fields fail), and the KubeRay RayCluster, a CRD those
schemas lack, is checked for the fields the operator requires.
"""

from __future__ import annotations

import base64
import io
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from dockerfile_parse import DockerfileParser

ROOT = Path(__file__).resolve().parents[1]
K8S = ROOT / "infra" / "k8s"
DOCKER = ROOT / "infra" / "docker"
K8S_VERSION = "1.32"
ENV_FILES = {"env/s3.env": "env/s3.env.example", "postgres.env": "postgres.env.example"}


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
        docs.append({"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "metadata": meta})
        docs[-1]["data"] = encoded
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


@pytest.fixture(scope="module")
def rendered(k8s_copy) -> list[dict]:
    return render(k8s_copy)


def _by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def test_kustomization_renders_the_services(rendered):
    names = {(d["kind"], d["metadata"]["name"]) for d in rendered}
    assert {
        ("Namespace", "bert"), ("RayCluster", "bert-ray"), ("Deployment", "mlflow"),
        ("Deployment", "minio"), ("StatefulSet", "postgres"), ("Job", "minio-create-bucket"),
        ("Secret", "bert-s3"), ("Secret", "bert-postgres"), ("ConfigMap", "bert-pipeline-env"),
    } <= names  # fmt: skip
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
    head_ports = {p["containerPort"] for c in _containers_of(ray["spec"]["headGroupSpec"])
                  for p in c.get("ports", [])}  # fmt: skip
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
    from pipelines import cluster, pod_env

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
                    if ref in src:
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
    (mlflow,) = [d for d in _by_kind(rendered, "Deployment") if d["metadata"]["name"] == "mlflow"]
    (c,) = _containers(mlflow)
    args = " ".join(c["args"])
    assert "--backend-store-uri=postgresql://$(POSTGRES_USER):$(POSTGRES_PASSWORD)@postgres" in args
    assert "--artifacts-destination=s3://bert/mlflow" in args
    env_names = {e["name"] for e in c.get("env", [])}
    assert "MLFLOW_S3_ENDPOINT_URL" in env_names


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
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
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
    """(constraints file, extras) of the package install in `make venv`."""
    text = (ROOT / "Makefile").read_text()
    (line,) = [ln for ln in text.splitlines() if "pip install" in ln and "-e" in ln.split()]
    args = shlex.split(line.replace("$(PY)", "python"))
    constraints = args[args.index("-c") + 1]
    (target,) = [a for a in args if a.startswith(".[")]
    return constraints, set(target[2:-1].split(","))


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


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cuda", "Dockerfile.mlflow"])
def test_dockerfile_parses_on_python_311_slim(name):
    parser = _parse(DOCKER / name)
    assert parser.baseimage == "python:3.11-slim"
    instructions = [i["instruction"] for i in parser.structure if i["instruction"] != "COMMENT"]
    assert instructions[0] == "FROM" and "RUN" in instructions and "USER" in instructions
    assert instructions[-1] == "CMD"


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cuda"])
def test_image_installs_the_package_like_make_venv(name):
    constraints, extras = _makefile_install()
    installs = _pip_installs(DOCKER / name)
    (pkg,) = [args for args in installs if any(a.startswith(".[") for a in args)]
    assert pkg[pkg.index("-c") + 1] == constraints
    (target,) = [a for a in pkg if a.startswith(".[")]
    assert set(target[2:-1].split(",")) == extras - {"dev"}, "same extras as make venv, less dev"
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
    pkgs = [a for a in args[args.index("-c") + 2 :] if not a.startswith("-")]
    for pkg in pkgs:
        if "==" not in pkg:
            _pin(pkg)  # unpinned here means pinned by the lock
    assert {"mlflow", "boto3"} <= {p.split("==")[0] for p in pkgs}
    assert any(p.startswith("psycopg2-binary==") for p in pkgs)


def test_dockerignore_keeps_what_the_build_needs():
    ignored = [
        ln for ln in (ROOT / ".dockerignore").read_text().splitlines()
        if ln.strip() and not ln.startswith("#")
    ]  # fmt: skip
    for needed in ["pyproject.toml", "constraints-cpu.txt", "bert_core", "README.md"]:
        assert needed not in ignored
    assert {".venv", ".git", "runs", "mlflow.db"} <= set(ignored)
