"""Ray Train overhead: tokens/s of `bert pretrain` with 1 Ray worker against the bare loop.

Both sides build their training with the very same set-up (`bert_core.pretrain.worker.setup`:
model, optimizer, schedule, data stream) and run the very same step (`train_step`: the worker's
micro-batches, clipping, AdamW, scheduler, metric sums) on the same instances and config, in the
same process run; the Ray side adds the Ray worker process, metric reporting, the MLflow sink
and checkpoints (every `--checkpoint-every` steps). The bare loop runs half its steps before and
half after the Ray run, so slow drift in machine load hits both sides alike. Throughput is steady
state: the first `--log-every` interval (start-up, warm-up) is left out on both sides.

Prints one JSON line: ray/bare tokens/s, the overhead (1 - ray/bare, target <= 10 %), and the
share of step time spent waiting for data on each side (target <= 5 %).

    python bench/pretrain.py --instances runs/default/instances --preset tiny --steps 200
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from bert_core.pretrain.command import pretrain
from bert_core.pretrain.config import PretrainConfig
from bert_core.pretrain.data import prefetch
from bert_core.pretrain.state import Meter
from bert_core.pretrain.worker import setup, train_step


def bare_loop(cfg: PretrainConfig, steps: int, start_step: int) -> dict[str, float]:
    """The training step without Ray: returns tokens/s and data-wait share after warm-up."""
    device = torch.device("cuda" if cfg.use_gpu else "cpu")
    t = setup(cfg, device=device, start_step=start_step)  # the Ray worker's set-up, rank 0 of 1
    batches = prefetch(t.stream)
    t.model.train()
    for _ in range(cfg.log_every):  # warm-up, as the Ray side's first interval
        train_step(t.model, batches, t.optimizer, t.scheduler, cfg, device, Meter())
    if device.type == "cuda":
        torch.cuda.synchronize()
    meter = Meter()
    for _ in range(steps):
        train_step(t.model, batches, t.optimizer, t.scheduler, cfg, device, meter)
    values = meter.values(device, 1)  # reads the sums: waits for the GPU
    return {"tokens_per_s": values["tokens_per_s"], "data_wait_share": values["data_wait_share"]}


def ray_run(cfg: PretrainConfig) -> dict[str, float]:
    t0 = time.perf_counter()
    pretrain(cfg)
    wall = time.perf_counter() - t0
    with open(Path(cfg.output) / "pretrain_metrics.csv") as f:
        rows = list(csv.DictReader(f))[1:]  # leave out the first interval (start-up)
    mean = lambda key: sum(float(r[key]) for r in rows) / len(rows)  # noqa: E731
    return {
        "tokens_per_s": mean("tokens_per_s"),
        "data_wait_share": mean("data_wait_share"),
        "wall_s": wall,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--instances", required=True)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--checkpoint-every", type=int, default=100)
    p.add_argument("--cpus-per-worker", type=int, default=1)
    p.add_argument("--use-gpu", action="store_true")
    p.add_argument("--compile", action="store_true")
    p.add_argument(
        "--bare-only", action="store_true", help="no Ray/MLflow: per-device step throughput only"
    )
    args = p.parse_args()
    if not args.bare_only:
        os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{tempfile.mkdtemp()}/mlflow.db")
    with tempfile.TemporaryDirectory(prefix="bench-pretrain-") as tmp:
        cfg = PretrainConfig(
            instances=str(Path(args.instances).resolve()),
            output=tmp,
            preset=args.preset,
            steps=args.steps,
            batch_size=args.batch_size,
            num_workers=1,
            use_gpu=args.use_gpu,
            cpus_per_worker=args.cpus_per_worker,
            log_every=args.log_every,
            checkpoint_every=args.checkpoint_every,
            compile=args.compile,
        )
        timed = args.steps - args.log_every
        first = bare_loop(cfg, timed // 2, 0)
        ray = None if args.bare_only else ray_run(cfg)
        second = bare_loop(cfg, timed - timed // 2, args.steps // 2)
    bare_tps = (first["tokens_per_s"] + second["tokens_per_s"]) / 2
    bare_wait = (first["data_wait_share"] + second["data_wait_share"]) / 2
    device = torch.cuda.get_device_name() if args.use_gpu else f"cpu x{args.cpus_per_worker}"
    out = {
        "bench": "pretrain",
        "device": device,
        "preset": args.preset,
        "batch_size": args.batch_size,
        "steps": args.steps,
        "compile": args.compile,
        "bare_tokens_per_s": round(bare_tps, 1),
        "bare_data_wait_share": round(bare_wait, 4),
    }
    if ray is not None:
        out |= {
            "ray_tokens_per_s": round(ray["tokens_per_s"], 1),
            "ray_overhead": round(1 - ray["tokens_per_s"] / bare_tps, 4),
            "ray_data_wait_share": round(ray["data_wait_share"], 4),
            "ray_wall_s_with_startup": round(ray["wall_s"], 1),
        }
    out["targets"] = {"ray_overhead": "<= 0.10", "data_wait_share": "<= 0.05"}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
