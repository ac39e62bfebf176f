"""The cluster path without a cluster: the compiled pipeline run pod by pod by the rules of the
pinned Kubeflow backend (`tests/cluster/pod_harness.py`, which cites the backend's source for each)
against a real S3 server, a real MLflow server and a real Ray head, on `s3://` data, with the
environment the platform spec takes from the manifests in infra/k8s/env; plus the pieces it
stands on: the pods' environment and placement (`tests/cluster/pod_env.py`), the refusal of
workstation paths, and the data digests that reach the cache keys and MLflow.

The servers are infra/scripts/local_services.py's (moto S3, `mlflow server`), on loopback, with
a bucket named as the cluster's (`s3://bert`), so the pipeline's cluster defaults for its data
(`s3://bert/data/...`) are used as they are. The whole-pipeline run submits pre-training through
the Ray Jobs API of a local `ray start --head` (dashboard on, token authentication with the
token of the manifests' `bert-ray-auth` Secret): the ConfigMap's RAY_ADDRESS is mapped to that
head, as a cluster's DNS maps it to the RayCluster's head service. Nothing here needs root.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from bert_core import storage
from bert_core.serve import registry
from infra.scripts import mlflow_users
from pipelines import cluster
from pipelines.bert_pipeline import DEFAULTS, P, form_arguments
from tests.cluster import pod_env, pod_harness, secrets
from tests.cluster.secrets import Items, Planted
from tests.pipeline_helpers import (
    GLUE_TASKS,
    ROOT,
    SPEC,
    RayHead,
    cluster_objects,
    git_head,
    pipeline_args,
    pods_s3_env,
    start_cluster_mlflow,
    start_cluster_s3,
    upload_data_slice,
)

BUCKET = cluster.BUCKET.removeprefix("s3://")
# the settings of a small whole-DAG run (tests/pipeline_helpers.py), as pipeline parameters
SMALL_ARGS = pipeline_args(GLUE_TASKS)
# the compression branch on for SST-2: the tiny model's student keeps 1 of its 2 layers
COMPRESS = {
    "compress_task": "SST-2",
    "compress_student_layers": 1,
    "compress_student_ffn_share": 0.5,
}
# the paper's phase two on (the cluster's default): a few steps at 512 tokens from phase one
PHASE2_STEPS = {"pretrain_phase2_steps": 4}
TRAIN_IMAGE = "registry.example/bert-cuda:ci"
IMAGE_ENV = {"PYTHONUNBUFFERED": "1", "BERT_GIT_COMMIT": git_head(), "OMP_NUM_THREADS": "1"}
# Two runs at once that differ in every setting a mix-up would show: tasks, steps, seed, where
# pre-training runs (the Ray head's Jobs API, a private Ray in the pod)
RUNS = {
    "a": {**SMALL_ARGS, **COMPRESS, **PHASE2_STEPS, "cluster_train_image": TRAIN_IMAGE},
    "b": pipeline_args(
        ["MRPC"], pretrain_steps=7, instances_random_seed=22, finetune_control_tasks=[]
    ),
}
RAY_TMP = Path("/tmp/ray")  # where a local Ray keeps its session folders (logs, sockets)


def _secret() -> dict[str, str]:
    return pod_env.manifest_objects()[("Secret", cluster.SECRET)]


def _config() -> dict[str, str]:
    return pod_env.manifest_objects()[("ConfigMap", cluster.CONFIG_MAP)]


@pytest.fixture(scope="module")
def planted() -> Planted:
    """The fake credentials this module's cluster holds (tests/cluster/secrets.py): the S3
    Secret's keys, the optional `bert-mlflow-auth` Secret and a token in the image."""
    return Planted.new()


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """The servers' and the whole runs' pods' folders: what the secret search walks."""
    return tmp_path_factory.mktemp("cluster")


@pytest.fixture(scope="module")
def s3_server(root, planted):
    """S3 with the cluster's bucket (`bert`), started with the planted S3 keys, so the pods'
    credentials are the server's (moto takes any)."""
    s3 = start_cluster_s3(root / "s3", BUCKET, planted.s3())
    yield s3
    s3.stop()


@pytest.fixture(scope="module")
def servers(s3_server, root, planted):
    """(S3, MLflow): the MLflow server keeps its artifacts in s3://bert/mlflow, behind MLflow's
    basic-auth app as infra/k8s/mlflow.yaml runs it, with the users its Job makes
    (infra/scripts/mlflow_users.py): the pipeline's identity is the planted `bert-mlflow-auth`
    Secret's, so every pod of the whole runs works as it (and anonymously would get 401). This
    process reads the records as the reader identity."""
    admin = uuid.uuid4().hex
    mlflow = start_cluster_mlflow(
        root / "mlflow", s3_server.url, f"{cluster.BUCKET}/mlflow", planted.s3(), admin
    )
    users = {
        "PIPELINE": (planted.mlflow_username, planted.mlflow_password),
        "RELEASE": ("bert-release", uuid.uuid4().hex),
        "READER": ("bert-reader", uuid.uuid4().hex),
    }
    models = sorted(
        {registry.model_name(t) for args in RUNS.values() for t in args["finetune_tasks"]}
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_USERNAME", "admin")
        mp.setenv("MLFLOW_TRACKING_PASSWORD", admin)
        mlflow_users.bootstrap(mlflow.url, users, models)
        mp.setenv("MLFLOW_TRACKING_USERNAME", users["READER"][0])
        mp.setenv("MLFLOW_TRACKING_PASSWORD", users["READER"][1])
        yield s3_server, mlflow
    mlflow.stop()


@pytest.fixture(scope="module")
def s3_data(s3_server, planted, shared_data) -> None:
    """The data slice every run of this module reads, under the cluster's data defaults
    (s3://bert/data): one fixture, so a test that runs the pipeline alone finds it too."""
    import boto3

    keys = {key.lower(): value for key, value in planted.s3().items()}
    region = _config()["AWS_DEFAULT_REGION"]
    client = boto3.client("s3", endpoint_url=s3_server.url, region_name=region, **keys)
    tasks = sorted({t for args in RUNS.values() for t in args["finetune_tasks"]})
    upload_data_slice(shared_data, client, BUCKET, tasks)


@pytest.fixture
def s3_client_env(monkeypatch, s3_server):
    """This process as an S3 client of the test server (for storage.* and checks)."""
    s3 = s3_server
    for key, value in {**_secret(), "AWS_ENDPOINT_URL": s3.url}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("AWS_DEFAULT_REGION", _config()["AWS_DEFAULT_REGION"])
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    return s3


def _objects(servers, ray_dashboard: str = "", planted: Planted | None = None) -> pod_env.Objects:
    """The manifests' ConfigMap and Secrets, their service URLs mapped to the test servers (the
    Ray head's to `ray_dashboard`; "": pretrain trains in its own pod on a private local Ray);
    with `planted`, the S3 Secret's keys and the optional MLflow auth Secret are those."""
    s3, mlflow = servers
    objects = pod_env.manifest_objects()
    if planted is not None:
        objects[("Secret", cluster.SECRET)] = planted.s3()
        objects[("Secret", cluster.AUTH_SECRET)] = planted.mlflow_auth()
    return cluster_objects(objects, s3.url, mlflow.url, ray_dashboard)


@pytest.fixture(scope="module")
def ray_head(servers, planted):
    """The RayCluster's head: the Jobs API behind the token of the `bert-ray-auth` Secret, with
    what KubeRay gives the Ray pods (infra/k8s/raycluster.yaml's envFrom: the ConfigMap, the S3
    Secret and the optional MLflow auth Secret, here the planted ones; services mapped here)."""
    objects = _objects(servers, planted=planted)
    pods = {**objects[("ConfigMap", cluster.CONFIG_MAP)], **objects[("Secret", cluster.SECRET)]}
    pods |= objects[("Secret", cluster.AUTH_SECRET)]
    pods.pop("RAY_ADDRESS")
    env = {**os.environ, **pods, "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("AWS_ENDPOINT_URL_S3", None)
    (token,) = pod_env.manifest_objects()[("Secret", cluster.RAY_AUTH_SECRET)].values()
    head = RayHead(env, token=token)
    try:
        head.wait_ready()
        yield head
    finally:
        head.stop()


# --------------------------------------------------------------------------- the pods' environment


def test_pod_env_is_the_manifests_config_map_and_secret_and_the_run_id_label():
    objects = pod_env.manifest_objects()
    _, platform = pod_harness.load_spec(SPEC)
    env = pod_env.pod_env(platform, "exec-clean", objects, {"pipeline/runid": "run-7"})
    config, secret = objects[("ConfigMap", cluster.CONFIG_MAP)], objects[("Secret", cluster.SECRET)]
    auth = objects[("Secret", cluster.AUTH_SECRET)]  # the pipeline's MLflow identity
    assert env == {**config, **secret, **auth, "KFP_RUN_ID": "run-7"}
    assert set(env) == {
        *cluster.CONFIG_KEYS,
        *cluster.SECRET_KEYS,
        *cluster.AUTH_KEYS,
        "KFP_RUN_ID",
    }
    # bert-mlflow-auth is optional: without it (a server without auth) the pod starts anyway
    without = {k: v for k, v in objects.items() if k != ("Secret", cluster.AUTH_SECRET)}
    env = pod_env.pod_env(platform, "exec-clean", without, {"pipeline/runid": "run-7"})
    assert env == {**config, **secret, "KFP_RUN_ID": "run-7"}
    # a required key the ConfigMap lacks stops the pod, as Kubernetes does
    uri = objects[("ConfigMap", cluster.CONFIG_MAP)].pop("MLFLOW_TRACKING_URI")
    with pytest.raises(pod_env.PodConfigError, match="couldn't find key MLFLOW_TRACKING_URI"):
        pod_env.pod_env(platform, "exec-clean", objects, {})
    objects[("ConfigMap", cluster.CONFIG_MAP)]["MLFLOW_TRACKING_URI"] = uri
    del objects[("Secret", cluster.SECRET)]
    with pytest.raises(pod_env.PodConfigError, match="secret 'bert-s3' not found"):
        pod_env.pod_env(platform, "exec-clean", objects, {})


def test_localize_maps_every_cluster_service_or_fails():
    objects = pod_env.manifest_objects()
    config = objects[("ConfigMap", cluster.CONFIG_MAP)]
    services = {config["MLFLOW_TRACKING_URI"]: "http://127.0.0.1:1"}
    services[config["AWS_ENDPOINT_URL"]] = "http://127.0.0.1:2"
    with pytest.raises(pod_env.PodConfigError, match="RAY_ADDRESS=http://bert-ray-head-svc"):
        pod_env.localize(objects, services)
    mapped = pod_env.localize(
        objects,
        {
            config["MLFLOW_TRACKING_URI"]: "http://127.0.0.1:1",
            config["AWS_ENDPOINT_URL"]: "http://127.0.0.1:2",
            config["RAY_ADDRESS"]: "",
        },
    )[("ConfigMap", cluster.CONFIG_MAP)]
    assert mapped["MLFLOW_TRACKING_URI"] == "http://127.0.0.1:1"
    assert mapped["AWS_ENDPOINT_URL"] == mapped["MLFLOW_S3_ENDPOINT_URL"] == "http://127.0.0.1:2"
    assert mapped["RAY_ADDRESS"] == ""
    assert mapped["BERT_RAY_STORAGE"] == config["BERT_RAY_STORAGE"] == f"{cluster.BUCKET}/ray"


@pytest.mark.parametrize(
    "arguments",
    [
        {k: P[k] for k in cluster.DATA},  # params.yaml's workstation paths
        {"data_glue": str(ROOT.parent / "shared" / "data" / "glue")},
        {"data_corpus": "file:///data/corpus"},
    ],
)
def test_harness_refuses_workstation_paths_before_any_pod_runs(tmp_path, arguments):
    objects = pod_env.localize(
        pod_env.manifest_objects(),
        {v: "" for v in _config().values() if v.startswith("http://")},
    )
    harness = pod_harness.Harness(SPEC, objects, tmp_path)
    with pytest.raises(pod_harness.WorkstationPath, match="is a path on this machine"):
        harness.run(arguments)
    # refused when the first task reading data (pipeline-run) had its inputs resolved
    assert [t.path for t in harness.tasks] == [f"{BODY}/settings"]


# ------------------------------------------------------------------------------- data identity


def test_digest_sees_one_changed_byte_and_agrees_with_its_s3_upload(tmp_path, s3_client_env):
    data = tmp_path / "corpus"
    (data / "more").mkdir(parents=True)
    (data / "a.txt").write_text("It was the best of times.\n")
    (data / "more" / "b.txt").write_text("It was the worst of times.\n")
    before = storage.digest(data)
    s3 = storage.s3_client()
    for f in (data / "a.txt", data / "more" / "b.txt"):
        s3.upload_file(str(f), BUCKET, f"digest/corpus/{f.relative_to(data).as_posix()}")
    assert storage.digest(f"s3://{BUCKET}/digest/corpus") == before  # ETags are the md5s
    (data / "a.txt").write_text("It was the best of timez.\n")  # one byte
    assert storage.digest(data) != before
    s3.upload_file(str(data / "a.txt"), BUCKET, "digest/corpus/a.txt")
    assert storage.digest(f"s3://{BUCKET}/digest/corpus") == storage.digest(data) != before
    assert len(before) == 32 and storage.digest() != before  # no inputs: a digest of nothing
    with pytest.raises(FileNotFoundError, match="no such"):
        storage.digest(f"s3://{BUCKET}/digest/nothing-here")


def test_local_copy_reads_s3_objects_and_prefixes_and_passes_local_paths(tmp_path, s3_client_env):
    s3 = storage.s3_client()
    s3.put_object(Bucket=BUCKET, Key="copy/task/train.tsv", Body=b"sentence\tlabel\n")
    s3.put_object(Bucket=BUCKET, Key="copy/task/sub/dev.tsv", Body=b"x\t1\n")
    s3.put_object(Bucket=BUCKET, Key="copy/book.txt", Body=b"Call me Ishmael.\n")
    with storage.local_copy(f"s3://{BUCKET}/copy/task") as folder:
        assert folder.name == "task"
        assert (folder / "train.tsv").read_bytes() == b"sentence\tlabel\n"
        assert (folder / "sub" / "dev.tsv").read_bytes() == b"x\t1\n"
    assert not folder.exists()  # removed afterwards
    with storage.local_copy(f"s3://{BUCKET}/copy/book.txt") as book:
        assert book.name == "book.txt" and book.read_text() == "Call me Ishmael.\n"
    with storage.local_copy(tmp_path) as same:
        assert same == tmp_path
    with pytest.raises(FileNotFoundError), storage.local_copy(f"s3://{BUCKET}/copy/none"):
        pass


# --------------------------------------------------------------------------- the whole pipeline


@pytest.fixture(scope="module")
def cache():
    """The backend's cache, shared by the runs of this module (the KFP database's task table)."""
    return pod_harness.Cache()


@dataclass
class Runs:
    """The two pipeline runs made at once (RUNS' names -> harness, final state)."""

    harnesses: dict[str, pod_harness.Harness]
    states: dict[str, str]
    seconds: float
    ray_sessions: list[Path]  # the Ray session folders of the runs (private Rays, the head's)

    def logs(self, name: str) -> str:
        return _logs(self.harnesses[name])


def _ray_sessions() -> set[Path]:
    return set(RAY_TMP.glob("session_2*")) if RAY_TMP.is_dir() else set()


@pytest.fixture(scope="module")
def runs(servers, s3_data, ray_head, planted, cache, root) -> Runs:
    """The compiled pipeline run twice at once, a thread each, against one S3 server with one
    bucket, one MLflow server and one Ray head, every pod and the servers holding the planted
    keys. `a`: small settings, the random-init control and the compression branch on for
    SST-2, pre-training submitted to the Ray head's Jobs API, a GPU image named for the
    trainings (resolved, not pulled). `b`: other tasks, steps and seed, pre-training on a
    private Ray in its pod (a cluster without a RayCluster)."""
    image_env = {**IMAGE_ENV, "MLFLOW_TRACKING_TOKEN": planted.mlflow_token}  # beside the Secret
    harnesses = {
        name: pod_harness.Harness(
            SPEC,
            _objects(servers, ray_head.url if name == "a" else "", planted),
            root / f"pods-{name}",
            image_env=image_env,
            cache=cache if name == "a" else None,
        )
        for name in RUNS
    }
    before, start = _ray_sessions(), time.monotonic()
    with ThreadPoolExecutor(len(RUNS)) as pool:
        futures = {
            name: pool.submit(h.run, form_arguments(RUNS[name])) for name, h in harnesses.items()
        }
        states = {name: f.result() for name, f in futures.items()}
    seconds = time.monotonic() - start
    print(f"\ntwo pipeline runs at once: {seconds:.0f} s")
    sessions = [*sorted(_ray_sessions() - before), Path(ray_head.tmp)]
    return Runs(harnesses, states, seconds, sessions)


@pytest.fixture(scope="module")
def pipeline_run(runs):
    """Run `a`: (harness, final state, its pods' logs)."""
    return runs.harnesses["a"], runs.states["a"], runs.logs("a")


BODY = "/exit-handler-1"
# phase two's branches: run a takes the paper's phase two, run b (0 steps) the other; each holds
# a copy of the fine-tuning fan-out and evaluate (KFP names the second copies' tasks `-2`)
PHASE2 = f"{BODY}/condition-branches-2/condition-6"
ONE_PHASE = f"{BODY}/condition-branches-2/condition-7"
LOOP = f"{PHASE2}/for-loop-3"  # run a's fine-tuning fan-out
COMPRESS_BRANCH = f"{LOOP}[0]/condition-4"  # compress_task's iteration only
FINAL = {  # where each run's fine-tunings and evaluate are, and the model they fine-tune
    "a": (LOOP, "finetune", f"{PHASE2}/evaluate", f"{PHASE2}/pretrain-phase2"),
    "b": (f"{ONE_PHASE}/for-loop-8", "finetune-2", f"{ONE_PHASE}/evaluate-2", f"{BODY}/pretrain"),
}


def _execution(harness, path: str):
    """The ML Metadata execution of the DAG at `path` (e.g. PHASE2)."""
    execution = harness.dag
    for name in path.strip("/").split("/"):
        (execution,) = [e for e in execution.children if e.name == name]
    return execution


def _logs(harness) -> str:
    return "\n".join(f"--- {t.path}\n{t.log.read_text()[-3000:]}" for t in harness.tasks)


def _end_state(harness) -> str:
    """The state the exit handler was handed (its PipelineTaskFinalStatus input)."""
    (end,) = [t for t in harness.tasks if "status" in t.parameters]
    return end.parameters["status"]["state"]


def _parent(mlflow_url: str, harness):
    from mlflow import MlflowClient

    client = MlflowClient(mlflow_url)
    experiment = client.get_experiment_by_name("bert-pipeline")
    (parent,) = client.search_runs(
        [experiment.experiment_id],
        filter_string=f"tags.`kfp.run_id` = '{harness.run_id}' and tags.`bert.step` = 'pipeline'",
    )
    return parent


@pytest.mark.slow
def test_compiled_pipeline_runs_as_pods_on_s3_data(pipeline_run, ray_head, planted):
    harness, state, logs = pipeline_run
    assert state == pod_harness.SUCCEEDED, logs
    ran = [(t.path, t.state) for t in harness.tasks]
    assert ran == [
        (f"{BODY}/settings", "COMPLETE"),  # advanced_settings, split into typed outputs
        (f"{BODY}/pipeline-run", "COMPLETE"),
        (f"{BODY}/finetune-jobs", "COMPLETE"),
        (f"{BODY}/clean", "COMPLETE"),
        (f"{BODY}/vocab", "COMPLETE"),
        (f"{BODY}/instances", "COMPLETE"),
        (f"{BODY}/pretrain", "COMPLETE"),
        (f"{PHASE2}/instances-2", "COMPLETE"),  # at 512 tokens
        (f"{PHASE2}/pretrain-phase2", "COMPLETE"),
        (f"{LOOP}[0]/finetune", "COMPLETE"),
        (f"{COMPRESS_BRANCH}/distill", "COMPLETE"),  # compress_task: SST-2's job only
        (f"{COMPRESS_BRANCH}/quantize", "COMPLETE"),
        (f"{LOOP}[1]/finetune", "COMPLETE"),
        (f"{LOOP}[2]/finetune", "COMPLETE"),  # the random-init control
        (f"{PHASE2}/evaluate", "COMPLETE"),
        ("/pipeline-end", "COMPLETE"),
    ]
    # the untriggered branches (the release branch, deploy_task none, in every iteration; the
    # compression branch in iterations 1 and 2) were created CANCELED by their drivers after the
    # iteration's last launcher published, so nothing settles the iterations, the loop or the
    # body (metadata/client.go UpdateDAGExecutionsState runs in launchers only): the exit
    # handler is handed RUNNING, and closes the run by evaluate's record
    assert _execution(harness, ONE_PHASE).state == "CANCELED"  # phase two ran: not its Else
    loop = _execution(harness, LOOP)
    assert [i.state for i in loop.children] == ["RUNNING", "RUNNING", "RUNNING"]
    assert [[c.state for c in i.children] for i in loop.children] == [
        ["COMPLETE", "COMPLETE", "CANCELED"],
        ["COMPLETE", "CANCELED", "CANCELED"],
        ["COMPLETE", "CANCELED", "CANCELED"],
    ]
    assert _end_state(harness) == "RUNNING"
    by_path = {t.path: t for t in harness.tasks}
    for task in harness.tasks:
        # every pod: the ConfigMap and the Secret, the run id from the label; nothing else
        assert set(task.env) >= {*cluster.CONFIG_KEYS, *cluster.SECRET_KEYS}, task.path
        assert task.env["KFP_RUN_ID"] == harness.run_id
        assert task.env["MLFLOW_TRACKING_URI"].startswith("http://127.0.0.1:")
        assert task.env["RAY_ADDRESS"] == ray_head.url
        assert {k: task.env[k] for k in cluster.AUTH_KEYS} == planted.mlflow_auth()
        pretrain = task.path.endswith(("/pretrain", "/pretrain-phase2"))  # submit Ray jobs
        assert ("RAY_AUTH_TOKEN" in task.env) == pretrain, task.path
        finetune = task.path.endswith(("/finetune", "/distill"))  # the trainings: GPU nodes
        assert task.image == (TRAIN_IMAGE if finetune else cluster.IMAGE)
        assert (task.accelerator or {}).get("resourceCount") == ("0" if finetune else None)
        tolerations = cluster.GPU_TOLERATIONS if finetune else []
        assert task.placement == pod_env.Placement({}, tolerations), task.path
    # pre-training went through the Ray Jobs API: the head ran both phases' jobs, the pods
    # followed them; phase two's job read phase one's model from the run's storage, where its
    # step uploaded it (no Ray worker can read a pod's folder)
    jobs = ray_head.jobs()
    assert [j["status"] for j in jobs.values()] == ["SUCCEEDED", "SUCCEEDED"], jobs
    assert "Ray job bert-pretrain-" in by_path[f"{BODY}/pretrain"].log.read_text()
    phase2 = by_path[f"{PHASE2}/pretrain-phase2"]
    start = f"{cluster.BUCKET}/ray/kfp-{harness.run_id}-phase2/init-model"
    assert f"files of init-model to {start}" in phase2.log.read_text()
    (job,) = [j for j in jobs.values() if "--init-model" in j["entrypoint"]]
    assert f"--init-model {start}" in job["entrypoint"]
    # both jobs read their instances where the instances steps wrote them, under the pipeline
    # root: the pre-training pods took the URI, downloaded no shard and copied none to Ray
    root = f"{cluster.BUCKET}/kfp/{harness.run_id}"
    for job in jobs.values():
        argv = shlex.split(job["entrypoint"])
        step = f"{PHASE2}/instances-2" if "--init-model" in argv else f"{BODY}/instances"
        assert argv[argv.index("--instances") + 1] == f"{root}{step}/shards", argv
    for task in (by_path[f"{BODY}/pretrain"], phase2):
        assert not list((task.log.parent / "s3").rglob("*.parquet")), task.path
        assert "files of instances" not in task.log.read_text(), task.path
    assert by_path[f"{PHASE2}/instances-2"].parameters["max_seq_length"] == 512
    assert phase2.parameters["steps"] == RUNS["a"]["pretrain_phase2_steps"]
    with pods_s3_env(harness.objects):  # its model's record: 512 positions trained
        record = f"{cluster.BUCKET}/kfp/{harness.run_id}{PHASE2}/pretrain-phase2/pretrained"
        with storage.local_copy(f"{record}/model/mlflow_run.json") as path:
            assert json.loads(path.read_text())["trained_positions"] == 512
    clean = by_path[f"{BODY}/clean"].parameters
    assert clean["corpus"] == f"{cluster.BUCKET}/data/corpus"
    jobs = [by_path[f"{LOOP}[{i}]/finetune"].parameters["job"] for i in range(3)]
    assert [j["name"] for j in jobs] == ["SST-2", "STS-B", "SST-2 (random init)"]
    options = dict(zip(jobs[0]["options"][::2], jobs[0]["options"][1::2], strict=True))
    assert options["--data"] == f"{cluster.BUCKET}/data/glue/SST-2"
    assert options["--init"] == "pretrained"
    assert "--init" in jobs[2]["options"] and "random" in jobs[2]["options"]
    # the digests the first tasks output are the data's, and reached the cache-keyed inputs
    assert clean["corpus_digest"] == _digest(harness, f"{cluster.BUCKET}/data/corpus")
    assert jobs[0]["data_digest"] == _digest(harness, f"{cluster.BUCKET}/data/glue/SST-2")
    assert jobs[1]["data_digest"] == _digest(harness, f"{cluster.BUCKET}/data/glue/STS-B")
    # the student: SST-2's fine-tuned model taught to 1 layer of the run's pre-trained model,
    # keyed by the SST-2 data's digest (the loop item's field, through the selector); then int8
    distill = by_path[f"{COMPRESS_BRANCH}/distill"].parameters
    assert distill["task"] == "SST-2" and distill["student_layers"] == 1
    assert distill["student_ffn_share"] == 0.5
    assert distill["student"] == "pretrained"
    assert distill["data_digest"] == jobs[0]["data_digest"]
    quantize = by_path[f"{COMPRESS_BRANCH}/quantize"].parameters
    assert quantize["data_digest"] == jobs[0]["data_digest"]
    # evaluate's pod got each fine-tuning's metrics.json, not its model (the launcher downloads
    # an input artifact whole)
    got = [p for p in (by_path[f"{PHASE2}/evaluate"].log.parent / "s3").rglob("*") if p.is_file()]
    assert sorted(p.name for p in got if "result" in p.parts) == ["metrics.json"] * 3
    assert not [p for p in got if p.suffix == ".safetensors"]  # its own outputs are the rest


@pytest.mark.slow
def test_a_rerun_is_cached_and_the_exit_handler_still_closes_the_run(
    pipeline_run, servers, ray_head, planted, cache, tmp_path
):
    """The same run again, against the backend's cache: every cached step is a cache hit (no
    pod), and the four uncached tasks run. No launcher published in the fan-out or after the
    cached steps, so the backend never settles the body's DAG and hands the exit handler
    RUNNING (metadata/client.go UpdateDAGExecutionsState); the exit handler then reads the
    run's record, finds evaluate FINISHED under this run's parent, and closes it FINISHED."""
    first, state, logs = pipeline_run
    assert state == pod_harness.SUCCEEDED, logs
    harness = pod_harness.Harness(
        SPEC,
        _objects(servers, ray_head.url, planted),
        tmp_path,
        image_env=IMAGE_ENV,
        cache=cache,
    )
    state = harness.run(form_arguments(RUNS["a"]))
    assert state == pod_harness.SUCCEEDED, _logs(harness)
    states = {t.path: t.state for t in harness.tasks}
    uncached = {f"{BODY}/pipeline-run", f"{BODY}/finetune-jobs", f"{PHASE2}/evaluate"}
    assert {p for p, s in states.items() if s == "COMPLETE"} == {*uncached, "/pipeline-end"}
    assert {p for p, s in states.items() if s == "CACHED"} == {
        f"{BODY}/settings",
        f"{BODY}/clean",
        f"{BODY}/vocab",
        f"{BODY}/instances",
        f"{BODY}/pretrain",
        f"{PHASE2}/instances-2",
        f"{PHASE2}/pretrain-phase2",
        f"{LOOP}[0]/finetune",
        f"{LOOP}[1]/finetune",
        f"{LOOP}[2]/finetune",
        f"{COMPRESS_BRANCH}/distill",
        f"{COMPRESS_BRANCH}/quantize",
    }
    keys = {t.path: t.cache_key for t in first.tasks}
    assert all(t.cache_key == keys[t.path] for t in harness.tasks if t.state == "CACHED")
    assert len(ray_head.jobs()) == 2  # no new Ray job: the two phases' of the first run
    assert _end_state(harness) == "RUNNING"
    _, mlflow = servers
    parent = _parent(mlflow.url, harness)
    assert parent.info.status == "FINISHED"
    assert parent.info.run_id != _parent(mlflow.url, first).info.run_id


def _digest(harness, *uris: str) -> str:
    """storage.digest with the pods' S3 settings (this process has none of its own)."""
    with pods_s3_env(harness.objects):
        return storage.digest(*uris)


@pytest.mark.slow
def test_glue_table_lands_in_mlflow_under_one_finished_parent_run(
    pipeline_run, servers, monkeypatch
):
    from mlflow import MlflowClient

    from bert_core.track import lineage

    harness, state, logs = pipeline_run
    assert state == pod_harness.SUCCEEDED, logs
    _, mlflow = servers
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow.url)  # for lineage.child_runs
    client = MlflowClient(mlflow.url)
    experiment = client.get_experiment_by_name(lineage.PIPELINE_EXPERIMENT)
    (parent,) = client.search_runs(
        [experiment.experiment_id],
        filter_string=f"tags.`kfp.run_id` = '{harness.run_id}' and tags.`bert.step` = 'pipeline'",
    )
    assert parent.info.status == "FINISHED"  # closed by the exit handler
    assert parent.data.tags["mlflow.source.git.commit"] == git_head()  # the image's commit
    params = parent.data.params
    assert params["data.corpus"] == f"{cluster.BUCKET}/data/corpus"
    assert params["pretrain.steps"] == "20" and params["kfp.cluster_finetune_gpus"] == "0"
    assert params["kfp.cluster_train_image"] == TRAIN_IMAGE
    assert params["kfp.compress_task"] == "SST-2" and params["compress.student_layers"] == "1"
    assert params["compress.student_ffn_share"] == "0.5"
    assert params["kfp.pretrain_phase2_steps"] == str(PHASE2_STEPS["pretrain_phase2_steps"])
    # the data inputs, with their content digests (mlflow.log_input's records)
    inputs = {d.dataset.name: d for d in parent.inputs.dataset_inputs}
    assert set(inputs) == {"corpus", "glue"}  # no token-level tasks: no token input
    clean = next(t for t in harness.tasks if t.path.endswith("/clean"))
    assert inputs["corpus"].dataset.digest == clean.parameters["corpus_digest"]
    assert f"{cluster.BUCKET}/data/corpus" in inputs["corpus"].dataset.source
    assert {t.key: t.value for t in inputs["glue"].tags} == {"mlflow.data.context": "glue"}
    children = lineage.child_runs(parent.info.run_id)
    steps = {r.info.run_name: r for r in children}
    assert sorted(r.info.run_name for r in children) == sorted(
        [
            "clean",
            "vocab",
            "instances (64 tokens)",
            "pretrain",
            "instances (512 tokens)",  # phase two's: the length tells the two apart
            "pretrain (phase two, 512 tokens)",
            "finetune-SST-2",
            "finetune-STS-B",
            "finetune-SST-2-random",
            "evaluate",
            "distill-SST-2",
            "quantize",
        ]
    )
    assert steps["finetune-SST-2-random"].data.params["init"] == "random"
    for run in children:
        assert run.info.status == "FINISHED" and run.data.tags["kfp.run_id"] == harness.run_id
        assert run.data.tags["mlflow.source.git.commit"] == git_head()
    assert steps["clean"].data.params["input"] == f"{cluster.BUCKET}/data/corpus"
    assert steps["finetune-SST-2"].data.params["data"] == f"{cluster.BUCKET}/data/glue/SST-2"
    phase2 = steps["pretrain (phase two, 512 tokens)"]
    assert phase2.data.tags["bert.step"] == "pretrain"
    assert phase2.data.tags["bert.start_from"] == "random init"  # phase one's: ours from scratch
    assert (
        steps["finetune-SST-2"]
        .data.params["model"]
        .endswith(f"{PHASE2}/pretrain-phase2/pretrained/model")
    )
    evaluate = steps["evaluate"]
    assert -100 <= evaluate.data.metrics["eval/score"] <= 100
    table = client.download_artifacts(evaluate.info.run_id, "glue/glue_table.md")
    markdown = Path(table).read_text()
    assert all(f"| {task} |" in markdown for task in GLUE_TASKS), markdown
    assert "| random init |" in markdown and "gain" in markdown, markdown  # the control's row
    assert "random_init/eval/SST-2/score" in evaluate.data.metrics
    # its pre-trained model, registered once (the other run registers its own)
    versions = [v.run_id for v in client.search_model_versions(f"name='{registry.PRETRAINED}'")]
    assert versions.count(steps["pretrain"].info.run_id) == versions.count(phase2.info.run_id) == 1


@pytest.mark.slow
def test_outputs_are_artifacts_in_the_bucket_under_the_pipeline_root(pipeline_run):
    harness, state, logs = pipeline_run
    assert state == pod_harness.SUCCEEDED, logs
    prefix = f"kfp/{harness.run_id}/"
    pages = harness.s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    keys = {o["Key"][len(prefix) :] for page in pages for o in page.get("Contents", [])}
    for key in (
        f"{BODY}/clean/cleaned/stats.json",
        f"{BODY}/vocab/wordpiece/vocab.txt",
        f"{BODY}/pretrain/pretrained/model/model.safetensors",
        f"{PHASE2}/instances-2/shards/stats.json",
        f"{PHASE2}/pretrain-phase2/pretrained/model/model.safetensors",
        f"{LOOP}[1]/finetune/finetuned/metrics.json",
        f"{PHASE2}/evaluate/table",
        f"{COMPRESS_BRANCH}/distill/distilled/model/model.safetensors",
        f"{COMPRESS_BRANCH}/quantize/quantized/metrics.json",
    ):
        assert key.lstrip("/") in keys, sorted(keys)[:50]
    body = harness.s3.get_object(Bucket=BUCKET, Key=f"{prefix}{PHASE2[1:]}/evaluate/table")
    assert "| STS-B |" in body["Body"].read().decode()
    # every pod ran in an empty working folder of its own, and no parameter named a local path
    for task in harness.tasks:
        pod_harness.reject_workstation_paths(task.path, task.parameters)


def _keys(client, prefix: str = "") -> list[str]:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return [o["Key"] for page in pages for o in page.get("Contents", [])]


def _tasks(name: str) -> list[str]:
    return RUNS[name]["finetune_tasks"]


def _steps(name: str) -> set[str]:
    """The names of the step runs a run of RUNS makes under its parent."""
    args = RUNS[name]
    steps = {"clean", "vocab", "instances (64 tokens)", "pretrain", "evaluate"}
    if args["pretrain_phase2_steps"]:  # and its instances at 512
        steps |= {"instances (512 tokens)", "pretrain (phase two, 512 tokens)"}
    steps |= {f"finetune-{t}" for t in args["finetune_tasks"]}
    steps |= {f"finetune-{t}-random" for t in args["finetune_control_tasks"]}
    if args.get("compress_task", "none") != "none":
        steps |= {f"distill-{args['compress_task']}", "quantize"}
    return steps


def _task_rows(markdown: str) -> dict[str, str]:
    """The GLUE table's per-task lines of our model (`| SST-2 | accuracy 48.3 | 48.3 |`, with
    `| BERT (ours) ` before it when a control's rows are there too), by task."""
    rows = (
        re.match(r"\| (?:BERT \(ours\) \| )?([A-Z][\w-]*) \| [a-z]", line)
        for line in markdown.splitlines()
    )
    return {row.group(1): row.string.rstrip() for row in rows if row}


@pytest.mark.slow
def test_two_pipeline_runs_at_once_keep_their_runs_and_artifacts_apart(runs, servers, tmp_path):
    """Issue #18, point 5: both runs succeed against one MLflow server and one bucket, each with
    its own parent run, its own steps nested under it, its own GLUE table, registered models
    and artifacts; nothing is left RUNNING."""
    from mlflow import MlflowClient
    from mlflow.entities import ViewType

    from bert_core.model.heads import BertForSequenceClassification
    from bert_core.model.modeling import BertForPreTraining
    from bert_core.track import lineage

    for name, state in runs.states.items():
        assert state == pod_harness.SUCCEEDED, runs.logs(name)
    ids = {name: h.run_id for name, h in runs.harnesses.items()}
    assert len(set(ids.values())) == len(RUNS)
    # at the same time: one after the other, they would take longer than their pods together
    assert runs.seconds < sum(t.seconds for h in runs.harnesses.values() for t in h.tasks)
    loop_b, finetune_b, evaluate_b, _ = FINAL["b"]  # one phase (run a's pods: the test above)
    assert [t.path for t in runs.harnesses["b"].tasks] == [
        f"{BODY}/settings",
        f"{BODY}/pipeline-run",
        f"{BODY}/finetune-jobs",
        f"{BODY}/clean",
        f"{BODY}/vocab",
        f"{BODY}/instances",
        f"{BODY}/pretrain",
        f"{loop_b}[0]/{finetune_b}",  # its one task
        evaluate_b,
        "/pipeline-end",
    ]
    assert _execution(runs.harnesses["b"], PHASE2).state == "CANCELED"
    for h in runs.harnesses.values():
        assert {t.state for t in h.tasks} == {pod_harness.COMPLETE}
        assert {t.env["KFP_RUN_ID"] for t in h.tasks} == {h.run_id}

    _, mlflow = servers
    client = MlflowClient(mlflow.url)
    experiment = client.get_experiment_by_name(lineage.PIPELINE_EXPERIMENT)
    found = client.search_runs([experiment.experiment_id], run_view_type=ViewType.ALL)
    parents = {
        r.data.tags["kfp.run_id"]: r for r in found if r.data.tags["bert.step"] == "pipeline"
    }
    assert set(ids.values()) <= set(parents)  # one parent per KFP run (the rerun test's too)
    steps: dict[str, dict[str, Any]] = {kfp_id: {} for kfp_id in parents}
    instances: dict[str, list] = {kfp_id: [] for kfp_id in parents}
    for run in found:  # every step run sits under the parent of its own KFP run, once
        if run.data.tags["bert.step"] != "pipeline":
            kfp_id = run.data.tags["kfp.run_id"]
            assert run.data.tags["mlflow.parentRunId"] == parents[kfp_id].info.run_id
            if run.data.tags["bert.step"] == "instances":
                instances[kfp_id].append(run)
            assert run.info.run_name not in steps[kfp_id], run.info.run_name
            steps[kfp_id][run.info.run_name] = run
    versions = client.search_model_versions(f"name='{registry.PRETRAINED}'")
    # a pre-trained model per run and phase (the rerun is cached)
    assert len(versions) == sum(1 + bool(args["pretrain_phase2_steps"]) for args in RUNS.values())
    for name, args in RUNS.items():
        kfp_id, parent, own = ids[name], parents[ids[name]], steps[ids[name]]
        assert parent.info.status == "FINISHED"  # closed by its own exit handler
        assert parent.data.params["pretrain.steps"] == str(args["pretrain_steps"])
        assert parent.data.params["instances.random_seed"] == str(args["instances_random_seed"])
        assert set(own) == _steps(name)
        assert {r.info.status for r in own.values()} == {"FINISHED"}
        assert own["pretrain"].data.params["steps"] == str(args["pretrain_steps"])
        lengths = sorted(int(r.data.params["max_seq_length"]) for r in instances[kfp_id])
        assert lengths == ([64, 512] if args["pretrain_phase2_steps"] else [64])
        seeds = {r.data.params["random_seed"] for r in instances[kfp_id]}
        assert seeds == {str(args["instances_random_seed"])}
        (version,) = [v for v in versions if v.run_id == own["pretrain"].info.run_id]
        assert version.status == "READY"
        prefix, (loop, finetune, evaluate, final) = f"kfp/{kfp_id}", FINAL[name]
        own_ids = {r.info.run_id for r in own.values()}
        for task in _tasks(name):
            params = own[f"finetune-{task}"].data.params
            # fine-tuned from its own pipeline's pre-trained model (phase two's, when it ran)
            # on its own task's data
            assert params["model"].endswith(f"/{prefix}{final}/pretrained/model"), params
            assert params["data"] == f"{cluster.BUCKET}/data/glue/{task}"
            # its task's candidates: versions from this run's steps only
            pool = registry.candidates_of(registry.model_name(task))
            tuned = {v.run_id for v in client.search_model_versions(f"name='{pool}'")}
            assert own[f"finetune-{task}"].info.run_id in tuned and tuned <= own_ids, task
        # its GLUE table: a row for each of its own tasks, with its own score, and no other
        table = client.download_artifacts(
            own["evaluate"].info.run_id, "glue/glue_table.md", str(tmp_path)
        )
        rows = _task_rows(Path(table).read_text())
        assert sorted(rows) == sorted(_tasks(name)), rows
        # its artifacts: complete under its own prefix, the models load, its own checkpoints
        s3 = runs.harnesses[name].s3
        keys = set(_keys(s3, f"{prefix}/"))
        pretrained = f"{prefix}{BODY}/pretrain/pretrained"
        for key in (
            "model/model.safetensors",
            "model/config.json",
            "model/vocab.txt",
            "pretrain_metrics.csv",
        ):
            assert f"{pretrained}/{key}" in keys, sorted(keys)
        assert f"{prefix}{evaluate}/table" in keys
        with pods_s3_env(runs.harnesses[name].objects):
            with storage.local_copy(f"{cluster.BUCKET}/{pretrained}/model") as model:
                BertForPreTraining.from_pretrained(model)
        csv = s3.get_object(Bucket=BUCKET, Key=f"{pretrained}/pretrain_metrics.csv")
        last = csv["Body"].read().decode().strip().splitlines()[-1]
        assert last.split(",")[0] == str(args["pretrain_steps"])  # trained its own steps
        for i, task in enumerate(_tasks(name)):
            out = f"{prefix}{loop}[{i}]/{finetune}/finetuned"
            body = s3.get_object(Bucket=BUCKET, Key=f"{out}/metrics.json")["Body"].read()
            metrics = json.loads(body)
            assert metrics["task"] == task
            assert f"| {metrics['score']:.1f} |" in rows[task], rows[task]
            with pods_s3_env(runs.harnesses[name].objects):
                with storage.local_copy(f"{cluster.BUCKET}/{out}/model") as model:
                    loaded = BertForSequenceClassification.from_pretrained(model)
            assert loaded.config.num_labels == (1 if task == "STS-B" else 2)
        assert _keys(s3, f"ray/kfp-{kfp_id}/"), "no Ray checkpoints of its own"
    # nothing left running, in any experiment of the shared server
    experiments = [e.experiment_id for e in client.search_experiments(view_type=ViewType.ALL)]
    every = client.search_runs(experiments, run_view_type=ViewType.ALL, max_results=1000)
    assert [r.info.run_name for r in every if r.info.status == "RUNNING"] == []


def _outputs(runs: Runs, root: Path, servers, fresh_spec: Path) -> dict[str, Items]:
    """Every output of the two runs, by kind."""
    from mlflow import MlflowClient

    s3, mlflow = servers
    client = runs.harnesses["a"].s3
    pods = [root / f"pods-{name}" for name in RUNS]
    metrics = [k for k in _keys(client) if k.endswith("/metrics.json")]
    return {
        "step logs": lambda: secrets.files(
            *(t.log for h in runs.harnesses.values() for t in h.tasks)
        ),
        # the pods' folders (work, home, /s3 copies, KFP outputs), the servers' (their logs,
        # mlflow.db and its journals), the Rays' session folders (the head's: its jobs' logs)
        "files": lambda: secrets.files(root, *runs.ray_sessions),
        "metrics.json": lambda: (
            item
            for item in [*secrets.files(*pods), *secrets.bucket_objects(client, BUCKET, metrics)]
            if item[0].endswith("/metrics.json")
        ),
        "bucket objects": lambda: secrets.bucket_objects(client, BUCKET, _keys(client)),
        "MLflow records": lambda: secrets.mlflow_records(MlflowClient(mlflow.url)),
        "compiled pipeline": lambda: secrets.files(SPEC, fresh_spec),
    }


@pytest.mark.slow
def test_no_planted_credential_reaches_any_output_of_the_runs(
    runs, servers, planted, root, tmp_path
):
    """Issue #18, point 6: the two runs held fake credentials where a cluster puts the real ones
    (the `bert-s3` Secret, the optional `bert-mlflow-auth` Secret, a token in the image's
    environment); every output is searched for them (`_outputs`) and none may appear, while a
    marker written on purpose into each kind of output must be found."""
    from mlflow import MlflowClient

    s3, mlflow = servers
    for name, state in runs.states.items():
        assert state == pod_harness.SUCCEEDED, runs.logs(name)
    hidden, user, key_id = planted.secrets(), planted.mlflow_username, planted.s3_key_id
    for task in (t for h in runs.harnesses.values() for t in h.tasks):  # the pods did hold them
        assert {*hidden, user, key_id} <= set(task.env.values()), task.path
    # the pipeline compiled afresh in an environment holding them, its image named on purpose
    control = f"planted-CONTROL-{uuid.uuid4().hex}"
    fresh = tmp_path / "bert_pipeline.yaml"
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        **planted.s3(),
        **planted.mlflow_auth(),
        "MLFLOW_TRACKING_TOKEN": planted.mlflow_token,
    }
    compiled = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipelines.bert_pipeline",
            "compile",
            "--output",
            str(fresh),
            "--image",
            f"registry.example/{control}:1",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert compiled.returncode == 0, compiled.stderr
    # the positive control: the marker, written on purpose into one output of each kind
    a = runs.harnesses["a"]
    with a.tasks[-1].log.open("a") as log:
        log.write(f"\n{control}\n")
    finetuned = next(a.workdir.glob("pod-*-finetune/s3/**/finetuned/metrics.json"))
    finetuned.write_text(finetuned.read_text() + control)
    a.s3.put_object(Bucket=BUCKET, Key="control/marker.txt", Body=control.encode())
    client = MlflowClient(mlflow.url)
    experiment = client.get_experiment_by_name("bert-pipeline").experiment_id
    (parent,) = client.search_runs(
        [experiment], f"tags.`kfp.run_id` = '{a.run_id}' and tags.`bert.step` = 'pipeline'"
    )
    with pytest.MonkeyPatch.context() as mp:  # as the pipeline: this process only reads
        mp.setenv("MLFLOW_TRACKING_USERNAME", planted.mlflow_username)
        mp.setenv("MLFLOW_TRACKING_PASSWORD", planted.mlflow_password)
        client.set_tag(parent.info.run_id, "control", control)

    places = _outputs(runs, root, servers, fresh)
    hits, counts = secrets.search(places, [*hidden, user, key_id, control])
    hits += secrets.git_grep([*hidden, user, key_id, secrets.GIT_CONTROL])
    print(
        f"\nsearched {counts} and git for {len(hidden)} secrets, 2 identities, 2 controls; "
        f"{len(runs.ray_sessions)} Ray session folders"
    )
    found = {
        n: [(place, where) for place, where, needle in hits if needle == n]
        for n in [*hidden, user, key_id, control, secrets.GIT_CONTROL]
    }
    assert {place for place, _ in found[control]} == set(places), found[control]
    assert found[secrets.GIT_CONTROL] == [("git", "tests/cluster/secrets.py")]
    assert counts["step logs"] == sum(len(h.tasks) for h in runs.harnesses.values())
    assert counts["metrics.json"] >= 2 * sum(len(_tasks(n)) for n in RUNS)  # pod + bucket
    assert len(runs.ray_sessions) >= len(RUNS)  # run b's pod's private Ray, the Ray head
    # no secret anywhere
    assert [hit for n in hidden for hit in found[n]] == []
    # The auth user name is an identity: MLflow records it as the runs' user (`mlflow.user`, as
    # it records the login name without auth), in its store and nowhere else.
    assert {place for place, _ in found[user]} == {"files", "MLflow records"}
    stores = {Path(where).parent for place, where in found[user] if place == "files"}
    assert stores == {mlflow.log.parent}, found[user]  # mlflow.db (and its journal)
    records = [
        json.loads(body) for where, body in places["MLflow records"]() if where[:4] == "run "
    ]
    users = {r["data"]["tags"].get("mlflow.user") for r in records}
    assert user in users and users <= {user, None}, users  # parents (create_run) have none
    # The S3 access key id is an identity too (SigV4 sends it with every request): it may show
    # only in the S3 server's own request log, as the credential scope of the presigned URLs
    # the MLflow server hands its clients for downloads (the test above downloads a table).
    assert {where for _, where in found[key_id]} <= {str(s3.log)}, found[key_id]
    for line in s3.log.read_text(errors="replace").splitlines():
        assert line.count(key_id) == line.count(f"X-Amz-Credential={key_id}/"), line


def test_the_harness_runs_the_committed_spec_defaults():
    """The run above uses the spec's defaults for the data: the cluster's, not params.yaml's."""
    pipeline, _ = pod_harness.load_spec(SPEC)
    inputs = pipeline["root"]["inputDefinitions"]["parameters"]
    for key, uri in cluster.DATA.items():
        assert inputs[key]["defaultValue"] == uri == DEFAULTS[key]
        assert uri.startswith(f"{cluster.BUCKET}/")


@pytest.mark.slow
@pytest.mark.parametrize(
    "arguments, failed, message",
    [
        (
            {"data_corpus": f"{cluster.BUCKET}/data/no-such-corpus"},
            "pipeline-run",
            "no-such-corpus: no such file, folder, object or prefix",
        ),
        (
            {"finetune_tasks": [], "finetune_control_tasks": [], "finetune_token_tasks": []},
            "finetune-jobs",
            "nothing to fine-tune",
        ),
        (
            {"advanced_settings": {"pretrain_stepz": 5}},
            "settings",
            "advanced_settings: no setting pretrain_stepz",
        ),
    ],
)
def test_bad_inputs_fail_a_first_task_and_the_exit_handler_marks_the_run_failed(
    servers, s3_data, planted, tmp_path, arguments, failed, message
):
    """An unknown advanced setting fails `settings`, data that is not there `pipeline-run` (its
    digest), nothing to fine-tune `finetune-jobs`, before any step starts; the steps are not
    started, the failed launcher settles the body's DAG FAILED, and the exit handler, handed
    FAILED, closes the parent run as FAILED."""
    _, mlflow = servers
    harness = pod_harness.Harness(SPEC, _objects(servers, planted=planted), tmp_path)
    state = harness.run(form_arguments(SMALL_ARGS) | arguments)
    assert state == pod_harness.FAILED
    ran = [(t.path, t.state) for t in harness.tasks]
    order = ["settings", "pipeline-run", "finetune-jobs"]
    first = [(f"{BODY}/{task}", "COMPLETE") for task in order[: order.index(failed)]]
    assert ran == [*first, (f"{BODY}/{failed}", "FAILED"), ("/pipeline-end", "COMPLETE")]
    assert message in harness.tasks[-2].log.read_text()
    assert _end_state(harness) == "FAILED"
    assert _parent(mlflow.url, harness).info.status == "FAILED"


def test_a_collected_loop_of_no_iteration_fails_its_consumer_as_the_backend_does(
    s3_server, tmp_path
):
    """The backend rule the one fan-out exists for: a ParallelFor over an empty list feeding a
    `dsl.Collected` input fails the consumer's driver (driver/resolve.go
    resolveUpstreamArtifacts), so the consumer never gets a pod and the run fails; the loop's
    DAG is never settled, so the exit handler is handed RUNNING. The same pipeline over one
    item succeeds and hands over COMPLETE."""
    from kfp import compiler

    from tests.empty_loop_pipeline import empty_loop

    spec = tmp_path / "empty_loop.yaml"
    compiler.Compiler().compile(empty_loop, str(spec))
    objects = cluster_objects(pod_env.manifest_objects(), s3_server.url, "http://127.0.0.1:1")
    for items, state, handed in (
        ([], pod_harness.FAILED, "RUNNING"),
        (["a"], pod_harness.SUCCEEDED, "COMPLETE"),
    ):
        harness = pod_harness.Harness(spec, objects, tmp_path / str(len(items)))
        assert harness.run({"items": items}) == state, _logs(harness)
        (consumer,) = [t for t in harness.tasks if t.path.endswith("/total")]
        assert consumer.state == ("COMPLETE" if items else "FAILED")
        if not items:
            assert "driver: " in consumer.log.read_text()  # no pod: the driver failed
        assert _end_state(harness) == handed
