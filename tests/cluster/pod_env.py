"""A pipeline pod's environment as Kubernetes would build it from the compiled platform spec and
the manifests in `infra/k8s/env`: the pod harness's (`tests/cluster/pod_harness.py`) view of
the cluster.

The compiled spec's second document (the kfp-kubernetes platform spec) names, per executor, the
ConfigMaps and Secrets to load as environment variables (`configMapAsEnv`, `secretAsEnv`) and the
pod fields to expose (`fieldPathAsEnv`). Kubernetes resolves them when it creates the container:
a missing object or key that is not `optional` stops the pod (CreateContainerConfigError). This
module does the same with the objects the manifests define (`manifest_objects`: the ConfigMaps
of the kustomization and its generated Secrets, from the committed `*.example` env files), so a
key the spec names but the manifests lack fails here as on a cluster.

The manifests point at in-cluster services (`http://mlflow.bert.svc.cluster.local:5000`);
`localize` rewrites those URLs to the servers a test started, as a cluster's DNS would resolve
them, and refuses to leave any `*.svc.cluster.local` address unmapped: a pod that would call a
service the test does not provide fails before it starts, not halfway through.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
ENV_DIR = ROOT / "infra" / "k8s" / "env"
LAUNCHER = ROOT / "infra" / "k8s" / "kfp" / "kfp-launcher.yaml"  # the namespace's kfp-launcher
CLUSTER_DOMAIN = ".svc.cluster.local"
# KFP 2.17.0, backend/src/v2/config/env.go: the launcher's ConfigMap and the root without one
LAUNCHER_CONFIG_MAP, MINIO_ROOT = "kfp-launcher", "minio://mlpipeline/v2/artifacts"
# backend/src/v2/config/s3.go: the fields S3ProviderConfig reads (sigs.k8s.io/yaml ignores others)
S3_PROVIDER = {
    "default": {"endpoint", "credentials", "region", "disableSSL", "forcePathStyle", "maxRetries"},
    "credentials": {"fromEnv", "secretRef"},
    "secretRef": {"secretName", "accessKeyKey", "secretKeyKey"},
}

Objects = dict[tuple[str, str], dict[str, str]]  # (kind, name) -> data


class PodConfigError(RuntimeError):
    """What Kubernetes reports as CreateContainerConfigError: the pod cannot be configured."""


def _read_env_file(path: Path) -> dict[str, str]:
    pairs = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            pairs[key.strip()] = value.strip()
    return pairs


def manifest_objects(env_dir: Path = ENV_DIR, launcher: Path = LAUNCHER) -> Objects:
    """The ConfigMaps and Secrets the kustomization in `env_dir` creates: its ConfigMap
    resources, and its `secretGenerator` Secrets read from the committed `<file>.example`
    (example values: the real env files are git-ignored, and a test must not read them); and
    the namespace's `kfp-launcher` ConfigMap (`launcher`), which the launcher reads."""
    kust = yaml.safe_load((env_dir / "kustomization.yaml").read_text())
    objects: Objects = {}
    doc = yaml.safe_load(launcher.read_text())
    objects[("ConfigMap", doc["metadata"]["name"])] = dict(doc["data"])
    for resource in kust.get("resources", []):
        for doc in yaml.safe_load_all((env_dir / resource).read_text()):
            if doc and doc["kind"] in ("ConfigMap", "Secret"):
                objects[(doc["kind"], doc["metadata"]["name"])] = dict(doc.get("data") or {})
    for gen in kust.get("secretGenerator", []):
        data: dict[str, str] = {}
        for env_file in gen.get("envs", []):
            data |= _read_env_file(env_dir / f"{env_file}.example")
        objects[("Secret", gen["name"])] = data
    return objects


def localize(objects: Objects, services: Mapping[str, str]) -> Objects:
    """`objects` with each in-cluster service URL (a key of `services`, e.g.
    `http://mlflow.bert.svc.cluster.local:5000`) replaced by its value (a loopback URL, or ""
    for "no such service here"); its host:port alone, as the launcher's `providers` name an
    endpoint, by the local one's. Fails when a value still names a cluster service."""
    out: Objects = {}
    for ref, data in objects.items():
        out[ref] = {}
        for key, value in data.items():
            for cluster_url, local_url in services.items():
                if value.startswith(cluster_url):
                    value = local_url + value[len(cluster_url) :] if local_url else ""
                elif _host(cluster_url) and _host(cluster_url) in value:
                    value = value.replace(_host(cluster_url), _host(local_url) if local_url else "")
            if CLUSTER_DOMAIN in value:
                raise PodConfigError(
                    f"{ref[0]} {ref[1]}: {key}={value} is a cluster service the harness was "
                    "not given: map it in `services`"
                )
            out[ref][key] = value
    return out


def _from_object(
    objects: Objects, kind: str, entry: Mapping, name_key: str, key_key: str, executor: str
) -> dict[str, str]:
    """The variables of one `configMapAsEnv` / `secretAsEnv` entry, as the kubelet sets them."""
    name, optional = entry[name_key], entry.get("optional", False)
    data = objects.get((kind, name))
    if data is None:
        if optional:
            return {}
        raise PodConfigError(f"{executor}: {kind.lower()} {name!r} not found")
    env = {}
    for pair in entry["keyToEnv"]:
        key = pair[key_key]
        if key in data:
            env[pair["envVar"]] = data[key]
        elif not optional:
            raise PodConfigError(f"{executor}: couldn't find key {key} in {kind} {name}")
    return env


def pod_env(
    platform: Mapping, executor: str, objects: Objects, labels: Mapping[str, str]
) -> dict[str, str]:
    """The environment the platform spec gives `executor`'s pods: its ConfigMaps and Secrets
    (from `objects`) and its downward-API fields (only pod labels, from `labels`)."""
    executors = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    spec = executors.get(executor, {})
    env: dict[str, str] = {}
    for entry in spec.get("configMapAsEnv", []):
        env |= _from_object(objects, "ConfigMap", entry, "configMapName", "configMapKey", executor)
    for entry in spec.get("secretAsEnv", []):
        env |= _from_object(objects, "Secret", entry, "secretName", "secretKey", executor)
    for entry in spec.get("fieldPathAsEnv", []):
        path = entry["fieldPath"]
        prefix, suffix = "metadata.labels['", "']"
        if not (path.startswith(prefix) and path.endswith(suffix)):
            raise PodConfigError(f"{executor}: field path {path} is not a pod label")
        env[entry["name"]] = labels.get(path[len(prefix) : -len(suffix)], "")
    run_as_root(spec.get("securityContext", {}), executor)
    unknown = set(spec) - {
        "configMapAsEnv",
        "secretAsEnv",
        "fieldPathAsEnv",
        "securityContext",
        *PLACEMENT,
    }
    if unknown:  # volumes, affinity, ...: not modelled, so not silently ignored either
        raise PodConfigError(f"{executor}: platform settings the harness does not model: {unknown}")
    return env


def run_as_root(context: Mapping, executor: str) -> None:
    """The kubelet's refusal of a container that asks for runAsNonRoot with runAsUser 0
    (kubernetes pkg/kubelet/kuberuntime/security_context_others.go verifyRunAsNonRoot: "container's
    runAsUser breaks non-root policy"); the harness's processes run as whoever runs the tests, so
    the user itself is not modelled, only this refusal."""
    if context.get("runAsNonRoot") and str(context.get("runAsUser", "")) == "0":
        raise PodConfigError(f"{executor}: container's runAsUser breaks non-root policy")


PLACEMENT = ("nodeSelector", "tolerations")
TOLERATION_FIELDS = {"key", "operator", "value", "effect", "tolerationSeconds"}


@dataclass
class Placement:
    """Where a pod may be scheduled: its node selector and tolerations, resolved."""

    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)


def _json_parameter(spec: Mapping, parameters: Mapping[str, Any], executor: str) -> Any:
    """A `...Json` field's value: a pipeline parameter of the task's DAG (the driver's
    resolveInputParameter, componentInputParameter) or a constant."""
    if "componentInputParameter" in spec:
        name = spec["componentInputParameter"]
        if name not in parameters:
            raise PodConfigError(f"{executor}: no parameter {name} in the task's DAG")
        return parameters[name]
    if "runtimeValue" in spec:
        return spec["runtimeValue"]["constant"]
    raise PodConfigError(f"{executor}: {spec} is not modelled")


def placement(platform: Mapping, executor: str, parameters: Mapping[str, Any]) -> Placement:
    """The node selector and tolerations the platform spec gives `executor`'s pods, as the
    driver builds them (backend/src/v2/driver/k8s.go, initPodSpecPatch): `nodeSelector.labels`
    or `nodeSelectorJson` (a dict of strings), `tolerations` with fields or `tolerationJson` (one
    toleration or a list). A value Kubernetes would refuse fails here, before the pod."""
    executors = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    spec = executors.get(executor, {})
    out = Placement()
    selector = spec.get("nodeSelector", {})
    if "nodeSelectorJson" in selector:
        labels = _json_parameter(selector["nodeSelectorJson"], parameters, executor)
    else:
        labels = selector.get("labels", {})
    if not isinstance(labels, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in labels.items()
    ):
        raise PodConfigError(f"{executor}: node selector {labels!r} is not a map of strings")
    out.node_selector = dict(labels)
    for entry in spec.get("tolerations", []):
        if "tolerationJson" in entry:
            value = _json_parameter(entry["tolerationJson"], parameters, executor)
            found = value if isinstance(value, list) else [value]
        else:
            found = [entry]
        for toleration in (t for t in found if t != {}):  # k8s.go skips an empty one
            if not isinstance(toleration, Mapping) or set(toleration) - TOLERATION_FIELDS:
                raise PodConfigError(f"{executor}: {toleration!r} is not a toleration")
            out.tolerations.append(dict(toleration))
    return out


def _host(url: str) -> str:
    return url.split("://", 1)[-1].split("/", 1)[0]


def pipeline_root(objects: Objects, run_root: str = "") -> str:
    """Where a run's artifacts go, as KFP 2.17.0's root DAG driver decides it
    (backend/src/v2/driver/root_dag.go): the run's own pipeline root, else the namespace's
    `kfp-launcher` defaultPipelineRoot, else KFP's MinIO (config/env.go). The compiled spec's
    defaultPipelineRoot is not read by the backend."""
    launcher = objects.get(("ConfigMap", LAUNCHER_CONFIG_MAP)) or {}
    return run_root or launcher.get("defaultPipelineRoot") or MINIO_ROOT


def s3_session(objects: Objects, root: str) -> dict[str, str]:
    """The launcher's S3 client for an `s3://` root (config/s3.go, ProvideSessionInfo, without
    overrides, which the manifests do not use): the `providers` default's endpoint (http:// when
    disableSSL), region and the keys of the Secret its secretRef names; no providers, or a root
    with a query string: the environment's (fromEnv), which a pod of ours does not give the
    launcher, so that is an error here. Fields s3.go does not read are refused: its YAML parser
    would drop a misspelt one in silence."""
    launcher = objects.get(("ConfigMap", LAUNCHER_CONFIG_MAP)) or {}
    providers = yaml.safe_load(launcher.get("providers") or "{}") or {}
    default = (providers.get("s3") or {}).get("default")
    if not root.startswith("s3://") or "?" in root or default is None:
        raise PodConfigError(f"pipeline root {root}: no s3 provider in {LAUNCHER_CONFIG_MAP}")
    credentials = default.get("credentials") or {}
    ref = credentials.get("secretRef") or {}
    for part, fields in (("default", default), ("credentials", credentials), ("secretRef", ref)):
        unknown = set(fields) - S3_PROVIDER[part]
        if unknown:
            raise PodConfigError(f"{LAUNCHER_CONFIG_MAP} providers.s3 {part}: {sorted(unknown)}")
    if credentials.get("fromEnv") or not ref:
        raise PodConfigError(f"{LAUNCHER_CONFIG_MAP}: credentials fromEnv, not a Secret")
    secret = objects.get(("Secret", ref["secretName"]))
    if secret is None or not {ref["accessKeyKey"], ref["secretKeyKey"]} <= set(secret):
        raise PodConfigError(f"{LAUNCHER_CONFIG_MAP}: no Secret {ref['secretName']} with its keys")
    scheme = "http" if default.get("disableSSL") else "https"
    return {
        "endpoint_url": f"{scheme}://{default['endpoint']}" if default.get("endpoint") else "",
        "region_name": default.get("region", ""),
        "aws_access_key_id": secret[ref["accessKeyKey"]],
        "aws_secret_access_key": secret[ref["secretKeyKey"]],
    }
