"""The driver and rank 0 while a pre-training runs: metrics one way, a stop request the other.

The driver's `Progress` makes two Ray queues and hands them to the workers in the loop config:
`queue` carries rank 0's training rows to the driver's progress bar and, when the numbers went
non-finite, its `DIVERGED` word (the driver then raises `errors.Diverged`); `control` carries the
driver's stop request (SIGTERM or SIGINT), which every rank acts on after the same step
(`stop_requested`). `MetricSink` is rank 0's end: metrics to MLflow and to the bar.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from typing import Any

import torch

from bert_core.errors import Diverged

# the key of rank 0's message to the driver (`MetricSink.tell_driver`) when the numbers went
# non-finite: the workers stop, the driver raises `errors.Diverged`
DIVERGED = "diverged"


class MetricSink:
    """Rank 0's metrics to MLflow and to the driver's progress bar, from a background thread.

    Why not `ray.train.report` for every log line: a report waits until the Ray Train controller
    has collected the previous one (it polls every 2 s), which would stall fast steps. Reports
    are kept for checkpoints; frequent metrics go out here without blocking training.
    """

    def __init__(self, loop_config: dict[str, Any]):
        self.run_id = loop_config.get("mlflow_run_id")
        self.uri = loop_config.get("mlflow_tracking_uri")
        self.progress = loop_config.get("progress")
        self.queue: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, daemon=True, name="bert-metrics")
        self.thread.start()

    def log_params(self, params: dict[str, str]) -> None:
        """Parameters of the driver's run known only here (e.g. the instances' settings); once,
        at start, so synchronously. The same value again (a restart) is accepted by MLflow."""
        if not self.run_id or not params:
            return
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        try:
            batch = [Param(k, str(v)[:6000]) for k, v in params.items()]
            MlflowClient(self.uri).log_batch(self.run_id, params=batch)
        except Exception as e:  # tracking must never kill training
            print(f"[pretrain] parameter logging failed: {e}", flush=True)

    def put(self, metrics: dict[str, float]) -> None:
        self.queue.put(dict(metrics))

    def tell_driver(self, message: dict[str, str]) -> None:
        """`message` to the driver now, through its progress queue (e.g. `DIVERGED`)."""
        if self.progress is None:
            raise Diverged(next(iter(message.values())))
        self.progress.put(message)

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join(timeout=60)

    def _run(self) -> None:
        from mlflow.entities import Metric
        from mlflow.tracking import MlflowClient

        client = MlflowClient(self.uri) if self.run_id else None
        while (metrics := self.queue.get()) is not None:
            step, now = int(metrics["step"]), int(time.time() * 1000)
            try:
                if client is not None:
                    batch = [Metric(k, float(v), now, step) for k, v in metrics.items()]
                    client.log_batch(self.run_id, metrics=batch)
                if self.progress is not None and "loss" in metrics:  # training rows only
                    self.progress.put(metrics)
            except Exception as e:  # tracking must never kill training
                print(f"[pretrain] metric logging failed at step {step}: {e}", flush=True)


class Progress:
    """A tqdm bar on the driver, fed by rank 0 through a Ray queue; and the queue the other way,
    `control`, that asks the workers to stop (`command._stop_on_signals`)."""

    def __init__(self, total: int):
        from ray.util.queue import Queue
        from tqdm import tqdm

        self.queue, self.control = Queue(), Queue()
        self.diverged: str | None = None  # rank 0's word that the numbers went non-finite
        self.bar = tqdm(total=total, desc="pretrain", unit="step", dynamic_ncols=True, disable=None)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        from ray.util.queue import Empty

        while not self.stop.is_set():
            try:
                m = self.queue.get(timeout=0.5)
            except Empty:
                continue
            except Exception:  # the queue actor went away at shutdown
                return
            self._show(m)

    def _show(self, m: dict) -> None:
        if DIVERGED in m:
            self.diverged = m[DIVERGED]
            return
        self.bar.n = int(m["step"])
        self.bar.set_postfix(
            loss=f"{m['loss']:.3f}",
            mlm_acc=f"{m['mlm_accuracy']:.3f}",
            tok_s=f"{m['tokens_per_s']:.0f}",
            refresh=False,
        )
        self.bar.refresh()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        with contextlib.suppress(Exception):  # what came after the thread's last look
            while not self.queue.empty():
                self._show(self.queue.get_nowait())
        self.bar.close()
        import ray

        for ray_queue in (self.queue, self.control):
            with contextlib.suppress(Exception):
                ray.kill(ray_queue.actor)


def stop_requested(control, device: torch.device, world: int) -> bool:
    """Has the driver asked to stop (an item in its `control` queue)? Rank 0 looks; with more
    ranks an all-reduce tells them all, so every rank stops after the same step (one rank alone
    in a collective would hang the others)."""
    if control is None:
        return False
    if world == 1:
        return not control.empty()
    import torch.distributed as dist

    flag = torch.tensor([float(dist.get_rank() == 0 and not control.empty())], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())
