"""The identities of the cluster's MLflow server (MLflow's basic-auth app, infra/k8s/mlflow.yaml).

Run once after the server starts, and again after a new task's model is added (the Job
`mlflow-users` does, as MLflow's admin): creates the users and the grants the pipeline needs.

- `default_permission = READ` (infra/k8s/mlflow/basic_auth.ini): every signed-in user reads
  every experiment and model; no one reads anonymously (401).
- the pipeline identity (Secret `bert-mlflow-auth`, every KFP task): creates its experiments,
  runs and the tasks' candidates models (`bert-sst2-candidates`), owning what it creates.
- the release identity (Secret `bert-mlflow-release`, the KFP `promote` task and a person
  releasing by hand): EDIT on each task's release model (`bert-sst2`), which this script
  creates, so that it exists before anyone else could create, and own, it. Creating a version
  and moving an alias need the same permission in MLflow 3.17 (`update` on the registered
  model: mlflow/server/auth/__init__.py, validate_can_create_model_version and
  validate_can_set_model_or_prompt_version_alias), so only the release identity can move the
  `champion` that `bert deploy` serves.
- the reader identity (Secret `bert-mlflow-reader`): READ alone, for people and dashboards.

Credentials come from the environment (the Secrets), never the command line: MLflow's own
MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD for the admin, and ROLE_USERNAME /
ROLE_PASSWORD for each role. Idempotent: an existing user keeps its password (rotate with
MLflow's update-password API), an existing model its versions.
"""

from __future__ import annotations

import argparse
import os

ROLES = ("PIPELINE", "RELEASE", "READER")
RELEASE_PERMISSION = "EDIT"  # create versions and move aliases; not delete the model


def ensure_user(auth, username: str, password: str) -> bool:
    """Create `username` unless it exists; True when created."""
    from mlflow.exceptions import MlflowException

    try:
        auth.get_user(username)
        return False
    except MlflowException as e:
        if e.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
    auth.create_user(username, password)
    return True


def ensure_release_model(client, auth, name: str, release_user: str) -> None:
    """Registered model `name`, created unless it exists, with EDIT for `release_user`."""
    from mlflow.exceptions import MlflowException

    try:
        client.create_registered_model(name)
    except MlflowException as e:
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    try:
        auth.grant_user_permission(release_user, "registered_model", name, RELEASE_PERMISSION)
    except MlflowException as e:  # granted before: whatever it is now, it is EDIT again
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
        auth.revoke_user_permission(release_user, "registered_model", name)
        auth.grant_user_permission(release_user, "registered_model", name, RELEASE_PERMISSION)


def bootstrap(tracking_uri: str, users: dict[str, tuple[str, str]], release_models: list[str]):
    """`users`: role -> (username, password). Returns the usernames created now."""
    from mlflow import MlflowClient
    from mlflow.server.auth.client import AuthServiceClient

    auth, client = AuthServiceClient(tracking_uri), MlflowClient(tracking_uri)
    created = [name for name, pw in users.values() if ensure_user(auth, name, pw)]
    for model in release_models:
        ensure_release_model(client, auth, model, users["RELEASE"][0])
    return created


def role_users(env: dict[str, str]) -> dict[str, tuple[str, str]]:
    missing = [
        f"{r}_{k}" for r in ROLES for k in ("USERNAME", "PASSWORD") if not env.get(f"{r}_{k}")
    ]
    if missing:
        raise SystemExit(f"mlflow_users: set {', '.join(missing)} (from the Secrets)")
    return {r: (env[f"{r}_USERNAME"], env[f"{r}_PASSWORD"]) for r in ROLES}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tracking-uri", default=os.environ.get("MLFLOW_TRACKING_URI"))
    p.add_argument(
        "--release-models",
        required=True,
        help="comma list: each task's release model (bert-sst2,...)",
    )
    args = p.parse_args(argv)
    models = [m for m in args.release_models.split(",") if m]
    created = bootstrap(args.tracking_uri, role_users(dict(os.environ)), models)
    print(f"mlflow_users: created {created or 'no user'}; release models {models}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
