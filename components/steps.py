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
`cluster_train_image` parameter for the fine-tuning tasks at run time (`set_container_image`).

The data digests (`corpus_digest`, `data_digest`) are inputs a step does not read: they are
there for KFP's cache key, which sees parameter values but never the data behind a path, so new
data under the same s3:// URI re-runs the steps that read it instead of being a cache hit.
"""

import os
from typing import List, NamedTuple  # noqa: UP035 - KFP reads these annotations: typing.List

from kfp import dsl
from kfp.dsl import Dataset, Input, Markdown, Metrics, Model, Output

from pipelines import cluster

IMAGE = os.environ.get("BERT_IMAGE", cluster.IMAGE)
# the default of the `cluster_train_image` parameter: the fine-tuning pods' image
TRAIN_IMAGE = os.environ.get("BERT_TRAIN_IMAGE", cluster.CUDA_IMAGE)


def component(func):
    """A lightweight component in the project image, no run-time installs (kfp is in it too)."""
    return dsl.component(base_image=IMAGE, packages_to_install=[], install_kfp_package=False)(func)


@component
def settings(advanced: dict, defaults: str) -> NamedTuple(
    "Settings",
    [
        ("vocab_vocab_size", int),
        ("instances_max_seq_length", int),
        ("instances_max_predictions_per_seq", int),
        ("instances_masked_lm_prob", float),
        ("instances_dupe_factor", int),
        ("instances_random_seed", int),
        ("instances_masking_recipe", str),
        ("model_num_layers", int),
        ("model_hidden_size", int),
        ("model_num_heads", int),
        ("model_intermediate_size", int),
        ("pretrain_export_every", int),
        ("pretrain_batch_size", int),
        ("pretrain_cpus_per_worker", int),
        ("pretrain_learning_rate", float),
        ("pretrain_objective", str),
        ("finetune_batch_size", int),
        ("finetune_learning_rate", float),
        ("finetune_max_seq_length", int),
        ("finetune_lr_sweep", str),
        ("finetune_restarts", int),
        ("finetune_top_bilstm", bool),
        ("finetune_token_epochs", int),
        ("finetune_token_max_seq_length", int),
        ("finetune_token_max_train_examples", int),
        ("finetune_token_max_eval_examples", int),
        ("finetune_token_document_context", bool),
        ("compress_student", str),
        ("compress_student_layers", int),
        ("compress_student_ffn_share", float),
        ("compress_temperature", float),
        ("compress_alpha", float),
        ("compress_epochs", int),
        ("compress_learning_rate", float),
    ],
):
    """The run form's `advanced_settings` (one JSON object of the rarely changed settings) over
    their `defaults` (JSON text: a Struct would turn their integers into doubles), each as an output
    of its own type, so every step takes a typed value and its cache key holds only the settings
    it reads. Refuses an unknown key or a value of another type, before any step starts. The
    outputs are the pipeline's ADVANCED keys, in this literal form because KFP reads the
    annotation from this source (a test keeps the two equal)."""
    from bert_core.cli import kfp_settings

    return kfp_settings(advanced, defaults)


@component
def pipeline_run(settings: dict, tasks: list, control_tasks: list, token_tasks: list) -> NamedTuple(
    "Digests", [("corpus_digest", str), ("glue_digest", str), ("token_digest", str)]
):
    """The MLflow parent run of this KFP run, with the run's settings as its parameters and its
    data inputs' content digests; first in the DAG and never cached, so it exists before any
    step looks for it and the digests it outputs are always fresh (`clean` takes the corpus's,
    see the module docstring). The list settings come as inputs of their own: inside a dict,
    KFP pastes a list in as broken text."""
    from bert_core.cli import kfp_pipeline_run

    return kfp_pipeline_run(settings, tasks, control_tasks, token_tasks)


@component
def finetune_jobs(
    settings: dict, tasks: list, control_tasks: list, token_tasks: list
) -> List[dict]:  # noqa: UP006
    """The run's fine-tunings as one list, the pipeline's one fan-out (`bert_core.finetune.jobs`:
    the GLUE, control and token-level lists, each job with its `bert finetune` options and its
    task data's digest, for the cache key). Never cached: the digests are always fresh. A task
    of its own, with one output: kfp.local loops only over a task's single `Output`. Typed
    `List[dict]`, not `list`: the loop item is then a STRUCT; of a plain list, kfp declares it
    a STRING, the backend's driver turns each job into JSON text and the finetune task's driver
    refuses it (backend/src/v2/driver/resolve.go, resolveInputs: type mismatch)."""
    from bert_core.cli import kfp_finetune_jobs

    return kfp_finetune_jobs(settings, tasks, control_tasks, token_tasks)


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
def vocab(cleaned: Input[Dataset], vocab_size: int, init_model: str, wordpiece: Output[Dataset]):
    """bert vocab: WordPiece vocab.txt + tokenizer.json learned from the corpus, or with
    `init_model` (not "none") that checkpoint's own vocabulary and casing."""
    from bert_core.cli import kfp_step

    argv = ["vocab", "--input", cleaned.path, "--output", wordpiece.path]
    kfp_step([*argv, "--vocab-size", vocab_size, "--init-model", init_model])


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
) -> str:
    """bert instances: MLM/NSP pre-training instances as Parquet shards. Returns their URI (in
    the pipeline root's bucket on a cluster), which the pre-training steps take instead of the
    artifact: KFP's launcher downloads every input artifact whole into the pod
    (backend/src/v2/component/launcher_v2.go, downloadArtifacts), and a pre-training pod only
    hands the instances to Ray, whose workers read them from the bucket where they are."""
    from bert_core.cli import kfp_step

    kfp_step(
        ["instances", "--input", cleaned.path, "--vocab", f"{wordpiece.path}/vocab.txt"]
        + ["--output", shards.path, "--max-seq-length", max_seq_length]
        + ["--max-predictions-per-seq", max_predictions_per_seq]
        + ["--masked-lm-prob", masked_lm_prob, "--dupe-factor", dupe_factor]
        + ["--random-seed", random_seed, "--masking-recipe", masking_recipe]
    )
    return shards.uri


@component
def pretrain(
    shards: str,
    preset: str,
    num_layers: int,
    hidden_size: int,
    num_heads: int,
    intermediate_size: int,
    steps: int,
    batch_size: int,
    num_workers: int,
    cpus_per_worker: int,
    learning_rate: float,
    use_gpu: bool,
    objective: str,
    init_model: str,
    export_every: int,
    pretrained: Output[Model],
    metrics: Output[Metrics],
):
    """bert pretrain (Ray Train) on the instances at the URI `shards` (the instances step's
    output, read in place); the model is logged and registered in MLflow. The shape:
    `preset`, each of the numbers in its place when not 0. `init_model`:
    none (from scratch) or the public checkpoint whose pre-training continues (the vocab step
    gave the instances its vocabulary).

    On a cluster the pod's RAY_ADDRESS is the RayCluster's dashboard (http://...:8265), so the
    command submits itself as a Ray job, follows it and copies the model back into `pretrained`
    (bert_core.pretrain.ray_jobs). The Ray run is named after the KFP run (`kfp-<KFP_RUN_ID>`), so
    its checkpoints, under $BERT_RAY_STORAGE/kfp-<id>, belong to this run only and a retry of this
    task finds them: it follows the job still running, or resubmits it to resume."""
    import os

    from bert_core.cli import kfp_register_pretrained, kfp_step

    kfp_run = os.environ.get("KFP_RUN_ID", "")  # the pod's env, not an input: see above
    kfp_step(
        ["pretrain", "--instances", shards, "--output", pretrained.path, "--preset", preset]
        + ["--num-layers", num_layers, "--hidden-size", hidden_size, "--num-heads", num_heads]
        + ["--intermediate-size", intermediate_size]
        + ["--steps", steps, "--batch-size", batch_size, "--num-workers", num_workers]
        + ["--cpus-per-worker", cpus_per_worker]
        + ["--learning-rate", learning_rate, "--objective", objective]
        + ["--init-model", init_model, "--export-every", export_every]
        + (["--use-gpu"] if use_gpu else [])
        + (["--run-name", f"kfp-{kfp_run}"] if kfp_run else [])
    )
    for name, value in kfp_register_pretrained(pretrained.path).items():
        metrics.log_metric(name, value)


@component
def pretrain_phase2(
    shards: str,
    phase1: Input[Model],
    steps: int,
    batch_size: int,
    num_workers: int,
    cpus_per_worker: int,
    learning_rate: float,
    use_gpu: bool,
    objective: str,
    pretrained: Output[Model],
    metrics: Output[Metrics],
):
    """bert pretrain again, the paper's phase two: `steps` more steps on the longer instances at
    the URI `shards` from phase one's model (its shape and vocabulary are that model's); logged
    and registered as `pretrain` is. Its Ray run is `kfp-<KFP_RUN_ID>-phase2`, so its
    checkpoints are apart from phase one's; as a Ray job, phase one's model reaches the workers
    through the run's storage (bert_core.pretrain.ray_jobs)."""
    import os

    from bert_core.cli import kfp_register_pretrained, kfp_step

    kfp_run = os.environ.get("KFP_RUN_ID", "")  # the pod's env, not an input: see above
    kfp_step(
        ["pretrain", "--instances", shards, "--output", pretrained.path]
        + ["--init-model", f"{phase1.path}/model"]
        + ["--steps", steps, "--batch-size", batch_size, "--num-workers", num_workers]
        + ["--cpus-per-worker", cpus_per_worker]
        + ["--learning-rate", learning_rate, "--objective", objective]
        + (["--use-gpu"] if use_gpu else [])
        + (["--run-name", f"kfp-{kfp_run}-phase2"] if kfp_run else [])
    )
    for name, value in kfp_register_pretrained(pretrained.path).items():
        metrics.log_metric(name, value)


@component
def finetune(
    pretrained: Input[Model],
    job: dict,
    finetuned: Output[Model],
    result: Output[Dataset],
    metrics: Output[Metrics],
) -> str:
    """bert finetune, one job of the run's fine-tuning fan-out (`finetune_jobs`):
    `job["options"]` are its `bert finetune` options (task, data folder, local
    or s3://, init, epochs, lengths, `--lr-sweep` / `--restarts`: the paper's protocol, every
    trial a nested MLflow run, the best on dev kept); the model and output are this step's. The
    device is the pod's: cuda when it was given a GPU, else cpu (`--device auto`).
    `job["data_digest"]`: the task data's digest, there for the cache key. Returns the job's
    name ("SST-2", "SST-2 (random init)", "conll2003"): the pipeline's conditions for the
    compression and release steps compare it with `compress_task` and `deploy_task` (a
    condition on the loop item's field itself compiles wrong in kfp 2.17: to the constant
    'Output-loop-item'). `result` is the output's metrics.json alone, in a folder of its own: what
    evaluate reads (the launcher downloads every input artifact whole, and a model is hundreds
    of MB)."""
    import os
    import shutil

    from bert_core.cli import kfp_metrics, kfp_step

    model = ["--model", f"{pretrained.path}/model", "--output", finetuned.path]
    kfp_step(["finetune", *job["options"], *model])
    os.makedirs(result.path, exist_ok=True)
    shutil.copyfile(f"{finetuned.path}/metrics.json", f"{result.path}/metrics.json")
    for name, value in kfp_metrics(f"{finetuned.path}/metrics.json").items():
        metrics.log_metric(name, value)
    return job["name"]


@component
def evaluate(
    results: Input[List[Dataset]],  # noqa: UP006
    glue: Output[Dataset],
    table: Output[Markdown],
    metrics: Output[Metrics],
):
    """bert evaluate over every fine-tuning of the run (`results`: each one's metrics.json, not
    its model): the GLUE table (rendered by the KFP UI as Markdown) and the GLUE score, a
    "random init" row and the gain when the control ran, NER / SQuAD rows when token-level
    tasks ran (evaluate groups the folders into systems by their init). The metrics are the
    evaluate step's MLflow metrics (percent, named by role)."""
    import shutil

    from bert_core.cli import kfp_metrics, kfp_step

    kfp_step(["evaluate", "--results", *[r.path for r in results], "--output", glue.path])
    shutil.copyfile(f"{glue.path}/glue_table.md", table.path)
    for name, value in kfp_metrics(f"{glue.path}/glue_results.json").items():
        metrics.log_metric(name, value)


@component
def distill(
    teacher: Input[Model],
    pretrained: Input[Model],
    task: str,
    data_glue: str,
    data_digest: str,
    student: str,
    student_layers: int,
    student_ffn_share: float,
    temperature: float,
    alpha: float,
    epochs: int,
    batch_size: int,
    learning_rate: float,
    max_seq_length: int,
    max_train_examples: int,
    distilled: Output[Model],
    metrics: Output[Metrics],
):
    """bert distill: a fine-tuned `task` model (`teacher`) taught to a student of
    `student_layers` layers (`student_ffn_share` of their feed-forward neurons), started from
    `student`: "pretrained" is this run's pre-trained model (DistilBERT's start: the teacher's
    own pre-training), else a checkpoint of the same vocabulary. `data_digest`: the task data's,
    there for the cache key."""
    from bert_core.cli import kfp_metrics, kfp_step

    start = f"{pretrained.path}/model" if student == "pretrained" else student
    kfp_step(
        ["distill", "--teacher", teacher.path, "--task", task]
        + ["--data", f"{data_glue.rstrip('/')}/{task}", "--output", distilled.path]
        + ["--student", start, "--student-layers", student_layers]
        + ["--student-ffn-share", student_ffn_share]
        + ["--temperature", temperature, "--alpha", alpha, "--epochs", epochs]
        + ["--batch-size", batch_size, "--lr", learning_rate, "--device", "auto"]
        + ["--max-seq-length", max_seq_length, "--max-train-examples", max_train_examples or "none"]
    )
    for name, value in kfp_metrics(f"{distilled.path}/metrics.json").items():
        metrics.log_metric(name, value)


@component
def quantize(
    model: Input[Model],
    task: str,
    data_glue: str,
    data_digest: str,
    quantized: Output[Model],
    metrics: Output[Metrics],
):
    """bert quantize: the distilled student as a dynamic-int8 CPU model, scored on `task`'s dev
    set beside its fp32 source."""
    from bert_core.cli import kfp_metrics, kfp_step

    data = f"{data_glue.rstrip('/')}/{task}"
    kfp_step(["quantize", "--model", model.path, "--output", quantized.path, "--data", data])
    for name, value in kfp_metrics(f"{quantized.path}/metrics.json").items():
        metrics.log_metric(name, value)


@component
def promote(finetuned: Input[Model], task: str):
    """bert promote: the version this `finetuned` output registered becomes `task`'s champion
    when its dev score beats the champion's (the registry's rule; the decision is the version's
    `bert.promotion` tag)."""
    from bert_core.cli import kfp_step

    kfp_step(["promote", task, finetuned.path])


@component
def deploy(task: str):
    """bert deploy: `task`'s champion as a KServe InferenceService in namespace bert (a canary
    beside the running version when the champion changed; `bert promote --full-traffic` ends it).
    The pod's service account needs the Role in infra/k8s/kserve."""
    from bert_core.cli import kfp_step

    kfp_step(["deploy", "--task", task])


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
