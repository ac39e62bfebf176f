"""`bert finetune`: fine-tune a BERT on one task (GLUE, CoNLL-2003, SQuAD, SWAG), one engine.

The step around the engine (`bert_core.finetune.engine`): the task named by `--task` (one table,
`TASKS`, of the task classes), the inputs copied from s3:// when they are there, every input
checked before any training, one MLflow run with the settings as parameters and the metrics per
epoch, one run or the paper's sweep (`bert_core.finetune.sweep`), and the output folder written
atomically; its model is logged as an MLflow model and, once the output is complete and the run
FINISHED, registered (`bert_core.serve.registry`).

Output (atomic: all or nothing): `model/` (HF layout, label names in config.json, the vocab),
`metrics.json` (`task, init, metrics, score, best_epoch, epochs, config`, `start_from` and
`continued_pretraining` (`pretraining`: which row of `bert evaluate`'s table), `test_metrics` and
`sweep` when there are, the task's counts: all `bert evaluate` needs), the prediction files,
`mlflow_model.json`.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import asdict
from pathlib import Path

from bert_core import hub
from bert_core.finetune.config import FinetuneConfig, config_from_args
from bert_core.finetune.engine import (
    FinetuneTask,
    Fitted,
    load_tokenizer,
    model_config,
    numeric,
    save_model,
    train,
)
from bert_core.finetune.tasks import glue_data
from bert_core.finetune.tasks.glue import GlueFinetune
from bert_core.finetune.tasks.ner import NerFinetune
from bert_core.finetune.tasks.squad import SquadFinetune
from bert_core.finetune.tasks.swag import SwagFinetune
from bert_core.metrics import named, task_run
from bert_core.model import optim
from bert_core.options import add_options
from bert_core.serve.registry import (
    DEFAULT_NAME,
    log_finetuned,
    model_name,
    pretrained_source,
    register_finetuned,
)
from bert_core.storage import check_apart, local_copy, output_dir
from bert_core.tracking import RUN_RECORD, start_run

log = logging.getLogger(__name__)

# Every task `bert finetune` runs: exact name -> its `FinetuneTask` class. GLUE names are also
# found forgiving case and dashes (`sst2`, `mnli`), as `glue_data.get_task`.
TASKS: dict[str, type[FinetuneTask]] = {
    **dict.fromkeys(glue_data.TASKS, GlueFinetune),
    "conll2003": NerFinetune,
    "squad": SquadFinetune,
    "squad_v2": SquadFinetune,
    "swag": SwagFinetune,
}


def load_task(name: str) -> FinetuneTask:
    """The task object for `--task`: exact names first, then GLUE's forgiving lookup."""
    if name not in TASKS:
        name = glue_data.get_task(name).name  # unknown: "unknown GLUE task ..." with the known
    return TASKS[name](name)


def finetune(
    task: FinetuneTask,
    data_dir: str | Path,
    model_dir: str | Path,
    output: str | Path,
    cfg,
    data_uri: str | None = None,
    model_uri: str | None = None,
    release: str | None = None,
) -> dict:
    """Fine-tune (one run, or a sweep of trials with the best on dev kept), write the output
    folder (local or s3://); returns metrics.json's content. `data_uri`, `model_uri`: where
    `data_dir` and `model_dir` were copied from (s3:// URIs), recorded instead of them.
    `release`: the registered model whose candidates the model joins (None: not registered)."""
    # Everything that can be wrong with the input fails here, before any training.
    tokenizer = load_tokenizer(model_dir)
    counts = task.prepare(Path(data_dir), tokenizer, cfg)
    device = optim.resolve_device(cfg.device)
    model_config(task, Path(model_dir), cfg)
    warn_untrained_positions(Path(model_dir), cfg.max_seq_length)
    data_uri, model_uri = data_uri or str(data_dir), model_uri or str(model_dir)
    # models:/bert-pretrained/N for a `bert pretrain` folder (registered by now), else the path
    source = None if cfg.init == "random" else pretrained_source(model_dir, model_uri)
    start = {} if cfg.init == "random" else pretraining(Path(model_dir), model_uri)
    params = {"task": task.name, "data": data_uri, "model": model_uri, **asdict(cfg)}
    if cfg.init == "random":  # the control names what it started from: no pre-trained weights
        params |= {"model": "none (random init)", "architecture_from": model_uri}
    params |= counts | {"device": str(device)}
    if cfg.is_sweep:  # logged at the end: the chosen trial's (MLflow parameters are write-once)
        del params["learning_rate"], params["seed"]
    # the control's run is named apart from the pre-trained model's, so one pipeline run's
    # step runs stay one per (task, init) in the MLflow UI and in lineage.child_runs
    step = f"finetune-{task.name}" + ("-random" if cfg.init == "random" else "")
    with start_run(step, params, run_tags(start), run_name(step, start)), output_dir(output) as tmp:
        import mlflow

        if cfg.is_sweep:
            from bert_core.finetune.sweep import run_trials

            run, cfg, sweep = run_trials(task, model_dir, cfg, device, train)
        else:
            run, sweep = train(task, model_dir, cfg, device, mlflow.log_metrics), None
        model, fitted = run
        test = task.evaluate_test(model, device, cfg)
        result = run_result(task, cfg, fitted, model_uri, data_uri, device) | {
            **({"test_metrics": numeric(test)} if test else {}),
            **({"sweep": sweep} if sweep else {}),
            "pretrained_model": source,
            **start,
        }
        if test:
            mlflow.log_metrics(named(test, "test"))
        save_model(task, model, tmp / "model")  # label names, task, problem type: config.json
        task.write_outputs(tmp, model, fitted.predictions, device, cfg)
        record = finish(tmp, result, release)
    # only now, the output complete and the run FINISHED: a failure above registers nothing
    version = register_finetuned(record, result)
    if version is not None:
        result["registered_model"] = f"{version.name}/{version.version}"
    return result


def run_result(
    task: FinetuneTask, cfg, fitted: Fitted, model_uri: str, data_uri: str, device
) -> dict:
    """What metrics.json holds for every trained model (`bert finetune`, `bert distill`): the
    kept epoch's metrics and score, the history, the settings, the task's counts, the training
    time and where model and data came from, and the task's baseline on the same dev set (the
    best answer that ignores the input: `FinetuneTask.baseline`)."""
    best, train_seconds = fitted.best, fitted.train_seconds
    baseline, rule = task.baseline()
    return {
        "task": task.name,
        "init": cfg.init,
        "metrics": numeric(best.metrics),
        "score": best.score,
        "baseline_score": baseline,  # the best input-blind answer's: champion must beat it
        "baseline": rule,
        "best_epoch": best.epoch,
        "epochs": [asdict(epoch) for epoch in fitted.history],
        "config": asdict(cfg),
        **task.summary(best),
        "train_seconds": train_seconds,
        "train_examples_per_second": task.num_train_examples * cfg.epochs / train_seconds,
        "model": model_uri,
        "score_metric": task.score_metric,
        "data": data_uri,
        "device": str(device),
    }


def warn_untrained_positions(model_dir: Path, max_seq_length: int) -> None:
    """A WARNING when `max_seq_length` reaches past the positions the model's pre-training
    trained (`trained_positions` in its record, `bert pretrain`'s): their embeddings are still
    random, so SQuAD at 384 tokens from a model pre-trained at 128 reads noise there. Not
    refused: fine-tuning trains them too; the paper's remedy is a phase two at 512 tokens."""
    record = model_dir / RUN_RECORD
    trained = json.loads(record.read_text()).get("trained_positions") if record.is_file() else None
    if trained and max_seq_length > trained:
        log.warning(
            f"--max-seq-length {max_seq_length} reaches positions {trained}-{max_seq_length - 1}, "
            f"which pre-training never trained ({model_dir} was pre-trained at {trained} tokens: "
            f"{record.name}); pre-train a phase two at {max_seq_length} tokens from it "
            f"(docs/pretrain.md) or fine-tune at {trained}"
        )


def pretraining(model_dir: Path, model_uri: str) -> dict:
    """What the pre-trained weights are, for `bert evaluate`'s rows: `start_from` ("random init"
    for ours from scratch, else a public checkpoint's identity, `hub.identity`) and
    `continued_pretraining` (`bert pretrain` ran from that checkpoint). A `bert pretrain` model
    folder says both in its record (`tracking.RUN_RECORD`); a checkpoint named by the hub or a
    package is fine-tuned as it is. Any other folder says nothing (empty: `bert evaluate` counts
    it as ours, as results written before these fields)."""
    record = model_dir / RUN_RECORD
    if record.is_file():
        start = json.loads(record.read_text()).get("start_from", "random init")
        return {"start_from": start, "continued_pretraining": start != "random init"}
    if hub.is_named(model_uri):
        return {"start_from": hub.identity(model_uri), "continued_pretraining": False}
    return {}


def run_name(step: str, start: dict) -> str:
    """The MLflow run's name: the step's, and for a public checkpoint's start the checkpoint and
    whether it was pre-trained further, so one pipeline run's fine-tunings of a task from our
    model and from a public one are told apart in the runs list (the step tag stays the same)."""
    if start.get("start_from", "random init") == "random init":
        return step
    how = "continued" if start["continued_pretraining"] else "as published"
    return f"{step} ({start['start_from']}, {how})"


def run_tags(start: dict) -> dict[str, str]:
    """`bert.start_from` (what the weights were before fine-tuning), to filter runs by it."""
    return {"bert.start_from": start.get("start_from", "random init")} if start else {}


def finish(out: Path, result: dict, release: str | None) -> dict:
    """The end of every run: `log_result`, and the model (`serve.registry.log_finetuned`, not
    yet registered) in the open MLflow run. Returns the model's record (`mlflow_model.json`)."""
    log_result(out, result)
    return log_finetuned(out, result, release)  # the model as an MLflow model (serve.registry)


def log_result(out: Path, result: dict) -> None:
    """metrics.json in `out`, and in the open MLflow run the kept (best) epoch's metrics in the
    one metric language (`eval/score` lines every task up) and that file: the record of every
    trained model (`bert finetune`, `bert distill`)."""
    import mlflow

    (out / "metrics.json").write_text(json.dumps(result, indent=2) + "\n")
    mlflow.log_metrics(task_run(result["score"], result["metrics"]))
    mlflow.log_metric("eval/best_epoch", result["best_epoch"])
    mlflow.log_artifact(str(out / "metrics.json"))


def build_parser(task: FinetuneTask | None = None) -> argparse.ArgumentParser:
    """`bert finetune`'s options: the run's, the task's config fields, `--download` when the
    task can fetch its data. Without a task: the GLUE (base) options."""
    p = argparse.ArgumentParser(prog="bert finetune", description=__doc__.split("\n")[0])
    tasks = ", ".join(TASKS)
    p.add_argument("--task", required=True, help=f"one of {tasks} (GLUE: any case)")
    p.add_argument("--data", required=True, help="the task's data folder, local or s3://")
    p.add_argument("--model", required=True, help="HF-layout BERT folder with vocab, or s3://")
    p.add_argument("--output", required=True, help="output folder, local or s3://")
    p.add_argument(
        "--registered-model",
        default=DEFAULT_NAME,
        metavar="NAME",
        help="the task's release model, a template with {task} (default: %(default)s); the "
        "model is registered in NAME-candidates for `bert promote`; none: logged, not registered",
    )
    add_options(p, task.config_class if task is not None else FinetuneConfig)
    if task is not None and task.download_help:
        where = f"first fetch the data into --data when missing ({task.download_help})"
        p.add_argument("--download", action="store_true", help=where)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    peek = argparse.ArgumentParser(add_help=False)
    peek.add_argument("--task")
    name = peek.parse_known_args(argv)[0].task
    task = load_task(name) if name is not None else None
    args = build_parser(task).parse_args(argv)
    cfg = config_from_args(args, task.config_class)
    release = model_name(task.name, args.registered_model)
    inputs = {"--data": args.data, "--model": args.model}
    check_apart({"--output": args.output}, hub.folders(inputs))
    if getattr(args, "download", False):
        task.download(Path(args.data))
    with local_copy(args.data) as data, local_copy(hub.location(args.model)) as model:
        result = finetune(
            task, data, model, args.output, cfg, str(args.data), str(args.model), release
        )
    keys = ("task", "metrics", "best_epoch", "registered_model")
    print(json.dumps({k: result[k] for k in keys if k in result} | {"output": str(args.output)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
