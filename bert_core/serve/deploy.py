"""`bert deploy --model NAME`: a registered model's alias (`champion`) as a KServe InferenceService.

The service is written from the registry, never by hand: the version the alias names, its
artifacts' location in the bucket as the `storageUri` (KServe's storage initializer downloads
them to /mnt/models, where the `bert-serve` runtime's `bert serve` reads the MLflow model:
infra/k8s/kserve/servingruntime.yaml), a service account whose credentials read that bucket
(`--service-account`, read-only by the cluster's policy: docs/cluster.md), resources and GPUs,
autoscaling between `--min-replicas` (0: scale to zero, KServe's Serverless mode) and
`--max-replicas`, and the registered model, version and alias as labels, so `kubectl get isvc
-L bert.model-version` says what answers.

A new champion replacing a running one is a canary: when the service exists and serves other
artifacts, the new manifest sends `--canary-percent` of the traffic to the new version, and the
rest stays on the last ready one (KServe keeps it: `canaryTrafficPercent`, Serverless mode
only). `bert deploy --model NAME --promote` moves all traffic to the latest once it looks right (it
removes the canary split); re-deploying the same version changes nothing.

`--dry-run` prints the manifest and touches no cluster (no `kubectl get` either: it shows a
first deploy). Otherwise `kubectl` applies it (the manifest on stdin; no credential passes
through this command). What only a cluster can show: KServe accepting it, the storage
initializer reading the bucket, the traffic split.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import MISSING, dataclass

import yaml

from bert_core.errors import BertError
from bert_core.options import add_options, config_from_args, option
from bert_core.serve.registry import CHAMPION, by_alias
from bert_core.tracking import tracking_uri

API_VERSION = "serving.kserve.io/v1beta1"
MODEL_FORMAT = "bert-mlflow"  # the format the bert-serve runtime declares


@dataclass
class DeployConfig:
    """`bert deploy`'s options."""

    model: str = option(MISSING, "the registered model, e.g. bert-sst2")
    alias: str = option(CHAMPION, "the alias whose version is served")
    name: str | None = option(None, "the InferenceService's name (default: the model's)")
    namespace: str = option("bert", "the Kubernetes namespace")
    runtime: str = option("bert-serve", "the ServingRuntime (infra/k8s/kserve)")
    service_account: str = option("bert-serve", "the service account whose credentials read "
                                  "the model's artifacts (read-only)")  # fmt: skip
    min_replicas: int = option(0, "fewest replicas; 0: scale to zero when idle")
    max_replicas: int = option(3, "most replicas under load")
    cpu: str = option("1", "CPU request")
    cpu_limit: str = option("2", "CPU limit")
    memory: str = option("2Gi", "memory request and limit")
    gpus: int = option(0, "GPUs per replica (nvidia.com/gpu)")
    canary_percent: int = option(10, "traffic to a new version replacing a running one")
    promote: bool = option(False, "move all traffic to the latest version (ends a canary)")
    dry_run: bool = option(False, "print the manifest; touch no cluster")

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
            raise ValueError("--min-replicas and --max-replicas: 0 <= min <= max, max >= 1")
        if not 1 <= self.canary_percent <= 99:
            raise ValueError("--canary-percent must be 1..99")
        if self.gpus < 0:
            raise ValueError("--gpus must be >= 0")


def served_version(cfg: DeployConfig) -> tuple[str, str]:
    """(version, storage URI) of the alias: the registered version's artifacts in the bucket."""
    from mlflow import MlflowClient

    uri = tracking_uri()
    client = MlflowClient(uri)
    version = by_alias(client, cfg.model, cfg.alias)
    if version is None:
        raise BertError(f"{cfg.model}@{cfg.alias}: no such registered model or alias at {uri} "
                        "(bert finetune registers, bert promote moves champion)")  # fmt: skip
    storage = client.get_model_version_download_uri(cfg.model, version.version)
    if not str(storage).startswith("s3://"):
        raise BertError(f"{cfg.model} version {version.version}: its artifacts are at "
                        f"{storage}, not in a bucket; KServe reads s3:// (log models to the "
                        "cluster's MLflow, whose artifacts are in the bucket)")  # fmt: skip
    return str(version.version), str(storage)


def inference_service(cfg: DeployConfig, version: str, storage: str, running: dict | None) -> dict:
    """The InferenceService (see the module doc); `running`: the service on the cluster now."""
    resources = {"requests": {"cpu": cfg.cpu, "memory": cfg.memory},
                 "limits": {"cpu": cfg.cpu_limit, "memory": cfg.memory}}  # fmt: skip
    if cfg.gpus:
        resources["limits"]["nvidia.com/gpu"] = str(cfg.gpus)
    predictor = {
        "serviceAccountName": cfg.service_account,
        "minReplicas": cfg.min_replicas,
        "maxReplicas": cfg.max_replicas,
        "model": {
            "modelFormat": {"name": MODEL_FORMAT},
            "runtime": cfg.runtime,
            "protocolVersion": "v2",
            "storageUri": storage,
            "resources": resources,
        },
    }
    serving = (running or {}).get("spec", {}).get("predictor", {}).get("model", {})
    if running is not None and serving.get("storageUri") != storage and not cfg.promote:
        predictor["canaryTrafficPercent"] = cfg.canary_percent
    return {
        "apiVersion": API_VERSION,
        "kind": "InferenceService",
        "metadata": {
            "name": cfg.name or cfg.model,
            "namespace": cfg.namespace,
            "labels": {
                "bert.registered-model": cfg.model,
                "bert.model-version": version,
                "bert.model-alias": cfg.alias,
            },  # fmt: skip
            "annotations": {"serving.kserve.io/deploymentMode": "Serverless"},
        },
        "spec": {"predictor": predictor},
    }


def kubectl(args: list[str], stdin: str | None = None) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["kubectl", *args], input=stdin, capture_output=True, text=True,
                              timeout=120)  # fmt: skip
    except FileNotFoundError:
        raise BertError("kubectl not found: install it, or use --dry-run") from None


def running_service(cfg: DeployConfig) -> dict | None:
    name = cfg.name or cfg.model
    done = kubectl(["get", "inferenceservice", name, "-n", cfg.namespace, "-o", "json"])
    if done.returncode == 0:
        return json.loads(done.stdout)
    if "NotFound" in done.stderr:
        return None
    raise BertError(f"kubectl get inferenceservice {name}: {done.stderr.strip()}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bert deploy", description=__doc__.split("\n")[0])
    add_options(p, DeployConfig)
    return p


def main(argv: list[str] | None = None) -> int:
    cfg = config_from_args(build_parser().parse_args(sys.argv[1:] if argv is None else argv),
                           DeployConfig)  # fmt: skip
    version, storage = served_version(cfg)
    running = None if cfg.dry_run else running_service(cfg)
    manifest = inference_service(cfg, version, storage, running)
    text = yaml.safe_dump(manifest, sort_keys=False)
    if cfg.dry_run:
        print(text, end="")
        return 0
    done = kubectl(["apply", "-f", "-"], stdin=text)
    if done.returncode != 0:
        raise BertError(f"kubectl apply: {done.stderr.strip()}")
    canary = manifest["spec"]["predictor"].get("canaryTrafficPercent")
    print(json.dumps({"inference_service": manifest["metadata"]["name"], "version": version,
                      "storage_uri": storage, "canary_percent": canary}))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
