"""`bert deploy` and `bert promote`: the InferenceService written from the registry (the
alias's version, its artifacts in the bucket), field by field and against KServe v0.20.0's CRD;
a canary when it replaces a running service with other artifacts, kept by a re-deploy, ended by
`bert promote --full-traffic`; the requests the real Kubernetes client sends, to an API server
that follows the API's rules (tests/kube_api.py); `bert promote TASK FOLDER` naming the version
a fine-tuning made; refusals before any cluster is touched. KServe acting on it, admission and
RBAC only a cluster shows."""

from __future__ import annotations

import json

import mlflow
import pytest
import yaml
from mlflow import MlflowClient

from bert_core import cli
from bert_core.serve.champion import BASELINE_TAG, SCORE_TAG
from bert_core.serve.deploy import DeployConfig, inference_service
from tests.kserve_schema import crd_problems, kserve_schemas
from tests.kube_api import KubeApi

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
    argv = ["deploy", "--task", "SST-2", "--dry-run", "--max-replicas", "4", "--gpus", "1"]
    assert cli.main(argv) == 0
    isvc = yaml.safe_load(capsys.readouterr().out)
    assert (isvc["apiVersion"], isvc["kind"]) == ("serving.kserve.io/v1beta1", "InferenceService")
    meta = isvc["metadata"]
    assert (meta["name"], meta["namespace"]) == ("bert-sst2", "bert")
    assert meta["labels"] == {
        "bert.registered-model": "bert-sst2",
        "bert.model-version": "1",
        "bert.model-alias": "champion",
    }
    assert meta["annotations"] == {"serving.kserve.io/deploymentMode": "Knative"}
    predictor = isvc["spec"]["predictor"]
    assert predictor["serviceAccountName"] == "bert-serve"
    assert (predictor["minReplicas"], predictor["maxReplicas"]) == (0, 4)  # scale to zero
    assert "canaryTrafficPercent" not in predictor  # a first deploy
    model = predictor["model"]
    assert model["storageUri"] == SOURCE  # the champion's artifacts, not version 2's
    # --gpus: the runtime of the CUDA image (the CPU one could not use the GPU)
    assert (model["runtime"], model["modelFormat"]) == ("bert-serve-gpu", {"name": "bert-mlflow"})
    assert model["protocolVersion"] == "v2"
    assert model["resources"] == {
        "requests": {"cpu": "1", "memory": "2Gi"},
        "limits": {"cpu": "2", "memory": "2Gi", "nvidia.com/gpu": "1"},
    }
    assert crd_problems(isvc, kserve_schemas()) == []


def test_a_proxied_artifact_uri_is_served_from_the_bucket_behind_the_server(
    tmp_path, capsys, monkeypatch
):
    """The cluster's MLflow server proxies artifacts, so the registry answers mlflow-artifacts:/
    URIs (what a real `mlflow server --artifacts-destination` returns for a logged model's
    version); the InferenceService gets the same path under the destination, in the bucket."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.chdir(tmp_path)
    client = MlflowClient(uri)
    client.create_registered_model("bert-sst2")
    client.create_model_version("bert-sst2", "mlflow-artifacts:/0/models/m-42/artifacts")
    client.set_registered_model_alias("bert-sst2", "champion", "1")
    monkeypatch.setenv("BERT_BUCKET", "s3://bert")  # the ConfigMap's, in a pipeline pod
    assert cli.main(["deploy", "--task", "SST-2", "--dry-run"]) == 0
    isvc = yaml.safe_load(capsys.readouterr().out)
    assert isvc["spec"]["predictor"]["model"]["storageUri"] == (
        "s3://bert/mlflow/0/models/m-42/artifacts"
    )
    argv = ["deploy", "--task", "SST-2", "--dry-run", "--artifacts-destination", "s3://b/x/"]
    assert cli.main(argv) == 0
    isvc = yaml.safe_load(capsys.readouterr().out)
    assert isvc["spec"]["predictor"]["model"]["storageUri"] == "s3://b/x/0/models/m-42/artifacts"
    monkeypatch.delenv("BERT_BUCKET")
    assert cli.main(["deploy", "--task", "SST-2", "--dry-run"]) == 2
    assert "--artifacts-destination" in capsys.readouterr().err


def test_a_new_version_replacing_a_running_one_is_a_canary_a_redeploy_keeps():
    cfg = DeployConfig(model="bert-sst2", canary_percent=20)
    running = inference_service(DeployConfig(model="bert-sst2"), "1", SOURCE, None)
    newer = "s3://bert/mlflow/1/models/m-4567/artifacts"
    canary = inference_service(cfg, "2", newer, running)
    assert canary["spec"]["predictor"]["canaryTrafficPercent"] == 20
    assert canary["metadata"]["labels"]["bert.model-version"] == "2"
    same = inference_service(cfg, "1", SOURCE, running)  # re-deploying changes nothing
    assert "canaryTrafficPercent" not in same["spec"]["predictor"]
    # a pipeline re-run deploying the canary's version again leaves the split as it is
    again = inference_service(DeployConfig(model="bert-sst2"), "2", newer, canary)
    assert again["spec"]["predictor"]["canaryTrafficPercent"] == 20
    for manifest in (canary, same, again):
        assert crd_problems(manifest, kserve_schemas()) == []


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    """An API server (tests/kube_api.py) and a kubeconfig naming it; a fresh registry with
    bert-sst2 version 1 (champion, dev score 0.8) in the bucket, and its (empty) candidates."""
    api = KubeApi()
    monkeypatch.setenv("KUBECONFIG", str(api.kubeconfig(tmp_path)))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.chdir(tmp_path)
    client = MlflowClient(uri)
    client.create_registered_model("bert-sst2")
    client.create_model_version("bert-sst2", SOURCE, tags={"bert.dev_score": "0.8"})
    client.set_registered_model_alias("bert-sst2", "champion", "1")
    client.create_registered_model("bert-sst2-candidates")
    mlflow.set_tracking_uri(uri)
    yield api, client
    api.close()


def finetuned_folder(
    client: MlflowClient,
    folder,
    score: str,
    baseline: str = "0.5",
    registered: str | None = "bert-sst2-candidates",
) -> str:
    """A fine-tuning output's record (`mlflow_model.json`), its metrics.json and the version its
    run registered (`registered` None: none, as the random-init control): what `bert finetune`
    leaves, minus the model."""
    run = client.create_run(client.get_experiment_by_name("Default").experiment_id)
    source = f"s3://bert/mlflow/0/models/m-{run.info.run_id[:8]}/artifacts"
    if registered:
        tags = {SCORE_TAG: score, BASELINE_TAG: baseline}
        client.create_model_version(registered, source, run_id=run.info.run_id, tags=tags)
    folder.mkdir(parents=True)
    record = {
        "model_uri": f"models:/m-{run.info.run_id[:8]}",
        "run_id": run.info.run_id,
        "registered_model": registered,
    }
    (folder / "mlflow_model.json").write_text(json.dumps(record))
    metrics = {
        "task": "SST-2",
        "score": float(score),
        "data": "glue/SST-2",
        "num_dev_examples": {"dev": 872},
    }
    (folder / "metrics.json").write_text(json.dumps(metrics))
    return source


def test_deploy_promote_and_full_traffic_through_the_kubernetes_client(cluster, tmp_path, capsys):
    """The release as the pipeline's deploy branch makes it: first deploy; a better fine-tuning
    promoted by its output folder; its deploy a canary; a re-deploy keeps the split;
    --full-traffic ends it. Each request as the Kubernetes API takes it."""
    api, client = cluster
    assert cli.main(["deploy", "--task", "SST-2"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert first == {
        "inference_service": "bert-sst2",
        "version": "1",
        "storage_uri": SOURCE,
        "canary_percent": None,
    }
    get, apply = api.requests[:2]
    assert (get["method"], apply["method"]) == ("GET", "PATCH")
    isvcs = "/apis/serving.kserve.io/v1beta1/namespaces/bert/inferenceservices"
    assert apply["path"] == f"{isvcs}/bert-sst2"
    assert apply["content_type"] == "application/apply-patch+yaml"
    assert apply["query"] == {"fieldManager": "bert-deploy", "force": "true"}
    live = api.objects[("bert", "bert-sst2")]
    assert live["spec"]["predictor"]["model"]["storageUri"] == SOURCE
    assert live["metadata"]["generation"] == 1

    newer = finetuned_folder(client, tmp_path / "SST-2", "0.9")
    assert cli.main(["promote", "SST-2", str(tmp_path / "SST-2")]) == 0
    decision = json.loads(capsys.readouterr().out)  # copied into bert-sst2 as its version 2
    assert (decision["candidate"], decision["champion"]) == ("bert-sst2-candidates/1", 2)
    assert decision["promoted"]
    assert cli.main(["deploy", "--task", "SST-2", "--canary-percent", "25"]) == 0
    assert json.loads(capsys.readouterr().out)["canary_percent"] == 25
    predictor = api.objects[("bert", "bert-sst2")]["spec"]["predictor"]
    assert (predictor["model"]["storageUri"], predictor["canaryTrafficPercent"]) == (newer, 25)
    assert api.objects[("bert", "bert-sst2")]["metadata"]["labels"]["bert.model-version"] == "2"

    assert cli.main(["deploy", "--task", "SST-2"]) == 0  # a re-run: the split stays
    assert api.objects[("bert", "bert-sst2")]["spec"]["predictor"]["canaryTrafficPercent"] == 25
    capsys.readouterr()

    assert cli.main(["promote", "SST-2", "--full-traffic"]) == 0
    ended = json.loads(capsys.readouterr().out)
    assert ended == {
        "inference_service": "bert-sst2",
        "version": "2",
        "full_traffic": True,
        "changed": True,
        "canary_percent_before": 25,
    }
    patch = api.requests[-1]
    assert (patch["method"], patch["content_type"]) == ("PATCH", "application/json-patch+json")
    path = "/spec/predictor/canaryTrafficPercent"
    assert json.loads(patch["body"]) == [
        {"op": "test", "value": 25, "path": path},
        {"op": "remove", "path": path},
    ]
    live = api.objects[("bert", "bert-sst2")]
    assert "canaryTrafficPercent" not in live["spec"]["predictor"]
    assert live["spec"]["predictor"]["model"]["storageUri"] == newer
    assert crd_problems(live, kserve_schemas()) == []
    assert cli.main(["promote", "SST-2", "--full-traffic"]) == 0  # nothing left to move
    assert json.loads(capsys.readouterr().out)["changed"] is False
    # the registry is as the promotion left it: --full-traffic does not touch it
    assert str(client.get_model_version_by_alias("bert-sst2", "champion").version) == "2"


def test_a_worse_fine_tuning_is_not_promoted_and_the_service_is_unchanged(
    cluster, tmp_path, capsys
):
    api, client = cluster
    assert cli.main(["deploy", "--task", "SST-2"]) == 0
    finetuned_folder(client, tmp_path / "SST-2", "0.7")
    assert cli.main(["promote", "SST-2", str(tmp_path / "SST-2")]) == 0
    assert "not promoted" in capsys.readouterr().out.splitlines()[-1]
    before = api.objects[("bert", "bert-sst2")]
    assert cli.main(["deploy", "--task", "SST-2"]) == 0
    after = api.objects[("bert", "bert-sst2")]
    assert after["spec"] == before["spec"] and after["metadata"]["generation"] == 1
    # a version whose dev score is NaN (a diverged fine-tuning) is refused, even with --force
    champion = client.get_model_version_by_alias("bert-sst2", "champion").version
    finetuned_folder(client, tmp_path / "nan", "nan")
    assert cli.main(["promote", "SST-2", str(tmp_path / "nan"), "--force"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(
        "dev score 'nan' is not a finite number (a diverged fine-tuning?): not promoted"
    ), err
    assert client.get_model_version_by_alias("bert-sst2", "champion").version == champion


def test_the_gate_promotes_the_best_of_a_runs_models_that_beats_its_baseline(
    cluster, tmp_path, capsys
):
    """`bert promote TASK --best-of DIR`, the gate `make run` ends with: of the outputs under DIR
    registered as the task's model (not the control's, not another task's), the best by dev
    score, moved by the registry's rule; a model at or below its task's baseline is never
    champion, even forced; outputs scored on different dev sets do not compare."""
    _, client = cluster  # bert-sst2 version 1: champion at 0.8
    glue = tmp_path / "glue"
    finetuned_folder(client, glue / "SST-2", "0.85")
    finetuned_folder(client, glue / "minilm-SST-2", "0.9")
    finetuned_folder(client, glue / "random-SST-2", "0.95", registered=None)  # the control
    assert cli.main(["promote", "SST-2", "--best-of", str(glue)]) == 0
    moved = json.loads(capsys.readouterr().out)
    assert moved["promoted"] and moved["candidate"] == "bert-sst2-candidates/2"  # minilm's
    assert moved["champion"] == 2  # its copy
    # at its baseline (a model that learned nothing): registered, never champion, not forced
    finetuned_folder(client, tmp_path / "flat", "0.95", baseline="0.95")
    assert cli.main(["promote", "SST-2", str(tmp_path / "flat"), "--force"]) == 0
    refused = json.loads(capsys.readouterr().out)
    assert (refused["promoted"], refused["champion"]) == (False, 2)
    assert refused["reason"].startswith(
        "not promoted: dev score 0.95 does not beat the task's baseline 0.95"
    )
    assert str(client.get_model_version_by_alias("bert-sst2", "champion").version) == "2"
    # different dev sets; nothing registered as the task's model there; both forms at once
    other = json.loads((glue / "SST-2" / "metrics.json").read_text())
    other["num_dev_examples"] = {"dev": 100}
    (glue / "SST-2" / "metrics.json").write_text(json.dumps(other))
    for argv, message in (
        ([str(glue)], "were scored on different dev sets"),
        ([str(tmp_path / "nothing")], "no such folder"),
        ([str(glue / "random-SST-2")], "no fine-tuning output there is registered as bert-sst2-"),
    ):
        assert cli.main(["promote", "SST-2", "--best-of", *argv]) == 2
        assert message in capsys.readouterr().err
    assert cli.main(["promote", "SST-2", "3", "--best-of", str(glue)]) == 2
    assert "give it or a VERSION, not both" in capsys.readouterr().err


def test_the_api_servers_refusal_is_one_line_exit_2(cluster, capsys, monkeypatch):
    api, _ = cluster
    api.token = "another-token"  # the kubeconfig's token no longer valid
    assert cli.main(["deploy", "--task", "SST-2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "bert deploy: error: GET inferenceservice bert/bert-sst2: 401 Unauthorized", err
    assert api.objects == {}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "bert-mrpc", "--dry-run"], "bert-mrpc@champion: no such registered model"),
        (["--model", "bert-sst2", "--alias", "candidate", "--dry-run"], "no such registered"),
        (["--model", "bert-sst2", "--alias", "local", "--dry-run"], "not in a bucket"),
        (["--model", "bert-sst2", "--min-replicas", "3", "--max-replicas", "2"], "--min-replicas"),
        (["--model", "bert-sst2", "--canary-percent", "100"], "--canary-percent"),
        (["--model", "bert-sst2", "--task", "SST-2"], "one of them"),
        (["--model", "bert-sst2"], "no Kubernetes cluster to deploy to"),  # no kubeconfig
    ],
)
def test_refused_before_any_cluster_is_touched(registry, capsys, monkeypatch, argv, message):
    monkeypatch.setenv("KUBECONFIG", str(registry / "no-such-kubeconfig"))
    assert cli.main(["deploy", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
