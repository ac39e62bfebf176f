"""One Kubeflow Pipelines v2 lightweight component per pipeline step.

Each component is one call of the step's `bert` command through `bert_core.cli.kfp_step`
(which also nests the step's MLflow run under the pipeline run, found by the KFP run id): all
logic lives in `bert_core`, so the DAG run by KFP, by DVC and by hand is the same code. The
components import `bert_core.cli` and nothing else of the library: what they do around their
command (open / close the MLflow parent run, register the pre-trained model, read the numbers
for their KFP Metrics output) is one `bert_core.cli.kfp_*` call each.

The KFP run id is not an input: an input that differs per run would be part of every step's
cache key, so no step could ever be reused by a later run. The pipeline hands it to the pods
through the environment instead (`KFP_RUN_ID`, see pipelines/bert_pipeline.py).

The image is the project's (infra/docker/Dockerfile), chosen at compile time with BERT_IMAGE; it
already holds every package, so nothing is pip-installed when a step starts (the compiled
command runs `python3 -m kfp.dsl.executor_main` straight away). The pipeline swaps in the
`train_image` parameter for the fine-tuning tasks at run time (`set_container_image`).

The data digests (`corpus_digest`, `data_digest`) are inputs a step does not read: they are
there for KFP's cache key, which sees parameter values but never the data behind a path, so new
data under the same s3:// URI re-runs the steps that read it instead of being a cache hit.
"""

import os
from typing import List, NamedTuple  # noqa: UP035 - KFP reads these annotations: typing.List

from kfp import dsl
from kfp.dsl import Dataset, Input, Markdown, Metrics, Model, Output

from pipelines.cluster import IMAGE as DEFAULT_IMAGE

IMAGE = os.environ.get("BERT_IMAGE", DEFAULT_IMAGE)
TRAIN_IMAGE = os.environ.get("BERT_TRAIN_IMAGE", IMAGE)  # default of the `train_image` parameter


def component(func):
    """A lightweight component in the project image, no run-time installs (kfp is in it too)."""
    return dsl.component(base_image=IMAGE, packages_to_install=[], install_kfp_package=False)(func)


@component
def pipeline_run(settings: dict, tasks: list, control_tasks: list, token_tasks: list) -> NamedTuple(
    "Digests", [("corpus_digest", str), ("glue_digest", str), ("token_digest", str)]
):
    """The MLflow parent run of this KFP run, with the run's settings as its parameters and its
    data inputs' content digests; first in the DAG and never cached, so it exists before any
    step looks for it and the digests it outputs are always fresh (the steps reading the data
    take them as inputs, see the module docstring). The list settings come as inputs of their
    own: inside a dict, KFP pastes a list in as broken text."""
    from bert_core.cli import kfp_pipeline_run

    lists = {
        "finetune.tasks": tasks,
        "finetune.control_tasks": control_tasks,
        "finetune.token_tasks": token_tasks,
    }
    return kfp_pipeline_run({**settings, **lists})


@component
def pipeline_end(status: dsl.PipelineTaskFinalStatus):
    """The exit handler: closes the MLflow parent run as FINISHED, FAILED or KILLED."""
    from bert_core.cli import kfp_pipeline_end

    print("MLflow parent run:", kfp_pipeline_end(status.state))


@component
def clean(corpus: str, corpus_digest: str, cleaned: Output[Dataset]):
    """bert clean: raw text (a local path or s3:// URI) -> sharded documents in BERT's input
    format. `corpus_digest` is for the cache key only."""
    from bert_core.cli import kfp_step

    kfp_step(["clean", "--input", corpus, "--output", cleaned.path])


@component
def vocab(cleaned: Input[Dataset], vocab_size: int, wordpiece: Output[Dataset]):
    """bert vocab: WordPiece vocab.txt + tokenizer.json."""
    from bert_core.cli import kfp_step

    argv = ["vocab", "--input", cleaned.path, "--output", wordpiece.path]
    kfp_step([*argv, "--vocab-size", vocab_size])


@component
def instances(
    cleaned: Input[Dataset],
    wordpiece: Input[Dataset],
    max_seq_length: int,
    max_predictions_per_seq: int,
    masked_lm_prob: float,
    dupe_factor: int,
    random_seed: int,
    masking_recipe: str,
    shards: Output[Dataset],
):
    """bert instances: MLM/NSP pre-training instances as Parquet shards."""
    from bert_core.cli import kfp_step

    kfp_step(
        ["instances", "--input", cleaned.path, "--vocab", f"{wordpiece.path}/vocab.txt"]
        + ["--output", shards.path, "--max-seq-length", max_seq_length]
        + ["--max-predictions-per-seq", max_predictions_per_seq]
        + ["--masked-lm-prob", masked_lm_prob, "--dupe-factor", dupe_factor]
        + ["--random-seed", random_seed, "--masking-recipe", masking_recipe]
    )


@component
def pretrain(
    shards: Input[Dataset],
    preset: str,
    steps: int,
    batch_size: int,
    num_workers: int,
    learning_rate: float,
    use_gpu: bool,
    objective: str,
    pretrained: Output[Model],
    metrics: Output[Metrics],
):
    """bert pretrain (Ray Train); the model is logged and registered in MLflow.

    On a cluster the pod's RAY_ADDRESS is the RayCluster's dashboard (http://...:8265), so the
    command submits itself as a Ray job, follows it and copies the model back into `pretrained`
    (bert_core.ray_jobs). The Ray run is named after the KFP run (`kfp-<KFP_RUN_ID>`), so its
    checkpoints, under $BERT_RAY_STORAGE/kfp-<id>, belong to this run only and a retry of this
    task finds them: it follows the job still running, or resubmits it to resume."""
    import os

    from bert_core.cli import kfp_register_pretrained, kfp_step

    kfp_run = os.environ.get("KFP_RUN_ID", "")  # the pod's env, not an input: see above
    kfp_step(
        ["pretrain", "--instances", shards.path, "--output", pretrained.path, "--preset", preset]
        + ["--steps", steps, "--batch-size", batch_size, "--num-workers", num_workers]
        + ["--learning-rate", learning_rate, "--objective", objective]
        + (["--use-gpu"] if use_gpu else [])
        + (["--run-name", f"kfp-{kfp_run}"] if kfp_run else [])
    )
    for name, value in kfp_register_pretrained(pretrained.path).items():
        metrics.log_metric(name, value)


@component
def finetune(
    pretrained: Input[Model],
    data_dir: str,
    task: str,
    epochs: int,
    batch_size: int,
    learning_rate: float,
    max_seq_length: int,
    max_train_examples: int,
    lr_sweep: str,
    restarts: int,
    data_digest: str,
    finetuned: Output[Model],
    metrics: Output[Metrics],
    max_eval_examples: int = 0,
    init: str = "pretrained",
):
    """bert finetune on one task, `{data_dir}/{task}`: a GLUE task (data_dir: the GLUE folder)
    or a token-level one (conll2003, squad; data_dir: the folder holding it), local or s3://.
    The pipeline fans this out with dsl.ParallelFor over the GLUE tasks, over them again with
    `init=random` (the control) and over the token-level ones; 0 max_eval_examples means the
    whole dev set. `lr_sweep` ('none', 'paper' or a comma list) and `restarts`: the paper's
    protocol, every trial a nested MLflow run, the best on dev kept (bert_core.sweep). The
    device is the pod's: cuda when it was given a GPU, else cpu (`--device auto`).
    `data_digest`: the cache key's."""
    from bert_core.cli import kfp_metrics, kfp_step

    kfp_step(
        ["finetune", "--task", task, "--data", f"{data_dir}/{task}"]
        + ["--model", f"{pretrained.path}/model", "--output", finetuned.path]
        + ["--epochs", epochs, "--batch-size", batch_size, "--learning-rate", learning_rate]
        + ["--max-seq-length", max_seq_length, "--max-train-examples", max_train_examples]
        + ["--device", "auto", "--init", init, "--lr-sweep", lr_sweep, "--restarts", restarts]
        + (["--max-eval-examples", max_eval_examples] if max_eval_examples > 0 else [])
    )
    for name, value in kfp_metrics(f"{finetuned.path}/metrics.json").items():
        metrics.log_metric(name, value)


@component
def evaluate(
    results: Input[List[Model]],  # noqa: UP006
    control_results: Input[List[Model]],  # noqa: UP006
    token_results: Input[List[Model]],  # noqa: UP006
    glue: Output[Dataset],
    table: Output[Markdown],
    metrics: Output[Metrics],
):
    """bert evaluate: the GLUE table (rendered by the KFP UI as Markdown) and the GLUE score,
    a "random init" row and the gain when the control ran, NER / SQuAD rows when token-level
    tasks ran (control_results and token_results may be empty; evaluate groups the folders
    into systems by their init). The metrics are the evaluate step's MLflow metrics
    (fractions)."""
    import shutil

    from bert_core.cli import kfp_metrics, kfp_step

    # an empty loop's Collected outputs may arrive as None rather than []
    collected = [*(results or []), *(control_results or []), *(token_results or [])]
    folders = [r.path for r in collected]
    kfp_step(["evaluate", "--results", *folders, "--output", glue.path])
    shutil.copyfile(f"{glue.path}/glue_table.md", table.path)
    for name, value in kfp_metrics(f"{glue.path}/glue_results.json").items():
        metrics.log_metric(name, value)


@component
def predict(
    inputs: str,
    predictions: Output[Dataset],
    finetuned: Input[Model] = None,
    model_uri: str = "",
    columns: str = "",
):
    """bert predict: a fine-tuned model's answers for a file of inputs (`inputs`: .txt, .tsv,
    .jsonl or .parquet, s3://... or a path the pod can read) into predictions/predictions.jsonl.
    The model is a `finetune` step's output (`finetuned`) or an MLflow model URI (`model_uri`,
    e.g. models:/bert-sst2@champion, from the MLflow server). `columns`: space-separated
    MODEL=FILE column mappings (text=sentence)."""
    from bert_core.cli import kfp_step

    if not model_uri and finetuned is None:
        raise ValueError("predict needs a finetuned model or a model_uri")
    model = model_uri or finetuned.path
    argv = ["predict", "--model", model, "--input", inputs]
    argv += ["--output", f"{predictions.path}/predictions.jsonl"]
    kfp_step(argv + [arg for c in columns.split() for arg in ("--column", c)])
