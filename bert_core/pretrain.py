"""`bert pretrain`: BERT pre-training (masked LM + next sentence) on Ray Train.

The driver (`pretrain`) builds a `TorchTrainer`; every worker runs `train_loop_per_worker`, which
reads its own share of the instance shards (`bert_core.pretrain_data`), trains with the paper's
optimiser (AdamW, lr 1e-4, betas 0.9/0.999, weight decay 0.01 except LayerNorm and biases, linear
warm-up then linear decay, gradient clipping at 1.0) and reports metrics. Every `checkpoint_every`
steps rank 0 reports a Ray checkpoint holding everything needed to continue bit-for-bit: model,
optimizer, scheduler, every rank's RNG states, the step (which is the data position: each rank has
consumed `step * grad_accum * micro_batch` samples) and the metric history.

Resume: Ray Train (V2) keeps a snapshot of the reported checkpoints in
`storage_path/run_name`; a new run with the same storage path and name loads it, so a worker that
failed (`FailureConfig.max_failures`) and a command started again both continue from the latest
checkpoint through `ray.train.get_checkpoint()`. Ray writes a checkpoint completely before it
records it in the snapshot, so a crash while saving never hides the previous one.

Two-phase training as in the paper (90% of steps at 128 tokens, then 512): run phase one on
128-token instances, then phase two on 512-token instances with `--init-model PHASE1/model`.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import math
import os
import random
import shutil
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bert_core.errors import BertError, InputError, atomic_dir, atomic_file
from bert_core.pretrain_data import (
    InstanceStream,
    list_row_groups,
    masking_config_from_vocab,
    prefetch,
)
from bert_core.storage import filesystem, is_s3, preflight
from bert_core.tokenizer import read_vocab

CSV_COLUMNS = (
    "step",
    "loss",
    "mlm_loss",
    "nsp_loss",
    "mlm_accuracy",
    "nsp_accuracy",
    "learning_rate",
    "grad_norm",
    "tokens_per_s",
    "sequences_per_s",
    "data_wait_share",
    "mfu",
)
# Dense bf16 peak FLOP/s for MFU; other GPUs: pass --peak-tflops.
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L4": 121.0, "A10G": 125.0}


@dataclass
class PretrainConfig:
    """Everything that defines a pre-training run (logged to MLflow as parameters)."""

    instances: str
    output: str
    preset: str = "tiny"
    steps: int = 1000
    batch_size: int = 256  # sequences per optimizer step, all workers and accumulation together
    num_workers: int = 1
    use_gpu: bool = False
    cpus_per_worker: int = 1
    grad_accum: int = 1
    learning_rate: float = 1e-4
    warmup_steps: int | None = None  # default: 1% of steps (10k of the paper's 1M)
    weight_decay: float = 0.01
    adam_betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-6
    max_grad_norm: float = 1.0
    dropout: float | None = None  # overrides the preset's hidden and attention dropout
    dynamic_masking: bool = False
    masked_lm_prob: float = 0.15
    max_predictions_per_seq: int = 20
    init_model: str | None = None  # phase two: start from phase one's model
    compile: bool = False
    seed: int = 12345
    log_every: int = 50
    checkpoint_every: int = 500
    keep_checkpoints: int = 3
    max_failures: int = 3
    storage_path: str | None = None  # default OUTPUT/ray; s3:// allowed
    run_name: str = "pretrain"
    stop_after: int | None = None  # stop (with a checkpoint) after this step; rerun to resume
    peak_tflops: float | None = None
    inject_failure_at: int | None = None  # tests: raise once at this step

    @property
    def micro_batch(self) -> int:
        return self.batch_size // (self.num_workers * self.grad_accum)

    def validate(self) -> None:
        if self.steps < 1 or self.batch_size < 1 or self.num_workers < 1 or self.grad_accum < 1:
            raise BertError("--steps, --batch-size, --num-workers, --grad-accum must be >= 1")
        if self.batch_size % (self.num_workers * self.grad_accum):
            raise BertError(
                f"--batch-size {self.batch_size} is not divisible by --num-workers x "
                f"--grad-accum = {self.num_workers * self.grad_accum}"
            )
        for name in ("log_every", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise BertError(f"--{name.replace('_', '-')} must be >= 1")


# ---------------------------------------------------------------- optimisation


def build_optimizer(model: torch.nn.Module, cfg: PretrainConfig) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only: as BERT, LayerNorm weights and biases are
    excluded (they are the 1-D parameters)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for _, p in named if p.ndim >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for _, p in named if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        groups, lr=cfg.learning_rate, betas=tuple(cfg.adam_betas), eps=cfg.adam_eps
    )


def warmup_linear_decay(warmup_steps: int, total_steps: int):
    """lr multiplier: linear warm-up to 1 over `warmup_steps`, then linear decay to 0."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))

    return factor


def warmup_steps(cfg: PretrainConfig) -> int:
    return cfg.warmup_steps if cfg.warmup_steps is not None else max(1, cfg.steps // 100)


# ---------------------------------------------------------------- RNG and checkpoints


def rng_state() -> dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's `obj` on every rank (one element when not distributed)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t)
    return t.tolist()


# ---------------------------------------------------------------- the worker


def _model_class():
    from bert_core.model import BertConfig, BertForPreTraining

    return BertConfig, BertForPreTraining


def build_model(cfg: PretrainConfig, vocab_size: int) -> torch.nn.Module:
    BertConfig, BertForPreTraining = _model_class()
    overrides: dict[str, Any] = {}
    if cfg.dropout is not None:
        overrides = {
            "hidden_dropout_prob": cfg.dropout,
            "attention_probs_dropout_prob": cfg.dropout,
        }
    if cfg.init_model:
        return BertForPreTraining.from_pretrained(cfg.init_model, **overrides)
    return BertForPreTraining(
        BertConfig.from_preset(cfg.preset, vocab_size=vocab_size, **overrides)
    )


def flops_per_token(model: torch.nn.Module, seq_len: float) -> float:
    """Training FLOPs per token: 6 x parameters plus attention (PaLM appendix B)."""
    c = model.config
    n = sum(p.numel() for p in model.parameters())
    return 6 * n + 12 * c.num_hidden_layers * c.hidden_size * seq_len


def peak_flops(cfg: PretrainConfig, device: torch.device) -> float | None:
    if cfg.peak_tflops:
        return cfg.peak_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    tflops = next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    return tflops * 1e12 if tflops else None


class Meter:
    """Sums over a reporting interval; `values` all-reduces them into interval means."""

    KEYS = (
        "loss",
        "mlm_loss",
        "nsp_loss",
        "micro",
        "mlm_correct",
        "mlm_count",
        "nsp_correct",
        "nsp_count",
        "tokens",
        "sequences",
        "padded_tokens",
        "data_wait",
        "grad_norm",
        "steps",
    )

    def __init__(self):
        self.sums: dict[str, Any] = dict.fromkeys(self.KEYS, 0.0)
        self.start = time.perf_counter()

    def add(self, **kw: float | torch.Tensor) -> None:
        """Tensors stay on the device (no GPU sync per step); they are read at report time."""
        for k, v in kw.items():
            self.sums[k] = self.sums[k] + (v.detach().double() if torch.is_tensor(v) else v)

    def values(self, device: torch.device, world_size: int) -> dict[str, float]:
        totals = all_reduce_sum([float(self.sums[k]) for k in self.KEYS], device)
        s = dict(zip(self.KEYS, totals, strict=True))
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        return {
            "loss": s["loss"] / max(s["micro"], 1),
            "mlm_loss": s["mlm_loss"] / max(s["micro"], 1),
            "nsp_loss": s["nsp_loss"] / max(s["micro"], 1),
            "mlm_accuracy": s["mlm_correct"] / max(s["mlm_count"], 1),
            "nsp_accuracy": s["nsp_correct"] / max(s["nsp_count"], 1),
            "grad_norm": s["grad_norm"] / max(s["steps"], 1),
            "tokens_per_s": s["tokens"] / elapsed,
            "sequences_per_s": s["sequences"] / elapsed,
            "data_wait_share": s["data_wait"] / world_size / elapsed,
            "_mean_seq_len": s["padded_tokens"] / max(s["sequences"], 1),
        }


def autocast_for(device: torch.device):
    """bf16 autocast on CUDA (as the paper's TPUs used bf16 activations); fp32 on CPU."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def train_step(
    model: torch.nn.Module,
    batches,
    optimizer: torch.optim.Optimizer,
    scheduler,
    cfg: PretrainConfig,
    device: torch.device,
    meter: Meter,
    distributed: bool = False,
) -> float:
    """One optimizer step over `grad_accum` micro-batches; returns the learning rate used.

    Shared by the Ray worker and the bare loop of bench/pretrain.py, so the bench measures
    exactly what Ray Train adds.
    """
    for i in range(cfg.grad_accum):
        t0 = time.perf_counter()
        batch = next(batches)
        wait = time.perf_counter() - t0
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        sync = not distributed or i == cfg.grad_accum - 1
        # accumulation micro-steps skip DDP's gradient all-reduce; the last one syncs
        with contextlib.nullcontext() if sync else model.no_sync():
            with autocast_for(device):
                out = model(**batch)
            (out.loss / cfg.grad_accum).backward()
        labels = batch["masked_lm_labels"]
        predicted = labels != -100
        meter.add(
            loss=out.loss,
            mlm_loss=out.mlm_loss,
            nsp_loss=out.nsp_loss,
            micro=1,
            mlm_correct=((out.mlm_logits.argmax(-1) == labels) & predicted).sum(),
            mlm_count=predicted.sum(),
            nsp_correct=(out.nsp_logits.argmax(-1) == batch["next_sentence_label"]).sum(),
            nsp_count=labels.shape[0],
            tokens=batch["attention_mask"].sum(),
            sequences=labels.shape[0],
            padded_tokens=batch["input_ids"].numel(),
            data_wait=wait,
        )
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
    lr = scheduler.get_last_lr()[0]
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    meter.add(grad_norm=grad_norm, steps=1)
    return lr


def train_loop_per_worker(loop_config: dict[str, Any]) -> None:
    """One Ray Train worker: restore, train to `steps` (or `stop_after`), report, checkpoint."""
    import ray.train
    import ray.train.torch

    cfg = PretrainConfig(**loop_config["config"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = ray.train.torch.get_device()
    torch.set_num_threads(max(1, cfg.cpus_per_worker))
    vocab_file = _join(cfg.instances, "vocab.txt")
    vocab = read_vocab(vocab_file)

    seed_all(cfg.seed)  # same initial weights on every rank
    model = build_model(cfg, len(vocab))
    optimizer = build_optimizer(model, cfg)
    total, warm = cfg.steps, warmup_steps(cfg)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_linear_decay(warm, total))
    step, history = 0, []
    seed_all(cfg.seed + 1000 * (rank + 1))  # distinct dropout per rank

    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            state = torch.load(Path(d) / "state.pt", map_location="cpu", weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        step, history = state["step"], state["history"]
        if len(state["rng"]) == world:
            set_rng_state(state["rng"][rank])
        if rank == 0:
            print(f"[pretrain] resumed from step {step} ({checkpoint.path})", flush=True)

    model = ray.train.torch.prepare_model(model)  # device + DistributedDataParallel
    core = model.module if hasattr(model, "module") else model
    if device.type != "cpu":
        for s in optimizer.state.values():  # optimizer state was loaded on the CPU
            for k, v in s.items():
                if torch.is_tensor(v) and k != "step":
                    s[k] = v.to(device)
    forward = torch.compile(model) if cfg.compile else model

    masking = None
    if cfg.dynamic_masking:
        masking = masking_config_from_vocab(
            vocab,
            masked_lm_prob=cfg.masked_lm_prob,
            max_predictions_per_seq=cfg.max_predictions_per_seq,
        )
    micro = cfg.micro_batch
    stream = InstanceStream(
        list_row_groups(cfg.instances),
        micro,
        rank=rank,
        world_size=world,
        seed=cfg.seed,
        start_sample=step * cfg.grad_accum * micro,
        masking=masking,
        pad_id=vocab.get("[PAD]", 0),
    )
    batches = prefetch(stream)
    end = min(total, cfg.stop_after or total)
    sink = MetricSink(loop_config) if rank == 0 else None
    peak = peak_flops(cfg, device)
    meter = Meter()
    model.train()

    while step < end:
        lr = train_step(forward, batches, optimizer, scheduler, cfg, device, meter, world > 1)
        step += 1
        _maybe_inject_failure(cfg, step)

        save = step % cfg.checkpoint_every == 0 or step == end
        if step % cfg.log_every and not save:  # metrics every log_every, and with checkpoints
            continue
        metrics = meter.values(device, world)
        seq_len = metrics.pop("_mean_seq_len")
        metrics.update(step=step, learning_rate=lr)
        if peak:
            metrics["mfu"] = (
                metrics["tokens_per_s"] * flops_per_token(core, seq_len) / (peak * world)
            )
        meter = Meter()
        if rank == 0:
            history.append({k: metrics.get(k) for k in CSV_COLUMNS})
            sink.put(metrics)
        if save:
            _report_checkpoint(
                cfg,
                core,
                optimizer,
                scheduler,
                step,
                history,
                metrics,
                rank,
                final=step == total,
                vocab_file=vocab_file,
            )
    if sink is not None:
        sink.close()


def _maybe_inject_failure(cfg: PretrainConfig, step: int) -> None:
    """Test hook: die once at `inject_failure_at` (a marker file makes it once per run dir)."""
    if cfg.inject_failure_at != step:
        return
    marker = Path(cfg.output) / ".injected_failure"
    if not marker.exists():
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(str(step))
        raise RuntimeError(f"injected failure at step {step}")


class MetricSink:
    """Rank 0's metrics to MLflow and to the driver's progress bar, from a background thread.

    Why not `ray.train.report` for every log line: a report waits until the Ray Train controller
    has collected the previous one (it polls every 2 s), which would stall fast steps. Reports
    are kept for checkpoints; frequent metrics go out here without blocking training.
    """

    def __init__(self, loop_config: dict[str, Any]):
        import queue

        self.run_id = loop_config.get("mlflow_run_id")
        self.uri = loop_config.get("mlflow_tracking_uri")
        self.progress = loop_config.get("progress")
        self.queue: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, daemon=True, name="bert-metrics")
        self.thread.start()

    def put(self, metrics: dict[str, float]) -> None:
        self.queue.put(dict(metrics))

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
                if self.progress is not None:
                    self.progress.put(metrics)
            except Exception as e:  # tracking must never kill training
                print(f"[pretrain] metric logging failed at step {step}: {e}", flush=True)


def _report_checkpoint(
    cfg,
    model,
    optimizer,
    scheduler,
    step,
    history,
    metrics,
    rank,
    *,
    final: bool,
    vocab_file: str | Path,
) -> None:
    """Every rank hands in its RNG state; rank 0 writes the checkpoint and reports it."""
    import ray.train

    rngs = gather_objects(rng_state())
    if rank != 0:
        ray.train.report(metrics)
        return
    with tempfile.TemporaryDirectory(prefix="bert-ckpt-") as tmp:
        state = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "step": step,
            "samples_per_rank": step * cfg.grad_accum * cfg.micro_batch,
            "rng": rngs,
            "history": history,
            "config": asdict(cfg),
        }
        torch.save(state, Path(tmp) / "state.pt")
        if final:
            if is_s3(vocab_file):  # save_pretrained copies a local file
                fs, inner = filesystem(vocab_file)
                with fs.open_input_stream(inner) as f:
                    (Path(tmp) / "vocab.txt").write_bytes(f.read())
                vocab_file = Path(tmp) / "vocab.txt"
            model.save_pretrained(Path(tmp) / "model", vocab_file=vocab_file)
            (Path(tmp) / "vocab.txt").unlink(missing_ok=True)
        ray.train.report(
            metrics,
            checkpoint=ray.train.Checkpoint.from_directory(tmp),
            checkpoint_dir_name=f"checkpoint_{step:08d}",
        )


# ---------------------------------------------------------------- the driver


def _quiet_worker_logs() -> None:
    """Ray worker setup hook: without a dashboard (a bare local cluster) Ray Train's placement
    group cleaner warns every few seconds that the state API is unavailable; silence it."""
    import logging

    logging.getLogger(
        "ray.train.v2._internal.execution.controller.placement_group_cleaner"
    ).setLevel(logging.ERROR)


def init_local_ray(num_cpus: int, **kwargs: Any) -> None:
    """Start a private local Ray instance (never attach to someone else's `ray start`)."""
    import ray

    ray.init(
        address="local",
        num_cpus=num_cpus,
        include_dashboard=False,
        runtime_env={"worker_process_setup_hook": _quiet_worker_logs},
        **kwargs,
    )


def _init_ray(cfg: PretrainConfig) -> None:
    """Join the cluster in RAY_ADDRESS, or start a local one sized for this run."""
    import ray

    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"])
    else:
        init_local_ray(max(os.cpu_count() or 1, cfg.num_workers * cfg.cpus_per_worker))


def _storage(cfg: PretrainConfig) -> str:
    path = cfg.storage_path or str(Path(cfg.output) / "ray")
    return path if "://" in path else str(Path(path).resolve())


def _check_inputs(cfg: PretrainConfig) -> int:
    """Fail before starting Ray: the instances (local or s3://) and their vocabulary exist."""
    list_row_groups(cfg.instances)
    vocab = read_vocab(_join(cfg.instances, "vocab.txt"))
    if cfg.init_model and not (Path(cfg.init_model) / "config.json").is_file():
        raise InputError(Path(cfg.init_model) / "config.json", "not found")
    return len(vocab)


def _join(base: str, name: str) -> str:
    return f"{base.rstrip('/')}/{name}"


def _local(path: str) -> str:
    return path if is_s3(path) else str(Path(path).resolve())


class _Progress:
    """A tqdm bar on the driver, fed by rank 0 through a Ray queue."""

    def __init__(self, total: int):
        from ray.util.queue import Queue
        from tqdm import tqdm

        self.queue = Queue()
        self.bar = tqdm(total=total, desc="pretrain", unit="step", dynamic_ncols=True)
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
        self.bar.close()
        import ray

        with contextlib.suppress(Exception):
            ray.kill(self.queue.actor)


def pretrain(cfg: PretrainConfig) -> dict[str, Any]:
    """Run (or resume) pre-training; write OUTPUT/model and OUTPUT/pretrain_metrics.csv."""
    import ray.train
    from ray.train.torch import TorchTrainer

    from bert_core import tracking

    cfg.validate()
    # Seconds, not GPU hours: an unreachable tracking server or bucket fails before Ray starts.
    preflight(tracking.tracking_uri(), [cfg.instances, cfg.storage_path])
    _check_inputs(cfg)
    cfg.instances = _local(cfg.instances)
    cfg.output = str(Path(cfg.output).resolve())
    if cfg.init_model:
        cfg.init_model = str(Path(cfg.init_model).resolve())
    _init_ray(cfg)
    storage = _storage(cfg)
    with tracking.start_run("pretrain", cfg, tags={"bert.storage_path": storage}) as run:
        progress = _Progress(cfg.steps)
        try:
            trainer = TorchTrainer(
                train_loop_per_worker,
                train_loop_config={
                    "config": asdict(cfg),
                    "mlflow_run_id": run.info.run_id,
                    "mlflow_tracking_uri": tracking.tracking_uri(),
                    "progress": progress.queue,
                },
                scaling_config=ray.train.ScalingConfig(
                    num_workers=cfg.num_workers,
                    use_gpu=cfg.use_gpu,
                    resources_per_worker={
                        "CPU": cfg.cpus_per_worker,
                        **({"GPU": 1} if cfg.use_gpu else {}),
                    },
                ),
                run_config=ray.train.RunConfig(
                    name=cfg.run_name,
                    storage_path=filesystem(storage)[1] if is_s3(storage) else storage,
                    storage_filesystem=filesystem(storage)[0] if is_s3(storage) else None,
                    checkpoint_config=ray.train.CheckpointConfig(num_to_keep=cfg.keep_checkpoints),
                    failure_config=ray.train.FailureConfig(max_failures=cfg.max_failures),
                ),
            )
            result = trainer.fit()
        finally:
            progress.close()
        if result.checkpoint is None:
            raise BertError(f"the run under {storage}/{cfg.run_name} produced no checkpoint")
        summary = _finish(cfg, result.checkpoint)
        import mlflow

        if summary["finished"]:
            mlflow.log_artifact(str(Path(cfg.output) / "pretrain_metrics.csv"))
        mlflow.set_tag("bert.pretrain.step", str(summary["step"]))
    return summary


def _finish(cfg: PretrainConfig, checkpoint) -> dict[str, Any]:
    """Copy the final model out of the last checkpoint and write the metrics CSV."""
    out = Path(cfg.output)
    with checkpoint.as_directory() as d:
        state = torch.load(Path(d) / "state.pt", map_location="cpu", weights_only=False)
        finished = state["step"] >= cfg.steps and (Path(d) / "model").is_dir()
        if finished:
            with atomic_dir(out / "model") as tmp:
                shutil.copytree(Path(d) / "model", tmp, dirs_exist_ok=True)
    with atomic_file(out / "pretrain_metrics.csv") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for row in state["history"]:
            writer.writerow({k: ("" if v is None else v) for k, v in row.items()})
    last = state["history"][-1] if state["history"] else {}
    return {"step": state["step"], "finished": finished, "last": last}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bert pretrain", description="Pre-train BERT (MLM + NSP) with Ray Train."
    )
    p.add_argument("--instances", required=True, help="folder of shard-*.parquet and vocab.txt")
    p.add_argument("--output", required=True, help="run folder: model/, pretrain_metrics.csv")
    p.add_argument("--preset", default="tiny", help="model size: tiny/mini/small/medium/base/large")
    p.add_argument("--steps", type=int, default=1000, help="optimizer steps in the whole run")
    p.add_argument("--batch-size", type=int, default=256, help="global batch (sequences/step)")
    p.add_argument("--num-workers", type=int, default=1, help="Ray Train workers")
    p.add_argument("--use-gpu", action="store_true", help="one GPU per worker, bf16 autocast")
    p.add_argument("--cpus-per-worker", type=int, default=1)
    p.add_argument("--grad-accum", type=int, default=1, help="gradient accumulation steps")
    p.add_argument("--learning-rate", type=float, default=1e-4)
    p.add_argument("--warmup-steps", type=int, default=None, help="default: 1%% of --steps")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--dropout", type=float, default=None, help="override the preset's dropout")
    p.add_argument("--dynamic-masking", action="store_true", help="re-mask on every read")
    p.add_argument("--masked-lm-prob", type=float, default=0.15)
    p.add_argument("--max-predictions-per-seq", type=int, default=20)
    p.add_argument("--init-model", default=None, help="start from this model (phase two)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--seed", type=int, default=12345)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--checkpoint-every", type=int, default=500)
    p.add_argument("--keep-checkpoints", type=int, default=3)
    p.add_argument("--max-failures", type=int, default=3, help="worker restarts before giving up")
    p.add_argument("--storage-path", default=None, help="Ray checkpoints (default OUTPUT/ray)")
    p.add_argument("--run-name", default="pretrain")
    p.add_argument("--stop-after", type=int, default=None, help="stop after this step (resumable)")
    p.add_argument("--peak-tflops", type=float, default=None, help="GPU peak for MFU")
    p.add_argument("--inject-failure-at", type=int, default=None, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    names = {f.name for f in fields(PretrainConfig)}
    cfg = PretrainConfig(**{k: v for k, v in vars(args).items() if k in names})
    summary = pretrain(cfg)
    last = summary["last"]
    where = f"{cfg.output}/model" if summary["finished"] else f"checkpoint (step {summary['step']})"
    print(
        f"pretrain: step {summary['step']}/{cfg.steps}, loss {last.get('loss', math.nan):.4f}, "
        f"mlm_accuracy {last.get('mlm_accuracy', math.nan):.4f} -> {where}"
    )
    return 0
