"""The model registry: two registered models per task, the pre-trained one, `bert promote`.

`bert finetune` logs its model as an MLflow model (`bert_core.serve.mlflow_model`) on its run
(`log_finetuned`) and, only once its output folder is complete and its run has ended FINISHED,
registers a new version of the task's *candidates* (`register_finetuned`): a step that fails at
any point before leaves the registry as it was. What is served is the task's *release* model:
its versions are candidates copied in by `bert promote` (MLflow's `copy_model_version`, the way
MLflow promotes a model from one environment's registered model to the next), and its
`champion` alias is the one `bert serve` and `bert deploy` read. Two models, not one: an MLflow
server with authentication (MLflow's basic-auth app, docs/cluster.md) grants creating a version
and moving an alias with one permission (`update` on the registered model), so only two models
let the pipeline's identity register candidates while moving `champion` needs the identity
`bert promote` runs as. The release name is the `--registered-model` option of `bert
finetune`, `promote` and `deploy` (a template, default `bert-{task}`: `bert-sst2`,
`bert-conll2003`, `bert-squad`; `none` tells `bert finetune` to log the model without
registering it); its candidates are `bert-sst2-candidates` (`candidates_of`). The
random-init control is never registered: it is a measurement, not a candidate. A fine-tuning
output folder records its logged model and the candidates model it is registered in, in
`mlflow_model.json`; the version number is on the run (`bert.model_version` tag) and in the
registry (`MlflowClient().search_model_versions(f"run_id='{run_id}'")`).

Why descriptions and tags: versions told apart only by run id are of no use to a person choosing
one. Each registered model says what it is and how its versions are made and promoted; each
version says which run made it, its dev score and metric, and what it was fine-tuned from, as a
description and as tags to search by (`bert.task`, `bert.dev_score`, `bert.dev_metric`,
`bert.pretrained_model`); a copy keeps its candidate's.

The pre-trained model is `bert-pretrained`, one version per `bert pretrain` run that ended
FINISHED (`register_pretrained`). Its model folder names its run (`tracking.RUN_RECORD`, written
by `bert pretrain`, which sits below this layer and never imports it: pre-training must not
depend on serving or fine-tuning code, or DVC would re-run it when they change). The version is
found by that run, or logged on it and registered, by the KFP pretrain step or by the first
`bert finetune --model` of the folder, so it exists before any fine-tuned version names it:
`bert.pretrained_model` = `models:/bert-pretrained/N` (`pretrained_source`). A folder that names
no such run (a public checkpoint, one made by hand) is linked by the path or URI given.

`champion` (which candidate is served, and why) is `bert_core.serve.champion`'s rule, applied
only by `bert promote`.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from bert_core.errors import BadValue, BertError, NotFound
from bert_core.serve.champion import BASELINE_TAG, CHAMPION, SCORE_TAG, on_register
from bert_core.tracking import RUN_RECORD, tracking_uri

DEFAULT_NAME = "bert-{task}"  # the release model's name template (`--registered-model`)
CANDIDATES = "{name}-candidates"  # where `bert finetune` registers; `bert promote` copies out
TASK_TAG, METRIC_TAG, SOURCE_TAG = "bert.task", "bert.dev_metric", "bert.pretrained_model"
RECORD = "mlflow_model.json"  # in a fine-tuning output: the model's MLflow URI and version
PRETRAINED = "bert-pretrained"  # the registered model of `bert pretrain`'s models


def model_name(task: str, template: str = DEFAULT_NAME) -> str | None:
    """The task's release model (served: `champion`) by `template`: `bert-sst2` for SST-2 (the
    task name lower-cased, alphanumerics only); None: no registration (`none`)."""
    if template.strip().lower() in ("", "none"):
        return None
    try:
        return template.format(task=re.sub(r"[^a-z0-9]", "", task.lower()))
    except (KeyError, IndexError, ValueError):
        raise BadValue(
            f"--registered-model {template!r}: a name, or a template whose only field is {{task}}"
        ) from None


def candidates_of(release: str) -> str:
    """The registered model whose versions `bert promote` may copy into `release`."""
    return CANDIDATES.format(name=release)


def feature_based(result: dict) -> str | None:
    """The Table 7 choice of a feature-based run's metrics.json content, else None."""
    choice = (result.get("config") or {}).get("feature_based", "none")
    return None if choice == "none" else choice


def log_finetuned(out: Path, result: dict, release: str | None) -> dict:
    """In `bert finetune`'s open MLflow run: log `out/model` as an MLflow model with the run's
    inference settings (`mlflow_model.inference_settings`: SQuAD 2.0's tuned null threshold
    too), and write `out/mlflow_model.json` (its URI, the run, and the candidates of `release`
    it is meant for: none when `release` is None, nor for a random-init control or a
    feature-based tagger, measurements rather than candidates). Returns that record; nothing is
    registered yet."""
    from bert_core.serve.mlflow_model import inference_settings

    registered: dict[str, Any] = {}
    # a control or a feature-based tagger is a measurement, never a candidate for the task
    measurement = result.get("init", "pretrained") == "random" or feature_based(result)
    if release is not None and not measurement:
        registered = {"registered_model": candidates_of(release), "release_model": release}
    return write_record(out, inference_settings(result), registered)


def write_record(out: Path, settings: dict, registered: dict | None = None) -> dict:
    """Log `out/model` as an MLflow model in the open run (with its inference `settings`) and
    write `out/mlflow_model.json`: its URI and run, and `registered` (the registered model it is
    meant for, if any). The record every trained model's folder holds (`bert finetune`,
    `bert distill`, `bert quantize`), so `bert predict` and `bert serve` find the MLflow model
    of any of them the same way. Returns the record."""
    from bert_core.serve.mlflow_model import log_model

    info = log_model(out / "model", settings)
    record = {"model_uri": info.model_uri, "run_id": info.run_id, **(registered or {})}
    (out / RECORD).write_text(json.dumps(record, indent=2) + "\n")
    return record


def register_finetuned(record: dict, result: dict):
    """After the step succeeded (output complete, run FINISHED): register the logged model as a
    new version of `record["registered_model"]` (the candidates of its `release_model`), tag the
    run with it.
    Returns the ModelVersion, or None when the record names no registered model."""
    from mlflow import MlflowClient

    if not record.get("registered_model"):
        return None
    version = register(record["model_uri"], record["release_model"], result)
    tags = {"bert.registered_model": version.name, "bert.model_version": str(version.version)}
    if result.get("pretrained_model"):
        tags[SOURCE_TAG] = result["pretrained_model"]
    client = MlflowClient(tracking_uri())
    for key, value in tags.items():
        client.set_tag(record["run_id"], key, value)
    return version


def register(model_uri: str, release: str, result: dict):
    """A new version of `release`'s candidates (`candidates_of`) for a logged model, described
    and tagged from the run's result (task, dev score and metric, the pre-trained model it came
    from, the task's baseline); one that does not beat the baseline says so
    (`champion.on_register`). Returns the ModelVersion."""
    import mlflow
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri())
    name = candidates_of(release)
    metric = result.get("score_metric") or "score"
    describe(client, name, task_description(release, result["task"], metric))
    tags = {
        TASK_TAG: result["task"],
        SCORE_TAG: repr(float(result["score"])),
        BASELINE_TAG: repr(float(result["baseline_score"])),
        METRIC_TAG: metric,
        SOURCE_TAG: result.get("pretrained_model"),
    }
    tags = {k: v for k, v in tags.items() if v}
    mlflow.set_tracking_uri(tracking_uri())
    version = mlflow.register_model(model_uri, name, tags=tags)
    text = version_description(version.run_id, result, metric)
    client.update_model_version(name, version.version, description=text)
    on_register(
        client, name, version.version, float(result["score"]), float(result["baseline_score"])
    )
    return version


def describe(client, name: str, description: str) -> None:
    """Create registered model `name` with `description`, or give it the description when it
    has none (one made before, by hand or by `mlflow.register_model`); a description a person
    wrote is kept. Two steps creating it at once: the loser finds it there."""
    from mlflow.exceptions import MlflowException

    try:
        client.create_registered_model(name, description=description)
    except MlflowException as e:
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
        if not client.get_registered_model(name).description:
            client.update_registered_model(name, description=description)


def task_description(release: str, task: str, metric: str) -> str:
    """What a task's candidates model (of `release`) is, how its versions are made and promoted."""
    return (
        f"Candidates for {release}: BERT fine-tuned on {task} by `bert finetune --task {task}`, "
        f"scored on {task}'s dev set by {metric} (percent). Each fine-tuning from a pre-trained "
        f"model that ends FINISHED adds a version, tagged `{SCORE_TAG}`, `{METRIC_TAG}` and "
        f"`{SOURCE_TAG}` (the pre-trained model it started from) and `{BASELINE_TAG}` (the best "
        f"input-blind answer's score); the random-init control is never registered. `bert "
        f"promote {task}` copies a version whose dev score beats the champion's and its "
        f"baseline into {release} as `{CHAMPION}`. Serve `models:/{release}@{CHAMPION}`."
    )


def release_description(task: str) -> str:
    """What a task's release model is: the champions `bert promote` copied in."""
    return (
        f"BERT fine-tuned on {task}, as served: each version is a candidate that `bert promote "
        f"{task}` copied in from its candidates model (its source, tags and description are the "
        f"candidate's), and `{CHAMPION}` is the one served: `models:/NAME@{CHAMPION}`."
    )


def version_description(run_id: str | None, result: dict, metric: str) -> str:
    """Which run made a version, its dev score, and what it was fine-tuned from."""
    source = result.get("pretrained_model") or result.get("model") or "an unrecorded model"
    return (
        f"`bert finetune` run {run_id}: {result['task']} dev {metric} "
        f"{float(result['score']):.2f} (percent), fine-tuned from {source}."
    )


PRETRAINED_DESCRIPTION = (
    "BERT pre-trained by `bert pretrain` (masked LM + next sentence), as an MLflow pyfunc "
    "model that fills [MASK] tokens; its HF-layout folder is the `model` artifact. A version is "
    "one pretrain run that ended FINISHED, registered once, before anything is fine-tuned from "
    "it (by the KFP pretrain step, or by the first `bert finetune --model` of its folder). Each "
    f"fine-tuned version of a task's model names the version it came from in `{SOURCE_TAG}`. "
    "No champion: pre-training has no dev score to compare."
)


def pretrained_source(model_dir: str | os.PathLike, given: str) -> str:
    """What `bert finetune --model` started from, for `bert.pretrained_model`: the registered
    pre-trained version (`models:/bert-pretrained/N`) when the folder is a `bert pretrain`
    output whose run ended FINISHED (registered now when it is not yet), else the path or URI
    the model was `given` as (a public checkpoint, a folder made by hand)."""
    version = register_pretrained(model_dir)
    return given if version is None else f"models:/{version.name}/{version.version}"


def register_pretrained(model_dir: str | os.PathLike, name: str = PRETRAINED):
    """The registered version of a `bert pretrain` model folder, found by the run the folder
    names (`tracking.RUN_RECORD`), else logged on that run and registered now. None when the
    folder names no run, or one this tracking store does not hold or that did not end FINISHED:
    only a complete pre-training is registered."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    record = Path(model_dir) / RUN_RECORD
    if not record.is_file():
        return None
    run_id = json.loads(record.read_text())["run_id"]
    client = MlflowClient(tracking_uri())
    try:
        run = client.get_run(run_id)
    except MlflowException:  # a folder from another tracking store
        return None
    if run.info.status != "FINISHED":
        return None
    found = _versions_of(client, name, run_id)
    return found[0] if found else _register_run(client, name, Path(model_dir), run)


def _versions_of(client, name: str, run_id: str) -> list:
    """`name`'s versions made from `run_id`, oldest first."""
    found = client.search_model_versions(f"run_id = '{run_id}'")
    return sorted((v for v in found if v.name == name), key=lambda v: int(v.version))


def _register_run(client, name: str, model_dir: Path, run):
    """Log `model_dir` on its pretrain `run` and register it as a new version of `name`. Two
    steps registering the same run at once (two fine-tunings of one fresh folder): each then
    keeps the oldest version of the run and deletes its own newer one, so one is left."""
    import mlflow

    from bert_core.serve.mlflow_model import log_model

    mlflow.set_tracking_uri(tracking_uri())
    run_id = run.info.run_id
    info = log_model(model_dir, run_id=run_id)
    describe(client, name, PRETRAINED_DESCRIPTION)
    config = json.loads((model_dir / "config.json").read_text())
    tags = {f"bert.{k}": str(config.get(k)) for k in ("hidden_size", "num_hidden_layers")}
    start = run.data.tags.get("bert.start_from", "random init")
    text = (
        f"`bert pretrain` run {run_id}: {config.get('num_hidden_layers')} layers x "
        f"{config.get('hidden_size')}, {run.data.params.get('steps', '?')} steps, "
        f"from {start}."
    )
    # the logged model's id too: a tracking server (unlike a local store) refuses a
    # `models:/m-...` source without it
    mine = client.create_model_version(
        name,
        source=info.model_uri,
        run_id=run_id,
        tags=tags,
        description=text,
        model_id=info.model_id,
    )
    first = _versions_of(client, name, run_id)[0]
    if first.version != mine.version:
        client.delete_model_version(name, mine.version)
    return first


def version_of(out: Path, name: str) -> str:
    """The version of `name` registered from the fine-tuning output folder `out`: its record
    names the run (`mlflow_model.json`), the registry has the version that run made. How a
    pipeline promotes the model it just trained, whatever was registered since."""
    from mlflow import MlflowClient

    path = out / RECORD
    if not path.is_file():
        raise NotFound(f"{out}: no {RECORD} (not a `bert finetune` output folder)")
    record = json.loads(path.read_text())
    if record.get("registered_model") != name:
        raise BadValue(
            f"{path}: its model is registered as {record.get('registered_model')!r}, not {name!r}"
        )
    found = MlflowClient(tracking_uri()).search_model_versions(f"run_id='{record['run_id']}'")
    versions = [v.version for v in found if v.name == name]
    if not versions:
        raise BertError(
            f"{path}: run {record['run_id']} registered no version of {name} "
            "(its step did not finish?)"
        )
    return str(versions[0])
