"""The model registry: one registered model per task, aliases, and `bert promote`.

`bert finetune` logs its model as an MLflow model (`bert_core.serve.mlflow_model`) on its run
(`log_finetuned`) and, only once its output folder is complete and its run has ended FINISHED,
registers a new version of the task's registered model (`register_finetuned`): a step that fails
at any point before leaves the registry as it was. The name comes from `BERT_REGISTERED_MODEL` (a
template, default `bert-{task}`: `bert-sst2`, `bert-conll2003`, `bert-squad`; `none` logs the
model without registering it). The version carries the run's dev score and task as tags. When
`BERT_MODEL_ALIAS` is set (the pipeline sets `candidate`) the new version gets that alias. A
fine-tuning output folder records its logged model and the name it is registered under in
`mlflow_model.json`; the version number is on the run (`bert.model_version` tag) and in the registry
(`MlflowClient().search_model_versions(f"run_id='{run_id}'")`).

`bert promote TASK [VERSION]` then moves the `champion` alias to the version (default: the
`candidate`) only when its dev score beats the current champion's (ties keep the champion;
`--force` moves it anyway), and records the decision as the version's `bert.promotion` tag, so
the registry shows why each champion is one. Serving and batch inference then name the alias,
never a number: `models:/bert-sst2@champion`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path
from typing import Any

from bert_core.errors import BertError
from bert_core.tracking import tracking_uri

NAME_ENV = "BERT_REGISTERED_MODEL"  # registered model name template; "none": do not register
ALIAS_ENV = "BERT_MODEL_ALIAS"  # alias given to the new version (the pipeline: candidate)
DEFAULT_NAME = "bert-{task}"
CANDIDATE, CHAMPION = "candidate", "champion"
SCORE_TAG, TASK_TAG, PROMOTION_TAG = "bert.dev_score", "bert.task", "bert.promotion"
RECORD = "mlflow_model.json"  # in a fine-tuning output: the model's MLflow URI and version


def model_name(task: str, template: str | None = None) -> str | None:
    """`bert-sst2` for SST-2 (the task name lower-cased, alphanumerics only); None: no
    registration (`none`)."""
    template = os.environ.get(NAME_ENV) or DEFAULT_NAME if template is None else template
    if template.strip().lower() in ("", "none"):
        return None
    return template.format(task=re.sub(r"[^a-z0-9]", "", task.lower()))


def log_finetuned(out: Path, result: dict) -> dict:
    """In `bert finetune`'s open MLflow run: log `out/model` as an MLflow model with the run's
    inference settings (`mlflow_model.inference_settings`: SQuAD 2.0's tuned null threshold
    too), and write `out/mlflow_model.json` (its URI, the run, and the registered model it is
    meant for: none for a random-init control, a measurement rather than a candidate for the
    task's model). Returns that record; nothing is registered yet."""
    from bert_core.serve.mlflow_model import inference_settings, log_model

    info = log_model(out / "model", inference_settings(result))
    record: dict[str, Any] = {"model_uri": info.model_uri, "run_id": info.run_id}
    name, alias = model_name(result["task"]), os.environ.get(ALIAS_ENV) or None
    if name is not None and result.get("init", "pretrained") != "random":
        record |= {"registered_model": name, "alias": alias}
    (out / RECORD).write_text(json.dumps(record, indent=2) + "\n")
    return record


def register_finetuned(record: dict, result: dict):
    """After the step succeeded (output complete, run FINISHED): register the logged model as a
    new version of `record["registered_model"]` (alias moved), tag the run with it. Returns the
    ModelVersion, or None when the record names no registered model."""
    from mlflow import MlflowClient

    if not record.get("registered_model"):
        return None
    name = record["registered_model"]
    version = register(record["model_uri"], name, result, record.get("alias"))
    tags = {"bert.registered_model": name, "bert.model_version": str(version.version)}
    client = MlflowClient(tracking_uri())
    for key, value in tags.items():
        client.set_tag(record["run_id"], key, value)
    return version


def register(model_uri: str, name: str, result: dict, alias: str | None = None):
    """A new version of `name` for a logged model, tagged with the run's task and dev score;
    `alias` (e.g. candidate) moved to it. Returns the ModelVersion."""
    import mlflow
    from mlflow import MlflowClient

    tags = {TASK_TAG: result["task"], SCORE_TAG: repr(float(result["score"]))}
    version = mlflow.register_model(model_uri, name, tags=tags)
    if alias:
        MlflowClient(tracking_uri()).set_registered_model_alias(name, alias, version.version)
    return version


def _by_alias(client, name: str, alias: str):
    from mlflow.exceptions import MlflowException

    try:
        return client.get_model_version_by_alias(name, alias)
    except MlflowException:  # no such alias (yet)
        return None


def _score(version) -> float:
    if SCORE_TAG not in version.tags:
        raise ValueError(f"{version.name} version {version.version} has no {SCORE_TAG} tag")
    return float(version.tags[SCORE_TAG])


def promote(name: str, version: str | int | None = None, force: bool = False) -> dict:
    """Move `champion` to `version` (default: the `candidate`) when its dev score beats the
    champion's, or with `force`; the decision becomes the version's `bert.promotion` tag."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    uri = tracking_uri()
    client = MlflowClient(uri)
    try:
        client.get_registered_model(name)
    except MlflowException:  # not there: no `bert finetune` of the task registered one
        raise BertError(
            f"no registered model {name!r} at {uri}: `bert finetune` of the task registers "
            "it (or name another with --registered-model)"
        ) from None
    if version is None:
        chosen = _by_alias(client, name, CANDIDATE)
        if chosen is None:
            raise ValueError(f"{name} has no {CANDIDATE!r} version: name the VERSION")
    else:
        try:
            chosen = client.get_model_version(name, str(version))
        except MlflowException as e:  # no such model or version: the user's to fix
            raise BertError(f"{name} version {version}: {e.message}") from None
    score, champion = _score(chosen), _by_alias(client, name, CHAMPION)
    if champion is not None and str(champion.version) == str(chosen.version):
        return {"registered_model": name, "version": int(chosen.version), "dev_score": score,
                "champion": int(chosen.version), "promoted": False,
                "reason": "already the champion"}  # fmt: skip
    old = None if champion is None else _score(champion)
    promoted = force or old is None or score > old
    if old is None:
        reason = f"first champion (dev score {score:.4g})"
    else:
        cmp = ">" if score > old else "<="
        reason = f"dev score {score:.4g} {cmp} champion version {champion.version}'s {old:.4g}"
        reason += " (forced)" if force and score <= old else ""
    reason = ("champion: " if promoted else "not promoted: ") + reason
    if promoted:
        client.set_registered_model_alias(name, CHAMPION, chosen.version)
    client.set_model_version_tag(name, chosen.version, PROMOTION_TAG, reason)
    now = chosen if promoted else champion
    return {"registered_model": name, "version": int(chosen.version), "dev_score": score,
            "champion": int(now.version), "promoted": promoted, "reason": reason}  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bert promote", description=__doc__.split("\n")[0])
    p.add_argument("task", help="the task (SST-2, conll2003, ...): its registered model")
    p.add_argument("version", nargs="?", help=f"the version (default: the {CANDIDATE!r} alias)")
    p.add_argument("--registered-model", help=f"the name (default: {NAME_ENV} or bert-{{task}})")
    p.add_argument("--force", action="store_true", help="make it champion whatever its score")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    name = args.registered_model or model_name(args.task)
    if name is None:
        raise ValueError(f"{NAME_ENV}=none: name the model with --registered-model")
    print(json.dumps(promote(name, args.version, args.force)))
    return 0
