"""Shared by the pipeline tests: the small settings a whole DAG runs on in CI, a throwaway
copy of the project (the tracked files, as a fresh clone has them) with ../shared beside it,
small pre-training instances made by the real data stages, and what the compiled pipeline's
pod-harness runs stand on (the cluster's servers on loopback, its data slice, its settings)."""

from __future__ import annotations

import itertools
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "pipelines" / "bert_pipeline.yaml"  # the committed compiled pipeline
GLUE_TASKS = ["SST-2", "STS-B"]

# a few thousand sentences, a 1,000-piece vocabulary, 20 tiny-model steps, 64 examples a task
# (the public branch fine-tunes, distils and quantizes the real 6-layer MiniLM on them: at 200
# examples and 300 dev rows those stages were half of a whole DAG's time)
SMALL = {
    "data": {"corpus": "../shared/data/corpus/a_christmas_carol.txt"},
    "vocab": {"vocab_size": 1000},
    "instances": {"max_seq_length": 64},
    "pretrain": {"steps": 20, "batch_size": 16, "num_workers": 1},
    "finetune": {"epochs": 1, "max_train_examples": 64, "max_seq_length": 64},
    "compress": {"epochs": 1},
}


def small_params(base: dict) -> dict:
    params = {k: dict(v) for k, v in base.items()}
    for section, values in SMALL.items():
        params[section].update(values)
    # two tasks (a classification, a regression) for ours, the first for the control, as the
    # cluster tests (`pipeline_args`): the control's row and gain need no second task
    params["finetune"].update(tasks=GLUE_TASKS, control_tasks=GLUE_TASKS[:1])
    # the public checkpoints' branch (MiniLM, real weights): a couple of continued steps, the
    # held-out MLM on 16 sequences
    params["public"] = {
        name: {**entry, "steps": 2, "eval_sequences": 16} for name, entry in base["public"].items()
    }
    return params


def project_copy(tmp: Path, shared_data: Path) -> Path:
    """tmp/repo: the project's files (tracked, plus new ones not ignored) in a new git repo, and
    tmp/shared/data the shared data (`shared_slice`), so params.yaml's ../shared/data paths
    resolve as in a clone."""
    repo = tmp / "repo"
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\0")
    for name in filter(None, files):
        src = ROOT / name
        if src.is_file() and not src.is_symlink():
            (repo / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, repo / name)
    shared_slice(tmp / "shared" / "data", shared_data)
    params = small_params(yaml.safe_load((repo / "params.yaml").read_text()))
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    git = ["git", "-c", "user.email=ci@example.com", "-c", "user.name=ci"]
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True)
    subprocess.run([*git, "commit", "-qm", "copy"], cwd=repo, check=True)
    return repo


def glue_slice(shared_data: Path, task: str, name: str) -> bytes:
    """The header and first rows of a GLUE file (100 training, 100 dev): the whole-DAG tests'
    GLUE, so a fine-tuning reads and scores a hundred rows, not SST-2's 67k and STS-B's 1,500
    dev pairs (which took most of a 6-layer public model's fine-tuning time here)."""
    rows = {"train.tsv": 100, "dev.tsv": 100}[name]
    with (shared_data / "glue" / task / name).open("rb") as f:
        return b"".join(itertools.islice(f, rows + 1))


def shared_slice(dest: Path, shared_data: Path) -> Path:
    """dest: the shared data as a whole-DAG test reads it: every folder linked, but GLUE's
    train.tsv and dev.tsv sliced (`glue_slice`)."""
    dest.mkdir(parents=True)
    for entry in shared_data.iterdir():
        if entry.name != "glue":
            os.symlink(entry, dest / entry.name)
    for task in (shared_data / "glue").iterdir():
        (dest / "glue" / task.name).mkdir(parents=True)
        for name in ("train.tsv", "dev.tsv"):
            if (task / name).is_file():
                sliced = glue_slice(shared_data, task.name, name)
                (dest / "glue" / task.name / name).write_bytes(sliced)
    return dest


def env_for(repo: Path, tracking_uri: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BERT_PARENT", "KFP_"))}
    env.update(
        MLFLOW_TRACKING_URI=tracking_uri,
        PYTHONPATH=str(repo),
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
        OMP_NUM_THREADS="2",
    )
    env.pop("MLFLOW_EXPERIMENT_NAME", None)
    return env


def pretraining_instances(
    root: Path, shared_data: Path, chars: int, num_shards: int, vocab_size: int, max_seq_length: int
) -> Path:
    """The real `bert clean` / `bert vocab` / `bert instances` on a `chars`-character slice of a
    shared-corpus book, run in `root` with MLflow there; returns the instances folder."""
    import pytest

    from bert_core import cli

    text = (shared_data / "corpus" / "pride_and_prejudice.txt").read_text(encoding="utf-8-sig")
    (root / "slice.txt").write_text(text[20_000 : 20_000 + chars], encoding="utf-8")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
        mp.chdir(root)
        mp.delenv("BERT_PARENT_RUN_ID", raising=False)
        for argv in (
            [
                "clean",
                "--input",
                root / "slice.txt",
                "--output",
                root / "clean",
                "--num-shards",
                num_shards,
                "--num-workers",
                "1",
            ],
            [
                "vocab",
                "--input",
                root / "clean",
                "--output",
                root / "vocab",
                "--vocab-size",
                vocab_size,
            ],
            [
                "instances",
                "--input",
                root / "clean",
                "--vocab",
                root / "vocab" / "vocab.txt",
                "--output",
                root / "instances",
                "--max-seq-length",
                max_seq_length,
                "--dupe-factor",
                "1",
                "--num-workers",
                "1",
            ],
        ):
            assert cli.main([str(a) for a in argv]) == 0, argv
    return root / "instances"


def local_services():
    """infra/scripts/local_services.py (the S3 and MLflow servers users start too), loaded once:
    a script, not a package module."""
    import importlib.util

    if "local_services" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "local_services", ROOT / "infra" / "scripts" / "local_services.py"
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules["local_services"]


# ------------------------------------------------------- the compiled pipeline on the pod harness


def pipeline_args(tasks: list[str], **overrides: Any) -> dict[str, Any]:
    """The settings of a small run of the compiled pipeline (by name: `form_arguments` makes
    them the run form's fields and `advanced_settings`): params.yaml's settings (the run
    form's defaults are a cluster's first run), SMALL's over them, no GPUs; the data stay the
    spec's cluster defaults (s3://); fine-tuning `tasks` and the random-init control of the
    first of them (one more job: the control runs, at little cost), one pre-training phase, then
    `overrides` (e.g. pretrain_steps=10)."""
    from pipelines.bert_pipeline import P

    args = {k: v for k, v in P.items() if not k.startswith("data_")}
    args |= {
        f"{section}_{key}": value
        for section, values in SMALL.items()
        for key, value in values.items()
        if section != "data"
    }
    lists = {"finetune_tasks": list(tasks), "finetune_control_tasks": list(tasks[:1])}
    one_phase = {"pretrain_phase2_steps": 0}  # params.yaml's one phase, as `local` runs
    return args | lists | {"cluster_finetune_gpus": "0"} | one_phase | overrides


def git_head() -> str:
    """This checkout's commit: the one the harness's stand-in image reports (BERT_GIT_COMMIT)."""
    out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return out.stdout.strip()


def upload_data_slice(
    shared_data: Path, client, bucket: str, tasks: list[str] = GLUE_TASKS
) -> None:
    """A small slice of the shared data under the cluster's data defaults (`s3://<bucket>/data`):
    one corpus book and the GLUE `tasks` (`glue_slice`)."""
    corpus = shared_data / "corpus" / "a_christmas_carol.txt"
    client.upload_file(str(corpus), bucket, f"data/corpus/{corpus.name}")
    for task in tasks:
        for name in ("train.tsv", "dev.tsv"):
            body = glue_slice(shared_data, task, name)
            client.put_object(Bucket=bucket, Key=f"data/glue/{task}/{name}", Body=body)


def _with_env(env: Mapping[str, str], start, *args: Any):
    """`start(*args)` with `env` added to this process's environment for the call: the servers
    of local_services take their credentials from the environment they are started in."""
    import pytest

    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        return start(*args)


def start_cluster_s3(workdir: Path, bucket: str, credentials: Mapping[str, str]):
    """S3 (moto) with the cluster's bucket, started with `credentials` (the Secret's S3 keys:
    moto takes any, so the pods' keys are the server's)."""
    return _with_env(credentials, local_services().start_s3, workdir, None, (bucket,))


def start_cluster_mlflow(
    workdir: Path,
    s3_url: str,
    artifacts: str,
    credentials: Mapping[str, str],
    admin_password: str | None = None,
):
    """`mlflow server` keeping its artifacts at `artifacts` (s3://...), with `credentials`; with
    `admin_password`, behind MLflow's basic-auth app as the cluster runs it."""
    start = local_services().start_mlflow
    return _with_env(credentials, start, workdir, s3_url, artifacts, None, admin_password)


def cluster_objects(objects, s3_url: str, mlflow_url: str, ray_dashboard: str = ""):
    """The manifests' ConfigMap and Secrets (`objects`, pod_env.manifest_objects or a variant),
    their service URLs mapped to the test servers; the Ray address to `ray_dashboard` ("": no
    RayCluster, pretrain runs a local Ray in its pod)."""
    from pipelines import cluster
    from tests.cluster import pod_env

    config = objects[("ConfigMap", cluster.CONFIG_MAP)]
    return pod_env.localize(
        objects,
        {
            config["MLFLOW_TRACKING_URI"]: mlflow_url,
            config["AWS_ENDPOINT_URL"]: s3_url,
            config["RAY_ADDRESS"]: ray_dashboard,
        },
    )


@contextmanager
def pods_s3_env(objects) -> Iterator[None]:
    """This process as an S3 client with the pods' settings (endpoint and keys from the
    localized `objects`), for `bert_core.storage` calls of a test; restored afterwards."""
    import pytest

    env: dict[str, str] = {}
    for data in objects.values():
        env |= data
    with pytest.MonkeyPatch.context() as mp:
        for key in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            mp.setenv(key, env[key])
        mp.delenv("AWS_ENDPOINT_URL_S3", raising=False)
        yield


class RayHead:
    """A Ray head as the RayCluster's: `ray start --head --block` with its dashboard (the Jobs
    API) on a free loopback port and token authentication (`token`, or a new one), in its own
    session; `stop` kills it and every process it
    started (found before killing, since orphans lose their parent), never `ray stop`, which
    would stop every Ray instance on the machine."""

    def __init__(self, env: Mapping[str, str], token: str | None = None):
        ports = iter(local_services().free_ports(6))  # six different ones: see free_ports
        self.env = {"RAY_AUTH_MODE": "token", **env}  # env's own auth settings stand
        self.token = token or self.env.get("RAY_AUTH_TOKEN") or secrets.token_hex(32)
        self.env["RAY_AUTH_TOKEN"] = self.token
        self.port = next(ports)
        self.tmp = tempfile.mkdtemp(prefix="rayjobs-", dir="/tmp")  # short: unix socket paths
        self.env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        self.env.pop("RAY_ADDRESS", None)
        cmd = [
            str(Path(sys.executable).with_name("ray")),
            "start",
            "--head",
            "--block",
            "--node-ip-address=127.0.0.1",
            f"--port={next(ports)}",
            "--include-dashboard=true",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={self.port}",
            f"--ray-client-server-port={next(ports)}",
            f"--dashboard-agent-listen-port={next(ports)}",
            f"--dashboard-agent-grpc-port={next(ports)}",
            f"--runtime-env-agent-port={next(ports)}",
            "--num-cpus=2",
            "--num-gpus=0",
            "--disable-usage-stats",
            f"--temp-dir={self.tmp}",
        ]
        self.log = Path(self.tmp) / "head.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                cmd,
                env=self.env,
                cwd=self.tmp,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.url = f"http://127.0.0.1:{self.port}"

    def api(self, method: str, path: str):
        req = urllib.request.Request(self.url + path, method=method)
        req.add_header("Authorization", f"Bearer {self.token}")
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read() or b"null")

    def wait_ready(self, timeout: float = 120) -> None:
        end = time.time() + timeout
        while time.time() < end:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            try:
                self.api("GET", "/api/jobs/")
                return
            except OSError:
                time.sleep(1)
        raise AssertionError(f"Ray dashboard not up in {timeout}s: {self.log.read_text()[-3000:]}")

    def jobs(self, prefix: str = "bert-pretrain-") -> dict[str, dict]:
        return {
            j["submission_id"]: j
            for j in self.api("GET", "/api/jobs/")
            if (j.get("submission_id") or "").startswith(prefix)
        }

    def stop(self) -> None:
        import psutil

        try:
            procs = [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(True)]
        except psutil.NoSuchProcess:
            procs = []
        for p in procs:
            try:
                p.terminate()
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(procs, timeout=5)
        for p in alive:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(alive, timeout=5)
        shutil.rmtree(self.tmp, ignore_errors=True)
