"""`bert serve MODEL`: one MLflow model behind an HTTP endpoint that holds up under load and abuse.

One server, two protocols over the same model:

- the Open Inference (V2) protocol, as KServe serves it on the cluster: KServe's own routes and
  data plane (`bert_core.serve.v2`: /v2/health/live, /v2/health/ready, /v2/models/NAME,
  /v2/models/NAME/ready, /v2/models/NAME/infer, and KServe's V1 /v1/models/NAME:predict), NAME
  being `--name`;
- MLflow's scoring protocol: MLflow's own scoring app, `mlflow.pyfunc.scoring_server.init(model)`,
  the one `mlflow models serve` runs under uvicorn (mlflow/pyfunc/scoring_server/__init__.py and
  app.py, MLflow 3.17), mounted under KServe's, so requests, answers, errors and the routes
  (/invocations, /ping, /health, /version) are exactly `mlflow models serve`'s.

Around both:

- `limits.Limits`, an ASGI middleware: a body over `--max-body-bytes` -> 413; more than
  `--max-concurrency` requests to /invocations in flight -> 503 with Retry-After; a body that
  does not arrive within `--body-timeout` -> 408 (see that module for why not uvicorn's own
  `limit_concurrency`, which is kept as the backstop, `--max-connections`); a connection whose
  headers are not complete within `--header-timeout` is closed (`limits.with_header_timeout`);
- `batching.BatchedModel`: requests that arrive while the model is busy are answered together,
  one call of the model, up to `--max-batch-rows` rows;
- `batching.BatchedModel` answers both protocols' requests from one queue;
- uvicorn, one process, on a socket bound here first (so a port in use is a one-line error
  before the model loads), `127.0.0.1` unless `--host` says otherwise: the endpoint has no
  authentication, so it is reachable from this machine only until you choose otherwise.

What a client gets (the model's own statuses come from `mlflow_model.RefusedInput`):

- 400 (MLflow's app): not JSON; none of `dataframe_split`, `dataframe_records`, `inputs`,
  `instances`; a column of the model missing.
- 422 (the model): a row's value refused: text over `max_chars`, empty, not text, too many
  tokens where the model does not cut text (a question, fill-mask).
- 413 (`Limits`): a body over `--max-body-bytes`; 408: a body slower than `--body-timeout`.
- 503 + Retry-After (`Limits`): over `--max-concurrency` requests in flight.
- 415 (MLflow's app): a content type other than JSON, CSV or Parquet; 504: no answer within
  `--timeout` seconds.

Every error body is JSON, `{"error_code": ..., "message": ...}`, and the server keeps serving.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import socket
import sys
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from bert_core.errors import BertError, NotFound, redacted
from bert_core.options import number
from bert_core.serve.batching import BatchedModel
from bert_core.serve.limits import Limits, with_header_timeout
from bert_core.storage import is_uri
from bert_core.tracking import tracking_uri

LOOPBACK = ("127.0.0.1", "localhost", "::1")
POSITIVE = (
    "max_body_bytes",
    "max_concurrency",
    "max_connections",
    "max_batch_rows",
    "max_chars",
    "timeout",
    "body_timeout",
)
log = logging.getLogger("uvicorn.error")  # uvicorn's own log: one stream, one format


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bert serve", description=__doc__.split("\n")[0])
    p.add_argument(
        "model",
        metavar="MODEL",
        help="models:/<name>@<alias>, models:/<name>/<version>, "
        "runs:/<run>/model, an MLflow model folder or a `bert finetune` output",
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0 "
        "for every interface: the endpoint has no authentication)",
    )
    p.add_argument("--port", type=int, default=5000, help="default 5000 (0: any free port)")
    p.add_argument(
        "--name",
        help="the model's name in the V2 paths, /v2/models/NAME/... "
        "(default: the registered model's name of a models:/ URI, else 'bert')",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=1 << 20,
        help="a larger request body gets 413 (default 1 MiB)",
    )
    p.add_argument(
        "--max-concurrency",
        type=int,
        default=64,
        help="requests to /invocations in flight, read, queued or computing; more "
        "get 503 with Retry-After (default 64)",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=1024,
        help="open connections; more get uvicorn's 503 (default 1024)",
    )
    p.add_argument(
        "--max-batch-rows",
        type=int,
        default=64,
        help="rows of concurrent requests answered in one call (default 64)",
    )
    p.add_argument(
        "--max-chars",
        type=int,
        help="a longer text gets 422 (default: the model's, 20000 unless logged otherwise)",
    )
    p.add_argument(
        "--timeout",
        type=int,
        default=60,
        help="seconds before an unanswered request gets 504 (default 60)",
    )
    p.add_argument(
        "--body-timeout",
        type=number("positive"),
        default=30.0,
        help="seconds for the request body to arrive, else 408 (default 30)",
    )
    p.add_argument(
        "--header-timeout",
        type=number("positive"),
        default=20.0,
        help="seconds for a request's headers to arrive, else the connection is closed "
        "(default 20)",
    )
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in POSITIVE:
        value = getattr(args, name)
        if value is not None and value <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0, got {value}")
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be 0..65535, got {args.port}")
    return args


def model_source(model: str) -> str:
    """An MLflow model URI or folder for a model reference (`bert finetune`'s output folder
    records its logged model's URI in mlflow_model.json)."""
    if is_uri(model):
        return model
    path = Path(model)
    if (path / "MLmodel").is_file():
        return str(path)
    if (path / "mlflow_model.json").is_file():
        return json.loads((path / "mlflow_model.json").read_text())["model_uri"]
    if not path.exists():
        raise NotFound(f"{path}: no such model folder")
    raise BertError(
        f"{path}: not an MLflow model (no MLmodel file): serve a registered model "
        "(models:/<name>@<alias>), runs:/<run>/model or a `bert finetune` output folder"
    )


@contextmanager
def model_files(model: str, overrides: dict) -> Iterator[tuple[Path, object, dict]]:
    """(local MLflow model folder, its `Model` metadata, the pyfunc model_config to load it
    with: the logged inference settings with `overrides` over them). A URI is downloaded into a
    temporary folder, removed when the block ends."""
    import mlflow
    from mlflow.exceptions import MlflowException
    from mlflow.models import Model

    from bert_core.serve.mlflow_model import CONFIG_KEY

    source = model_source(model)
    with tempfile.TemporaryDirectory(prefix="bert-serve-") as tmp:
        local = Path(source)
        if is_uri(source):
            uri = tracking_uri()
            mlflow.set_tracking_uri(uri)
            try:
                local = Path(mlflow.artifacts.download_artifacts(source, dst_path=tmp))
            except MlflowException as e:  # no such model, version or alias
                raise BertError(f"{model}: {e.message} (tracking URI {redacted(uri)})") from None
        if not (local / "MLmodel").is_file():
            raise BertError(f"{model}: not an MLflow model (no MLmodel file)")
        meta = Model.load(str(local / "MLmodel"))
        flavor = meta.flavors.get("python_function")
        if flavor is None:
            raise BertError(f"{model}: an MLflow model without the python_function flavor")
        config = dict(flavor.get("config") or {})
        if overrides:
            if CONFIG_KEY not in config:
                raise BertError(f"{model}: --max-chars applies to models `bert finetune` logged")
            config[CONFIG_KEY] = {**config[CONFIG_KEY], **overrides}
        yield local, meta, config


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port), as uvicorn's `Config.bind_socket` makes one."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:  # in use, not an address of this machine, unknown name
        sock.close()
        raise BertError(f"--host {host} --port {port}: cannot listen ({e.strerror or e})") from None
    return sock


def model_name(args: argparse.Namespace) -> str:
    """The V2 name: --name, else a models:/ URI's registered model, else "bert"."""
    if args.name:
        return args.name
    if args.model.startswith("models:/"):
        return args.model.removeprefix("models:/").split("/")[0].split("@")[0]
    return "bert"


def build_app(model, args: argparse.Namespace, meta):
    """KServe's V2 app with MLflow's scoring app mounted beneath it, over `model` (the batched
    model) and its MLflow signature (`meta`: the MLmodel), inside the limits."""
    from mlflow.pyfunc import scoring_server

    from bert_core.serve.v2 import V2Model, v2_app

    if meta.signature is None:
        raise BertError(f"{args.model}: no signature: the V2 protocol needs the model's columns")
    # init() reads MLflow's request timeout from the environment
    os.environ["MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT"] = str(args.timeout)
    app = v2_app(V2Model(model_name(args), model, meta.signature))
    app.mount("/", scoring_server.init(model))  # after KServe's routes: whatever they leave
    return Limits(app, args.max_body_bytes, args.max_concurrency, args.body_timeout)


def run(app, sock: socket.socket, args: argparse.Namespace, banner: str) -> None:
    """uvicorn on `sock` until SIGINT / SIGTERM. MLflow's app parses each request in a thread
    of the loop's default executor (`asyncio.to_thread`): sized to --max-concurrency, so every
    admitted request is parsed at once and waits for the model in the batching queue."""
    import uvicorn

    port = sock.getsockname()[1]
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    http = with_header_timeout(AutoHTTPProtocol, args.header_timeout)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=port,
        lifespan="on",
        http=http,
        limit_concurrency=args.max_connections,
        timeout_graceful_shutdown=args.timeout,
    )
    server = uvicorn.Server(config)

    async def serve() -> None:
        executor = ThreadPoolExecutor(args.max_concurrency, thread_name_prefix="bert-serve")
        asyncio.get_running_loop().set_default_executor(executor)
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not (server.started or task.done()):
            await asyncio.sleep(0.05)
        if server.started:  # uvicorn logs no address for a socket handed to it
            log.info(banner.replace("PORT", str(port)))
        await task

    asyncio.run(serve())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    overrides = {"max_chars": args.max_chars} if args.max_chars else {}
    try:
        with model_files(args.model, overrides) as (local, meta, config):
            sock = listen(args.host, args.port)
            import mlflow

            pyfunc = mlflow.pyfunc.load_model(str(local), model_config=config or None)
            model = BatchedModel(pyfunc, args.max_batch_rows)
            kind = (meta.metadata or {}).get("bert_kind", "pyfunc")
            if args.host not in LOOPBACK:
                print(
                    f"bert serve: warning: listening on {args.host}, reachable from other "
                    "machines; the endpoint has no authentication",
                    file=sys.stderr,
                )
            try:
                run(build_app(model, args, meta), sock, args, banner(args, kind))
            finally:
                log.info(
                    f"bert serve: answered {model.answered:,} requests to the model in "
                    f"{model.calls:,} calls of it"
                )
    except KeyboardInterrupt as e:  # SIGTERM / SIGINT, re-raised by uvicorn once it has stopped
        signum = getattr(e, "signum", signal.SIGINT)  # errors.Interrupted names its signal
        print(f"bert serve: stopped ({signal.Signals(signum).name})", file=sys.stderr)
        return 128 + signum  # the shell's convention, as the other commands
    return 0


def banner(args: argparse.Namespace, kind: str) -> str:
    host = f"[{args.host}]" if ":" in args.host else args.host
    return (
        f"bert serve: {args.model} ({kind}) on http://{host}:PORT, V2 as "
        f"/v2/models/{model_name(args)} and MLflow's /invocations (CTRL+C to quit); limits: "
        f"body {args.max_body_bytes:,} bytes, {args.max_concurrency} requests in flight, "
        f"batches of {args.max_batch_rows} rows, {args.timeout} s"
    )
