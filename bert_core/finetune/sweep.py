"""The paper's fine-tuning protocol: several trials, the best on dev kept.

Section 4.1: "For each task, we selected the best fine-tuning learning rate (among 5e-5, 4e-5,
3e-5, and 2e-5) on the Dev set. [...] For BERT-LARGE we found that fine-tuning was sometimes
unstable on small datasets, so we ran several random restarts and selected the best model on the
Dev set. With random restarts, we use the same pre-trained checkpoint but perform different
fine-tuning data shuffling and classifier layer initialization."

`bert finetune --lr-sweep 5e-5,4e-5,3e-5,2e-5 --restarts N` runs every (learning rate, seed)
pair, seeds `--seed` .. `--seed + N - 1`, in one step (`run_trials`): the task's data are read,
sampled (with `--seed`, the same for every trial) and featurised once; each trial is a nested
MLflow run under the step's run (its `learning_rate`, `seed`, per-epoch dev metrics and
`eval/score`); the best trial by dev score (each trial's best epoch; ties: the earlier trial)
is the step's output, its `learning_rate`/`seed` the step run's parameters, the choice in tags
`sweep.*` and in metrics.json's `sweep` section. A trial whose training diverges (non-finite
loss: `errors.Diverged`) is a failed trial, its nested run FAILED and its row in the section
`"score": null` with the reason; the sweep fails only when every trial does.

A pipeline can instead fan the trials out, one `bert finetune --lr X --seed S` step each, and
join them with `pick_best` (`python -m bert_core.finetune.sweep --results A B ... --output
BEST`): the best folder by dev score is copied to BEST with the same `sweep` section.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from bert_core.errors import Diverged, InputError, NotFound, atomic_dir
from bert_core.finetune.engine import Fitted, epoch_metrics, numeric
from bert_core.metrics import task_run
from bert_core.tracking import default_tags

SELECTED_BY = "dev score of each trial's best epoch (the task's score); ties: the earlier trial"


def trial_configs(cfg) -> list:
    """Every (learning rate, seed) trial of `cfg`, learning rates in the order given."""
    rates = cfg.lr_sweep or (cfg.learning_rate,)
    return [
        replace(cfg, learning_rate=lr, seed=cfg.seed + r)
        for lr in rates
        for r in range(cfg.restarts)
    ]


def _record(i: int, cfg, fitted: Fitted, run_id: str | None) -> dict:
    return {
        "trial": i,
        "learning_rate": cfg.learning_rate,
        "seed": cfg.seed,
        "score": fitted.best.score,
        "best_epoch": fitted.best.epoch,
        "metrics": numeric(fitted.best.metrics),
        "train_seconds": fitted.train_seconds,
        "run_id": run_id,
    }


def summary(trials: list[dict], chosen: int, data_seed: int | None) -> dict:
    """metrics.json's `sweep` section."""
    best = trials[chosen]
    return {
        "selected_by": SELECTED_BY,
        "chosen": chosen,
        "learning_rate": best["learning_rate"],
        "seed": best["seed"],
        "score": best["score"],
        "data_seed": data_seed,  # the training sample's seed (when a sample is drawn)
        "trials": trials,
    }


def run_trials(task, model_dir, cfg, device: torch.device, train: Callable):
    """Train every trial of `cfg` (a nested MLflow run each) with `train` (the engine's), keep
    the best on dev. Returns (the chosen trial's `train` result, its config, `sweep` section)."""
    import mlflow

    trials, kept, kept_fitted, kept_cfg, chosen = [], None, None, None, 0
    for i, trial in enumerate(trial_configs(cfg)):
        name = f"trial-{i} lr={trial.learning_rate:g} seed={trial.seed}"
        tags = {**default_tags(), "bert.step": f"finetune-{task.name}-trial", "bert.trial": str(i)}
        try:
            with mlflow.start_run(run_name=name, nested=True, tags=tags) as run:
                params = {"trial": i, "learning_rate": trial.learning_rate, "seed": trial.seed}
                mlflow.log_params(params | {"task": task.name, "init": trial.init})
                result = train(task, model_dir, trial, device, mlflow.log_metrics)
                model, fitted = result
                best = fitted.best
                kept_epoch = {"eval/best_epoch": best.epoch}
                mlflow.log_metrics(task_run(best.score, best.metrics) | kept_epoch)
        except Diverged as e:  # a failed trial (its run FAILED), as a tuner counts one
            print(f"trial {i}: {e}", file=sys.stderr, flush=True)
            record = {"trial": i, "learning_rate": trial.learning_rate, "seed": trial.seed}
            trials.append(record | {"score": None, "diverged": str(e), "run_id": run.info.run_id})
            continue
        trials.append(_record(i, trial, fitted, run.info.run_id))
        if kept is None or best.score > kept_fitted.best.score:
            kept, kept_fitted, kept_cfg, chosen = result, fitted, trial, i
        del model, result  # a beaten trial's weights are freed before the next one
    if kept is None:
        raise Diverged(f"every trial diverged; the last: {trials[-1]['diverged']}")
    section = summary(trials, chosen, cfg.seed if cfg.max_train_examples else None)
    # the step run reads as the chosen trial's: its parameters, and its per-epoch history
    mlflow.log_params({"learning_rate": kept_cfg.learning_rate, "seed": kept_cfg.seed})
    mlflow.set_tags(
        {
            "sweep.chosen_trial": chosen,
            "sweep.chosen_run_id": trials[chosen]["run_id"],
            "sweep.trials": len(trials),
            "sweep.selected_by": SELECTED_BY,
        }
    )
    for record in kept_fitted.history:
        mlflow.log_metrics(epoch_metrics(record), step=record.epoch)
    return kept, kept_cfg, section


def pick_best(folders: list[str | Path], output: str | Path) -> dict:
    """The fan-in of a fanned-out sweep: of several `bert finetune` outputs of one task (one per
    learning rate / seed), copy the best by dev score to `output`, its metrics.json given the
    `sweep` section a one-step sweep writes. Returns that metrics.json."""
    results = []
    for folder in folders:
        path = Path(folder) / "metrics.json"
        if not path.is_file():
            raise NotFound(f"{path}: not found (is {folder} a `bert finetune` output?)")
        results.append(json.loads(path.read_text()))
    tasks = {r["task"] for r in results}
    if len(tasks) != 1:
        raise InputError(folders[0], f"a sweep is over one task, got {sorted(tasks)}")
    trials = [
        {
            "trial": i,
            "learning_rate": r["config"]["learning_rate"],
            "seed": r["config"]["seed"],
            "score": r["score"],
            "best_epoch": r["best_epoch"],
            "metrics": r["metrics"],
            "train_seconds": r.get("train_seconds"),
            "run_id": None,
            "source": str(f),
        }
        for i, (r, f) in enumerate(zip(results, folders, strict=True))
    ]
    chosen = max(range(len(trials)), key=lambda i: (trials[i]["score"], -i))
    best = results[chosen] | {"sweep": summary(trials, chosen, None)}
    with atomic_dir(output) as tmp:
        shutil.copytree(folders[chosen], tmp, dirs_exist_ok=True)
        (tmp / "metrics.json").write_text(json.dumps(best, indent=2) + "\n")
    return best


def main(argv: list[str] | None = None) -> int:
    prog = "python -m bert_core.finetune.sweep"
    p = argparse.ArgumentParser(prog=prog, description=pick_best.__doc__)
    p.add_argument("--results", nargs="+", required=True, help="`bert finetune` outputs")
    p.add_argument("--output", required=True, help="the chosen one is copied here")
    args = p.parse_args(argv)
    best = pick_best(args.results, args.output)
    print(json.dumps({k: best["sweep"][k] for k in ("chosen", "learning_rate", "seed", "score")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
