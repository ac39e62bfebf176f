"""`bert pretrain` through the Ray Jobs API, against a real local Ray head and a real S3 server.

The head is `ray start --head` with its dashboard (the Jobs API) on a free loopback port, token
authentication on (Ray's default once a token exists), the S3 server's endpoint and credentials
in its environment as the KubeRay pods have them from the ConfigMap and Secret. The caller is
the `bert pretrain` command with `RAY_ADDRESS=http://127.0.0.1:<port>`, as in a KFP step.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import fields
from pathlib import Path

import pytest
from safetensors.torch import load_file

from bert_core import storage as st
from bert_core.errors import BertError, InputError
from bert_core.model.modeling import BertConfig, BertForPreTraining
from bert_core.pretrain import command as pt
from bert_core.pretrain import ray_jobs, worker
from bert_core.pretrain.config import PretrainConfig, parse_args
from tests.pipeline_helpers import RayHead, local_services, pretraining_instances

ROOT = Path(__file__).resolve().parents[2]
BUCKET = "bert-jobs"


services = local_services()


# ---------------------------------------------------------------- no cluster


def test_config_argv_gives_back_the_config():
    cfg = PretrainConfig(
        instances="s3://b/i",
        output="/o",
        steps=7,
        use_gpu=True,
        adam_betas=(0.9, 0.98),
        learning_rate=5e-3,
        dropout=0.0,
        storage_path="s3://b/ray/x",
        stop_after=3,
        export_steps=(2, 5),
        num_layers=3,
    )
    argv = ray_jobs.config_argv(cfg)
    assert parse_args(argv) == cfg
    assert argv[argv.index("--export-steps") + 1] == "2,5"  # a comma list: one value
    plain = ray_jobs.config_argv(PretrainConfig(instances="i", output="o"))
    assert "--export-steps" not in plain and parse_args(plain).export_steps == ()
    assert "--use-gpu" in argv and "--compile" not in argv and "--warmup-steps" not in argv
    assert argv[argv.index("--adam-betas") + 1 : argv.index("--adam-betas") + 3] == ["0.9", "0.98"]
    every = {f.name for f in fields(PretrainConfig)}  # a new field must round-trip too
    assert {a[2:].replace("-", "_") for a in argv if a.startswith("--")} <= every


def test_submission_ids_are_stable_per_run_and_count_attempts():
    base = ray_jobs.submission_base("s3://b/ray/kfp-1", "bert pretrain --steps 40")
    assert base == ray_jobs.submission_base("s3://b/ray/kfp-1", "bert pretrain --steps 40")
    assert re.fullmatch(r"bert-pretrain-[0-9a-f]{12}", base)
    assert base != ray_jobs.submission_base("s3://b/ray/kfp-2", "bert pretrain --steps 40")
    assert base != ray_jobs.submission_base("s3://b/ray/kfp-1", "bert pretrain --steps 80")
    assert [ray_jobs.attempt_id(base, n) for n in (1, 2, 3)] == [base, f"{base}-r2", f"{base}-r3"]
    numbers = [ray_jobs.attempt_number(s, base) for s in (base, f"{base}-r2", f"{base}-r12")]
    assert numbers == [1, 2, 12]
    assert ray_jobs.attempt_number(f"{base}x-r2", base) is None
    assert ray_jobs.attempt_number("bert-pretrain-000000000000", base) is None


def test_a_job_trains_only_the_code_of_the_step_that_submitted_it(monkeypatch):
    """The step sends its code's commit (an image's BERT_GIT_COMMIT, else its checkout's) as
    BERT_EXPECTED_COMMIT, never its BERT_GIT_COMMIT; the job's driver refuses other code, or
    code of no known commit, in one line naming both, and otherwise names that commit for its
    MLflow run."""
    from bert_core.errors import BadValue
    from bert_core.tracking import git_commit

    head = git_commit(ROOT)
    monkeypatch.delenv("BERT_GIT_COMMIT", raising=False)
    assert head and ray_jobs.code_commit() == head  # this checkout's, wherever the cwd is
    sent = []
    monkeypatch.setenv("BERT_GIT_COMMIT", "a" * 40)  # the step's image
    ray_jobs._submit(
        type("Client", (), {"submit_job": lambda self, **kw: sent.append(kw)})(),
        "sid",
        "bert pretrain",
        "run",
        "s3://b/ray",
    )
    (env,) = [kw["runtime_env"]["env_vars"] for kw in sent]
    assert env[ray_jobs.EXPECTED_COMMIT] == "a" * 40 and "BERT_GIT_COMMIT" not in env
    monkeypatch.setenv(ray_jobs.EXPECTED_COMMIT, "a" * 40)
    monkeypatch.setenv("BERT_GIT_COMMIT", "b" * 40)  # the cluster's image: another commit
    with pytest.raises(BadValue, match=f"runs bert at commit {'b' * 40}, .* at {'a' * 40}"):
        ray_jobs.check_commit()
    monkeypatch.setenv("BERT_GIT_COMMIT", "")
    monkeypatch.setattr(ray_jobs, "git_commit", lambda cwd=None: None)  # no .git either
    with pytest.raises(BadValue, match="at commit unknown .an image built without GIT_COMMIT"):
        ray_jobs.check_commit()
    monkeypatch.setenv("BERT_GIT_COMMIT", "a" * 40)
    ray_jobs.check_commit()
    monkeypatch.delenv(ray_jobs.EXPECTED_COMMIT)
    monkeypatch.setenv("BERT_GIT_COMMIT", "c" * 40)
    ray_jobs.check_commit()  # not a job: nothing to compare
    assert os.environ["BERT_GIT_COMMIT"] == "c" * 40


def test_storage_path_defaults(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("BERT_RAY_STORAGE", raising=False)
    cfg = PretrainConfig(instances="i", output="out", run_name="kfp-42")
    assert pt.storage_path(cfg) == str(tmp_path / "out" / "ray")
    s3 = PretrainConfig(instances="i", output="s3://b/run/")
    assert pt.storage_path(s3) == "s3://b/run/ray"
    monkeypatch.setenv("BERT_RAY_STORAGE", "s3://bert/ray/")
    assert pt.storage_path(cfg) == "s3://bert/ray/kfp-42"
    cfg.storage_path = "ckpt"  # an explicit --storage-path wins
    assert pt.storage_path(cfg) == str(tmp_path / "ckpt")
    monkeypatch.setenv("RAY_ADDRESS", "http://head:8265/")
    assert ray_jobs.dashboard_address() == "http://head:8265"
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")  # inside a job: the GCS, train here
    assert ray_jobs.dashboard_address() is None


# ---------------------------------------------------------------- real S3, real Ray head


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    svc = services.start_s3(tmp_path_factory.mktemp("s3-jobs"), buckets=(BUCKET,))
    env = services.client_env(svc.url, {})
    yield svc, env
    svc.stop()


def test_copy_between_local_and_s3(s3, tmp_path, monkeypatch):
    for key, value in s3[1].items():
        monkeypatch.setenv(key, value)
    src = tmp_path / "model"
    (src / "sub").mkdir(parents=True)
    (src / "config.json").write_text("{}")
    (src / "sub" / "w.bin").write_bytes(os.urandom(3000))
    assert st.copy(src, f"s3://{BUCKET}/copy/model") == 2
    assert st.exists(f"s3://{BUCKET}/copy/model/sub/w.bin")
    assert not st.exists(f"s3://{BUCKET}/copy/nothing")
    assert st.copy(f"s3://{BUCKET}/copy/model", tmp_path / "back") == 2
    back = tmp_path / "back" / "sub" / "w.bin"
    assert back.read_bytes() == (src / "sub" / "w.bin").read_bytes()
    assert st.copy(f"s3://{BUCKET}/copy/model/sub", tmp_path / "flat") == 1  # no subfolder
    assert (tmp_path / "flat" / "w.bin").read_bytes() == back.read_bytes()
    st.copy(src / "config.json", f"s3://{BUCKET}/copy/one.json")
    st.copy(f"s3://{BUCKET}/copy/one.json", tmp_path / "deep" / "one.json")
    assert (tmp_path / "deep" / "one.json").read_text() == "{}"
    with pytest.raises(FileNotFoundError, match="copy/missing: no such file or folder"):
        st.copy(f"s3://{BUCKET}/copy/missing", tmp_path / "x")


def test_a_local_init_model_reaches_the_workers_through_the_bucket(s3, tmp_path, monkeypatch):
    """Phase two as a job: its --init-model is phase one's model in the step's pod, which no Ray
    worker can read. The job is given its copy in the run's storage (uploaded once: a retry's
    step finds it by its listing), and a worker's `build_model` reads that s3:// copy."""
    for key, value in s3[1].items():
        monkeypatch.setenv(key, value)
    instances = f"s3://{BUCKET}/given/instances"  # already in the bucket: left as it is
    cfg = PretrainConfig(instances=instances, output="out", preset="tiny")
    phase1 = tmp_path / "phase1" / "model"
    BertForPreTraining(BertConfig(**cfg.shape(), vocab_size=50)).save_pretrained(phase1)
    cfg.init_model = str(phase1)
    storage = f"s3://{BUCKET}/ray/phase2"
    job = ray_jobs.job_config(cfg, storage)
    assert (job.instances, job.init_model) == (instances, f"{storage}/init-model")
    assert st.exists(f"{storage}/init-model/model.safetensors")
    st.copy(phase1 / "config.json", f"{storage}/init-model/config.json.mark")
    ray_jobs.job_config(cfg, storage)  # the same listing: not copied again
    assert st.exists(f"{storage}/init-model/config.json.mark")
    built = worker.build_model(job, 50)
    weight = "bert.embeddings.word_embeddings.weight"
    assert built.state_dict()[weight].equal(load_file(phase1 / "model.safetensors")[weight])
    local = ray_jobs.job_config(cfg, str(tmp_path / "ray"))  # a Ray on this machine
    assert local.init_model == str(phase1)


def test_a_bad_s3_init_model_is_named_by_its_uri(s3, tiny_instances, tmp_path, monkeypatch):
    """The checks read an s3:// --init-model in a temporary copy (`storage.local_copy`): their
    error names the URI the user gave, not that copy, gone when the message is read. A URI of
    another scheme is refused by name, not read as a local path."""
    for key, value in s3[1].items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/m.db")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    model = f"s3://{BUCKET}/no-model"
    (tmp_path / "notes.txt").write_text("not a model")
    st.copy(tmp_path / "notes.txt", f"{model}/notes.txt")
    with pytest.raises(BertError) as error:
        pt.pretrain(PretrainConfig(instances=str(tiny_instances), output="o", init_model=model))
    assert model in str(error.value) and "bert-s3-" not in str(error.value), error.value
    # a pipeline root that is not our bucket (KFP's own MinIO): the instances' URI is refused
    artifacts = "minio://mlpipeline/v2/artifacts/run/instances/shards"
    with pytest.raises(BertError, match=f"^{artifacts}: not a local path or an s3:// URI$"):
        pt.pretrain(PretrainConfig(instances=artifacts, output="o"))
    with pytest.raises(InputError) as error, st.local_copy(model) as copy:  # an InputError's parts
        raise InputError(copy / "config.json", "not JSON", line=3)
    assert (error.value.path, str(error.value)) == (
        f"{model}/config.json",
        f"{model}/config.json:3: not JSON",
    )


@pytest.fixture(scope="module")
def ray_head(s3):
    env = {**os.environ, **s3[1], "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    env["RAY_JOB_STOP_WAIT_TIME_S"] = "120"  # as infra/k8s/raycluster.yaml: time to checkpoint
    head = RayHead(env)
    try:
        head.wait_ready()
        yield head
    finally:
        head.stop()


@pytest.fixture(scope="module")
def tiny_instances(tmp_path_factory, shared_data) -> Path:
    return pretraining_instances(
        tmp_path_factory.mktemp("pt-jobs"),
        shared_data,
        chars=12_000,
        num_shards=2,
        vocab_size=500,
        max_seq_length=32,
    )


class Caller:
    """`bert pretrain` as a KFP step runs it, its output read line by line as it comes."""

    def __init__(self, args: list[str], env: dict[str, str], cwd: Path):
        cmd = [sys.executable, "-m", "bert_core", "pretrain", *args]
        self.proc = subprocess.Popen(
            cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        end = time.time() + timeout
        while time.time() < end:
            m = re.search(pattern, self.text)
            if m:
                return m
            assert self.proc.poll() is None or self.reader.is_alive(), self.text[-4000:]
            time.sleep(0.2)
        raise AssertionError(f"no {pattern!r} in {timeout}s:\n{self.text[-4000:]}")

    def finish(self, timeout: float = 300) -> int:
        code = self.proc.wait(timeout)
        self.reader.join(10)
        return code


def _s3_keys(prefix: str) -> set[str]:
    s3 = st.s3_client()
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return {o["Key"] for page in pages for o in page.get("Contents", [])}


def _wait_recorded(run: str, checkpoint: str, timeout: float) -> None:
    """Wait until Ray Train has recorded `checkpoint` in the run's snapshot in the bucket (it
    uploads a checkpoint first and records it after: only a recorded one is resumed from)."""
    key = f"ray/{run}/{run}/checkpoint_manager_snapshot.json"
    s3, end = st.s3_client(), time.time() + timeout
    while time.time() < end:
        if key in _s3_keys(key):
            body = s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()
            if checkpoint.encode() in body:
                return
        time.sleep(0.2)
    raise AssertionError(f"{checkpoint} not in s3://{BUCKET}/{key} after {timeout}s")


@pytest.mark.slow
def test_ray_job_killed_mid_run_is_resumed_by_a_retry(
    ray_head, s3, tiny_instances, tmp_path, monkeypatch
):
    """A KFP step's life on a KubeRay cluster, on loopback: the step submits the job; its pod
    dies (SIGKILL); a retry finds the job RUNNING and follows it; that step is stopped (SIGTERM)
    after the job's first checkpoint: it stops the job, whose driver saves a checkpoint first
    (exit 143, naming the job and the step); the next retry resubmits it as `-r2`, which resumes
    from that checkpoint in S3 and ends with the weights of an uninterrupted
    run; one more retry only fetches the outputs. One long test on purpose: each step needs the
    state the previous one left on the cluster, and every job start costs tens of seconds."""
    for key, value in s3[1].items():
        monkeypatch.setenv(key, value)  # this process reads the bucket too
    env = {**os.environ, **s3[1], "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env |= {"RAY_ADDRESS": ray_head.url, "RAY_AUTH_MODE": "token"}
    env |= {"RAY_AUTH_TOKEN": ray_head.token, "BERT_RAY_STORAGE": f"s3://{BUCKET}/ray"}
    env["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp_path}/m.db"
    env.pop("BERT_PARENT_RUN_ID", None)
    # 80 steps of ~0.1 s, a checkpoint every 10: the job is stopped after its first
    # checkpoint; the stop lands 10-13 steps later (measured), well before the end
    common = [
        "--instances",
        str(tiny_instances),
        "--preset",
        "tiny",
        "--steps",
        "80",
        "--batch-size",
        "8",
        "--checkpoint-every",
        "10",
        "--log-every",
        "10",
        "--seed",
        "7",
    ]
    args = [*common, "--output", "run", "--run-name", "kfp-retry"]

    # the same settings in one go with an s3:// --output (the job writes there), meanwhile
    ref = Caller([*common, "--output", f"s3://{BUCKET}/ref", "--run-name", "ref"], env, tmp_path)
    first = Caller(args, env, tmp_path)
    base = first.wait_for(r"submitted Ray job (bert-pretrain-[0-9a-f]{12})", 120).group(1)
    first.wait_for(r"Running entrypoint for job", 120)
    first.proc.send_signal(signal.SIGKILL)  # the pod dies; the job lives on
    first.finish()
    assert ray_head.jobs()[base]["status"] in {"PENDING", "RUNNING"}

    second = Caller(args, env, tmp_path)
    second.wait_for(rf"Ray job {base} is RUNNING at {re.escape(ray_head.url)}; following it", 120)
    _wait_recorded("kfp-retry", "checkpoint_00000010", 180)
    # the step is stopped (a KFP run terminated): SIGTERM to its pod's process, which stops
    # the job; Ray sends the job's driver SIGTERM, which saves a checkpoint and ends
    second.proc.send_signal(signal.SIGTERM)
    assert second.finish() == 143, second.text[-4000:]
    stopped = re.search(
        rf"bert pretrain: interrupted \(SIGTERM\): Ray job {base} stopped with a checkpoint at "
        r"step (\d+) under s3://bert-jobs/ray/kfp-retry; the same command resumes from it",
        second.text,
    )
    assert stopped, second.text[-4000:]
    assert not (tmp_path / "run").exists()

    third = Caller(args, env, tmp_path)
    assert third.finish() == 0, third.text[-4000:]
    assert f"Ray job {base} STOPPED; resubmitting as {base}-r2" in third.text
    resumed = int(re.search(r"\[pretrain\] resumed from step (\d+)", third.text).group(1))
    assert resumed == int(stopped.group(1)) and 10 < resumed < 80, resumed
    assert "pretrain: step 80/80" in third.text
    jobs = ray_head.jobs(base)
    assert {k: v["status"] for k, v in jobs.items() if k.startswith(base)} == {
        base: "STOPPED",
        f"{base}-r2": "SUCCEEDED",
    }
    # the instances went to the bucket once; the job got no credential and no Ray token
    n_files = sum(1 for f in tiny_instances.rglob("*") if f.is_file())  # held-out split too
    remote = "s3://bert-jobs/ray/kfp-retry/instances"
    assert f"copied {n_files} files of instances to {remote}" in first.text
    assert "files of instances" not in second.text + third.text
    keys = _s3_keys("ray/kfp-retry/")
    assert "ray/kfp-retry/instances/shard-00000.parquet" in keys
    assert "ray/kfp-retry/output/model/model.safetensors" in keys
    sent = jobs[f"{base}-r2"]["runtime_env"]["env_vars"]
    assert sent["PYTHONPATH"] == str(ROOT) and "MLFLOW_TRACKING_URI" in sent
    assert not {"AWS_SECRET_ACCESS_KEY", "RAY_AUTH_TOKEN", "RAY_ADDRESS"} & set(sent)
    assert "--output s3://bert-jobs/ray/kfp-retry/output" in jobs[base]["entrypoint"]

    # SUCCEEDED: a retry of a step whose job succeeded fetches the outputs, submits nothing
    model = tmp_path / "run" / "model" / "model.safetensors"
    resumed_weights = load_file(model)
    model.unlink()
    fourth = Caller(args, env, tmp_path)
    assert fourth.finish() == 0, fourth.text[-4000:]
    assert f"Ray job {base}-r2 already SUCCEEDED; fetching its outputs" in fourth.text
    assert set(ray_head.jobs(base)) == set(jobs)
    assert model.is_file()

    assert ref.finish() == 0, ref.text[-4000:]
    st.copy(f"s3://{BUCKET}/ref/model", tmp_path / "ref")
    one_go = load_file(tmp_path / "ref" / "model.safetensors")
    assert one_go.keys() == resumed_weights.keys()
    import torch

    for name in one_go:
        torch.testing.assert_close(resumed_weights[name], one_go[name], atol=1e-6, rtol=0)
    rows = (tmp_path / "run" / "pretrain_metrics.csv").read_text().splitlines()
    assert [r.split(",")[0] for r in rows[1:]] == [str(s) for s in range(10, 81, 10)]
