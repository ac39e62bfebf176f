"""`bert quantize`: a fine-tuned model as a dynamic-int8 CPU model, scored beside its source.

Why torch's dynamic int8 (`bert_core.model.int8`) and not ONNX Runtime's: measured on a MiniLM
SST-2 classifier, 2 threads (docs/compress.md), ONNX Runtime's int8 is about 1 ms faster for one
sentence but no faster for batches of 32, at the same dev accuracy; it would bring a second
runtime, an export per head and a new dependency of every served model for that millisecond.

`--model` is any model reference `bert predict` takes (a `bert finetune` output folder, a model
folder, `runs:/...`, `models:/...`) holding a fine-tuned head; anything else (a pre-trained
model, an int8 model, no model) is refused before any work, as is an `--output` that touches an
input. With `--data` (the task's data folder) both the fp32 source and the int8 model, as read
back from the written folder, are scored on the task's dev set on the CPU.

Output (atomic: all or nothing): `model/` (config.json with `quantization`: method and source;
int8 weights; vocab), `metrics.json` (the int8 model's `metrics` and `score` in the results
table's scale, the source's as `fp32`, sizes on disk, the source's inference settings as
`config`, so `bert predict --model OUTPUT` cuts text as the source did), `mlflow_model.json`.
The MLflow run `quantize` holds the model as an MLflow model, `eval/...` (int8) and
`fp32/...` (source) metrics, and the source and method as parameters and tags.
"""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import nullcontext
from dataclasses import MISSING, asdict, dataclass, fields, replace
from pathlib import Path

from bert_core.errors import BertError, InputError, NotFound
from bert_core.finetune.command import load_task
from bert_core.metrics import task_run
from bert_core.model import heads, int8
from bert_core.model.config import CONFIG_NAME
from bert_core.model.modeling import num_parameters
from bert_core.options import add_options, config_from_args, option, optional
from bert_core.serve.predictor import read_config
from bert_core.serve.registry import write_record
from bert_core.storage import check_apart, exists, local_copy, output_dir
from bert_core.tracking import start_run

HEADS = (
    "BertForSequenceClassification",
    "BertForTokenClassification",
    "BertForQuestionAnswering",
    "BertForMultipleChoice",
)


@dataclass
class QuantizeConfig:
    """`bert quantize`'s options."""

    model: str = option(
        MISSING,
        "the fine-tuned model: a `bert finetune` output or model folder, "
        "runs:/<run>/model, models:/<name>@<alias>",
    )
    output: str = option(MISSING, "the output folder (model/, metrics.json)")
    data: str | None = option(
        None, "the task's data folder: score fp32 and int8 on its dev set", type=optional(str)
    )
    max_eval_examples: int | None = option(
        None, "dev examples scored (default: all)", type=optional(int)
    )
    eval_batch_size: int = option(64, "dev batch size")


def head_class(config: dict, where: Path) -> str:
    """The fine-tuned head of a model folder's config.json, or an error saying what it is."""
    if int8.KEY in config:
        raise InputError(where, "already an int8 model (`bert quantize`); quantize its source")
    archs = config.get("architectures") or []
    for arch in archs:
        if arch in HEADS:
            return arch
    raise InputError(
        where,
        f"architectures {archs}: not a fine-tuned model (a head of "
        f"{', '.join(HEADS)}); `bert finetune` it first",
    )


def size_mb(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 1e6


def prepare(task, data: Path, source: Path, settings: dict, cfg: QuantizeConfig):
    """Read and featurise `task`'s dev set as the source model was scored (its settings);
    returns the task's config to evaluate with. Bad data fails here, before any work."""
    from bert_core.finetune.engine import load_tokenizer

    names = {f.name for f in fields(task.config_class)}
    tcfg = task.config_class(**{k: v for k, v in settings.items() if k in names})
    tcfg = replace(
        tcfg,
        max_train_examples=1,
        max_eval_examples=cfg.max_eval_examples,
        eval_batch_size=cfg.eval_batch_size,
        device="cpu",
    )
    task.prepare(data, load_tokenizer(source), tcfg)
    return tcfg


def score(task, model, tcfg) -> tuple[dict, float]:
    """(metrics, score in percent) of `model` on the prepared dev set, on the CPU."""
    import torch

    metrics, value, _ = task.evaluate(model, torch.device("cpu"), tcfg)
    return metrics, value


def quantize(cfg: QuantizeConfig, source: Path, settings: dict, data: Path | None) -> dict:
    """Quantize the model folder `source` into `cfg.output` (see the module doc), scored on the
    dev set in `data` (a local copy of --data) when given; returns metrics.json's content."""
    import mlflow

    from bert_core.finetune.engine import numeric

    config = read_config(source)
    head = getattr(heads, head_class(config, source / CONFIG_NAME))
    task_name = config.get("finetuning_task")
    task = None
    if data is not None:
        if not task_name:
            raise InputError(
                source / CONFIG_NAME,
                "no finetuning_task: --data needs the task the model was fine-tuned on",
            )
        task = load_task(task_name)
        if not data.is_dir():
            raise NotFound(f"--data {cfg.data}: no such folder")
        tcfg = prepare(task, data, source, settings, cfg)
    info = {"source": str(cfg.model)}
    params = {**asdict(cfg), "method": int8.METHOD, "task": task_name or ""}
    tags = {"bert.source_model": str(cfg.model), "bert.quantization": int8.METHOD}
    with start_run("quantize", params, tags), output_dir(cfg.output) as tmp:
        fp32 = head.from_pretrained(source).eval()
        result = {
            "task": task_name,
            "quantization": {"method": int8.METHOD, **info},
            "parameters": num_parameters(fp32),
            "config": settings,
        }
        if task is not None:
            metrics, value = score(task, fp32, tcfg)
            result["fp32"] = {"metrics": numeric(metrics), "score": value}
        int8.save(int8.quantize(fp32), tmp / "model", info, config)
        model = head.from_pretrained(tmp / "model")  # scored as a user will load it
        result["size_mb"] = {"fp32": size_mb(source), "int8": size_mb(tmp / "model")}
        if task is not None:
            metrics, value = score(task, model, tcfg)
            result |= {"metrics": numeric(metrics), "score": value}
            mlflow.log_metrics(task_run(value, metrics))
            mlflow.log_metrics(task_run(result["fp32"]["score"], result["fp32"]["metrics"], "fp32"))
        mlflow.log_metrics({f"size/{k}_mb": v for k, v in result["size_mb"].items()})
        (tmp / "metrics.json").write_text(json.dumps(result, indent=2) + "\n")
        mlflow.log_artifact(str(tmp / "metrics.json"))
        record = write_record(tmp, settings)
    return result | {"model_uri": record["model_uri"]}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bert quantize", description=__doc__.split("\n")[0])
    add_options(p, QuantizeConfig)
    return p


def main(argv: list[str] | None = None) -> int:
    from bert_core.serve.mlflow_model import local_model

    cfg = config_from_args(
        build_parser().parse_args(sys.argv[1:] if argv is None else argv), QuantizeConfig
    )
    check_apart({"--output": cfg.output}, {"--model": cfg.model, "--data": cfg.data})
    if cfg.data is not None and not exists(cfg.data):
        raise NotFound(f"--data {cfg.data}: no such folder")
    with (
        local_copy(cfg.data) if cfg.data is not None else nullcontext() as data,  # s3:// too
        local_model(cfg.model) as (source, settings),
    ):
        if not (source / CONFIG_NAME).is_file():
            raise BertError(f"--model {cfg.model}: no {CONFIG_NAME} (not a model folder)")
        result = quantize(cfg, source, settings, data)
    keys = ("task", "score", "fp32", "size_mb", "model_uri")
    print(json.dumps({k: result[k] for k in keys if k in result} | {"output": cfg.output}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
