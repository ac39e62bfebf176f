"""#43: MLflow behind its basic-auth app, as the cluster runs it (infra/k8s/mlflow.yaml, its
basic_auth.ini) with the users infra/scripts/mlflow_users.py makes: no anonymous access, the
pipeline identity registers candidates but cannot move `champion`, `bert promote` as the release
identity can, a reader reads. A real `mlflow server --app-name basic-auth`; the permission rules
are MLflow 3.17.2's own (mlflow/server/auth/__init__.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from bert_core import cli
from bert_core.serve import champion, registry
from infra.scripts import local_services, mlflow_users

ADMIN = "admin-password-for-the-test"
USERS = {
    "PIPELINE": ("bert-pipeline", "pipeline-password"),
    "RELEASE": ("bert-release", "release-password"),
    "READER": ("bert-reader", "reader-password"),
}
SOURCE = "s3://bert/mlflow/1/models/m-1234/artifacts"
ROOT = Path(__file__).resolve().parents[2]  # where a logged model's files would be


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("auth")
    service = local_services.start_mlflow(
        tmp / "mlflow", None, str(tmp / "artifacts"), admin_password=ADMIN
    )
    yield service.url
    service.stop()


def identity(monkeypatch, url: str, role: str | None) -> MlflowClient:
    """This process as `role` (None: anonymous, "ADMIN": MLflow's admin), as a pod with that
    Secret would be: MLflow's clients read the credentials from the environment."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
    if role is None:
        monkeypatch.delenv("MLFLOW_TRACKING_USERNAME", raising=False)
        monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD", raising=False)
    else:
        user, password = ("admin", ADMIN) if role == "ADMIN" else USERS[role]
        monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", user)
        monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", password)
    return MlflowClient(url)


def refused(call, status: str) -> None:
    with pytest.raises(MlflowException) as e:
        call()
    assert champion._denied(e.value) if status == "403" else status in str(e.value), e.value


@pytest.mark.slow
def test_only_the_release_identity_moves_champion(server, monkeypatch, capsys):
    identity(monkeypatch, server, "ADMIN")
    for role, (user, password) in USERS.items():
        monkeypatch.setenv(f"{role}_USERNAME", user)
        monkeypatch.setenv(f"{role}_PASSWORD", password)
    argv = ["--tracking-uri", server, "--release-models", "bert-sst2,bert-mrpc"]
    assert mlflow_users.main(argv) == 0
    assert "created ['bert-pipeline', 'bert-release', 'bert-reader']" in capsys.readouterr().out
    assert mlflow_users.main(argv) == 0  # again: nothing new, nothing lost
    assert "created no user" in capsys.readouterr().out

    client = identity(monkeypatch, server, None)  # anonymous: nothing, not even a read
    refused(client.search_experiments, "401")

    # the pipeline: its experiment, a run, the task's candidates and a version
    client = identity(monkeypatch, server, "PIPELINE")
    run = client.create_run(client.create_experiment("auth"))
    client.set_terminated(run.info.run_id)
    pool = registry.candidates_of("bert-sst2")
    client.create_registered_model(pool)
    tags = {champion.SCORE_TAG: "0.9", champion.BASELINE_TAG: "0.5"}
    client.create_model_version(pool, SOURCE, run_id=run.info.run_id, tags=tags)
    # ... but neither a version of the served model nor its alias
    assert cli.main(["promote", "SST-2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(
        "only the release identity may (its credentials as "
        "MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD, docs/cluster.md)"
    ), err
    assert ADMIN not in err and "pipeline-password" not in err
    refused(lambda: client.create_model_version("bert-sst2", SOURCE), "403")
    refused(lambda: client.set_registered_model_alias("bert-sst2", "champion", "1"), "403")
    assert client.search_model_versions("name='bert-sst2'") == []

    # the release identity: `bert promote` copies the candidate in and moves champion
    identity(monkeypatch, server, "RELEASE")
    assert cli.main(["promote", "SST-2"]) == 0
    decision = json.loads(capsys.readouterr().out)
    assert (decision["candidate"], decision["champion"], decision["promoted"]) == (
        f"{pool}/1",
        1,
        True,
    )

    # a reader sees it, and changes nothing
    client = identity(monkeypatch, server, "READER")
    served = champion.by_alias(client, "bert-sst2", champion.CHAMPION)
    assert served.source == f"models:/{pool}/1"
    assert client.get_model_version_download_uri("bert-sst2", served.version) == SOURCE
    refused(lambda: client.set_model_version_tag(pool, "1", "x", "y"), "403")
    refused(lambda: client.delete_registered_model_alias("bert-sst2", "champion"), "403")


def test_the_cluster_server_runs_the_auth_app_and_its_job_makes_every_release_model():
    """infra/k8s/mlflow.yaml as the test above ran it: the basic-auth app with the same
    basic_auth.ini (a ConfigMap), the admin's secrets from a Secret; its users' Job makes a
    release model for every task `bert finetune` knows, each user's credentials from a Secret."""
    import yaml

    from bert_core.finetune.command import TASKS
    from pipelines import cluster

    docs = list(yaml.safe_load_all((ROOT / "infra/k8s/mlflow.yaml").read_text()))
    kinds = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    (server,) = kinds[("Deployment", "mlflow")]["spec"]["template"]["spec"]["containers"]
    assert "--app-name=basic-auth" in server["args"]
    env = {e["name"]: e.get("value") for e in server["env"]}
    (mount,) = [m for m in server["volumeMounts"] if m["name"] == "auth-config"]
    assert env["MLFLOW_AUTH_CONFIG_PATH"] == f"{mount['mountPath']}/basic_auth.ini"
    assert {"secretRef": {"name": "bert-mlflow-admin"}} in server["envFrom"]
    kust = yaml.safe_load((ROOT / "infra/k8s/kustomization.yaml").read_text())
    (config,) = [g for g in kust["configMapGenerator"] if g["name"] == "bert-mlflow-auth-config"]
    assert config["files"] == ["mlflow/basic_auth.ini"]  # the file local_services runs with
    example = (ROOT / "infra/k8s/mlflow-admin.env.example").read_text()
    assert {"MLFLOW_AUTH_ADMIN_PASSWORD=", "MLFLOW_FLASK_SERVER_SECRET_KEY="} <= {
        line.split("=")[0] + "=" for line in example.splitlines() if "=" in line[:40]
    }

    job = kinds[("Job", "mlflow-users")]["spec"]["template"]["spec"]
    (users,) = job["containers"]
    (models,) = [a.split("=", 1)[1] for a in users["args"] if a.startswith("--release-models=")]
    assert models.split(",") == list(dict.fromkeys(registry.model_name(t) for t in TASKS))
    refs = {
        e["name"]: e["valueFrom"]["secretKeyRef"]["name"]
        for e in users["env"]
        if "valueFrom" in e and "secretKeyRef" in e["valueFrom"]
    }
    secrets = {"PIPELINE": cluster.AUTH_SECRET, "RELEASE": cluster.RELEASE_SECRET}
    secrets["READER"] = "bert-mlflow-reader"
    for role in mlflow_users.ROLES:
        assert refs[f"{role}_USERNAME"] == refs[f"{role}_PASSWORD"] == secrets[role], role
    assert refs["MLFLOW_TRACKING_PASSWORD"] == "bert-mlflow-admin"
    assert users["command"][-1] == "/opt/bert/mlflow_users.py"
