"""Integration tests against real servers on loopback: S3 (moto server) and `mlflow server`.

The servers are started once per session by infra/scripts/local_services.py (the script users
run too), on free 127.0.0.1 ports, and always stopped. Clients are the real ones: boto3,
pyarrow's S3 filesystem, DVC's s3 remote, the MLflow client through bert_core.tracking.
"""

from __future__ import annotations

import importlib.util
import io
import os
import re
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

from bert_core import storage, tracking
from bert_core.errors import BertError
from tests.pipeline_helpers import pretraining_instances

ROOT = Path(__file__).resolve().parents[1]
BUCKET = "bert-ci"
FAKE_SECRET = "fAkE-sEcReT-5f3c9a1e7b2d4c60"  # a credential value that must never be recorded


def _load_services():
    spec = importlib.util.spec_from_file_location(
        "local_services", ROOT / "infra" / "scripts" / "local_services.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


services = _load_services()


@contextmanager
def _server_credentials():
    """The servers get the known secret too, so their logs and stores are checked for it."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AWS_ACCESS_KEY_ID", "ci-access-key")
        mp.setenv("AWS_SECRET_ACCESS_KEY", FAKE_SECRET)
        mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
        yield


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    with _server_credentials():
        svc = services.start_s3(tmp_path_factory.mktemp("s3"), buckets=(BUCKET,))
    yield svc
    svc.stop()


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory, s3_server):
    with _server_credentials():
        svc = services.start_mlflow(
            tmp_path_factory.mktemp("mlflow"), s3_server.url, f"s3://{BUCKET}/mlflow"
        )
    yield svc
    svc.stop()


@pytest.fixture
def s3_env(monkeypatch, s3_server):
    """Client environment for the S3 server, with a known secret we can hunt for later."""
    for key, value in services.client_env(s3_server.url, {}).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", FAKE_SECRET)
    return s3_server


def _objects(prefix: str = "") -> dict[str, bytes]:
    s3 = storage.s3_client()
    out = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix):
        for obj in page.get("Contents", []):
            out[obj["Key"]] = s3.get_object(Bucket=BUCKET, Key=obj["Key"])["Body"].read()
    return out


def test_pyarrow_parquet_round_trip_through_s3(s3_env):
    import pyarrow as pa
    import pyarrow.parquet as pq

    # Only MLflow's variable set: the helpers must still find the endpoint.
    os.environ.pop("AWS_ENDPOINT_URL")
    table = pa.table({"input_ids": [[2, 7, 3], [2, 9, 9, 3]], "next_sentence_label": [0, 1]})
    fs, path = storage.filesystem(f"s3://{BUCKET}/instances/")
    assert path == f"{BUCKET}/instances"
    pq.write_table(table, f"{path}/shard-00000.parquet", filesystem=fs)
    assert "instances/shard-00000.parquet" in _objects("instances/")
    assert pq.read_table(f"{path}/shard-00000.parquet", filesystem=fs).equals(table)
    local_fs, local = storage.filesystem(ROOT / "pyproject.toml")
    assert local_fs.get_file_info(local).size == (ROOT / "pyproject.toml").stat().st_size


@pytest.mark.slow
def test_data_steps_read_and_write_s3(s3_env, shared_data, tmp_path, monkeypatch, capsys):
    """`bert clean`, `vocab` and `instances` take s3:// inputs and outputs as local ones (the
    one storage layer); a step that fails leaves nothing under its s3:// output."""
    import json

    from bert_core import cli

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("BERT_PARENT_RUN_ID", raising=False)
    book = (shared_data / "corpus" / "pride_and_prejudice.txt").read_text(encoding="utf-8-sig")
    storage.s3_client().put_object(
        Bucket=BUCKET, Key="steps/book.txt", Body=book[20_000:40_000].encode()
    )
    s3 = f"s3://{BUCKET}/steps"
    for argv in (
        [
            "clean",
            "--input",
            f"{s3}/book.txt",
            "--output",
            f"{s3}/clean",
            "--num-shards",
            "2",
            "--num-workers",
            "1",
        ],
        ["vocab", "--input", f"{s3}/clean", "--output", f"{s3}/vocab", "--vocab-size", "200"],
        [
            "instances",
            "--input",
            f"{s3}/clean",
            "--vocab",
            f"{s3}/vocab/vocab.txt",
            "--output",
            f"{s3}/instances",
            "--max-seq-length",
            "32",
            "--dupe-factor",
            "1",
            "--num-workers",
            "1",
        ],
    ):
        assert cli.main(argv) == 0, capsys.readouterr().err
    names = set(_objects("steps/"))
    assert {"steps/clean/shard-00000.txt", "steps/clean/stats.json"} <= names
    assert {"steps/vocab/vocab.txt", "steps/vocab/tokenizer_config.json"} <= names
    assert {"steps/instances/shard-00000.parquet", "steps/instances/vocab.txt"} <= names
    stats = json.loads(_objects("steps/instances/stats.json")["steps/instances/stats.json"])
    assert stats["instances"] > 0 and stats["config"]["lowercase"] is True
    failed = ["vocab", "--input", f"{s3}/clean", "--output", f"{s3}/vocab2", "--vocab-size", "3"]
    assert cli.main(failed) == 2
    assert "--vocab-size must be > 5" in capsys.readouterr().err
    assert _objects("steps/vocab2") == {}


def test_split_s3_rejects_non_s3():
    assert storage.split_s3("s3://b/a/b.txt") == ("b", "a/b.txt")
    with pytest.raises(BertError, match="not an s3://"):
        storage.split_s3("/tmp/x")


@pytest.mark.slow
def test_mlflow_server_stores_artifacts_in_bucket(s3_env, mlflow_server, tmp_path, monkeypatch):
    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server.url)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "infra-ci")
    # The client holds no S3 credential: artifacts go through the server's proxy.
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    report = tmp_path / "report.txt"
    report.write_text("mlm_accuracy 0.42\n")
    with tracking.start_run("infra-check", params={"optim": {"lr": 1e-4}}) as run:
        mlflow.log_metric("loss", 3.5, step=1)
        mlflow.log_artifact(str(report))
    got = mlflow.MlflowClient(mlflow_server.url).get_run(run.info.run_id)
    assert got.data.params["optim.lr"] == "0.0001" and got.data.metrics["loss"] == 3.5
    keys = [k for k in _objects("mlflow/") if k.endswith(f"{run.info.run_id}/artifacts/report.txt")]
    assert len(keys) == 1, keys
    assert _objects(keys[0])[keys[0]] == b"mlm_accuracy 0.42\n"


def _run(cmd, cwd, env):
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"{cmd}: {out.stdout}\n{out.stderr}"
    return out


@pytest.mark.slow
def test_dvc_push_wipe_pull_round_trip(s3_env, tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    env = {**os.environ, "DVC_NO_ANALYTICS": "1"}
    for who in ("AUTHOR", "COMMITTER"):
        env |= {f"GIT_{who}_NAME": "ci", f"GIT_{who}_EMAIL": "ci@localhost"}
    dvc = [sys.executable, "-m", "dvc"]
    data = repo / "data" / "corpus.txt"
    data.parent.mkdir()
    payload = "the quick brown fox .\njumps over the lazy dog .\n\nsecond document .\n" * 50
    data.write_text(payload)
    _run(["git", "init", "-q"], repo, env)
    _run([*dvc, "init", "-q"], repo, env)
    _run([*dvc, "remote", "add", "-d", "store", f"s3://{BUCKET}/dvc"], repo, env)
    _run([*dvc, "remote", "modify", "store", "endpointurl", s3_env.url], repo, env)
    _run([*dvc, "add", "-q", "data/corpus.txt"], repo, env)
    _run(["git", "add", "-A"], repo, env)
    _run(["git", "commit", "-qm", "data"], repo, env)
    _run([*dvc, "push", "-q"], repo, env)
    pushed = _objects("dvc/")
    assert payload.encode() in pushed.values(), list(pushed)
    # Credentials came from the environment: the committed DVC config holds none.
    config = (repo / ".dvc" / "config").read_text()
    assert FAKE_SECRET not in config and "endpointurl" in config
    # Wipe the workspace copy and the cache: only the bucket has the data now.
    data.unlink()
    subprocess.run(["rm", "-rf", str(repo / ".dvc" / "cache")], check=True)
    _run([*dvc, "pull", "-q"], repo, env)
    assert data.read_text() == payload


def test_preflight_passes_when_services_are_up(s3_env, mlflow_server, tmp_path):
    storage.preflight(mlflow_server.url, [f"s3://{BUCKET}/ray", tmp_path])
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "bert_core.storage",
            "--tracking-uri",
            mlflow_server.url,
            f"s3://{BUCKET}/instances",
        ],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0 and "preflight: ok" in out.stdout, out.stderr


def test_preflight_fails_fast_on_unreachable_tracking_server(s3_env):
    dead = f"http://127.0.0.1:{services.free_port()}"
    with pytest.raises(BertError, match=r"MLflow tracking server .* is unreachable"):
        storage.preflight(dead, [f"s3://{BUCKET}/ray"], timeout=2)
    out = subprocess.run(
        [sys.executable, "-m", "bert_core.storage", "--tracking-uri", dead],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert f"preflight: error: MLflow tracking server {dead} is unreachable" in out.stderr


def test_preflight_fails_fast_on_missing_bucket(s3_env, mlflow_server):
    missing = r"bucket 'no-such-bucket' at http://127\.0\.0\.1:\d+ does not exist"
    with pytest.raises(BertError, match=missing):
        storage.preflight(mlflow_server.url, ["s3://no-such-bucket/ray"], timeout=2)


def test_preflight_fails_fast_on_unreachable_s3_endpoint(s3_env, monkeypatch):
    dead = f"http://127.0.0.1:{services.free_port()}"
    monkeypatch.setenv("AWS_ENDPOINT_URL", dead)
    with pytest.raises(BertError, match=rf"S3 endpoint {dead} is unreachable") as err:
        storage.preflight(None, [f"s3://{BUCKET}/ray"], timeout=2)
    assert FAKE_SECRET not in str(err.value)


STEP = """
import mlflow, sys
from bert_core import storage, tracking
storage.preflight(tracking.tracking_uri(), [sys.argv[1]])
params = {"data": {"output": sys.argv[1]}, "optim": {"lr": 1e-4}, "seed": 12345}
with tracking.start_run("security-check", params=params, tags={"bert.stage": "ci"}) as run:
    mlflow.log_metric("loss", 1.25)
    mlflow.log_dict(params, "config.json")
    print("RUN_ID=" + run.info.run_id)
"""


def _files_containing(root: Path, needle: bytes) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and needle in p.read_bytes()]


@pytest.mark.slow
def test_secret_never_reaches_params_tags_logs_files_or_git(
    s3_env, mlflow_server, tmp_path, tmp_path_factory
):
    """A step runs with a known AWS secret; it must show up in none of the places people read."""
    import mlflow

    env = {**os.environ, "PYTHONPATH": str(ROOT), "MLFLOW_TRACKING_URI": mlflow_server.url}
    env |= {"MLFLOW_EXPERIMENT_NAME": "infra-security", "AWS_SECRET_ACCESS_KEY": FAKE_SECRET}
    out = subprocess.run(
        [sys.executable, "-c", STEP, f"s3://{BUCKET}/security"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    (run_id,) = re.findall(r"^RUN_ID=(\w+)$", out.stdout, re.M)
    # A real pipeline step, `bert clean`, with the same environment.
    text = "The first sentence of a document. And its second one.\n\nAnother document here.\n"
    (tmp_path / "raw.txt").write_text(text * 20)
    clean = subprocess.run(
        [sys.executable, "-m", "bert_core", "clean", "--input", "raw.txt", "--output", "clean"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert clean.returncode == 0, clean.stderr
    assert list((tmp_path / "clean").glob("shard-*.txt"))
    client = mlflow.MlflowClient(mlflow_server.url)
    run = client.get_run(run_id)
    assert run.data.params["optim.lr"] == "0.0001"
    exp = client.get_experiment_by_name("infra-security")
    runs = client.search_runs([exp.experiment_id])
    assert {r.data.tags["bert.step"] for r in runs} == {"security-check", "clean"}
    recorded = [kv for r in runs for kv in [*r.data.params.items(), *r.data.tags.items()]]
    assert not [kv for kv in recorded if FAKE_SECRET in f"{kv}"], recorded
    assert FAKE_SECRET not in out.stdout + out.stderr + clean.stdout + clean.stderr
    # Files: the step's working folder, both servers' logs and stores, every object in the bucket.
    for folder in (tmp_path, mlflow_server.log.parent, s3_env.log.parent):
        assert not _files_containing(folder, FAKE_SECRET.encode()), folder
    assert all(FAKE_SECRET.encode() not in body for body in _objects().values())
    assert any(k.endswith(f"{run_id}/artifacts/config.json") for k in _objects("mlflow/"))
    # Git: no tracked file of the project holds it (nor any AWS-style secret assignment).
    grep = subprocess.run(
        [
            "git",
            "grep",
            "-nIE",
            f"{FAKE_SECRET}|aws_secret_access_key *[:=] *[A-Za-z0-9/+]{{20,}}",
            "--",
            ":!tests/test_services.py",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert grep.returncode == 1 and not grep.stdout, grep.stdout


# ---------------------------------------------------------------- `bert pretrain` on the servers


@pytest.fixture(scope="module")
def tiny_instances(tmp_path_factory, shared_data) -> Path:
    """Instances from the real `bert clean` / `bert vocab` / `bert instances` on a 12k-character
    slice of a shared-corpus book (as tests/pretrain/test_pretrain.py does, smaller: a few
    steps only)."""
    return pretraining_instances(
        tmp_path_factory.mktemp("pt-svc"),
        shared_data,
        chars=12_000,
        num_shards=2,
        vocab_size=500,
        max_seq_length=32,
    )


def _pretrain(instances: Path, cwd: Path, env: dict[str, str], *args: str):
    cmd = [
        sys.executable,
        "-m",
        "bert_core",
        "pretrain",
        "--instances",
        str(instances),
        "--output",
        "run",
        "--preset",
        "tiny",
        "--num-workers",
        "1",
        *args,
    ]
    env = {**env, "PYTHONPATH": str(ROOT)}
    env.pop("BERT_PARENT_RUN_ID", None)
    env.pop("RAY_ADDRESS", None)  # a private local Ray, started by the command
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_tiny_pretrain_logs_to_server_and_checkpoints_to_bucket(
    s3_env, mlflow_server, tiny_instances, tmp_path
):
    import mlflow
    import torch

    env = {**os.environ, "MLFLOW_TRACKING_URI": mlflow_server.url}
    env |= {"MLFLOW_EXPERIMENT_NAME": "infra-pretrain"}
    out = _pretrain(
        tiny_instances,
        tmp_path,
        env,
        "--steps",
        "4",
        "--batch-size",
        "8",
        "--log-every",
        "2",
        "--checkpoint-every",
        "2",
        "--storage-path",
        f"s3://{BUCKET}/ray",
        "--run-name",
        "svc-tiny",
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "pretrain: step 4/4" in out.stdout
    # Metrics: in the server's store, one point per log line.
    client = mlflow.MlflowClient(mlflow_server.url)
    exp = client.get_experiment_by_name("infra-pretrain")
    (run,) = client.search_runs([exp.experiment_id], "tags.`bert.step` = 'pretrain'")
    assert run.data.tags["bert.storage_path"] == f"s3://{BUCKET}/ray"
    assert run.data.params["preset"] == "tiny" and run.data.params["steps"] == "4"
    losses = client.get_metric_history(run.info.run_id, "loss")
    assert sorted(m.step for m in losses) == [2, 4]
    assert all(0 < m.value < 20 for m in losses), losses
    artifacts = [a.path for a in client.list_artifacts(run.info.run_id)]
    assert "pretrain_metrics.csv" in artifacts
    # Checkpoints: Ray Train wrote them to the bucket; the last holds step 4 and the final model.
    objects = _objects("ray/svc-tiny/")
    steps = {k.split("/")[2] for k in objects if k.endswith("/state.pt")}
    assert steps == {"checkpoint_00000002", "checkpoint_00000004"}, sorted(objects)
    last = "ray/svc-tiny/checkpoint_00000004/"
    assert {f"{last}model/model.safetensors", f"{last}model/vocab.txt"} <= set(objects)
    state = torch.load(io.BytesIO(objects[f"{last}state.pt"]), weights_only=False)
    assert state["step"] == 4 and [r["step"] for r in state["history"]] == [2, 4]
    # ... and the run folder got the model copied out of the bucket's checkpoint.
    assert (tmp_path / "run" / "model" / "model.safetensors").read_bytes() == objects[
        f"{last}model/model.safetensors"
    ]


@pytest.mark.slow
def test_pretrain_fails_fast_before_ray_when_a_service_is_down(s3_env, tiny_instances, tmp_path):
    """Unreachable tracking server, then a missing bucket: exit 2 naming it, no Ray, no output."""
    dead = f"http://127.0.0.1:{services.free_port()}"
    out = _pretrain(tiny_instances, tmp_path, {**os.environ, "MLFLOW_TRACKING_URI": dead})
    assert out.returncode == 2, out.stderr
    assert f"bert pretrain: error: MLflow tracking server {dead} is unreachable" in out.stderr
    bucket_uri = "s3://no-such-bucket/ckpt"
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    out2 = _pretrain(tiny_instances, tmp_path, env, "--storage-path", bucket_uri)
    assert out2.returncode == 2, out2.stderr
    assert "bucket 'no-such-bucket'" in out2.stderr and "does not exist" in out2.stderr
    for o in (out, out2):  # one error line, raised before Ray was started
        assert len(o.stderr.strip().splitlines()) == 1, o.stderr
        assert "Ray instance" not in o.stdout + o.stderr
    assert not (tmp_path / "run").exists()
    if (tmp_path / "mlflow.db").exists():  # the tracking store may be made (tracking_uri)...
        from mlflow import MlflowClient

        client = MlflowClient(env["MLFLOW_TRACKING_URI"])
        experiments = [e.experiment_id for e in client.search_experiments()]
        assert client.search_runs(experiments) == []  # ... but no run was started
