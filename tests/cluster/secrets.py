"""Planted credentials and the search for them (issue #18, point 6): fake keys given to the pods
where a cluster gives the real ones, then every output of the run searched for them; a marker
written on purpose into each kind of output is the search's positive control."""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Written into this file on purpose: `git grep` must find it (the git search's positive control).
GIT_CONTROL = "secret-search-control-3f9e1c"

Items = Callable[[], Iterator[tuple[str, bytes]]]  # an output's pieces: (where, content)


@dataclass(frozen=True)
class Planted:
    """Fake credentials, new for each test session, given to the pods where a cluster gives
    the real ones; moto and an `mlflow server` without auth accept any."""

    s3_key_id: str
    s3_secret: str
    mlflow_username: str
    mlflow_password: str
    mlflow_token: str

    @classmethod
    def new(cls) -> Planted:
        tag = uuid.uuid4().hex
        kinds = ("KEYID", "SECRET", "USER", "PASSWORD", "TOKEN")
        return cls(*(f"fake-{kind}-{tag}" for kind in kinds))

    def secrets(self) -> list[str]:
        """What must never be recorded. The S3 access key id and the MLflow user name are
        identities, each recorded in one place by design: see the test."""
        return [self.s3_secret, self.mlflow_password, self.mlflow_token]

    def s3(self) -> dict[str, str]:
        """The `bert-s3` Secret's data (cluster.SECRET_KEYS)."""
        return {"AWS_ACCESS_KEY_ID": self.s3_key_id, "AWS_SECRET_ACCESS_KEY": self.s3_secret}

    def mlflow_auth(self) -> dict[str, str]:
        """The optional `bert-mlflow-auth` Secret's data (cluster.AUTH_KEYS)."""
        return {
            "MLFLOW_TRACKING_USERNAME": self.mlflow_username,
            "MLFLOW_TRACKING_PASSWORD": self.mlflow_password,
        }


def files(*roots: Path) -> Iterator[tuple[str, bytes]]:
    """Every regular file in `roots` (files, or folders walked without following links: the
    stand-in image's link to the repo's bert_core is not an output); a file gone meanwhile is
    skipped."""
    for root in roots:
        if root.is_file():
            paths = [root]
        else:
            paths = [Path(folder) / name for folder, _, names in os.walk(root) for name in names]
        for path in paths:
            if path.is_file() and not path.is_symlink():
                try:
                    yield str(path), path.read_bytes()
                except FileNotFoundError:
                    continue


def bucket_objects(client, bucket: str, keys: list[str]) -> Iterator[tuple[str, bytes]]:
    for key in keys:
        yield f"s3://{bucket}/{key}", client.get_object(Bucket=bucket, Key=key)["Body"].read()


def mlflow_records(client) -> Iterator[tuple[str, bytes]]:
    """Everything the tracking server returns: experiments, every run (params, tags, metric
    names, dataset inputs), registered models and their versions, logged models."""
    from mlflow.entities import ViewType

    experiments = client.search_experiments(view_type=ViewType.ALL)
    ids = [e.experiment_id for e in experiments]
    for e in experiments:
        yield f"experiment {e.name}", repr(dict(e)).encode()
    for run in client.search_runs(ids, run_view_type=ViewType.ALL, max_results=1000):
        yield f"run {run.info.run_name}", json.dumps(run.to_dictionary(), default=str).encode()
    for model in client.search_registered_models():
        yield f"registered model {model.name}", repr(dict(model)).encode()
        for v in client.search_model_versions(f"name='{model.name}'"):
            yield f"{model.name} version {v.version}", repr(dict(v)).encode()
    for logged in client.search_logged_models(ids):
        record = json.dumps(logged.to_dictionary(), default=str)
        yield f"logged model {logged.model_id}", record.encode()


def search(places: dict[str, Items], needles: list[str]) -> tuple[list[tuple[str, str, str]], dict]:
    """(place, where, needle) for each needle found, and how many pieces each place had."""
    hits, counts = [], {}
    for place, items in places.items():
        counts[place] = 0
        for where, content in items():
            counts[place] += 1
            hits += [(place, where, n) for n in needles if n.encode() in content]
    return hits, counts


def git_grep(needles: list[str]) -> list[tuple[str, str, str]]:
    """The repository's files, tracked and untracked-but-not-ignored, for each needle."""
    hits = []
    for needle in needles:
        out = subprocess.run(
            ["git", "grep", "-l", "-F", "--untracked", "-e", needle],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        assert out.returncode in (0, 1), out.stderr  # 1: not found
        hits += [("git", path, needle) for path in out.stdout.split()]
    return hits
