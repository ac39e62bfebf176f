"""Load and secrets (issue #18, points 5 and 6): runs at the same time stay apart, and no
credential reaches anything a person or a process can read afterwards.

- Two runs of the compiled pipeline (`tests/cluster/pod_harness.py`, one thread each) with
  different settings against ONE `mlflow server` and ONE bucket: both succeed, each with its own
  parent run, its own steps nested under it, its own GLUE table and its own artifacts; nothing
  is left RUNNING. The same two runs carry fake credentials planted where a cluster puts the
  real ones (the `bert-s3` Secret, the optional `bert-mlflow-auth` Secret, a token in the
  image's environment); afterwards every output is searched for them (`outputs`) and none may
  appear, while a marker written on purpose into each kind of output must be found.
- Two `bert finetune` processes at the same time on one new SQLite store: both succeed, with
  their own runs and registry versions (`tracking.ready_sqlite_store` is the fix: both
  processes created the new store's tables at once, and one died in the schema migration).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from bert_core import storage
from pipelines import cluster
from tests.cluster import pod_env, pod_harness
from tests.pipeline_helpers import (
    ROOT,
    SPEC,
    cluster_objects,
    git_head,
    pipeline_args,
    pods_s3_env,
    start_cluster_mlflow,
    start_cluster_s3,
    upload_data_slice,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

BUCKET = cluster.BUCKET.removeprefix("s3://")
# Two runs that differ in every setting a mix-up would show: tasks, pre-training steps, seed.
# no random-init control here (the cluster harness test runs it): two pods fewer to wait for
RUNS = {
    "a": pipeline_args(
        ["SST-2"], pretrain_steps=4, instances_random_seed=11, finetune_control_tasks=[]
    ),
    "b": pipeline_args(
        ["STS-B"], pretrain_steps=7, instances_random_seed=22, finetune_control_tasks=[]
    ),
}
RAY_TMP = Path("/tmp/ray")  # where a local Ray keeps its session folders (logs, sockets)
# Written into this file on purpose: `git grep` must find it (the git search's positive control).
GIT_CONTROL = "secret-search-control-3f9e1c"


@dataclass(frozen=True)
class Planted:
    """Fake credentials, new for each test session, given to the pods where a cluster gives
    the real ones; moto and an `mlflow server` without auth accept any."""

    s3_key_id: str
    s3_secret: str
    mlflow_username: str
    mlflow_password: str
    mlflow_token: str

    @classmethod
    def new(cls) -> Planted:
        tag = uuid.uuid4().hex
        kinds = ("KEYID", "SECRET", "USER", "PASSWORD", "TOKEN")
        return cls(*(f"fake-{kind}-{tag}" for kind in kinds))

    def secrets(self) -> list[str]:
        """What must never be recorded. The S3 access key id and the MLflow user name are
        identities, each recorded in one place by design: see the test."""
        return [self.s3_secret, self.mlflow_password, self.mlflow_token]

    def s3(self) -> dict[str, str]:
        """The `bert-s3` Secret's data (cluster.SECRET_KEYS)."""
        return {"AWS_ACCESS_KEY_ID": self.s3_key_id, "AWS_SECRET_ACCESS_KEY": self.s3_secret}

    def mlflow_auth(self) -> dict[str, str]:
        """The optional `bert-mlflow-auth` Secret's data (cluster.AUTH_KEYS)."""
        return {"MLFLOW_TRACKING_USERNAME": self.mlflow_username,
                "MLFLOW_TRACKING_PASSWORD": self.mlflow_password}  # fmt: skip


@dataclass
class Concurrent:
    """The two pipeline runs (RUNS' names -> harness, final state) and what they ran against."""

    planted: Planted
    s3: Any  # local_services.Service
    mlflow: Any
    harnesses: dict[str, pod_harness.Harness]
    states: dict[str, str]
    seconds: float
    root: Path  # the pods' folders and the servers' (logs, mlflow.db)
    ray_sessions: list[Path]  # the Ray session folders that appeared during the runs

    def logs(self, name: str) -> str:
        tasks = self.harnesses[name].tasks
        return "\n".join(f"--- {t.path}\n{t.log.read_text()[-3000:]}" for t in tasks)


def _ray_sessions() -> set[Path]:
    return set(RAY_TMP.glob("session_2*")) if RAY_TMP.is_dir() else set()


@pytest.fixture(scope="module")
def concurrent(shared_data, tmp_path_factory) -> Iterator[Concurrent]:
    """The compiled pipeline run twice at once (RUNS, a thread each) against one S3 server with
    one bucket and one MLflow server, every pod and both servers holding the planted keys."""
    planted = Planted.new()
    root = tmp_path_factory.mktemp("concurrent")
    s3 = start_cluster_s3(root / "s3", BUCKET, planted.s3())
    mlflow = None
    try:
        artifacts = f"{cluster.BUCKET}/mlflow"
        mlflow = start_cluster_mlflow(root / "mlflow", s3.url, artifacts, planted.s3())
        objects = pod_env.manifest_objects()
        objects[("Secret", cluster.SECRET)] = planted.s3()
        objects[("Secret", cluster.AUTH_SECRET)] = planted.mlflow_auth()
        image_env = {"PYTHONUNBUFFERED": "1", "BERT_GIT_COMMIT": git_head(), "OMP_NUM_THREADS": "1"}
        image_env["MLFLOW_TRACKING_TOKEN"] = planted.mlflow_token  # beside the auth Secret's
        harnesses = {
            name: pod_harness.Harness(
                SPEC, cluster_objects(objects, s3.url, mlflow.url), root / f"pods-{name}",
                f"{cluster.BUCKET}/kfp", image_env=image_env,
            )  # fmt: skip
            for name in RUNS
        }
        tasks = sorted({t for args in RUNS.values() for t in args["finetune_tasks"]})
        upload_data_slice(shared_data, harnesses["a"].s3, BUCKET, tasks)
        before, start = _ray_sessions(), time.monotonic()
        with ThreadPoolExecutor(len(RUNS)) as pool:
            futures = {name: pool.submit(h.run, RUNS[name]) for name, h in harnesses.items()}
            states = {name: f.result() for name, f in futures.items()}
        seconds = time.monotonic() - start
        print(f"\ntwo pipeline runs at once: {seconds:.0f} s")
        new_sessions = sorted(_ray_sessions() - before)
        yield Concurrent(planted, s3, mlflow, harnesses, states, seconds, root, new_sessions)
    finally:
        if mlflow is not None:
            mlflow.stop()
        s3.stop()


def _keys(client, prefix: str = "") -> list[str]:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return [o["Key"] for page in pages for o in page.get("Contents", [])]


# ------------------------------------------------------------ two pipelines, one server, one bucket


@pytest.mark.slow
def test_two_pipeline_runs_at_once_keep_their_runs_and_artifacts_apart(concurrent, tmp_path):
    from mlflow import MlflowClient
    from mlflow.entities import ViewType

    from bert_core.model.heads import BertForSequenceClassification
    from bert_core.model.modeling import BertForPreTraining
    from bert_core.serve import registry
    from bert_core.track import lineage

    c = concurrent
    for name, state in c.states.items():
        assert state == pod_harness.SUCCEEDED, c.logs(name)
    ids = {name: h.run_id for name, h in c.harnesses.items()}
    assert len(set(ids.values())) == len(RUNS)
    # at the same time: one after the other, they would take longer than their pods together
    assert c.seconds < sum(t.seconds for h in c.harnesses.values() for t in h.tasks)
    for name, h in c.harnesses.items():
        loop = [f"/exit-handler-1/for-loop-2[{i}]/finetune" for i in range(len(tasks_of(name)))]
        assert [t.path for t in h.tasks] == [
            "/exit-handler-1/pipeline-run", "/exit-handler-1/finetune-jobs",
            "/exit-handler-1/clean", "/exit-handler-1/vocab", "/exit-handler-1/instances",
            "/exit-handler-1/pretrain", *loop,
            "/exit-handler-1/evaluate", "/pipeline-end",
        ]  # fmt: skip
        assert {t.state for t in h.tasks} == {pod_harness.COMPLETE}
        assert {t.env["KFP_RUN_ID"] for t in h.tasks} == {h.run_id}

    client = MlflowClient(c.mlflow.url)
    experiment = client.get_experiment_by_name(lineage.PIPELINE_EXPERIMENT)
    runs = client.search_runs([experiment.experiment_id], run_view_type=ViewType.ALL)
    parents = {r.data.tags["kfp.run_id"]: r for r in runs if r.data.tags["bert.step"] == "pipeline"}
    assert sorted(parents) == sorted(ids.values())  # one parent per KFP run, no stray one
    steps: dict[str, dict[str, Any]] = {kfp_id: {} for kfp_id in parents}
    for run in runs:  # every step run sits under the parent of its own KFP run, once
        if run.data.tags["bert.step"] != "pipeline":
            kfp_id = run.data.tags["kfp.run_id"]
            assert run.data.tags["mlflow.parentRunId"] == parents[kfp_id].info.run_id
            assert run.data.tags["bert.step"] not in steps[kfp_id]
            steps[kfp_id][run.data.tags["bert.step"]] = run
    versions = client.search_model_versions(f"name='{registry.PRETRAINED}'")
    for name, args in RUNS.items():
        kfp_id, parent, own = ids[name], parents[ids[name]], steps[ids[name]]
        assert parent.info.status == "FINISHED"  # closed by its own exit handler
        assert parent.data.params["pretrain.steps"] == str(args["pretrain_steps"])
        assert parent.data.params["instances.random_seed"] == str(args["instances_random_seed"])
        assert set(own) == {"clean", "vocab", "instances", "pretrain", "evaluate",
                            *(f"finetune-{t}" for t in tasks_of(name))}  # fmt: skip
        assert {r.info.status for r in own.values()} == {"FINISHED"}
        assert own["pretrain"].data.params["steps"] == str(args["pretrain_steps"])
        assert own["instances"].data.params["random_seed"] == str(args["instances_random_seed"])
        (version,) = [v for v in versions if v.run_id == own["pretrain"].info.run_id]
        prefix = f"kfp/{kfp_id}/exit-handler-1"
        for task in tasks_of(name):
            params = own[f"finetune-{task}"].data.params
            # fine-tuned from its own pipeline's pre-trained model, on its own task's data
            assert params["model"].endswith(f"/{prefix}/pretrain/pretrained/model"), params
            assert params["data"] == f"{cluster.BUCKET}/data/glue/{task}"
            # its task's registered model: one version, from this run's fine-tuning
            (tuned,) = client.search_model_versions(f"name='{registry.model_name(task)}'")
            assert tuned.run_id == own[f"finetune-{task}"].info.run_id
        # its GLUE table: a row for each of its own tasks, with its own score, and no other
        table = client.download_artifacts(
            own["evaluate"].info.run_id, "glue/glue_table.md", str(tmp_path)
        )
        rows = task_rows(Path(table).read_text())
        assert sorted(rows) == sorted(tasks_of(name)), rows
        # its artifacts: complete under its own prefix, the models load, its own checkpoints
        s3 = c.harnesses[name].s3
        keys = set(_keys(s3, f"{prefix}/"))
        pretrained = f"{prefix}/pretrain/pretrained"
        for key in ("model/model.safetensors", "model/config.json", "model/vocab.txt",
                    "pretrain_metrics.csv"):  # fmt: skip
            assert f"{pretrained}/{key}" in keys, sorted(keys)
        assert f"{prefix}/evaluate/table" in keys
        with pods_s3_env(c.harnesses[name].objects):
            with storage.local_copy(f"{cluster.BUCKET}/{pretrained}/model") as model:
                BertForPreTraining.from_pretrained(model)
        csv = s3.get_object(Bucket=BUCKET, Key=f"{pretrained}/pretrain_metrics.csv")
        last = csv["Body"].read().decode().strip().splitlines()[-1]
        assert last.split(",")[0] == str(args["pretrain_steps"])  # trained its own steps
        for i, task in enumerate(tasks_of(name)):
            out = f"{prefix}/for-loop-2[{i}]/finetune/finetuned"
            body = s3.get_object(Bucket=BUCKET, Key=f"{out}/metrics.json")["Body"].read()
            metrics = json.loads(body)
            assert metrics["task"] == task
            assert rows[task].endswith(f"| {metrics['score']:.1f} |"), rows[task]
            with pods_s3_env(c.harnesses[name].objects):
                with storage.local_copy(f"{cluster.BUCKET}/{out}/model") as model:
                    loaded = BertForSequenceClassification.from_pretrained(model)
            assert loaded.config.num_labels == (1 if task == "STS-B" else 2)
        assert _keys(s3, f"ray/kfp-{kfp_id}/"), "no Ray checkpoints of its own"
        assert version.status == "READY"
    assert len(versions) == len(RUNS)
    # nothing left running, in any experiment of the shared server
    experiments = [e.experiment_id for e in client.search_experiments(view_type=ViewType.ALL)]
    every = client.search_runs(experiments, run_view_type=ViewType.ALL, max_results=1000)
    assert [r.info.run_name for r in every if r.info.status == "RUNNING"] == []


def tasks_of(name: str) -> list[str]:
    return RUNS[name]["finetune_tasks"]


def task_rows(markdown: str) -> dict[str, str]:
    """The GLUE table's per-task lines (`| SST-2 | accuracy 48.3 | 48.3 |`), by task."""
    return {
        line.split("|")[1].strip(): line.rstrip()
        for line in markdown.splitlines()
        if re.match(r"\| [A-Z][A-Za-z0-9-]* \| [a-z]", line)
    }


# ----------------------------------------------------------------------- secrets: search everything

Items = Callable[[], Iterator[tuple[str, bytes]]]  # an output's pieces: (where, content)


def _files(*roots: Path) -> Iterator[tuple[str, bytes]]:
    """Every regular file in `roots` (files, or folders walked without following links: the
    stand-in image's link to the repo's bert_core is not an output); a file gone meanwhile is
    skipped."""
    for root in roots:
        paths = [root] if root.is_file() else [
            Path(folder) / name for folder, _, names in os.walk(root) for name in names
        ]  # fmt: skip
        for path in paths:
            if path.is_file() and not path.is_symlink():
                try:
                    yield str(path), path.read_bytes()
                except FileNotFoundError:
                    continue


def _bucket(client, keys: list[str]) -> Iterator[tuple[str, bytes]]:
    for key in keys:
        yield f"s3://{BUCKET}/{key}", client.get_object(Bucket=BUCKET, Key=key)["Body"].read()


def _mlflow_records(client) -> Iterator[tuple[str, bytes]]:
    """Everything the tracking server returns: experiments, every run (params, tags, metric
    names, dataset inputs), registered models and their versions, logged models."""
    from mlflow.entities import ViewType

    experiments = client.search_experiments(view_type=ViewType.ALL)
    ids = [e.experiment_id for e in experiments]
    for e in experiments:
        yield f"experiment {e.name}", repr(dict(e)).encode()
    for run in client.search_runs(ids, run_view_type=ViewType.ALL, max_results=1000):
        yield f"run {run.info.run_name}", json.dumps(run.to_dictionary(), default=str).encode()
    for model in client.search_registered_models():
        yield f"registered model {model.name}", repr(dict(model)).encode()
        for v in client.search_model_versions(f"name='{model.name}'"):
            yield f"{model.name} version {v.version}", repr(dict(v)).encode()
    for logged in client.search_logged_models(ids):
        record = json.dumps(logged.to_dictionary(), default=str)
        yield f"logged model {logged.model_id}", record.encode()


def outputs(c: Concurrent, fresh_spec: Path) -> dict[str, Items]:
    """Every output of the two runs, by kind."""
    from mlflow import MlflowClient

    s3 = c.harnesses["a"].s3
    pods = [c.root / f"pods-{name}" for name in RUNS]
    return {
        "step logs": lambda: _files(*(t.log for h in c.harnesses.values() for t in h.tasks)),
        # the pods' folders (work, home, /s3 copies, KFP outputs), the servers' (their logs,
        # mlflow.db and its journals), the local Rays' session folders
        "files": lambda: _files(c.root, *c.ray_sessions),
        "metrics.json": lambda: (
            item for item in [*_files(*pods), *_bucket(s3, [k for k in _keys(s3) if k.endswith(
                "/metrics.json")])] if item[0].endswith("/metrics.json")
        ),  # fmt: skip
        "bucket objects": lambda: _bucket(s3, _keys(s3)),  # data, KFP artifacts, MLflow, Ray
        "MLflow records": lambda: _mlflow_records(MlflowClient(c.mlflow.url)),
        "compiled pipeline": lambda: _files(SPEC, fresh_spec),
    }


def search(places: dict[str, Items], needles: list[str]) -> tuple[list[tuple[str, str, str]], dict]:
    """(place, where, needle) for each needle found, and how many pieces each place had."""
    hits, counts = [], {}
    for place, items in places.items():
        counts[place] = 0
        for where, content in items():
            counts[place] += 1
            hits += [(place, where, n) for n in needles if n.encode() in content]
    return hits, counts


def git_grep(needles: list[str]) -> list[tuple[str, str, str]]:
    """The repository's files, tracked and untracked-but-not-ignored, for each needle."""
    hits = []
    for needle in needles:
        out = subprocess.run(["git", "grep", "-l", "-F", "--untracked", "-e", needle],
                             cwd=ROOT, capture_output=True, text=True)  # fmt: skip
        assert out.returncode in (0, 1), out.stderr  # 1: not found
        hits += [("git", path, needle) for path in out.stdout.split()]
    return hits


@pytest.mark.slow
def test_no_planted_credential_reaches_any_output_of_the_runs(concurrent, tmp_path):
    from mlflow import MlflowClient

    c = concurrent
    for name, state in c.states.items():
        assert state == pod_harness.SUCCEEDED, c.logs(name)
    secrets, user, key_id = c.planted.secrets(), c.planted.mlflow_username, c.planted.s3_key_id
    for task in (t for h in c.harnesses.values() for t in h.tasks):  # the pods did hold them
        assert {*secrets, user, key_id} <= set(task.env.values()), task.path
    # the pipeline compiled afresh in an environment holding them, its image named on purpose
    control = f"planted-CONTROL-{uuid.uuid4().hex}"
    fresh = tmp_path / "bert_pipeline.yaml"
    env = {**os.environ, "PYTHONPATH": str(ROOT), **c.planted.s3(), **c.planted.mlflow_auth(),
           "MLFLOW_TRACKING_TOKEN": c.planted.mlflow_token}  # fmt: skip
    compiled = subprocess.run(
        [sys.executable, "-m", "pipelines.bert_pipeline", "compile", "--output", str(fresh),
         "--image", f"registry.example/{control}:1"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert compiled.returncode == 0, compiled.stderr
    # the positive control: the marker, written on purpose into one output of each kind
    a = c.harnesses["a"]
    with a.tasks[-1].log.open("a") as log:
        log.write(f"\n{control}\n")
    finetuned = next(a.workdir.glob("pod-*-finetune/s3/**/finetuned/metrics.json"))
    finetuned.write_text(finetuned.read_text() + control)
    a.s3.put_object(Bucket=BUCKET, Key="control/marker.txt", Body=control.encode())
    client = MlflowClient(c.mlflow.url)
    experiment = client.get_experiment_by_name("bert-pipeline").experiment_id
    (parent,) = client.search_runs(
        [experiment], f"tags.`kfp.run_id` = '{a.run_id}' and tags.`bert.step` = 'pipeline'"
    )
    client.set_tag(parent.info.run_id, "control", control)

    places = outputs(c, fresh)
    hits, counts = search(places, [*secrets, user, key_id, control])
    hits += git_grep([*secrets, user, key_id, GIT_CONTROL])
    print(f"\nsearched {counts} and git for {len(secrets)} secrets, 2 identities, 2 controls; "
          f"{len(c.ray_sessions)} Ray session folders")  # fmt: skip
    found = {n: [(place, where) for place, where, needle in hits if needle == n]
             for n in [*secrets, user, key_id, control, GIT_CONTROL]}  # fmt: skip
    assert {place for place, _ in found[control]} == set(places), found[control]
    assert found[GIT_CONTROL] == [("git", "tests/test_concurrency.py")]
    assert counts["step logs"] == sum(len(h.tasks) for h in c.harnesses.values())
    assert counts["metrics.json"] >= 2 * sum(len(tasks_of(n)) for n in RUNS)  # pod + bucket
    assert len(c.ray_sessions) >= len(RUNS)  # each pretrain pod's local Ray
    # no secret anywhere
    assert [hit for n in secrets for hit in found[n]] == []
    # The auth user name is an identity: MLflow records it as the runs' user (`mlflow.user`, as
    # it records the login name without auth), in its store and nowhere else.
    assert {place for place, _ in found[user]} == {"files", "MLflow records"}
    stores = {Path(where).parent for place, where in found[user] if place == "files"}
    assert stores == {c.mlflow.log.parent}, found[user]  # mlflow.db (and its journal)
    runs = [json.loads(body) for where, body in places["MLflow records"]() if where[:4] == "run "]
    users = [r["data"]["tags"].get("mlflow.user") for r in runs]
    assert set(users) == {user, None}  # the parents, made by MlflowClient.create_run, have none
    # The S3 access key id is an identity too (SigV4 sends it with every request): it may show
    # only in the S3 server's own request log, as the credential scope of the presigned URLs
    # the MLflow server hands its clients for downloads (the test above downloads a table).
    assert {where for _, where in found[key_id]} <= {str(c.s3.log)}, found[key_id]
    for line in c.s3.log.read_text(errors="replace").splitlines():
        assert line.count(key_id) == line.count(f"X-Amz-Credential={key_id}/"), line


# ---------------------------------------------------------- two fine-tunings, one new SQLite store


@pytest.mark.slow
def test_two_finetunes_at_once_on_one_new_sqlite_store(tmp_path, shared_data, tiny_dir):
    from mlflow import MlflowClient

    db = tmp_path / "store" / "mlflow.db"  # new: the tables are made by whichever comes first
    uri = f"sqlite:///{db}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BERT_", "KFP_", "MLFLOW_"))}
    env |= {"PYTHONPATH": str(ROOT), "MLFLOW_TRACKING_URI": uri, "OMP_NUM_THREADS": "1"}
    seeds = (1, 2)
    procs = {
        seed: subprocess.Popen(
            [sys.executable, "-m", "bert_core", "finetune", "--task", "SST-2",
             "--data", str(shared_data / "glue" / "SST-2"), "--model", str(tiny_dir),
             "--output", str(tmp_path / f"seed-{seed}"), "--epochs", "1",
             "--max-train-examples", "64", "--max-eval-examples", "64",
             "--max-seq-length", "32", "--seed", str(seed)],
            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        for seed in seeds
    }
    logs = {seed: p.communicate(timeout=600)[0] for seed, p in procs.items()}
    for seed, p in procs.items():
        assert p.returncode == 0, logs[seed][-3000:]

    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("bert").experiment_id])
    by_seed = {int(r.data.params["seed"]): r for r in runs}
    assert sorted(by_seed) == list(seeds) and len(runs) == len(seeds)
    versions = {v.run_id: v for v in client.search_model_versions("name='bert-sst2'")}
    assert sorted(int(v.version) for v in versions.values()) == [1, 2]  # none clobbered
    for seed, run in by_seed.items():
        out = tmp_path / f"seed-{seed}"
        result = json.loads((out / "metrics.json").read_text())
        assert run.info.status == "FINISHED" and result["config"]["seed"] == seed
        accuracy = 100 * result["metrics"]["accuracy"]
        assert run.data.metrics["dev/accuracy"] == pytest.approx(accuracy)
        record = json.loads((out / "mlflow_model.json").read_text())
        assert record["run_id"] == run.info.run_id  # its own run's model, its own version
        assert run.data.tags["bert.model_version"] == str(versions[run.info.run_id].version)
