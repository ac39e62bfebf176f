"""`bert pretrain` as a Ray job: submitted to a cluster's dashboard, followed, outputs fetched.

Why a job and not Ray Client: Ray advises against Ray Client for Ray Train, and with the Jobs API
the driver (the same `bert pretrain`) runs on the cluster, so the caller, e.g. a KFP step's pod,
may die without taking the training with it. KubeRay users do exactly this: the pods know the
RayCluster's dashboard as `RAY_ADDRESS=http://<cluster>-head-svc:8265`, and when `RAY_ADDRESS`
is an http(s) URL `bert pretrain` submits itself (`run_as_job`):

1. the job's command line is the caller's settings (`config_argv`) with `--storage-path` made
   explicit, `--output` on the run's storage (`<storage>/output`) when the caller's is a local
   folder, and local instances and a local --init-model (phase two's start) uploaded beside it
   (`<storage>/instances`, `<storage>/init-model`) when the storage is s3:// (a pod's local
   folder means nothing on the cluster);
2. the submission id is derived from the storage path and that command line
   (`bert-pretrain-<hash>`), so a second attempt of the same step (a KFP retry: a new pod running
   the same command) finds the job: PENDING or RUNNING -> follow it; SUCCEEDED -> only fetch the
   outputs; FAILED or STOPPED -> submit it again as `<id>-r2`, `-r3`, ..., which resumes from the
   last checkpoint under `--storage-path` (Ray Train's own resume, bert_core.pretrain.command);
3. the job's logs are printed as they come; a job that ends in any state but SUCCEEDED is an
   error naming the job and how to read its logs; SIGTERM or SIGINT on the caller stops the job
   (its driver saves a checkpoint first: `stop`);
4. the final model and the metrics CSVs are copied into the caller's `--output`.

The job runs the cluster's code, so it must be the run's: the step sends its code's commit
(`code_commit`) as `BERT_EXPECTED_COMMIT`, and the job's driver refuses to train, exit
2 before Ray Train starts, when the code it runs is at another commit (`check_commit`: the
RayCluster's image built from another commit, or without GIT_COMMIT); the MLflow run is then
tagged with the commit that trained. Why one shared RayCluster and this check rather than a
RayJob per run: docs/cluster.md ("Pre-training on the RayCluster").

What crosses to the job: its command line, the few variables in `JOB_ENV` (MLflow run nesting,
code location) and the expected commit. Never credentials: a job's runtime_env is shown by the
dashboard to anyone who can reach it, and the cluster's pods have their own (the ConfigMap and
Secret).
"""

from __future__ import annotations

import asyncio
import csv
import dataclasses
import hashlib
import json
import os
import re
import shlex
import sys
import time
import typing
from pathlib import Path
from typing import Any

from bert_core import hub
from bert_core import storage as st
from bert_core.errors import BadValue, BertError, Interrupted, atomic_dir, credentials
from bert_core.pretrain.config import OUTPUT_FILES, PretrainConfig
from bert_core.tracking import git_commit

# Passed to the job when set: the MLflow parent run and experiment (so the job's run nests
# under the pipeline's), the tracking server the caller checked (without user:password@: a
# job's settings are shown by the Ray dashboard and `ray job list`; the cluster's pods take
# MLflow's credentials from their own environment, MLFLOW_TRACKING_USERNAME/PASSWORD), the KFP
# run id and where its code is (PYTHONPATH: a checkout rather than the image's install). Not
# BERT_GIT_COMMIT: the job's is its own code's, and the caller's travels as EXPECTED_COMMIT.
JOB_ENV = (
    "MLFLOW_TRACKING_URI",
    "MLFLOW_EXPERIMENT_NAME",
    "BERT_PARENT_RUN_ID",
    "KFP_RUN_ID",
    "PYTHONPATH",
)
EXPECTED_COMMIT = "BERT_EXPECTED_COMMIT"  # the submitting step's code's commit
TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}
POLL_S = 2.0


def dashboard_address() -> str | None:
    """RAY_ADDRESS when it is a dashboard URL (submit a job), else None (run here)."""
    address = os.environ.get("RAY_ADDRESS", "")
    return address.rstrip("/") if address.startswith(("http://", "https://")) else None


def config_argv(cfg: PretrainConfig) -> list[str]:
    """The `bert pretrain` options that give back `cfg` (`parse_args(config_argv(cfg)) == cfg`):
    a `tuple[X, X]` as that many values, a `tuple[X, ...]` as one comma list (none when empty)."""
    argv: list[str] = []
    hints = typing.get_type_hints(PretrainConfig)
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        option = f"--{f.name.replace('_', '-')}"
        if value is None or value is False:
            continue
        if value is True:
            argv.append(option)
        elif isinstance(value, tuple):
            items = [repr(v) if isinstance(v, float) else str(v) for v in value]
            if Ellipsis not in typing.get_args(hints[f.name]):
                argv += [option, *items]
            elif items:  # a comma list (options.comma_list)
                argv += [option, ",".join(items)]
        else:
            argv += [option, repr(value) if isinstance(value, float) else str(value)]
    return argv


def submission_base(storage: str, entrypoint: str) -> str:
    """The job's id before retries: one per (storage path, command line)."""
    digest = hashlib.sha256(f"{storage}\n{entrypoint}".encode()).hexdigest()[:12]
    return f"bert-pretrain-{digest}"


def attempt_number(submission_id: str, base: str) -> int | None:
    """1 for `base`, N for `base-rN`, None for another job's id."""
    if submission_id == base:
        return 1
    m = re.fullmatch(re.escape(base) + r"-r(\d+)", submission_id)
    return int(m.group(1)) if m else None


def attempt_id(base: str, n: int) -> str:
    return base if n == 1 else f"{base}-r{n}"


def job_config(cfg: PretrainConfig, storage: str) -> PretrainConfig:
    """The settings the job runs with: everything on paths the cluster can read."""
    job = dataclasses.replace(cfg, storage_path=storage)
    if not st.is_s3(cfg.output):
        job.output = f"{storage}/output"
    if not st.is_s3(cfg.instances):
        job.instances = _on_cluster(Path(cfg.instances), storage, "instances")
    if cfg.init_model and not st.is_s3(cfg.init_model) and not hub.is_named(cfg.init_model):
        # e.g. phase two's start, phase one's model in the step's pod: every worker reads it
        job.init_model = _on_cluster(Path(cfg.init_model), storage, "init-model")
    return job


def _on_cluster(local: Path, storage: str, name: str) -> str:
    """A local input folder as the job reads it: copied to `<storage>/<name>` when the storage is
    s3:// (once: a listing of names and sizes is written last, and a retry whose folder has the
    same listing skips the copy); else the folder itself (a Ray on this machine, or storage on a
    volume every node mounts)."""
    local = local.resolve()
    if not st.is_s3(storage):
        return str(local)
    remote = f"{storage}/{name}"
    listing = json.dumps(
        sorted((p.name, p.stat().st_size) for p in local.iterdir() if p.is_file())
    ).encode()
    fs, marker = st.filesystem(f"{remote}.listing.json")
    if st.exists(f"{remote}.listing.json"):
        with fs.open_input_stream(marker) as f:
            if f.read() == listing:
                return remote
    n = st.copy(local, remote)
    with fs.open_output_stream(marker) as f:
        f.write(listing)
    print(f"pretrain: copied {n} files of {name} to {remote}", flush=True)
    return remote


def run_as_job(cfg: PretrainConfig, storage: str) -> dict[str, Any]:
    """Run `cfg` as a Ray job on the cluster at RAY_ADDRESS (see the module's docstring);
    returns the summary `bert_core.pretrain.command.pretrain` returns."""
    address = dashboard_address()
    client = _client(address)
    job = job_config(cfg, storage)
    entrypoint = shlex.join(["bert", "pretrain", *config_argv(job)])
    base = submission_base(storage, entrypoint)
    sid, status = _latest(client, base)
    if status is None or status in {"FAILED", "STOPPED"}:
        previous = sid
        sid = attempt_id(base, attempt_number(sid, base) + 1 if sid else 1)
        if previous:
            print(f"pretrain: Ray job {previous} {status}; resubmitting as {sid}", flush=True)
        _submit(client, sid, entrypoint, cfg.run_name, storage)
    elif status == "SUCCEEDED":
        print(f"pretrain: Ray job {sid} already SUCCEEDED; fetching its outputs", flush=True)
    else:
        print(f"pretrain: Ray job {sid} is {status} at {address}; following it", flush=True)
    try:
        final = client.get_job_info(sid) if status == "SUCCEEDED" else follow(client, sid)
    except Interrupted as e:  # the step was stopped: so is its job (see `stop`)
        raise Interrupted(e.signum, stop(client, sid, storage)) from None
    if final.status.value != "SUCCEEDED":
        raise BertError(
            f"Ray job {sid} {final.status.value}: {(final.message or '').strip()[:2000]}\n"
            f"Logs: RAY_ADDRESS={address} ray job logs {sid}. Running the same command again "
            f"submits it anew, resuming from the last checkpoint under {storage}."
        )
    return fetch_outputs(job.output, cfg.output, cfg.steps)


def _client(address: str):
    from ray.job_submission import JobSubmissionClient

    try:
        return JobSubmissionClient(address)
    except ConnectionError as e:
        raise BertError(
            f"the Ray dashboard at {address} (RAY_ADDRESS) is unreachable: {e}"
        ) from None


def _latest(client, base: str) -> tuple[str | None, str | None]:
    """(id, status) of this job's most recent attempt, or (None, None) if it never ran."""
    attempts = {}
    for job in client.list_jobs():
        n = attempt_number(job.submission_id or "", base)
        if n is not None:
            attempts[n] = job
    if not attempts:
        return None, None
    last = attempts[max(attempts)]
    return last.submission_id, last.status.value


def _submit(client, sid: str, entrypoint: str, run_name: str, storage: str) -> None:
    env = {k: os.environ[k] for k in JOB_ENV if os.environ.get(k)}
    commit = code_commit()
    if commit:
        env[EXPECTED_COMMIT] = commit
    if "MLFLOW_TRACKING_URI" in env:
        env["MLFLOW_TRACKING_URI"] = credentials(env["MLFLOW_TRACKING_URI"])[0]
    client.submit_job(
        entrypoint=entrypoint,
        submission_id=sid,
        runtime_env={"env_vars": env},
        metadata={"bert.run_name": run_name, "bert.storage_path": storage},
    )
    print(f"pretrain: submitted Ray job {sid}: {entrypoint}", flush=True)


def code_commit() -> str | None:
    """The commit of the code this process runs: BERT_GIT_COMMIT (an image's: it has no .git),
    else the checkout this package is imported from (not the working directory's)."""
    return os.environ.get("BERT_GIT_COMMIT") or git_commit(Path(__file__).parent)


def check_commit() -> None:
    """In a job's driver: refuse to train code other than the submitting step's (see the
    module's docstring); once they agree, that commit is the one the MLflow run names."""
    expected = os.environ.get(EXPECTED_COMMIT)
    if not expected:
        return
    actual = code_commit()
    if actual != expected:
        actual = actual or "unknown (an image built without GIT_COMMIT)"
        raise BadValue(
            f"this Ray cluster runs bert at commit {actual}, the pipeline step that submitted "
            f"the job at {expected}: the RayCluster's image must be built from the run's commit "
            "(infra/k8s/raycluster.yaml), or the model would not be the code the run names"
        )
    os.environ["BERT_GIT_COMMIT"] = actual


def follow(client, sid: str):
    """Print the job's logs as they come until it ends; returns its final JobDetails.

    The log stream is a websocket that closes when the job ends; if it breaks first (a
    dashboard restart), the job is polled until it ends."""
    try:
        asyncio.run(_print_logs(client, sid))
    except Exception as e:  # the stream only; the job's state decides the outcome
        print(f"pretrain: log stream of {sid} lost ({e}); waiting for the job", flush=True)
    while True:
        info = client.get_job_info(sid)
        if info.status.value in TERMINAL:
            return info
        time.sleep(POLL_S)


def stop(client, sid: str, storage: str, wait_s: float = 180) -> str:
    """Stop the job of an interrupted step (a KFP run terminated, a pod evicted) rather than
    leave it holding the GPUs: Ray sends its driver SIGTERM, which saves a checkpoint after the
    current step (`bert_core.pretrain.command`) if the head's `RAY_JOB_STOP_WAIT_TIME_S` (Ray's
    default 3 s, infra/k8s/raycluster.yaml 120 s) leaves it time before SIGKILL. Waits for the
    job to end; returns what became of it, for the step's last line."""
    client.stop_job(sid)
    deadline = time.monotonic() + wait_s
    while client.get_job_info(sid).status.value not in TERMINAL and time.monotonic() < deadline:
        time.sleep(POLL_S)
    saved = re.findall(r"checkpoint at step (\d+) saved", client.get_job_logs(sid) or "")
    if saved:
        return (
            f"Ray job {sid} stopped with a checkpoint at step {saved[-1]} under {storage}; "
            "the same command resumes from it"
        )
    return (
        f"Ray job {sid} stopped; the same command resumes from its last checkpoint under {storage}"
    )


async def _print_logs(client, sid: str) -> None:
    async for chunk in client.tail_job_logs(sid):
        sys.stdout.write(chunk)
        sys.stdout.flush()


def fetch_outputs(job_output: str, output: str, steps: int) -> dict[str, Any]:
    """Copy the job's model and metrics CSVs into `output` (unless it is the job's own output);
    returns the run's summary, read from the CSV."""
    if job_output != output:
        if st.exists(f"{job_output}/model"):
            with atomic_dir(Path(output) / "model") as tmp:
                st.copy(f"{job_output}/model", tmp)
        for name in OUTPUT_FILES:
            if st.exists(f"{job_output}/{name}"):
                st.copy(f"{job_output}/{name}", Path(output) / name)
    fs, csv_path = st.filesystem(f"{output}/pretrain_metrics.csv")
    with fs.open_input_stream(csv_path) as f:
        rows = list(csv.DictReader(f.read().decode().splitlines()))
    last = {k: float(v) for k, v in rows[-1].items() if v} if rows else {}
    step = int(last.get("step", 0))
    return {"step": step, "finished": step >= steps and st.exists(f"{output}/model"), "last": last}
