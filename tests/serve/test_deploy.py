"""`bert deploy`: the InferenceService written from the registry (the alias's version, its
artifacts in the bucket), field by field and against KServe v0.20.0's CRD; a canary when it
replaces a running service with other artifacts, none after --promote; refusals before any
cluster is touched. Applying it, and KServe acting on it, only a cluster shows."""

from __future__ import annotations

import mlflow
import pytest
import yaml
from mlflow import MlflowClient

from bert_core import cli
from bert_core.serve.deploy import DeployConfig, inference_service
from tests.kserve_schema import crd_problems, kserve_schemas

SOURCE = "s3://bert/mlflow/1/models/m-0123abcd/artifacts"


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    """A SQLite registry with bert-sst2: version 1 (champion) in the bucket, version 2 with
    local artifacts (alias local)."""
    root = tmp_path_factory.mktemp("deploy")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", uri)
        mp.chdir(root)
        client = MlflowClient(uri)
        client.create_registered_model("bert-sst2")
        client.create_model_version("bert-sst2", SOURCE)
        local = root / "local-model"
        local.mkdir()
        client.create_model_version("bert-sst2", str(local))
        client.set_registered_model_alias("bert-sst2", "champion", "1")
        client.set_registered_model_alias("bert-sst2", "local", "2")
        mlflow.set_tracking_uri(uri)
        yield root


def test_dry_run_prints_the_champions_service_field_by_field(registry, capsys, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")  # --dry-run needs no kubectl and calls none
    argv = ["deploy", "--model", "bert-sst2", "--dry-run", "--max-replicas", "4", "--gpus", "1"]
    assert cli.main(argv) == 0
    isvc = yaml.safe_load(capsys.readouterr().out)
    assert (isvc["apiVersion"], isvc["kind"]) == ("serving.kserve.io/v1beta1", "InferenceService")
    meta = isvc["metadata"]
    assert (meta["name"], meta["namespace"]) == ("bert-sst2", "bert")
    assert meta["labels"] == {"bert.registered-model": "bert-sst2", "bert.model-version": "1",
                              "bert.model-alias": "champion"}  # fmt: skip
    assert meta["annotations"] == {"serving.kserve.io/deploymentMode": "Serverless"}
    predictor = isvc["spec"]["predictor"]
    assert predictor["serviceAccountName"] == "bert-serve"
    assert (predictor["minReplicas"], predictor["maxReplicas"]) == (0, 4)  # scale to zero
    assert "canaryTrafficPercent" not in predictor  # a first deploy
    model = predictor["model"]
    assert model["storageUri"] == SOURCE  # the champion's artifacts, not version 2's
    assert (model["runtime"], model["modelFormat"]) == ("bert-serve", {"name": "bert-mlflow"})
    assert model["protocolVersion"] == "v2"
    assert model["resources"] == {
        "requests": {"cpu": "1", "memory": "2Gi"},
        "limits": {"cpu": "2", "memory": "2Gi", "nvidia.com/gpu": "1"},
    }
    assert crd_problems(isvc, kserve_schemas()) == []


def test_a_new_version_replacing_a_running_one_is_a_canary_until_promoted():
    cfg = DeployConfig(model="bert-sst2", canary_percent=20)
    running = inference_service(DeployConfig(model="bert-sst2"), "1", SOURCE, None)
    newer = "s3://bert/mlflow/1/models/m-4567/artifacts"
    canary = inference_service(cfg, "2", newer, running)
    assert canary["spec"]["predictor"]["canaryTrafficPercent"] == 20
    assert canary["metadata"]["labels"]["bert.model-version"] == "2"
    same = inference_service(cfg, "1", SOURCE, running)  # re-deploying changes nothing
    assert "canaryTrafficPercent" not in same["spec"]["predictor"]
    promoted = inference_service(DeployConfig(model="bert-sst2", promote=True), "2", newer, canary)
    assert "canaryTrafficPercent" not in promoted["spec"]["predictor"]  # all traffic: latest
    for manifest in (canary, same, promoted):
        assert crd_problems(manifest, kserve_schemas()) == []


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "bert-mrpc", "--dry-run"], "bert-mrpc@champion: no such registered model"),
        (["--model", "bert-sst2", "--alias", "candidate", "--dry-run"], "no such registered"),
        (["--model", "bert-sst2", "--alias", "local", "--dry-run"], "not in a bucket"),
        (["--model", "bert-sst2", "--min-replicas", "3", "--max-replicas", "2"], "--min-replicas"),
        (["--model", "bert-sst2", "--canary-percent", "100"], "--canary-percent"),
        (["--model", "bert-sst2"], "kubectl not found"),  # PATH without it
    ],
)
def test_refused_before_any_cluster_is_touched(registry, capsys, monkeypatch, argv, message):
    monkeypatch.setenv("PATH", "/nonexistent")
    assert cli.main(["deploy", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
