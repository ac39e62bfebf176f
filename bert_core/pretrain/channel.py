"""The driver and rank 0 while a pre-training runs: metrics one way, a stop request the other.

The driver's `Progress` makes one Ray actor, a `Mailbox`, and hands it to the workers in the loop
config: rank 0 puts its training rows in it for the driver's progress bar and, when the numbers
went non-finite, its `DIVERGED` word (the driver then raises `errors.Diverged`); the driver marks
its stop request there (SIGTERM or SIGINT), which every rank acts on after the same step
(`stop_requested`). `MetricSink` is rank 0's end: metrics to MLflow and to the bar.

torch is imported only where a function needs it: the mailbox's own Ray process imports this
module to make the actor, and torch would cost it seconds of CPU for nothing.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from typing import TYPE_CHECKING, Any

from bert_core.errors import Diverged

if TYPE_CHECKING:
    import torch

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
        self.mailbox = loop_config.get("mailbox")
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
        """`message` to the driver now, through the mailbox (e.g. `DIVERGED`)."""
        if self.mailbox is None:
            raise Diverged(next(iter(message.values())))
        _post(self.mailbox, message)

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
                if self.mailbox is not None and "loss" in metrics:  # training rows only
                    _post(self.mailbox, metrics)
            except Exception as e:  # tracking must never kill training
                print(f"[pretrain] metric logging failed at step {step}: {e}", flush=True)


def _post(mailbox, row: dict) -> None:
    """`row` in the mailbox, waiting until it is there (a worker may end right after)."""
    import ray

    ray.get(mailbox.put.remote(row))


class Mailbox:
    """The one Ray actor between the driver and rank 0: rank 0's rows to the driver (`put`,
    `take`), the driver's stop request to the workers (`ask_to_stop`, `stop_asked`). One actor
    for both ways (a `ray.util.queue.Queue` is one actor per direction): each actor is a process
    to start, ~2.6 CPU-s of a short run on 2 cores. Its calls run one at a time, in the order
    each caller made them."""

    def __init__(self) -> None:
        self.rows: list[dict] = []
        self.stop = False

    def put(self, row: dict) -> None:
        self.rows.append(row)

    def take(self) -> list[dict]:
        rows, self.rows = self.rows, []
        return rows

    def ask_to_stop(self) -> None:
        self.stop = True

    def stop_asked(self) -> bool:
        return self.stop


class Progress:
    """A tqdm bar on the driver, fed by rank 0 through the `Mailbox` this makes (no CPU asked of
    Ray: it must never wait for a training worker's slot)."""

    POLL_S = 0.5  # how often the bar looks in the mailbox

    def __init__(self, total: int):
        import ray
        from tqdm import tqdm

        self.mailbox = ray.remote(num_cpus=0)(Mailbox).remote()
        self.diverged: str | None = None  # rank 0's word that the numbers went non-finite
        self.bar = tqdm(total=total, desc="pretrain", unit="step", dynamic_ncols=True, disable=None)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _take(self) -> None:
        import ray

        for row in ray.get(self.mailbox.take.remote()):
            self._show(row)

    def _run(self) -> None:
        while not self.stop.wait(self.POLL_S):
            try:
                self._take()
            except Exception:  # the actor went away at shutdown
                return

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
            self._take()
        self.bar.close()
        import ray

        with contextlib.suppress(Exception):
            ray.kill(self.mailbox)


def stop_requested(mailbox, device: torch.device, world: int) -> bool:
    """Has the driver asked to stop (`Mailbox.stop_asked`)? Rank 0 looks; with more ranks an
    all-reduce tells them all, so every rank stops after the same step (one rank alone in a
    collective would hang the others)."""
    if mailbox is None:
        return False
    import ray
    import torch

    if world == 1:
        return ray.get(mailbox.stop_asked.remote())
    import torch.distributed as dist

    asked = dist.get_rank() == 0 and ray.get(mailbox.stop_asked.remote())
    flag = torch.tensor([float(asked)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())
