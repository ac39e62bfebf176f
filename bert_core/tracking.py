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

A run must never stay RUNNING after its process is gone. A step that fails ends its run FAILED
(KILLED on Ctrl-C). A step killed outright (SIGKILL, a lost node) or one that lost its tracking
server cannot end its run, so every run carries the process that opened it (`bert.step.host`
and `bert.step.process`: pid namespace, pid, start time) and the next run of the same step on
the same machine marks such a run KILLED once that process is gone (`end_stale_runs`). A
tracking server that dies during a step fails the step within seconds (`HTTP_DEFAULTS`) with one
line naming the server, instead of MLflow's traceback after minutes of retries.

The pipeline side (parent runs, DVC hashes, the model registry) is `bert_core.track.lineage`, which
builds on this module; nothing here knows about pipelines.
"""

from __future__ import annotations

import base64
import contextlib
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from bert_core.errors import BertError, credentials, pid_alive, redacted

DEFAULT_EXPERIMENT = "bert"
PROCESS_TAG = "bert.step.process"
RUN_RECORD = "mlflow_run.json"  # in a model folder: the run that made it (`bert pretrain`'s)
# MLflow's HTTP client retries a refused connection 7 times with a doubling back-off (minutes:
# sized for a rate-limited hosted service) and waits up to 120 s for an answer. Our tracking
# server is self-hosted and never rate-limits, so a dead one should fail a step in seconds:
# 3 retries, 0 + 2 + 4 s of back-off (plus up to 1 s of jitter each). Defaults only: a value
# set in the environment wins. MLflow retries every request, POSTs included; a retried
# create-run whose first answer was lost could leave a second RUNNING run, which carries this
# process's tag and so is ended by `end_stale_runs` like any other.
HTTP_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "3",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "60",
}


def default_store(cwd: Path | None = None) -> Path:
    """Where the SQLite store lives when no tracking URI is set (see the module docstring)."""
    cwd = (cwd or Path.cwd()).resolve()
    for folder in (cwd, *cwd.parents):
        if (folder / "dvc.yaml").is_file() or (folder / ".git").exists():
            return folder / "mlflow.db"
    data = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
    return data / "bert" / "mlflow.db"


def tracking_uri(existing: bool = False) -> str:
    """The step's tracking URI (module docstring): MLFLOW_TRACKING_URI, else the default store's
    SQLite URI, refused when malformed (`check_uri`); a SQLite store is ready (its tables
    created) before the URI is handed out. With `existing` (reading runs, `bert runs`) the store
    must be there: a SQLite file that is not is an error naming it (reading would create an
    empty one), and a server must answer (`check_tracking`). Also sets `HTTP_DEFAULTS` in the
    environment where unset, before MLflow or Ray workers (which inherit it) make any request."""
    for key, value in HTTP_DEFAULTS.items():
        os.environ.setdefault(key, value)
    uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{default_store()}"
    (check_tracking if existing else check_uri)(uri)
    db = sqlite_file(uri)
    if db is None:
        return uri
    if existing and not db.is_file():
        raise BertError(
            f"{db}: no such MLflow store (tracking URI {uri}): no step has logged a run there; "
            "set MLFLOW_TRACKING_URI to the store that holds the runs"
        )
    if db.is_file() and db.stat().st_size:  # MLflow's error would be a traceback
        with open(db, "rb") as f:
            if f.read(16) != b"SQLite format 3\0":
                raise BertError(f"{db}: not a SQLite database (MLFLOW_TRACKING_URI {uri})")
    ready_sqlite_store(uri, db)
    return uri


def sqlite_file(uri: str) -> Path | None:
    """The database file of a `sqlite:///` URI; None for a server or an in-memory database."""
    if not uri.startswith("sqlite:///"):
        return None
    name = uri[len("sqlite:///") :].split("?", 1)[0]
    return None if name in ("", ":memory:") else Path(name)


# what MLflow opens besides http(s), sqlite and a folder: SQL databases (a driver may follow a +:
# postgresql+psycopg2) and Databricks
OTHER_STORES = ("postgresql", "mysql", "mssql", "databricks", "databricks-uc", "uc")


def check_uri(uri: str) -> None:
    """Refuse, in one line naming it, a tracking URI MLflow cannot open: MLflow would end in a
    traceback (`sqlite:/x.db`, `htp://host`) or make a store where the user meant another (a
    folder path that does not exist)."""
    parsed, what = urlparse(uri), f"MLFLOW_TRACKING_URI {redacted(uri)!r}"
    scheme = parsed.scheme.split("+")[0]
    if scheme in OTHER_STORES or uri in OTHER_STORES:  # `databricks` alone is a URI too
        return
    if scheme == "sqlite" and uri != "sqlite://" and not uri.startswith("sqlite:///"):
        forms = "sqlite:///relative/path.db or sqlite:////absolute/path.db"
        raise BertError(f"{what}: a SQLite store is {forms} (three slashes, then the path)")
    if scheme in ("http", "https") and not parsed.hostname:
        raise BertError(f"{what}: no host; a tracking server is {scheme}://HOST:PORT")
    if scheme in ("", "file"):
        folder = Path(parsed.path if scheme == "file" else uri)
        if not folder.is_dir():
            raise BertError(f"{what}: no such folder; a local store is sqlite:///PATH/mlflow.db")
        if os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() not in ("1", "true"):
            old = "a folder is MLflow's old file store, which MLflow refuses"
            raise BertError(f"{what}: {old}; use sqlite:///{folder.resolve()}/mlflow.db")
    elif scheme not in ("sqlite", "http", "https"):
        use = "http(s)://HOST:PORT, sqlite:///PATH.db or a database URI (postgresql://, ...)"
        raise BertError(f"{what}: unknown scheme {parsed.scheme!r}; use {use}")


def ready_sqlite_store(uri: str, db: Path) -> None:
    """Open the SQLite store `uri` (file `db`) under an exclusive lock on `<db>.lock`, so that
    exactly one process creates a new store's tables and runs MLflow's schema migrations.

    Why: MLflow does both in whichever process opens the store first, unlocked; two steps
    starting together on a new file both migrate, and one dies with alembic's "Online
    migration expected to match one row ... 0 found" (tests/test_concurrency.py). The others
    wait here for the lock, then find the tables. Later calls take the lock for a moment only:
    MLflow caches the opened store per URI."""
    import fcntl
    import logging

    from mlflow import MlflowClient

    db.parent.mkdir(parents=True, exist_ok=True)
    # MLflow announces a new store's tables and migrations at INFO ("Creating initial MLflow
    # database tables..."): noise on a step's stderr, where an error must be the one line
    quiet = [logging.getLogger(name) for name in ("mlflow.store.db.utils", "alembic")]
    levels = [log.level for log in quiet]
    with open(f"{db}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
        try:
            for log in quiet:
                log.setLevel(logging.WARNING)
            MlflowClient(uri).search_experiments(max_results=1)
        finally:
            for log, level in zip(quiet, levels, strict=True):
                log.setLevel(level)


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


def _start_time(pid: int | str) -> str:
    """A process's start time (clock ticks since boot, /proc/PID/stat field 22): with the pid it
    names one process even after the pid is reused. "-" where there is no /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "-"
    return stat[stat.rindex(")") + 2 :].split()[19]


def _pid_namespace() -> str:
    """Containers sharing a host name can still see different pids: the namespace tells."""
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return "-"


def process_tag() -> str:
    """This process, as the `bert.step.process` tag: `PIDNS/PID/START` (see `process_gone`)."""
    return f"{_pid_namespace()}/{os.getpid()}/{_start_time('self')}"


def process_gone(tag: str) -> bool:
    """True only when sure that the process named by `tag` (`process_tag` on this host) has
    ended: same pid namespace, and its pid is dead or now another process. False when unsure:
    another namespace, no tag, a malformed one."""
    parts = tag.split("/")
    if len(parts) != 3 or parts[0] != _pid_namespace() or not parts[1].isdigit():
        return False
    if not pid_alive(int(parts[1])):
        return True
    return parts[2] != "-" and _start_time(parts[1]) not in {parts[2], "-"}


def end_stale_runs(client, experiment_id: str, step: str) -> list[str]:
    """Mark KILLED the runs of `step` left RUNNING by a process of this machine that is gone
    (SIGKILL, or a step that lost its tracking server and could not end its run), with their
    RUNNING nested runs (a sweep's trials); returns their ids. A run of another machine, or of a
    process that may still be alive, is left alone: only its own machine can tell."""
    running = "attributes.status = 'RUNNING'"
    mine = f"tags.`bert.step` = '{step}' and tags.`bert.step.host` = '{os.uname().nodename}'"
    ended = []
    for run in client.search_runs([experiment_id], f"{running} and {mine}", max_results=1000):
        if not process_gone(run.data.tags.get(PROCESS_TAG, "")):
            continue
        children = f"{running} and tags.`mlflow.parentRunId` = '{run.info.run_id}'"
        for child in client.search_runs([experiment_id], children, max_results=1000):
            client.set_terminated(child.info.run_id, "KILLED")
        client.set_terminated(run.info.run_id, "KILLED")
        ended.append(run.info.run_id)
        print(
            f"bert {step}: marked MLflow run {run.info.run_id} KILLED (left RUNNING by a "
            "process that is gone)",
            file=sys.stderr,
        )
    return ended


def default_tags() -> dict[str, str]:
    tags = {"bert.step.host": os.uname().nodename, PROCESS_TAG: process_tag()}
    commit = os.environ.get("BERT_GIT_COMMIT") or git_commit()
    if commit:
        tags["mlflow.source.git.commit"] = commit
    if os.environ.get("KFP_RUN_ID"):
        tags["kfp.run_id"] = os.environ["KFP_RUN_ID"]
    if os.environ.get("DVC_STAGE"):  # set by DVC for every stage command
        tags["dvc.stage"] = os.environ["DVC_STAGE"]
    return tags


def _set_experiment(parent: str | None) -> str:
    """A nested run lives in its parent's experiment, or the MLflow UI cannot show the tree.
    Returns the experiment's id."""
    import mlflow

    if parent:
        experiment_id = mlflow.get_run(parent).info.experiment_id
        return mlflow.set_experiment(experiment_id=experiment_id).experiment_id
    return mlflow.set_experiment(
        os.environ.get("MLFLOW_EXPERIMENT_NAME", DEFAULT_EXPERIMENT)
    ).experiment_id


def check_tracking(uri: str, timeout: float = 5.0) -> None:
    """A well-formed tracking URI (`check_uri`); an http(s) one must answer MLflow's /health
    within `timeout` seconds; local stores need no server."""
    check_uri(uri)
    if urlparse(uri).scheme not in {"http", "https"}:
        return
    bare, login = credentials(uri)  # user:password@ is Basic auth, not part of the host name
    url, server = bare.rstrip("/") + "/health", f"MLflow tracking server {redacted(uri)}"
    auth = "Basic " + base64.b64encode(":".join(login).encode()).decode() if login else None
    request = urllib.request.Request(url, headers={"Authorization": auth} if auth else {})
    try:
        urllib.request.urlopen(request, timeout=timeout).close()
    except urllib.error.HTTPError as e:
        raise BertError(f"{server} answered {url} with HTTP {e.code}") from None
    except OSError as e:
        reason = getattr(e, "reason", e)
        fix = "start it or fix MLFLOW_TRACKING_URI"
        raise BertError(f"{server} is unreachable ({reason}); {fix}") from None


def _server_lost(uri: str, step: str, error: BaseException) -> BertError | None:
    """The error to report instead of `error` when the tracking server behind `uri` no longer
    answers (it failed the step): one line naming the server. None when there is no server or
    it answers (then `error` is something else and keeps its traceback)."""
    if isinstance(error, BertError) or urlparse(uri).scheme not in {"http", "https"}:
        return None
    try:
        check_tracking(uri, timeout=5)
    except BertError as lost:
        return BertError(
            f"{lost}. The step stopped ({step}); run it again once the server is back: the "
            "MLflow run this attempt could not end is then marked KILLED"
        )
    return None


@contextmanager
def _server_errors(uri: str, step: str) -> Iterator[None]:
    try:
        yield
    except Exception as e:
        if (lost := _server_lost(uri, step, e)) is not None:
            raise lost from None
        raise


@contextmanager
def environ(values: Mapping[str, str]) -> Iterator[None]:
    """These environment variables for the duration; what was there before comes back after."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _end_once(status: str) -> None:
    """End the active run on the failure path: one attempt, no retries (when the server is what
    failed, retrying only delays the error; a run left RUNNING is ended by `end_stale_runs`)."""
    import mlflow

    quick = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
    with environ(quick), contextlib.suppress(Exception):
        mlflow.end_run(status)


@contextmanager
def start_run(
    step: str,
    params: Mapping[str, Any] | Any = (),
    tags: Mapping[str, str] | None = None,
    name: str | None = None,
) -> Iterator[Any]:
    """Open the MLflow run of one step (nested under the pipeline's run when there is one; named
    `name`, default the step), after marking KILLED the step's runs dead processes left RUNNING.
    The run ends FINISHED, or FAILED when the block raises (KILLED on Ctrl-C); a lost tracking
    server becomes a `BertError` naming it."""
    import mlflow

    uri = tracking_uri()
    mlflow.set_tracking_uri(uri)
    parent = os.environ.get("BERT_PARENT_RUN_ID") or None
    all_tags = {**default_tags(), "bert.step": step, **(tags or {})}
    with _server_errors(uri, step):
        experiment_id = _set_experiment(parent)
        end_stale_runs(mlflow.MlflowClient(uri), experiment_id, step)
        run = mlflow.start_run(
            run_name=name or step, nested=parent is not None, parent_run_id=parent, tags=all_tags
        )
    try:
        if params:
            mlflow.log_params(flatten(params))
        yield run
    except BaseException as e:
        _end_once("KILLED" if isinstance(e, KeyboardInterrupt) else "FAILED")
        if (lost := _server_lost(uri, step, e)) is not None:
            raise lost from None
        raise
    with _server_errors(uri, step):
        mlflow.end_run()


def publish_results(run_id: str, metrics: Mapping[str, float], folder: str | os.PathLike) -> None:
    """A pipeline's results on its own run, so the run a user opens first and the compare view
    of pipeline runs show them: the evaluate step's metrics, table and plot. `bert evaluate`
    calls it for its parent (Kubeflow and DVC alike), `make run` when DVC skipped evaluate."""
    from mlflow import MlflowClient
    from mlflow.entities import Metric

    client, now = MlflowClient(tracking_uri()), int(time.time() * 1000)
    client.log_batch(run_id, metrics=[Metric(k, float(v), now, 0) for k, v in metrics.items()])
    for name in ("glue_table.md", "glue_scores.png"):  # `bert evaluate`'s
        if (Path(folder) / name).is_file():
            client.log_artifact(run_id, str(Path(folder) / name))
