"""Pipeline lineage in MLflow: one parent run per pipeline run, its steps' runs nested under it.

Used by the orchestrators (`pipelines/run_dvc.py` for DVC, the Kubeflow components through
`bert_core.cli`) and by `bert runs`; a step itself only ever calls `bert_core.tracking.start_run`,
which nests under whatever parent the orchestrator exported.

- DVC (`make run`): `start_pipeline_run` opens the parent run in the pipeline's experiment and
  exports its id (`BERT_PARENT_RUN_ID`), so every step started beneath it (DVC stages,
  subprocesses) nests under it; afterwards `record_dvc_lineage` records the DVC hashes
  of what each run read (from dvc.lock) as MLflow dataset inputs (the steps register the
  pre-trained model themselves: `bert_core.serve.registry`). The evaluate step puts the results
  on the parent run (`tracking.publish_results`).
- Kubeflow: no process lives for the whole run, so the parent is found or created by the KFP run
  id (`kfp_parent_run`), opened with the run's settings by the first task
  (`kfp_pipeline_run`) and closed by the exit handler (`kfp_pipeline_end`). The first task
  (`bert_core.cli.kfp_pipeline_run`) also records the content digest of each data input on the
  parent run (`data_digests`, `log_data_inputs`: MLflow dataset inputs) and outputs the
  digests, which the pipeline feeds into the cache keys of the steps that read the data.

Running a `bert` command as a KFP step is the CLI's job (`bert_core.cli.kfp_step`): this module
never imports the CLI, so the library has no loop back to the top.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

from bert_core import storage
from bert_core.errors import refuse_secrets
from bert_core.tracking import default_tags, environ, flatten, tracking_uri

PIPELINE_EXPERIMENT = "bert-pipeline"
# A unique key broken by a concurrent insert, as the tracking server reports it (SQLAlchemy's
# message for SQLite, PostgreSQL, MySQL): the row exists now, so the write can be retried.
LOST_INSERT_RACE = re.compile(r"IntegrityError|UniqueViolation|UNIQUE constraint|Duplicate entry")


@contextmanager
def start_pipeline_run(
    pipeline: str = PIPELINE_EXPERIMENT,
    params: Mapping[str, Any] | Any = (),
    tags: Mapping[str, str] | None = None,
    run_name: str | None = None,
) -> Iterator[Any]:
    """Open the parent run of one pipeline run; steps started inside nest under it.

    One experiment per pipeline (named after it). The run id is exported as BERT_PARENT_RUN_ID
    (and the experiment as MLFLOW_EXPERIMENT_NAME) for the duration, so step processes started
    from here, e.g. by `dvc repro`, pick it up through `start_run`.
    """
    import mlflow

    if params:  # before anything is logged
        refuse_secrets((params if isinstance(params, Mapping) else flatten(params)).items())
    mlflow.set_tracking_uri(tracking_uri())
    mlflow.set_experiment(pipeline)
    all_tags = {**default_tags(), "bert.pipeline": pipeline, "bert.step": "pipeline"}
    all_tags.update(tags or {})
    with mlflow.start_run(run_name=run_name, tags=all_tags) as run:
        if params:
            mlflow.log_params(flatten(params))
        with environ({"BERT_PARENT_RUN_ID": run.info.run_id, "MLFLOW_EXPERIMENT_NAME": pipeline}):
            yield run


def kfp_parent_run(kfp_run_id: str, pipeline: str = PIPELINE_EXPERIMENT) -> str:
    """The MLflow parent run of a Kubeflow run: found by its `kfp.run_id` tag, else created.

    Kubeflow starts each step in its own pod, so there is no process to hold the parent open;
    the first task (`kfp_pipeline_run`, alone before any step) creates it, the steps find it.
    """
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri())
    experiment_id = _experiment_id(client, pipeline)
    found = client.search_runs(
        [experiment_id],
        filter_string=f"tags.`kfp.run_id` = '{kfp_run_id}' and tags.`bert.step` = 'pipeline'",
        max_results=1,
    )
    if found:
        return found[0].info.run_id
    tags = {**default_tags(), "kfp.run_id": kfp_run_id, "bert.pipeline": pipeline}
    tags["bert.step"] = "pipeline"
    run = client.create_run(experiment_id, tags=tags, run_name=f"kfp-{kfp_run_id[:8]}")
    return run.info.run_id


def _experiment_id(client: Any, name: str) -> str:
    """The id of experiment `name`, created when missing. Two pipeline runs starting at once on
    a new server both find no experiment and both create it: the loser's RESOURCE_ALREADY_EXISTS
    means it is there now, so it is looked up again rather than failing the run."""
    from mlflow.exceptions import MlflowException

    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    try:
        return client.create_experiment(name)
    except MlflowException as e:
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
        return client.get_experiment_by_name(name).experiment_id


class DataDigests(NamedTuple):
    """`storage.digest` of the pipeline's data inputs: the corpus, the listed GLUE tasks' folders
    and the listed token-level tasks' folders (the KFP `pipeline-run` task's outputs)."""

    corpus_digest: str
    glue_digest: str
    token_digest: str


def data_inputs(settings: Mapping[str, Any]) -> dict[str, list[str]]:
    """The data a run reads, by input (corpus, glue, token): the URIs of the corpus and of each
    listed task's folder, from the run's settings (`data.*`, `finetune.tasks`, ...)."""
    return {
        "corpus": [str(settings["data.corpus"])],
        "glue": [f"{settings['data.glue']}/{t}" for t in settings["finetune.tasks"]],
        "token": [f"{settings['data.token']}/{t}" for t in settings["finetune.token_tasks"]],
    }


def data_digests(inputs: Mapping[str, list[str]]) -> DataDigests:
    """The digest of each of `data_inputs` (a missing input fails here, in the first task)."""
    return DataDigests(*(storage.digest(*inputs[name]) for name in ("corpus", "glue", "token")))


def log_data_inputs(run_id: str, inputs: Mapping[str, list[str]], digests: DataDigests) -> None:
    """Record each data input on a run as an MLflow dataset input: name corpus / glue / token,
    source its URI (the data folder for a task list), digest the content digest, context the
    input's name. An input with no tasks (an empty token list) is left out."""
    datasets = [
        Dataset(name, uris[0] if len(uris) == 1 else uris[0].rsplit("/", 1)[0], value, name)
        for (name, uris), value in zip(inputs.items(), digests, strict=True)
        if uris
    ]
    log_datasets(run_id, datasets)


class Dataset(NamedTuple):
    """One MLflow dataset input: what the run read (`name`, `source` URI), which version of it
    (`digest`: a content hash, DVC's or `storage.digest`), and in what role (`context`)."""

    name: str
    source: str
    digest: str
    context: str


def log_datasets(run_id: str, datasets: list[Dataset]) -> None:
    """`mlflow.log_input`'s records, through the client (the run need not be this process's
    active run): the MLflow UI lists them in the run's Datasets column and page, one line each,
    instead of a tag per file. MLflow keeps a digest of at most 36 characters (a DVC folder
    hash, `<md5>.dir`, is 36)."""
    from mlflow import MlflowClient
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.entities import DatasetInput, InputTag
    from mlflow.exceptions import MlflowException

    records = []
    for d in datasets:
        dataset = MetaDataset(resolve_dataset_source(d.source), name=d.name, digest=d.digest[:36])
        tags = [InputTag("mlflow.data.context", d.context)]
        records.append(DatasetInput(dataset._to_mlflow_entity(), tags=tags))
    if not records:
        return
    client = MlflowClient(tracking_uri())
    try:
        client.log_inputs(run_id, datasets=records)
    except MlflowException as e:
        # Two runs reading the same data, started together: the store keeps one dataset
        # record per (experiment, name, digest), and both found none and inserted it. The
        # loser's insert broke that unique key; the record exists now, so the retry links it.
        if not LOST_INSERT_RACE.search(str(e)):
            raise
        client.log_inputs(run_id, datasets=records)


def parse_settings(settings: Mapping[str, Any]) -> dict[str, Any]:
    """A KFP run's settings typed back: KFP hands parameters over as strings ('5', or '5.0'
    under kfp.local)."""
    import yaml

    parsed = {}
    for key, value in settings.items():
        value = yaml.safe_load(value) if isinstance(value, str) and value else value
        parsed[key] = int(value) if isinstance(value, float) and value.is_integer() else value
    return parsed


def kfp_pipeline_run(settings: dict[str, Any], pipeline: str = PIPELINE_EXPERIMENT) -> str | None:
    """Open the MLflow parent run of this Kubeflow run and log the run's settings on it.

    The pipeline's first task, never cached: the parent exists before any step looks for it (no
    two fan-out steps can race to create it) and carries the settings `bert runs` compares.
    The settings are typed back first (`parse_settings`).
    """
    from mlflow import MlflowClient
    from mlflow.entities import Param

    refuse_secrets(settings.items())
    kfp_run_id = os.environ.get("KFP_RUN_ID", "")
    if not kfp_run_id:
        return None
    parent = kfp_parent_run(kfp_run_id, pipeline)
    params = [Param(k, v) for k, v in sorted(flatten(parse_settings(settings)).items())]
    MlflowClient(tracking_uri()).log_batch(parent, params=params)
    return parent


# The exit handler's `PipelineTaskFinalStatus.state` -> the MLflow parent run's end status.
# The KFP backend (2.17.0, MLMD-based) hands over the ML Metadata state of the exit handler's
# DAG (`backend/src/v2/driver/resolve.go`: `GetLastKnownState().String()`): COMPLETE, FAILED,
# CANCELED (CACHED for a task); kfp.local hands over SUCCEEDED or FAILED.
END_STATUS = {
    "COMPLETE": "FINISHED",
    "CACHED": "FINISHED",
    "SUCCEEDED": "FINISHED",
    "FAILED": "FAILED",
    "CANCELED": "KILLED",
    "CANCELLED": "KILLED",
}
LAST_STEP = "evaluate"  # the pipeline's last step, never cached: it ran iff the DAG succeeded


def end_status(state: str, parent_run_id: str) -> str:
    """The MLflow status that closes a pipeline's parent run, from the state its exit handler
    was given. A state that is not final (RUNNING, NEW, UNKNOWN) is what the backend hands over
    when it never settled the DAG: it sets a DAG's state only after a task's launcher publishes
    (`backend/src/v2/metadata/client.go`, `UpdateDAGExecutionsState`, called from
    `backend/src/v2/component/launcher_v2.go`), so a DAG whose last tasks were cache hits, or
    whose failing task never reached its launcher, stays RUNNING. Then the run's own record
    decides: FINISHED when its last step finished under this parent run, else FAILED."""
    status = END_STATUS.get(state.upper())
    if status:
        return status
    last = child_runs(parent_run_id, LAST_STEP)
    return "FINISHED" if any(r.info.status == "FINISHED" for r in last) else "FAILED"


def kfp_pipeline_end(state: str, pipeline: str = PIPELINE_EXPERIMENT) -> str | None:
    """Close the MLflow parent run of this Kubeflow run with the run's final state
    (`end_status`).

    The pipeline's exit handler: no process holds a Kubeflow parent run open, so without it
    the run would show as running forever in the MLflow UI, whatever happened to the pipeline.
    """
    from mlflow import MlflowClient

    kfp_run_id = os.environ.get("KFP_RUN_ID", "")
    if not kfp_run_id:
        return None
    parent = kfp_parent_run(kfp_run_id, pipeline)
    status = end_status(state, parent)
    MlflowClient(tracking_uri()).set_terminated(parent, status)
    return status


def _read_yaml(path: str | os.PathLike) -> dict:
    import yaml

    return yaml.safe_load(Path(path).read_text()) or {}


def last_pretrain_metrics(csv_file: str | os.PathLike) -> dict[str, float]:
    """The last logged row of pretrain_metrics.csv (the numbers a pipeline UI shows)."""
    import csv

    with open(csv_file, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        return {}
    return {k: float(v) for k, v in rows[-1].items() if k and v not in ("", None)}


def dvc_lock_hashes(lock_file: str | os.PathLike) -> dict[str, dict[str, str]]:
    """{stage: {dep path: md5}} from a dvc.lock: the content hashes DVC decided to re-run on."""
    stages = _read_yaml(lock_file).get("stages") or {}
    return {
        stage: {d["path"]: d.get("md5") or d.get("hash", "") for d in entry.get("deps", [])}
        for stage, entry in stages.items()
    }


def _is_code(path: str) -> bool:
    """A stage's code dependency (its `bert_core` modules), not data."""
    return path.endswith(".py")


def record_dvc_lineage(parent_run_id: str, lock_file: str | os.PathLike) -> dict[str, str]:
    """The DVC hashes of what ran, as MLflow dataset inputs rather than a tag per file: the
    pipeline's inputs (the deps no stage produces: corpus, GLUE folders) on the parent run, each
    step's data deps (its inputs and the outputs of earlier stages it reads) on its step run,
    digest = the DVC hash, so two runs that read the same bytes show the same digest. A step's
    code deps (its `bert_core` modules) become one tag, `dvc.code_md5` (a hash of their
    hashes): the same value means the same code ran. A step run is matched to its stage by the
    `dvc.stage` tag `start_run` set from DVC's DVC_STAGE. Returns the inputs' hashes."""
    import hashlib

    from mlflow import MlflowClient

    root = Path(lock_file).resolve().parent  # dvc.lock's paths are relative to its folder
    hashes = dvc_lock_hashes(lock_file)
    stages = (_read_yaml(lock_file).get("stages") or {}).values()
    produced = [o["path"].rstrip("/") for e in stages for o in e.get("outs", [])]
    inputs = {
        path: md5
        for deps in hashes.values()
        for path, md5 in deps.items()
        # a dep inside, or holding, a stage's output is the pipeline's own data, not an input
        if not any(
            path == p or path.startswith(p + "/") or p.startswith(path + "/") for p in produced
        )
    }

    def datasets(deps: Mapping[str, str], context: str) -> list[Dataset]:
        return [
            Dataset(path, str((root / path).resolve()), md5, context)
            for path, md5 in sorted(deps.items())
            if not _is_code(path)
        ]

    log_datasets(parent_run_id, datasets(inputs, "pipeline input"))
    client = MlflowClient(tracking_uri())
    for child in child_runs(parent_run_id):
        deps = hashes.get(child.data.tags.get("dvc.stage", ""), {})
        log_datasets(child.info.run_id, datasets(deps, "step input"))
        code = sorted((p, m) for p, m in deps.items() if _is_code(p))
        if code:
            digest = hashlib.md5(json.dumps(code).encode()).hexdigest()
            client.set_tag(child.info.run_id, "dvc.code_md5", digest)
    return inputs


def child_runs(parent_run_id: str, step: str | None = None) -> list[Any]:
    """The step runs nested under a pipeline run (newest first), optionally of one step."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri())
    experiment_id = client.get_run(parent_run_id).info.experiment_id
    query = f"tags.mlflow.parentRunId = '{parent_run_id}'"
    if step:
        query += f" and tags.`bert.step` = '{step}'"
    return client.search_runs(
        [experiment_id], filter_string=query, order_by=["attributes.start_time DESC"]
    )
