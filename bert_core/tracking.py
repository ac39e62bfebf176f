"""MLflow tracking of one step: every `bert` command logs its run the same way.

Why one module: every step logs the same way, so experiments line up in the MLflow UI.
The tracking URI is `MLFLOW_TRACKING_URI` when set (a shared `mlflow server`), otherwise a SQLite
database `mlflow.db` in the project the command runs in (the nearest folder up from the current one
holding `dvc.yaml` or `.git`), or, outside any project, in the user's data folder
(`$XDG_DATA_HOME/bert`, default `~/.local/share/bert`): a step run from some other folder never
leaves a database behind there. The experiment is `MLFLOW_EXPERIMENT_NAME`
or "bert". When an orchestrator opened a parent run for the whole pipeline it passes its id in
`BERT_PARENT_RUN_ID`, and each step's run is nested under it.

Only explicit settings are logged as parameters: never the environment, so credentials in it
cannot leak into MLflow.

The pipeline side (parent runs, DVC hashes, the model registry) is `bert_core.lineage`, which
builds on this module; nothing here knows about pipelines.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

DEFAULT_EXPERIMENT = "bert"


def default_store(cwd: Path | None = None) -> Path:
    """Where the SQLite store lives when no tracking URI is set (see the module docstring)."""
    cwd = (cwd or Path.cwd()).resolve()
    for folder in (cwd, *cwd.parents):
        if (folder / "dvc.yaml").is_file() or (folder / ".git").exists():
            return folder / "mlflow.db"
    data = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
    return data / "bert" / "mlflow.db"


def tracking_uri() -> str:
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    store = default_store()
    store.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{store}"


def flatten(params: Mapping[str, Any] | Any, prefix: str = "") -> dict[str, str]:
    """Flatten nested dicts/dataclasses to MLflow's flat `a.b` string parameters."""
    if is_dataclass(params) and not isinstance(params, type):
        params = asdict(params)
    out: dict[str, str] = {}
    for key, value in dict(params).items():
        name = f"{prefix}{key}"
        if is_dataclass(value) or isinstance(value, Mapping):
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = str(value)[:6000]
    return out


def git_commit(cwd: str | os.PathLike | None = None) -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def default_tags() -> dict[str, str]:
    tags = {"bert.step.host": os.uname().nodename}
    commit = os.environ.get("BERT_GIT_COMMIT") or git_commit()
    if commit:
        tags["mlflow.source.git.commit"] = commit
    if os.environ.get("KFP_RUN_ID"):
        tags["kfp.run_id"] = os.environ["KFP_RUN_ID"]
    if os.environ.get("DVC_STAGE"):  # set by DVC for every stage command
        tags["dvc.stage"] = os.environ["DVC_STAGE"]
    return tags


def _set_experiment(parent: str | None) -> None:
    """A nested run lives in its parent's experiment, or the MLflow UI cannot show the tree."""
    import mlflow

    if parent:
        mlflow.set_experiment(experiment_id=mlflow.get_run(parent).info.experiment_id)
    else:
        mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", DEFAULT_EXPERIMENT))


@contextmanager
def start_run(
    step: str, params: Mapping[str, Any] | Any = (), tags: Mapping[str, str] | None = None
) -> Iterator[Any]:
    """Open the MLflow run of one step (nested under the pipeline's run when there is one)."""
    import mlflow

    mlflow.set_tracking_uri(tracking_uri())
    parent = os.environ.get("BERT_PARENT_RUN_ID") or None
    _set_experiment(parent)
    all_tags = {**default_tags(), "bert.step": step, **(tags or {})}
    with mlflow.start_run(
        run_name=step, nested=parent is not None, parent_run_id=parent, tags=all_tags
    ) as run:
        if params:
            mlflow.log_params(flatten(params))
        yield run
