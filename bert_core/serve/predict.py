"""`bert predict`: a model's answers for a file of inputs (batch inference).

The model is any reference a user holds: a `bert finetune` output folder (its settings, e.g.
`max_seq_length`, come from its metrics.json), a model folder, or an MLflow model
(`runs:/<run>/model`, `models:/bert-sst2@champion`: downloaded, settings from the MLflow model).
Answers are those of `bert_core.serve.predictors`, the code the MLflow model and
`mlflow models serve` run, so a file's answers equal the served ones.

Inputs and outputs are `bert_core.serve.records`': `.txt`, `.tsv`, `.jsonl` or `.parquet` in (the
model's columns: `text` [+ `text_pair`], or `question` + `context`; `--column text=sentence`
reads another column), `.jsonl` or `.parquet` out, written atomically: one row per input row,
`row` (its 0-based number), `id` when the input has one (as text), then the answer's fields.
The input is streamed `--chunk-size` rows at a time, so memory stays bounded on any input; within
a chunk the rows go through the model in length-sorted batches (`finetune.predict_batches`: the
least padding), on the GPU when there is one. A bad row stops the run with its file and line,
leaving no output.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from pathlib import Path

from bert_core.errors import BadValue
from bert_core.options import number
from bert_core.serve import records
from bert_core.serve.predictors import BadInput, Predictor, Settings, load_predictor
from bert_core.serve.registry import RECORD
from bert_core.storage import check_apart, is_uri, local_copy
from bert_core.tracking import environ, start_run, tracking_uri

OVERRIDES = (
    "batch_size",
    "device",
    "max_seq_length",
    "max_chars",
    "top_k",
    "null_score_diff_threshold",
)


def load(model: str | Path, overrides: dict | None = None) -> Predictor:
    """The predictor for any model reference (see the module doc); `overrides` win over the
    model's own settings (None values ignored)."""
    from bert_core.serve.mlflow_model import local_model

    with local_model(model) as (folder, settings):
        settings |= {k: v for k, v in (overrides or {}).items() if v is not None}
        return load_predictor(folder, Settings.from_dict(settings))


def output_schema(predictor: Predictor, with_id: bool):
    import pyarrow as pa

    fields = [("row", pa.int64())] + ([("id", pa.string())] if with_id else [])
    types = type(predictor).output_types(predictor.config.to_dict())
    return pa.schema(fields + [(k, records.arrow_type(t)) for k, t in types.items()])


def predict_file(
    predictor: Predictor,
    input: str | Path,
    output: str | Path,
    chunk_size: int = 2048,
    rename: dict[str, str] | None = None,
    id_column: str = "id",
    progress: bool = True,
) -> int:
    """Answer every row of `input` into `output`; returns the number of rows."""
    from tqdm import tqdm

    input = Path(input)
    chunks = records.read_chunks(input, chunk_size, rename)
    first = next(chunks)
    check_columns(predictor, rename or {}, first)
    with_id = id_column in first.frame.columns
    # disable=None: no bar when stderr is not a terminal (a KFP pod's log, CI): no log lines
    bar = tqdm(
        total=records.count_rows(input),
        desc="predict",
        unit="row",
        disable=None if progress else True,
    )
    rows = 0
    with records.writer(output, output_schema(predictor, with_id)) as write:
        for chunk in itertools.chain([first], chunks):
            try:
                answers = predictor.predict(chunk.frame)
            except BadInput as e:
                hint = " (`--column MODEL=FILE` reads another column)" if e.row is None else ""
                raise chunk.error(e.reason + hint, e.row) from None
            ids = [str(v) for v in chunk.frame[id_column]] if with_id else None
            write(
                [
                    {"row": chunk.start + i, **({"id": ids[i]} if with_id else {}), **answer}
                    for i, answer in enumerate(answers)
                ]
            )
            rows += len(answers)
            bar.update(len(answers))
    bar.close()
    return rows


def check_columns(predictor: Predictor, rename: dict[str, str], chunk: records.Chunk) -> None:
    """`--column` against the model's fields (`Predictor.fields`: a single-sentence task's
    model takes no `text_pair`, a pair task's needs one), and the input's columns (its first
    `chunk`) against them, before any answer: a field the model lacks would be ignored, a
    pair answered as one sentence. A FILE column not in the input is `records.read_chunks`'
    error."""
    for model, file in rename.items():
        if model not in (*predictor.inputs, *predictor.optional):
            task = predictor.config.finetuning_task
            raise BadValue(
                f"--column {model}={file}: this {predictor.kind} model"
                f"{f' (fine-tuned on {task})' if task else ''} takes the fields {predictor.takes()}"
            )
    error = predictor.missing([str(c) for c in chunk.frame.columns])
    if error is not None:
        raise chunk.error(f"{error}; `--column MODEL=FILE` reads another column", None)


def parse_columns(pairs: list[str]) -> dict[str, str]:
    """`--column text=sentence` -> {"text": "sentence"}."""
    out = {}
    for pair in pairs:
        model, sep, file = pair.partition("=")
        if not sep or not model or not file:
            raise BadValue(f"--column {pair!r}: expected MODEL_COLUMN=FILE_COLUMN")
        out[model] = file
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bert predict", description=__doc__.split("\n")[0])
    where = "a `bert finetune` output or model folder, runs:/<run>/model, models:/<name>@<alias>"
    p.add_argument("--model", required=True, help=where)
    p.add_argument("--input", required=True, help=".txt, .tsv, .jsonl or .parquet; or s3://...")
    p.add_argument("--output", required=True, help=".jsonl or .parquet, local or s3://")
    p.add_argument(
        "--column",
        action="append",
        default=[],
        metavar="MODEL=FILE",
        help="read the model's column MODEL from the file's column FILE",
    )
    p.add_argument("--id-column", default="id", help="copied to the output when present")
    p.add_argument("--chunk-size", type=int, default=2048, help="rows read at a time")
    p.add_argument("--batch-size", type=int, help="rows per forward pass (default: 64)")
    p.add_argument("--device", help="auto (cuda > mps > cpu), cpu, cuda, ...")
    p.add_argument("--max-seq-length", type=int, help="default: the fine-tuning run's")
    p.add_argument("--max-chars", type=int, help="longer text is an error (default: 20000)")
    p.add_argument("--top-k", type=int, help="fill-mask: candidates per [MASK] (default: 5)")
    p.add_argument(
        "--null-score-diff-threshold",
        type=number(),
        help='SQuAD 2.0: answer "" when the null score beats the best span\'s by '
        "more (default: the threshold tuned on dev, best_f1_thresh)",
    )
    return p


def model_run(source: str | Path) -> str | None:
    """The id of the MLflow run that logged the model `source` names: `runs:/<id>/...`, a
    registered version (`models:/<name>@<alias>`, `models:/<name>/<version>`), a logged model
    (`models:/m-...`), an MLflow model folder (MLmodel's `run_id`) or a `bert finetune` output
    (mlflow_model.json); None when it names none or the tracking store does not know it."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    text = str(source)
    try:
        if text.startswith("runs:/"):
            return text.removeprefix("runs:/").split("/")[0] or None
        if text.startswith("models:/"):
            client, ref = MlflowClient(tracking_uri()), text.removeprefix("models:/").strip("/")
            name, at, alias = ref.partition("@")
            if at:
                return client.get_model_version_by_alias(name, alias).run_id
            name, _, version = ref.partition("/")
            if version:
                return client.get_model_version(name, version).run_id
            return client.get_logged_model(name).source_run_id
        path = Path(source)
        if is_uri(source) or not path.is_dir():
            return None
        if (path / "MLmodel").is_file():
            from mlflow.models import Model

            return Model.load(str(path / "MLmodel")).run_id
        if (path / RECORD).is_file():
            return json.loads((path / RECORD).read_text()).get("run_id")
    except (MlflowException, OSError, ValueError):
        return None
    return None


def tracking_env(model: str | Path) -> tuple[dict[str, str], dict[str, str]]:
    """(environment, tags) for the run of a step that uses `model` (`bert predict`, `bert
    embed`). Its experiment follows every step's rule (`tracking.start_run`): nested under
    the pipeline's run (`BERT_PARENT_RUN_ID`), else MLFLOW_EXPERIMENT_NAME when set; and,
    where neither says, the experiment of the run that logged the model (a `make run` model's
    predictions beside it in bert-pipeline), not the catch-all default `bert`. The tag
    `bert.model_run_id` names that run."""
    run_id = model_run(model)
    if run_id is None:
        return {}, {}
    tags = {"bert.model_run_id": run_id}
    if os.environ.get("BERT_PARENT_RUN_ID") or os.environ.get("MLFLOW_EXPERIMENT_NAME"):
        return {}, tags
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    client = MlflowClient(tracking_uri())
    try:
        experiment = client.get_experiment(client.get_run(run_id).info.experiment_id)
    except MlflowException:  # a run of another store (a folder copied from elsewhere)
        return {}, {}
    return {"MLFLOW_EXPERIMENT_NAME": experiment.name}, tags


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rename = parse_columns(args.column)
    records.output_format(args.output)  # before any model is loaded

    check_apart({"--output": args.output}, {"--input": args.input, "--model": args.model})

    params = {"model": args.model, "input": args.input, "output": str(args.output)}
    env, tags = tracking_env(args.model)
    with environ(env), start_run("predict", params | {"chunk_size": args.chunk_size}, tags):
        import mlflow

        predictor = load(args.model, {k: getattr(args, k) for k in OVERRIDES})
        start = time.perf_counter()
        with local_copy(args.input) as path:  # an s3:// input is downloaded first
            rows = predict_file(
                predictor, path, args.output, args.chunk_size, rename, args.id_column
            )
        seconds = time.perf_counter() - start
        mlflow.log_metrics({"rows": rows, "rows_per_second": rows / max(seconds, 1e-9)})
    summary = {
        "rows": rows,
        "kind": predictor.kind,
        "output": str(args.output),
        "seconds": round(seconds, 3),
        "device": str(predictor.device),
    }
    print(json.dumps(summary))
    return 0
