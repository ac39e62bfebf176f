"""`bert deploy --task TASK`: a registered model's alias (`champion`) as a KServe InferenceService.

The service is written from the registry, never by hand: the version the alias names, its
artifacts' location in the bucket as the `storageUri` (KServe's storage initializer downloads
them to /mnt/models, where the `bert-serve` runtime's `bert serve` reads the MLflow model:
infra/k8s/kserve/servingruntime.yaml), a service account whose credentials read that bucket
(`--service-account`, read-only by the cluster's policy: docs/cluster.md), resources and GPUs,
autoscaling between `--min-replicas` (0: scale to zero, KServe's Knative mode) and
`--max-replicas`, and the registered model, version and alias as labels, so `kubectl get isvc
-L bert.model-version` says what answers.

A new champion replacing a running one is a canary: when the service exists and serves other
artifacts, the new manifest sends `--canary-percent` of the traffic to the new version, and the
rest stays on the last ready one (KServe keeps it: `canaryTrafficPercent`, Knative mode
only). `bert promote TASK --full-traffic` moves all traffic to the latest once it looks right
(`full_traffic`: it removes the split); re-deploying the same version changes nothing, a canary
in progress included (a pipeline re-run never ends one by accident).

The cluster is reached with the Kubernetes Python client, not `kubectl` (the project image has
none): the kubeconfig on a laptop (`KUBECONFIG`, ~/.kube/config), the pod's service account in a
Kubeflow step (RBAC: infra/k8s/kserve). The service is written by server-side apply (PATCH,
`application/apply-patch+yaml`, field manager `bert-deploy`): it creates or updates in one
request and owns exactly the fields written here, so a field this command stops writing (the
canary's percent) is removed, and KServe's own fields are left alone. `--dry-run` prints the
manifest and touches no cluster (it shows a first deploy). What only a cluster can show: KServe
accepting it, the storage initializer reading the bucket, the traffic split.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import yaml

from bert_core.errors import BadValue, BertError, redacted
from bert_core.options import add_options, config_from_args, option
from bert_core.serve.champion import CHAMPION, by_alias
from bert_core.serve.registry import DEFAULT_NAME, model_name
from bert_core.tracking import tracking_uri

API_VERSION = "serving.kserve.io/v1beta1"
MODEL_FORMAT = "bert-mlflow"  # the format the bert-serve runtimes declare
# KServe 0.20's name for the mode that has canaries and scale to zero ("Serverless" is its
# deprecated alias: pkg/constants/constants.go, ParseDeploymentMode); the install sets the same
DEPLOYMENT_MODE = "Knative"
# what the API server admits, checked before the registry or the cluster is asked: a quantity
# (k8s.io/apimachinery pkg/api/resource/quantity.go's grammar, not negative), a namespace (a
# DNS-1123 label), an InferenceService's name (KServe 0.20's IsvcNameFmt,
# pkg/apis/serving/v1beta1/inference_service_validation.go)
QUANTITY = re.compile(r"^(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+|[numkMGTPE]|[KMGTPE]i)?$")
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
ISVC_NAME = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
RUNTIME, GPU_RUNTIME = "bert-serve", "bert-serve-gpu"  # the CPU and CUDA images
# the InferenceService resource (KServe v0.20.0's CRD: group serving.kserve.io, plural
# inferenceservices), as the API server's path
ISVC_PATH = "/apis/serving.kserve.io/v1beta1/namespaces/{namespace}/inferenceservices/{name}"
FIELD_MANAGER = "bert-deploy"  # the server-side apply manager owning the fields written here
APPLY = "application/apply-patch+yaml"  # server-side apply; JSON is YAML, the client sends JSON
JSON_PATCH = "application/json-patch+json"


@dataclass
class DeployConfig:
    """`bert deploy`'s options."""

    task: str | None = option(
        None,
        f"the task (SST-2, conll2003, ...): its registered model ({DEFAULT_NAME}) is served",
    )
    model: str | None = option(None, "the registered model instead, e.g. bert-sst2")
    alias: str = option(CHAMPION, "the alias whose version is served")
    name: str | None = option(None, "the InferenceService's name (default: the model's)")
    namespace: str = option("bert", "the Kubernetes namespace")
    runtime: str | None = option(
        None,
        "the ServingRuntime (infra/k8s/kserve; default "
        f"{RUNTIME}, {GPU_RUNTIME} with --gpus: the CUDA image)",
    )
    service_account: str = option(
        "bert-serve", "the service account whose credentials read the model's artifacts (read-only)"
    )
    min_replicas: int = option(0, "fewest replicas; 0: scale to zero when idle")
    max_replicas: int = option(3, "most replicas under load")
    cpu: str = option("1", "CPU request")
    cpu_limit: str = option("2", "CPU limit")
    memory: str = option("2Gi", "memory request and limit")
    gpus: int = option(0, "GPUs per replica (nvidia.com/gpu)")
    canary_percent: int = option(10, "traffic to a new version replacing a running one")
    artifacts_destination: str | None = option(
        None,
        "the MLflow server's --artifacts-destination, where its proxied mlflow-artifacts:/ "
        "URIs are in the bucket (default: $BERT_BUCKET/mlflow, as infra/k8s/mlflow.yaml)",
    )
    dry_run: bool = option(False, "print the manifest; touch no cluster")

    def __post_init__(self) -> None:
        if (self.task is None) == (self.model is None):
            raise BadValue("name the model: --task TASK or --model NAME (one of them)")
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
            raise BadValue("--min-replicas and --max-replicas: 0 <= min <= max, max >= 1")
        if not 1 <= self.canary_percent <= 99:
            raise BadValue("--canary-percent must be 1..99")
        if self.gpus < 0:
            raise BadValue("--gpus must be >= 0")
        for flag, value in (
            ("--cpu", self.cpu),
            ("--cpu-limit", self.cpu_limit),
            ("--memory", self.memory),
        ):
            if not QUANTITY.match(value) or not re.search(r"[1-9]", value.split("e")[0]):
                raise BadValue(
                    f"{flag} {value!r}: a Kubernetes quantity above 0, e.g. 500m, 2, 512Mi, 4Gi"
                )
        if not DNS_LABEL.match(self.namespace):
            raise BadValue(
                f"--namespace {self.namespace!r}: a namespace is lower-case letters, "
                "digits and -, at most 63, starting and ending alphanumeric"
            )
        if not ISVC_NAME.match(self.service):
            given = "--name" if self.name else "the registered model"
            raise BadValue(
                f"{given} {self.service!r} is no InferenceService name (lower-case "
                "letters, digits and -, starting with a letter, at most 63): --name"
            )

    @property
    def registered_model(self) -> str:
        return self.model or str(model_name(str(self.task)))

    @property
    def serving_runtime(self) -> str:
        """--runtime, else the runtime of the image that can use the GPUs asked for."""
        return self.runtime or (GPU_RUNTIME if self.gpus else RUNTIME)

    @property
    def service(self) -> str:
        """The InferenceService's name: --name, else the registered model's."""
        return self.name or self.registered_model


def served_version(cfg: DeployConfig) -> tuple[str, str]:
    """(version, storage URI) of the alias: the registered version's artifacts in the bucket."""
    from mlflow import MlflowClient

    uri = tracking_uri()
    client = MlflowClient(uri)
    name = cfg.registered_model
    version = by_alias(client, name, cfg.alias)
    if version is None:
        raise BertError(
            f"{name}@{cfg.alias}: no such registered model or alias at {redacted(uri)} "
            "(bert finetune registers, bert promote moves champion)"
        )
    storage = in_bucket(str(client.get_model_version_download_uri(name, version.version)), cfg)
    if not storage.startswith("s3://"):
        raise BertError(
            f"{name} version {version.version}: its artifacts are at "
            f"{storage}, not in a bucket; KServe reads s3:// (log models to the "
            "cluster's MLflow, whose artifacts are in the bucket)"
        )
    return str(version.version), storage


def in_bucket(uri: str, cfg: DeployConfig) -> str:
    """`uri` as KServe's storage initializer can read it. The cluster's MLflow server proxies
    artifacts (`--artifacts-destination=s3://bert/mlflow`), so the registry answers
    `mlflow-artifacts:/0/models/m-.../artifacts`: that path under the destination is the bucket
    location (mlflow/server/handlers.py joins them the same way). Other URIs are returned as
    they are."""
    if not uri.startswith("mlflow-artifacts:"):
        return uri
    bucket = os.environ.get("BERT_BUCKET")
    root = cfg.artifacts_destination or (f"{bucket.rstrip('/')}/mlflow" if bucket else None)
    if root is None:
        raise BertError(
            f"{uri}: the MLflow server proxies its artifacts; name where they are "
            "with --artifacts-destination (the server's) or BERT_BUCKET"
        )
    return f"{root.rstrip('/')}/{urlsplit(uri).path.lstrip('/')}"


def inference_service(cfg: DeployConfig, version: str, storage: str, running: dict | None) -> dict:
    """The InferenceService (see the module doc); `running`: the service on the cluster now."""
    resources = {
        "requests": {"cpu": cfg.cpu, "memory": cfg.memory},
        "limits": {"cpu": cfg.cpu_limit, "memory": cfg.memory},
    }
    if cfg.gpus:
        resources["limits"]["nvidia.com/gpu"] = str(cfg.gpus)
    predictor = {
        "serviceAccountName": cfg.service_account,
        "minReplicas": cfg.min_replicas,
        "maxReplicas": cfg.max_replicas,
        "model": {
            "modelFormat": {"name": MODEL_FORMAT},
            "runtime": cfg.serving_runtime,
            "protocolVersion": "v2",
            "storageUri": storage,
            "resources": resources,
        },
    }
    now = (running or {}).get("spec", {}).get("predictor", {})
    if running is not None and now.get("model", {}).get("storageUri") != storage:
        predictor["canaryTrafficPercent"] = cfg.canary_percent  # a new version: a canary
    elif "canaryTrafficPercent" in now:  # the same version, its canary in progress: unchanged
        predictor["canaryTrafficPercent"] = now["canaryTrafficPercent"]
    return {
        "apiVersion": API_VERSION,
        "kind": "InferenceService",
        "metadata": {
            "name": cfg.service,
            "namespace": cfg.namespace,
            "labels": {
                "bert.registered-model": cfg.registered_model,
                "bert.model-version": version,
                "bert.model-alias": cfg.alias,
            },
            "annotations": {"serving.kserve.io/deploymentMode": DEPLOYMENT_MODE},
        },
        "spec": {"predictor": predictor},
    }


def cluster() -> Any:
    """A Kubernetes API client: the kubeconfig (`KUBECONFIG` or ~/.kube/config) where there is
    one, else the pod's service account (a Kubeflow step). Its own configuration object: the
    client library's global default is left alone."""
    from kubernetes import client, config

    settings = client.Configuration()
    in_pod = os.environ.get("KUBERNETES_SERVICE_HOST") and not os.environ.get("KUBECONFIG")
    try:
        if in_pod:
            config.load_incluster_config(client_configuration=settings)
        else:
            config.load_kube_config(
                config_file=os.environ.get("KUBECONFIG"), client_configuration=settings
            )
    except (config.ConfigException, OSError) as e:
        raise BertError(
            f"no Kubernetes cluster to deploy to ({e}): set KUBECONFIG, or use --dry-run"
        ) from None
    return client.ApiClient(settings)


def isvc_request(
    api: Any,
    method: str,
    namespace: str,
    name: str,
    body: Any = None,
    content_type: str | None = None,
) -> dict | None:
    """One request on the InferenceService `namespace/name`: its JSON answer; None for a GET
    of one that does not exist; the API server's message as a BertError otherwise."""
    from kubernetes.client.exceptions import ApiException

    headers = {"Accept": "application/json"}
    query = []
    if content_type is not None:
        headers["Content-Type"] = content_type
        query = [("fieldManager", FIELD_MANAGER)]
        query += [("force", "true")] if content_type == APPLY else []
    try:
        return api.call_api(
            ISVC_PATH,
            method,
            {"namespace": namespace, "name": name},
            query,
            headers,
            body=body,
            auth_settings=["BearerToken"],
            response_type="object",
            _return_http_data_only=True,
        )
    except ApiException as e:
        if e.status == 404 and method == "GET":
            return None
        try:
            message = json.loads(e.body or "{}").get("message") or e.reason
        except ValueError:
            message = e.reason
        raise BertError(
            f"{method} inferenceservice {namespace}/{name}: {e.status} {message}"
        ) from None


def full_traffic(api: Any, namespace: str, name: str) -> dict:
    """End a canary: all of the service's traffic to its latest version (`bert promote
    --full-traffic`). The JSON patch tests the percent it read before removing it, so a deploy
    that changed the service in between makes it fail rather than promote what was not seen."""
    running = isvc_request(api, "GET", namespace, name)
    if running is None:
        raise BertError(f"no InferenceService {namespace}/{name}: `bert deploy` it first")
    labels = running.get("metadata", {}).get("labels", {})
    answer = {"inference_service": name, "version": labels.get("bert.model-version")}
    percent = running.get("spec", {}).get("predictor", {}).get("canaryTrafficPercent")
    if percent is None:
        return answer | {"full_traffic": True, "changed": False}
    path = "/spec/predictor/canaryTrafficPercent"
    ops = [{"op": "test", "path": path, "value": percent}, {"op": "remove", "path": path}]
    isvc_request(api, "PATCH", namespace, name, ops, JSON_PATCH)
    return answer | {"full_traffic": True, "changed": True, "canary_percent_before": percent}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bert deploy", description=__doc__.split("\n")[0])
    add_options(p, DeployConfig)
    return p


def main(argv: list[str] | None = None) -> int:
    cfg = config_from_args(
        build_parser().parse_args(sys.argv[1:] if argv is None else argv), DeployConfig
    )
    version, storage = served_version(cfg)
    if cfg.dry_run:
        print(
            yaml.safe_dump(inference_service(cfg, version, storage, None), sort_keys=False), end=""
        )
        return 0
    api = cluster()
    running = isvc_request(api, "GET", cfg.namespace, cfg.service)
    manifest = inference_service(cfg, version, storage, running)
    isvc_request(api, "PATCH", cfg.namespace, cfg.service, manifest, APPLY)
    canary = manifest["spec"]["predictor"].get("canaryTrafficPercent")
    print(
        json.dumps(
            {
                "inference_service": manifest["metadata"]["name"],
                "version": version,
                "storage_uri": storage,
                "canary_percent": canary,
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
