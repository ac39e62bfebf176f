"""MLflow tracking of one step: every `bert` command logs its run the same way.

Why one module: every step logs the same way, so experiments line up in the MLflow UI.
The tracking URI is `MLFLOW_TRACKING_URI` when set (a shared `mlflow server`), otherwise a SQLite
database `mlflow.db` in the project the command runs in (the nearest folder up from the current one
holding `dvc.yaml` or `.git`), or, outside any project, in the user's data folder
(`$XDG_DATA_HOME/bert`, default `~/.local/share/bert`): a step run from some other folder never
leaves a database behind there. The experiment is `MLFLOW_EXPERIMENT_NAME`
or "bert". When an orchestrator opened a parent run for the whole pipeline it passes its id in
`BERT_PARENT_RUN_ID`, and each step's run is nested under it.

Several steps may start at once on one SQLite store (two `bert finetune` side by side, a DVC
stage beside `bert runs`). MLflow creates a new store's tables in whichever process opens it
first, with no lock, so `tracking_uri` opens a SQLite store itself first, one process at a time
(`ready_sqlite_store`); once the tables exist, SQLite's own locking (MLflow sets a 20 s busy
timeout) serialises the writes.

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
    """MLFLOW_TRACKING_URI, else the default store's SQLite URI; a SQLite store is ready (its
    tables created) before the URI is handed out."""
    uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{default_store()}"
    db = sqlite_file(uri)
    if db is not None:
        ready_sqlite_store(uri, db)
    return uri


def sqlite_file(uri: str) -> Path | None:
    """The database file of a `sqlite:///` URI; None for a server or an in-memory database."""
    if not uri.startswith("sqlite:///"):
        return None
    name = uri[len("sqlite:///") :].split("?", 1)[0]
    return None if name in ("", ":memory:") else Path(name)


def ready_sqlite_store(uri: str, db: Path) -> None:
    """Open the SQLite store `uri` (file `db`) under an exclusive lock on `<db>.lock`, so that
    exactly one process creates a new store's tables and runs MLflow's schema migrations.

    Why: MLflow does both in whichever process opens the store first, unlocked; two steps
    starting together on a new file both migrate, and one dies with alembic's "Online
    migration expected to match one row ... 0 found" (tests/test_concurrency.py). The others
    wait here for the lock, then find the tables. Later calls take the lock for a moment only:
    MLflow caches the opened store per URI."""
    import fcntl

    from mlflow import MlflowClient

    db.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{db}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
        MlflowClient(uri).search_experiments(max_results=1)


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
