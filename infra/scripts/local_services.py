"""Start the pipeline's services on this machine: an S3 endpoint and an MLflow tracking server.

The same two services the cluster runs (MinIO and `mlflow server` in infra/k8s), stood up on
loopback so the S3 code paths (DVC remote, MLflow artifacts, Ray checkpoints, Parquet shards) are
exercised for real in CI and on a laptop. The S3 endpoint is moto in server mode: MinIO's server
is neither on PyPI (the `minio` package there is only the client SDK) nor in Debian (only its Go
libraries are), and nothing else can be downloaded here. moto speaks the S3 REST protocol that
boto3, s3fs (DVC) and pyarrow use, so the clients under test are the real ones.

Usage (foreground until Ctrl-C; prints the environment to export in another shell):

    python infra/scripts/local_services.py --dir runs/services --bucket bert

The tests import `start_s3` / `start_mlflow` from this file so CI and users run the same thing.
Credentials come from the environment (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY); throwaway
defaults are used only when they are unset, since moto accepts any key.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

LOCAL_KEYS = {
    "AWS_ACCESS_KEY_ID": "local-access-key",
    "AWS_SECRET_ACCESS_KEY": "local-secret-key",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` different ports nothing listens on now (the OS picks them), for the servers of one
    test session. Each socket stays bound until all are picked: the OS may hand a closed
    socket's port out again at once, and one Ray head given the same port twice will not start."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in sockets:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in sockets]


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, for one server of one test session."""
    return free_ports(1, host)[0]


def _bin(name: str) -> str:
    """The console script installed beside this Python (the venv's), else the one on PATH."""
    here = Path(sys.executable).with_name(name)
    return str(here) if here.exists() else (shutil.which(name) or name)


@dataclass
class Service:
    """One server process; `stop()` is safe to call twice."""

    name: str
    url: str
    proc: subprocess.Popen
    log: Path
    env: dict[str, str] = field(default_factory=dict)

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout)


def _spawn(name: str, cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        # Own process group: mlflow server forks workers, and stop() must end all of them.
        return subprocess.Popen(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def wait_http(url: str, proc: subprocess.Popen, log: Path, timeout: float = 60.0) -> None:
    """Poll `url` until it answers (any HTTP status) or fail with the server's log tail."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            urllib.request.urlopen(url, timeout=2).close()
            return
        except urllib.error.HTTPError:
            return
        except OSError:
            time.sleep(0.2)
    tail = log.read_text(errors="replace")[-3000:] if log.exists() else ""
    raise RuntimeError(f"{url} did not come up within {timeout:.0f}s; log {log}:\n{tail}")


def client_env(s3_url: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for S3 clients: boto3/pyarrow (AWS_ENDPOINT_URL) and MLflow's artifact store."""
    env = dict(os.environ if base is None else base)
    for key, value in LOCAL_KEYS.items():
        env.setdefault(key, value)
    env["AWS_ENDPOINT_URL"] = s3_url
    env["MLFLOW_S3_ENDPOINT_URL"] = s3_url
    return env


def start_s3(workdir: Path, port: int | None = None, buckets: tuple[str, ...] = ()) -> Service:
    """moto's S3 server on 127.0.0.1; creates `buckets` once it answers."""
    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    log = Path(workdir) / "s3.log"
    env = client_env(url)
    proc = _spawn("s3", [_bin("moto_server"), "-H", "127.0.0.1", "-p", str(port)], env, log)
    service = Service("s3", url, proc, log, {"AWS_ENDPOINT_URL": url})
    try:
        wait_http(f"{url}/moto-api/", proc, log, timeout=30)
        if buckets:
            import boto3

            s3 = boto3.client(
                "s3",
                endpoint_url=url,
                region_name=env["AWS_DEFAULT_REGION"],
                aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
                aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
            )
            for bucket in buckets:
                s3.create_bucket(Bucket=bucket)
    except BaseException:
        service.stop()
        raise
    return service


def start_mlflow(
    workdir: Path,
    s3_url: str | None,
    artifacts: str,
    port: int | None = None,
    admin_password: str | None = None,
) -> Service:
    """`mlflow server` with a SQLite backend and artifacts proxied to `artifacts` (s3://..., or
    a local folder with `s3_url` None). With `admin_password`: behind MLflow's basic-auth app as
    the cluster runs it (infra/k8s/mlflow/basic_auth.ini, its users' database in `workdir`),
    the admin `admin` with that password (infra/scripts/mlflow_users.py adds the others).

    Clients log artifacts through the server (mlflow-artifacts:/), so only the server holds the
    S3 credentials, as in the cluster deployment. The same `workdir` and `port` again restart a
    server on the same store (what the fault tests do after killing one).
    """
    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / "mlflow.log"
    cmd = [
        _bin("mlflow"),
        "server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
        "--backend-store-uri",
        f"sqlite:///{(workdir / 'mlflow.db').resolve()}",
        "--artifacts-destination",
        artifacts,
    ]
    env = client_env(s3_url) if s3_url else dict(os.environ)
    if admin_password is not None:
        ini = workdir / "basic_auth.ini"
        text = (ROOT / "infra/k8s/mlflow/basic_auth.ini").read_text()
        auth_db = f"sqlite:///{(workdir / 'basic_auth.db').resolve()}"
        ini.write_text(re.sub(r"(?m)^database_uri = .*$", f"database_uri = {auth_db}", text))
        cmd += ["--app-name", "basic-auth"]
        env |= {
            "MLFLOW_AUTH_CONFIG_PATH": str(ini),
            "MLFLOW_AUTH_ADMIN_PASSWORD": admin_password,
            "MLFLOW_FLASK_SERVER_SECRET_KEY": secrets.token_hex(16),  # its forms' CSRF key
        }
    proc = _spawn("mlflow", cmd, env, log)
    service = Service("mlflow", url, proc, log, {"MLFLOW_TRACKING_URI": url})
    try:
        wait_http(f"{url}/health", proc, log, timeout=90)
    except BaseException:
        service.stop()
        raise
    return service


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=Path("runs/services"), help="logs + mlflow.db")
    parser.add_argument("--bucket", default="bert", help="bucket to create (DVC, MLflow, Ray)")
    parser.add_argument("--s3-port", type=int, default=9000)
    parser.add_argument("--mlflow-port", type=int, default=5000)
    args = parser.parse_args(argv)
    s3 = start_s3(args.dir, args.s3_port, buckets=(args.bucket,))
    try:
        mlflow = start_mlflow(args.dir, s3.url, f"s3://{args.bucket}/mlflow", args.mlflow_port)
    except BaseException:
        s3.stop()
        raise
    print("# S3 (moto) and MLflow are up; in another shell:")
    print(f"export AWS_ENDPOINT_URL={s3.url} MLFLOW_S3_ENDPOINT_URL={s3.url}")
    print(f"export MLFLOW_TRACKING_URI={mlflow.url}")
    print("export AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=...  # any value works with moto")
    print(f"# logs in {args.dir}; Ctrl-C stops both", flush=True)
    try:
        while s3.proc.poll() is None and mlflow.proc.poll() is None:
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        mlflow.stop()
        s3.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
