"""MLflow tracking and lineage: pipeline parent runs, nested step runs (also from other
processes, as DVC and Kubeflow start them), the KFP parent found by run id, model registration,
`bert runs`, and the import structure (the library never imports the CLI)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient

from bert_core import cli, tracking
from bert_core.cli import main as bert
from bert_core.track import lineage

CHILD = """
import mlflow
from bert_core.tracking import start_run
with start_run("instances", {"dupe_factor": 5}) as run:
    mlflow.log_metric("instances", 1234.0)
print(run.info.run_id)
"""


@pytest.fixture
def uri(tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    for key in ("BERT_PARENT_RUN_ID", "MLFLOW_EXPERIMENT_NAME", "KFP_RUN_ID", "DVC_STAGE"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.chdir(tmp_path)
    return uri


def test_step_processes_nest_under_the_pipeline_run(uri):
    params = {"model": {"preset": "tiny"}, "pretrain": {"steps": 20}}
    with lineage.start_pipeline_run(params=params, tags={"bert.runner": "test"}) as parent:
        assert os.environ["BERT_PARENT_RUN_ID"] == parent.info.run_id
        env = {**os.environ, "DVC_STAGE": "instances"}
        child_id = subprocess.run(
            [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True
        ).stdout.split()[-1]
    assert "BERT_PARENT_RUN_ID" not in os.environ  # restored when the pipeline run ends

    client = MlflowClient(uri)
    parent = client.get_run(parent.info.run_id)
    assert parent.data.params == {"model.preset": "tiny", "pretrain.steps": "20"}
    assert parent.data.tags["bert.runner"] == "test"
    experiment = client.get_experiment(parent.info.experiment_id)
    assert experiment.name == lineage.PIPELINE_EXPERIMENT
    (child,) = lineage.child_runs(parent.info.run_id)
    assert child.info.run_id == child_id
    assert child.info.experiment_id == parent.info.experiment_id
    assert child.data.tags["dvc.stage"] == "instances"
    assert child.data.params == {"dupe_factor": "5"}
    assert child.data.metrics == {"instances": 1234.0}


def test_kfp_steps_share_one_parent_per_kfp_run(uri, monkeypatch, capsys):
    monkeypatch.setenv("BERT_PARENT_RUN_ID", "")  # kfp_step sets these: restore after the test
    monkeypatch.setenv("KFP_RUN_ID", "")
    first = lineage.kfp_parent_run("4f1c-run-a")
    assert lineage.kfp_parent_run("4f1c-run-a") == first
    assert lineage.kfp_parent_run("77aa-run-b") != first

    monkeypatch.setenv("KFP_RUN_ID", "4f1c-run-a")  # as the pod's `pipeline/runid` label sets it
    cli.kfp_step(["runs"])  # a real `bert` command, as a component runs it
    assert os.environ["BERT_PARENT_RUN_ID"] == first
    assert "kfp" in capsys.readouterr().out  # `bert runs` lists the two KFP pipeline runs
    monkeypatch.setenv("BERT_PARENT_RUN_ID", "")
    monkeypatch.setenv("KFP_RUN_ID", "")  # a backend without the label: a standalone run
    with pytest.raises(RuntimeError, match="bert runs exited with code 2"):
        cli.kfp_step(["runs", "--limit", "x"])
    assert os.environ["BERT_PARENT_RUN_ID"] == ""


def test_kfp_pipeline_run_opens_the_parent_with_the_settings(uri, monkeypatch):
    """The pipeline's first task: KFP hands it every parameter as a string ('5.0' for an int
    under kfp.local); the parent run gets them typed back, named as DVC's parent names them."""
    monkeypatch.setenv("KFP_RUN_ID", "")
    assert lineage.kfp_pipeline_run({"model.preset": "tiny"}) is None  # no run id: no lineage
    monkeypatch.setenv("KFP_RUN_ID", "5b2e-run-c")
    settings = {
        "model.preset": "mini",
        "pretrain.steps": "300.0",
        "pretrain.learning_rate": "0.0001",
        "finetune.tasks": '["SST-2", "MRPC"]',
        "finetune.token_tasks": "[]",
    }
    parent = lineage.kfp_pipeline_run(settings)
    assert lineage.kfp_parent_run("5b2e-run-c") == parent  # the steps find it
    run = MlflowClient(uri).get_run(parent)
    assert run.data.params == {
        "model.preset": "mini",
        "pretrain.steps": "300",
        "pretrain.learning_rate": "0.0001",
        "finetune.tasks": "['SST-2', 'MRPC']",
        "finetune.token_tasks": "[]",
    }
    assert run.data.tags["kfp.run_id"] == "5b2e-run-c"
    assert run.data.tags["bert.step"] == "pipeline"
    assert run.info.status == "RUNNING"  # no process holds it open: the exit handler closes it
    assert lineage.kfp_pipeline_end("COMPLETE") == "FINISHED"
    assert MlflowClient(uri).get_run(parent).info.status == "FINISHED"


@pytest.mark.parametrize(
    "state, evaluated, status",
    [
        ("COMPLETE", False, "FINISHED"),  # the KFP backend (MLMD): the DAG settled
        ("CACHED", False, "FINISHED"),
        ("FAILED", True, "FAILED"),  # a final state wins over the record
        ("CANCELED", False, "KILLED"),
        ("SUCCEEDED", False, "FINISHED"),  # kfp.local
        ("RUNNING", True, "FINISHED"),  # not settled (cache hits): evaluate finished here
        ("RUNNING", False, "FAILED"),  # not settled, and the last step never finished
        ("NEW", False, "FAILED"),
    ],
)
def test_the_exit_handler_ends_the_parent_run_as_the_backend_state_says(
    uri, monkeypatch, state, evaluated, status
):
    """The KFP backend 2.17.0 hands the exit handler the ML Metadata state of the exit
    handler's DAG (backend/src/v2/driver/resolve.go, case TaskFinalStatus), which stays RUNNING
    when no launcher settled it (backend/src/v2/metadata/client.go UpdateDAGExecutionsState):
    then the run's last step, evaluate, decides from its MLflow record."""
    from mlflow import MlflowClient

    monkeypatch.setenv("KFP_RUN_ID", f"run-{state}-{evaluated}")
    parent = lineage.kfp_pipeline_run({})
    monkeypatch.setenv("BERT_PARENT_RUN_ID", parent)
    with tracking.start_run(lineage.LAST_STEP, {}):
        pass
    with tracking.start_run("finetune-SST-2", {}):
        pass  # a finished step that is not the last one decides nothing
    if not evaluated:  # the evaluate run failed (or never ran)
        (run,) = lineage.child_runs(parent, lineage.LAST_STEP)
        MlflowClient(uri).set_terminated(run.info.run_id, "FAILED")
    assert lineage.kfp_pipeline_end(state) == status
    assert MlflowClient(uri).get_run(parent).info.status == status


def test_register_pretrained_logs_and_versions_the_model_once_per_run(uri, tmp_path):
    import json

    import torch

    from bert_core.model.modeling import BertConfig, BertForPreTraining
    from bert_core.serve import registry

    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"abcdefgh"]))
    model = BertForPreTraining(BertConfig.from_preset("tiny", vocab_size=13))
    model.save_pretrained(tmp_path / "model", vocab_file=vocab)
    with lineage.start_pipeline_run() as parent:
        with tracking.start_run("pretrain", {"steps": 1}) as run:  # as `bert pretrain` leaves it
            pass
        record = {"run_id": run.info.run_id}
        (tmp_path / "model" / tracking.RUN_RECORD).write_text(json.dumps(record))
        first = registry.register_pretrained(tmp_path / "model")
        second = registry.register_pretrained(tmp_path / "model")  # found by its run
    (pretrain,) = lineage.child_runs(parent.info.run_id, "pretrain")
    assert (int(first.version), int(second.version)) == (1, 1)
    assert first.run_id == pretrain.info.run_id
    assert first.tags == {"bert.hidden_size": "128", "bert.num_hidden_layers": "2"}
    assert f"run {pretrain.info.run_id}: 2 layers x 128, 1 steps, from random init" in (
        first.description
    )
    import mlflow
    import pandas as pd

    from bert_core.serve.mlflow_model import local_model

    # an MLflow model (pyfunc flavor: masked-token filling) holding the HF-layout folder
    uri = f"models:/{registry.PRETRAINED}/1"
    (answer,) = mlflow.pyfunc.load_model(uri).predict(pd.DataFrame({"text": ["a [MASK] c"]}))
    assert len(answer["masks"]) == 1 and len(answer["masks"][0]["tokens"]) == 5
    with local_model(uri) as (folder, _):
        loaded = BertForPreTraining.from_pretrained(folder)
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_bert_runs_compares_pipeline_runs(uri, capsys):
    assert bert(["runs"]) == 2  # no store yet: a clear error, and none made
    assert "mlflow.db: no such MLflow store" in capsys.readouterr().err
    assert tracking.sqlite_file(uri) is not None and not tracking.sqlite_file(uri).exists()
    tracking.tracking_uri()  # a store, but no experiment yet: a clear error
    assert bert(["runs"]) == 2
    assert "no MLflow experiment 'bert-pipeline'" in capsys.readouterr().err
    for preset, score in (("tiny", 41.5), ("mini", 63.25)):  # MLflow holds percent
        with lineage.start_pipeline_run(params={"model": {"preset": preset}}):
            with tracking.start_run("evaluate"):
                import mlflow

                mlflow.log_metrics({"eval/score": score, "eval/SST-2/score": score + 1})
    assert bert(["runs"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header, newest, oldest = lines
    assert header.split()[-2:] == ["eval/score", "eval/SST-2/score"]
    assert "model.preset" in header
    assert newest.split()[-3:] == ["mini", "63.25", "64.25"]  # shown as logged: percent
    assert oldest.split()[-3:] == ["tiny", "41.50", "42.50"]


# That no module of the library imports the CLI, and that the components use it only, is
# tests/test_architecture.py's (the layers of docs/architecture.md).


def test_step_tracking_imports_no_lineage_and_no_cli():
    code = (
        "import sys, bert_core.tracking; "
        "print(sorted(m for m in sys.modules if m.startswith('bert_core')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    # errors: the bottom of the library (BertError, pid_alive), which imports nothing of it
    assert out.stdout.split() == ["['bert_core',", "'bert_core.errors',", "'bert_core.tracking']"]


def test_default_store_is_the_project_or_the_user_data_folder(tmp_path, monkeypatch):
    """No tracking URI: the project's mlflow.db, and never a stray one in an unrelated folder."""
    project = tmp_path / "project"
    (project / "runs" / "deep").mkdir(parents=True)
    (project / "dvc.yaml").write_text("stages: {}\n")
    assert tracking.default_store(project / "runs" / "deep") == project / "mlflow.db"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(elsewhere)
    assert tracking.tracking_uri() == f"sqlite:///{tmp_path / 'data' / 'bert' / 'mlflow.db'}"
    assert list(elsewhere.iterdir()) == []


def test_a_sqlite_store_is_made_under_a_lock_before_its_uri_is_handed_out(tmp_path, monkeypatch):
    """Two steps starting together on a new store both used to create its tables (one died:
    tests/test_concurrency.py); `tracking_uri` now creates them first, holding `<db>.lock`."""
    import sqlite3

    assert tracking.sqlite_file(f"sqlite:///{tmp_path}/a.db") == tmp_path / "a.db"
    assert tracking.sqlite_file("sqlite:///rel/a.db?timeout=30") == Path("rel/a.db")
    for uri in ("sqlite:///:memory:", "sqlite://", "http://127.0.0.1:5000", "postgresql://h/db"):
        assert tracking.sqlite_file(uri) is None, uri
    db = tmp_path / "new" / "mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{db}")
    assert tracking.tracking_uri() == f"sqlite:///{db}"
    tables = {r[0] for r in sqlite3.connect(db).execute("select name from sqlite_master")}
    assert {"experiments", "runs", "registered_models", "model_versions"} <= tables
    assert (tmp_path / "new" / "mlflow.db.lock").is_file()


def test_a_password_in_the_tracking_uri_is_basic_auth_never_shown(monkeypatch):
    """`http://user:pw@host` (MLflow's clients take it as Basic auth): /health is asked with an
    Authorization header at `host` (not at a host named `user:pw@host`), and no message, nor
    the URI a Ray job is given, holds the password."""
    import base64
    import http.server
    import threading

    from bert_core.errors import BertError
    from bert_core.pretrain import ray_jobs

    seen = []

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append((self.path, self.headers.get("Authorization")))
            self.send_response(200 if seen[-1][1] else 401)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    try:
        tracking.check_tracking(f"http://ada:s3cr%40t@127.0.0.1:{port}")
    finally:
        server.shutdown()
    assert seen == [("/health", "Basic " + base64.b64encode(b"ada:s3cr@t").decode())]
    with pytest.raises(BertError) as dead:  # the server is gone now
        tracking.check_tracking(f"http://ada:s3cr%40t@127.0.0.1:{port}", timeout=2)
    assert "s3cr" not in str(dead.value) and f"http://ada:***@127.0.0.1:{port}" in str(dead.value)
    with pytest.raises(BertError, match=r"'htp://ada:\*\*\*@host'") as bad:
        tracking.check_uri("htp://ada:s3cret@host")
    assert "s3cret" not in str(bad.value)

    class Jobs:  # what `bert pretrain` hands the Ray Jobs API
        def submit_job(self, **kw):
            self.sent = kw

    jobs = Jobs()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://ada:s3cret@mlflow.bert:5000")
    ray_jobs._submit(jobs, "sid", "bert pretrain", "run", "s3://bert/ray")
    assert jobs.sent["runtime_env"]["env_vars"]["MLFLOW_TRACKING_URI"] == "http://mlflow.bert:5000"
