"""The BERT DAG as a Kubeflow Pipelines v2 pipeline: compile it, run it locally, or submit it.

    settings -> pipeline-run -> finetune-jobs -> clean -> vocab -> instances -> pretrain
        -> [phase2: pretrain_phase2_steps > 0] instances-512 -> pretrain-phase2 -> the fan-out
           [phase1-only: else] the fan-out
    the fan-out: finetune (ParallelFor over finetune-jobs' list) -> evaluate (all of them)
           `-> distill -> quantize (in compress_task's iteration only; off by default)
           `-> promote -> deploy (in deploy_task's iteration only; off by default)
    pipeline-end (the exit handler, after everything)

Phase two is the paper's last 10 % of pre-training steps at 512 tokens, on by default
(`pretrain_phase2_steps`); the fan-out fine-tunes its model, or phase one's when it is 0.

One fan-out runs every fine-tuning: the GLUE tasks from the pre-trained model, the random-init
control (`finetune_control_tasks`: the "random init" row and the gain of evaluate's table) and
the token-level tasks (`finetune_token_tasks`: conll2003, squad). The first task, `settings`,
splits the form's `advanced_settings` into typed outputs (`FORM`, below). Two small uncached
tasks come next: `pipeline-run` opens the run's MLflow parent run with its settings and records and
outputs the content digest of each data input; `finetune-jobs` turns the three lists into one
(`bert_core.finetune.jobs`, which says why: a loop over an empty list stops the run on the
Kubeflow backend), each job with its own task data's digest. The steps reading the data take
those digests as inputs, so new data under the same URI changes their cache keys. Nothing starts
before both checked the run's inputs. The exit handler (`pipeline-end`) closes the parent run
with the run's final state. The steps read the KFP run id from the environment, so it never
enters their cache keys (see `pod`).

Every task runs as a cluster pod needs it to (`pod`): requests and limits, the ConfigMap
`bert-pipeline-env` and the Secrets `bert-s3` (and, optional, `bert-mlflow-auth`) as environment
variables (`pipelines/cluster.py` names them); pretrain also loads `bert-ray-auth`, the token of
the RayCluster it submits its training to as a Ray job (its workers use the GPUs there,
`pretrain_use_gpu`), and KFP retries it with backoff (it resumes from its last checkpoint). The
fine-tuning tasks run the `cluster_train_image` image with `cluster_finetune_gpus` GPUs each, on
nodes chosen by `cluster_gpu_node_selector` and `cluster_gpu_tolerations` (all run-time
parameters); everything else runs the CPU image.

The settings (`PARAMETERS`) are named `section_key` after params.yaml's sections (data, vocab
and instances: the pre-training data, model, pretrain, finetune, compress) plus KFP_ONLY's and
`cluster_*`: the UI lists fields by name, so each group stays together. The KFP UI's run form
(`FORM`) shows the usual ones as fields, each with its description in the compiled spec (the
pinned UI's form shows names and types only), and the rest in one JSON object,
`advanced_settings`, that the first task (`settings`) splits into typed outputs. Their defaults
are the cluster's first run (`pipelines/cluster.py` SETTINGS: BERT-Small, a GLUE slice, data
under the bucket; the paper's BERT-Base run is the preset `paper`), not params.yaml's, which are
the 2-core workstation's (`make run`, DVC; `local` runs with those). A step's component takes
`section_key` as `key`, so each params.yaml section is the keyword arguments of its step
(`section`).

    python -m pipelines.bert_pipeline compile [--image IMAGE] [--train-image IMAGE]
    python -m pipelines.bert_pipeline local [--set KEY=VALUE ...]  # whole DAG via kfp.local
    python -m pipelines.bert_pipeline submit --host URL [--spec FILE] [--run-name R] [--set ..]
        [--preset table5|table6|table8|figure2]  # a run per row of the paper's table: presets.py
    python -m pipelines.bert_pipeline check [FILE]  # before an upload: the pinned backend's rules

`check` reads a compiled spec (default: the committed one) as the KFP backend users deploy would
(`pipelines/kfp_backend.py`): both documents parsed with unknown fields as errors, and every
feature, placeholder and wiring it uses one that backend implements. It prints one line and
exits 0 when the spec is clean, else one line per problem and exits 2.
"""

import argparse
import json
import os
import re
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from pipelines import cluster, presets

ROOT = Path(__file__).resolve().parents[1]
SPEC = Path(__file__).with_name("bert_pipeline.yaml")
NAME = "bert-pipeline"
DESCRIPTION = "BERT: corpus -> WordPiece -> MLM/NSP -> pre-train -> GLUE (+ NER, SQuAD)"
DATA = tuple(cluster.DATA)  # the data inputs: data_corpus, data_glue, data_token


# params.yaml's settings no run form has: `public` is `make run`'s comparison row (a branch per
# public checkpoint; a Kubeflow run starts from a checkpoint with `pretrain_init_model`), and the
# keys of `compress` that name DVC's branches (which tasks, which branch teaches, from which
# checkpoint): a Kubeflow run distils its own fine-tuned model of `compress_task` into a student
# started from `compress_student` (KFP_ONLY), its pre-trained model by default.
DVC_ONLY = ("public", "data.output", "compress.tasks", "compress.teacher", "compress.student")
KFP_ONLY = ("pretrain_phase2_steps", "compress_task", "compress_student", "deploy_task")


def load_params(path: Path = ROOT / "params.yaml") -> dict[str, Any]:
    """params.yaml flattened to pipeline parameter names (`section_key`), DVC_ONLY left out
    (`data.output` too: under KFP the artifact store decides where outputs go)."""
    params = yaml.safe_load(path.read_text())
    return {
        f"{section}_{key}": value
        for section, values in params.items()
        if section not in DVC_ONLY
        for key, value in values.items()
        if f"{section}.{key}" not in DVC_ONLY
    }


P = load_params()  # params.yaml's settings (DVC's), workstation data paths included
DEFAULTS = cluster.SETTINGS  # the cluster's; the fine-tuning image is the one compiled in

# The run form, one line per parameter: its description in the compiled spec. Grouped by the
# name's first word (the UI lists parameters by name): cluster, compress, data, deploy (serving),
# finetune, instances (the pre-training data), model, pretrain, vocab.
PARAMETERS = {
    "data_corpus": "[data] Raw text to pre-train on: an s3:// file or prefix of .txt, .jsonl or "
    ".parquet files (upload it first: docs/cluster.md).",
    "data_glue": "[data] s3:// prefix holding one folder per GLUE task (train.tsv, dev.tsv).",
    "data_token": "[data] s3:// prefix holding conll2003/ and squad/ for the token-level tasks.",
    "vocab_vocab_size": "[pre-training data] WordPiece vocabulary size learned from the corpus "
    "(the paper's vocabulary: 30,522).",
    "instances_max_seq_length": "[pre-training data] Tokens per pre-training sequence (the "
    "paper: 128 for 90% of the steps; at most the model's 512 positions).",
    "instances_max_predictions_per_seq": "[pre-training data] Most masked positions predicted "
    "per sequence (the paper: 20 at 128 tokens).",
    "instances_masked_lm_prob": "[pre-training data] Fraction of tokens masked (the paper: 0.15).",
    "instances_dupe_factor": "[pre-training data] Passes over the corpus, each with other masks "
    "(the paper: 10).",
    "instances_random_seed": "[pre-training data] Seed of the masking and sentence pairing.",
    "instances_masking_recipe": "[pre-training data] [MASK]/random/unchanged split of the "
    "masked tokens in %: 80/10/10 is the paper's; its Table 8 ablates e.g. 100/0/0.",
    "model_preset": "[model] Size: tiny, mini, small, medium, base (BERT-Base, 110M) or large "
    "(BERT-Large, 340M): named shapes (L/H/A) that the model_* numbers below override.",
    "model_num_layers": "[model] Transformer layers L; 0: the preset's (the paper's Table 6: 3, "
    "6, 12, 24).",
    "model_hidden_size": "[model] Hidden size H; 0: the preset's (Table 6: 768, 1024).",
    "model_num_heads": "[model] Attention heads A, a divisor of H; 0: the preset's (Table 6: 12, "
    "16).",
    "model_intermediate_size": "[model] Feed-forward size; 0: 4H, the paper's.",
    "pretrain_steps": "[pre-training] Optimizer steps (the paper: 1,000,000; a trial run: a few "
    "thousand).",
    "pretrain_export_every": "[pre-training] A loadable model every this many steps, in the "
    "pretrained output's exports/step-N, to fine-tune from each (the paper's Figure 2); 0: none.",
    "pretrain_batch_size": "[pre-training] Sequences per step over all workers (the paper: 256).",
    "pretrain_num_workers": "[pre-training] Ray Train workers (one GPU each with pretrain_use_gpu)"
    "; the batch size must divide by it.",
    "pretrain_cpus_per_worker": "[pre-training] CPUs per Ray Train worker: its torch threads "
    "(on CPUs) or data loading beside its GPU.",
    "pretrain_learning_rate": "[pre-training] Peak learning rate, warmed up then decayed "
    "linearly (the paper: 1e-4).",
    "pretrain_use_gpu": "[pre-training] Train on the RayCluster's GPU workers (false: its CPUs).",
    "pretrain_objective": "[pre-training] mlm+nsp (the paper's), mlm (Table 5's No NSP), ltr "
    "(its 'LTR & No NSP': a left-to-right LM, causal when fine-tuned too) or ltr+nsp.",
    "pretrain_phase2_steps": "[pre-training] The paper's phase two: this many more steps on "
    "512-token instances from the model of pretrain_steps, so that the position embeddings past "
    "instances_max_seq_length train too (the paper: 100,000 after 900,000 at 128); 0: one phase.",
    "pretrain_init_model": "[pre-training] none: from scratch, with a WordPiece vocabulary "
    "learned from the corpus; or a public checkpoint whose pre-training continues on the corpus, "
    "with its own vocabulary and casing: hf:ORG/NAME@COMMIT (a tag is resolved, but the step "
    "cache keys on the name; docs/pretrain.md).",
    "finetune_tasks": "[fine-tuning] GLUE tasks fine-tuned from the pre-trained model, e.g. "
    '["SST-2", "MRPC"]; each is a folder under data_glue.',
    "finetune_epochs": "[fine-tuning] Epochs per GLUE task (the paper: 3).",
    "finetune_batch_size": "[fine-tuning] Batch size, GLUE and token-level (the paper: 32).",
    "finetune_learning_rate": "[fine-tuning] Learning rate when finetune_lr_sweep is none.",
    "finetune_max_seq_length": "[fine-tuning] Tokens per GLUE example.",
    "finetune_max_train_examples": "[fine-tuning] A seeded sample of each GLUE training set; 0: "
    "all of it.",
    "finetune_control_tasks": "[fine-tuning] GLUE tasks also fine-tuned from random weights: the "
    "'random init' row and the gain of pre-training in the results table; [] for none.",
    "finetune_lr_sweep": "[fine-tuning] paper: try 5e-5, 4e-5, 3e-5, 2e-5 and keep the best on "
    "dev (the paper's protocol); a comma list of rates; none: finetune_learning_rate alone.",
    "finetune_restarts": "[fine-tuning] Random restarts per learning rate, best on dev kept (the "
    "paper used several for BERT-Large on small tasks).",
    "finetune_top_bilstm": "[fine-tuning] Table 5's '+ BiLSTM': a randomly initialised BiLSTM "
    "under every task's head, trained with it (for pretrain_objective ltr).",
    "finetune_token_tasks": "[fine-tuning] Token-level tasks: conll2003 (NER), squad (SQuAD "
    "v1.1); each is a folder under data_token; [] for none.",
    "finetune_token_epochs": "[fine-tuning] Epochs per token-level task (the paper: 3 for SQuAD).",
    "finetune_token_max_seq_length": "[fine-tuning] Tokens per token-level example (the paper: "
    "384 for SQuAD).",
    "finetune_token_max_train_examples": "[fine-tuning] A seeded sample of each token-level "
    "training set; 0: all of it.",
    "finetune_token_max_eval_examples": "[fine-tuning] A seeded sample of each token-level dev "
    "set; 0: all of it.",
    "finetune_token_document_context": "[fine-tuning] conll2003: fill each window with the "
    "document's neighbouring sentences (the paper's maximal document context).",
    "compress_task": "[compression] none: no compression steps; or a task of finetune_tasks "
    "whose fine-tuned model is distilled into a smaller student (distill) that is then made "
    "int8 for CPUs (quantize), both scored on its dev set (docs/compress.md).",
    "compress_student": "[compression] The student's start: pretrained (this run's pre-trained "
    "model, DistilBERT's choice) or a checkpoint with the teacher's vocabulary (an s3:// prefix, "
    "hf:ORG/NAME@REVISION).",
    "compress_student_layers": "[compression] Layers the student keeps of its start, evenly "
    "spaced (DistilBERT: 6 of BERT-Base's 12).",
    "compress_student_ffn_share": "[compression] Share of each student layer's feed-forward "
    "neurons kept, those whose weights weigh most (1: all, as DistilBERT; make run keeps 0.5 "
    "for a student 3x its teacher's speed).",
    "compress_temperature": "[compression] Softmax temperature of the teacher's soft targets "
    "(Hinton et al.).",
    "compress_alpha": "[compression] Weight of the teacher's soft targets in the student's loss "
    "(1 - alpha on the labels).",
    "compress_epochs": "[compression] Epochs the student trains (its batch size, lengths and "
    "examples are the fine-tunings').",
    "compress_learning_rate": "[compression] The student's peak learning rate (a small student "
    "takes a larger one than its teacher).",
    "deploy_task": "[serving] none: nothing deployed; or a task of finetune_tasks: this run's "
    "fine-tuned model becomes its champion if its dev score beats the champion's (promote), and "
    "the champion is served as a KServe InferenceService in namespace bert, a canary beside the "
    "running version when it changed (deploy; docs/serving.md).",
    "cluster_train_image": "[cluster] Image of the fine-tuning pods: the CUDA image for GPUs, "
    'the CPU image with cluster_finetune_gpus "0".',
    "cluster_finetune_gpus": "[cluster] GPUs per fine-tuning pod (nvidia.com/gpu), as text: "
    '"1"; "0" on CPU nodes.',
    "cluster_gpu_node_selector": "[cluster] Node labels the fine-tuning pods must run on, e.g. "
    '{"nvidia.com/gpu.present": "true"}; {} for any node.',
    "cluster_gpu_tolerations": "[cluster] Taints the fine-tuning pods tolerate (Kubernetes "
    "toleration objects); the default tolerates the usual nvidia.com/gpu taint.",
}

# The run form: the fields a first run or a usual change needs (the data, the model's size, how
# long it trains, which tasks, the branches, where the fine-tunings run), and one JSON object,
# `advanced_settings`, with every other setting of PARAMETERS and its default (the UI shows the
# default object to edit; a key left out keeps its default). Its task `settings` splits it into
# typed outputs that the steps take as they took the parameters, so each step's cache key still
# holds only the settings it reads. The branch conditions, the fine-tuning pods' image, GPUs and
# placement, and the task lists stay fields: the backend resolves a condition and a pod's spec
# from pipeline parameters, and a list inside an object built of channels breaks (parent_run).
SHOWN = (
    "data_corpus",
    "data_glue",
    "data_token",
    "model_preset",
    "pretrain_steps",
    "pretrain_num_workers",
    "pretrain_use_gpu",
    "pretrain_init_model",
    "pretrain_phase2_steps",
    "finetune_tasks",
    "finetune_epochs",
    "finetune_max_train_examples",
    "finetune_control_tasks",
    "finetune_token_tasks",
    "compress_task",
    "deploy_task",
    "cluster_train_image",
    "cluster_finetune_gpus",
    "cluster_gpu_node_selector",
    "cluster_gpu_tolerations",
)
ADVANCED = tuple(k for k in PARAMETERS if k not in SHOWN)
ADVANCED_DEFAULTS = {k: DEFAULTS[k] for k in ADVANCED}
FORM_DEFAULTS = {k: DEFAULTS[k] for k in SHOWN} | {"advanced_settings": ADVANCED_DEFAULTS}
FORM = {k: PARAMETERS[k] for k in SHOWN} | {
    "advanced_settings": "[advanced] The other settings, one JSON object: each key a setting "
    "named as the fields are (section_key; docs/pipeline.md describes each), its default shown; "
    "a key left out keeps its default, an unknown key or a value of another type fails the run "
    "at its start."
}

# Parameters outside params.yaml, logged on the MLflow parent run as `kfp.<name>`: where the
# fine-tuning ran, and what was compressed. (The node selector and tolerations are placement,
# not results: not logged.)
RUNTIME = ("cluster_train_image", "cluster_finetune_gpus", *KFP_ONLY)


def section(settings: Mapping[str, Any], name: str, leave_out: Iterable[str] = ()) -> dict:
    """One params.yaml section of the pipeline parameters as its step's component inputs: the
    parameter `section_key` is the component's `key` (params.yaml mirrors the `bert` options)."""
    prefix = f"{name}_"
    keys = {k: k.removeprefix(prefix) for k in settings if k.startswith(prefix)}
    return {key: settings[k] for k, key in keys.items() if key not in set(leave_out)}


def _kfp():
    # imported lazily: `load_params` and `--help` work without KFP installed
    from kfp import dsl

    from components import steps

    return dsl, steps


# Retries of the pretrain task: its Ray job resumes from the last checkpoint in the bucket, so a
# lost pod or a failed job costs minutes; backoff 1, 2, 4 minutes lets a restarted head settle.
# Argo counts the retries' max duration from the first attempt's start (argo-workflows
# operator.go; KFP's default is 3600s): a BERT-Base pre-training runs for days, and a failure
# after the max duration is never retried, so it is 30 days here.
PRETRAIN_RETRY = {
    "num_retries": 3,
    "backoff_duration": "60s",
    "backoff_factor": 2.0,
    "backoff_max_duration": "2592000s",
}

# Requests and limits per task: (cpu request, cpu limit, memory). Memory's limit is its request
# (a pod is never killed for using what the scheduler promised it). The data steps are sized for
# a corpus of a few GB; pretrain only submits and follows its Ray job, the training runs on the
# RayCluster; a fine-tuning holds BERT-Base, its optimizer state and a dev set.
RESOURCES = {
    "settings": ("250m", "1", "1G"),
    "pipeline-run": ("500m", "1", "1G"),
    "finetune-jobs": ("500m", "1", "1G"),
    "clean": ("2", "4", "8G"),
    "vocab": ("2", "4", "8G"),
    "instances": ("4", "8", "16G"),
    "pretrain": ("1", "2", "4G"),
    "instances-512": ("4", "8", "32G"),  # four times the tokens per instance
    "pretrain-phase2": ("1", "2", "4G"),
    "finetune": ("4", "8", "16G"),
    "evaluate": ("1", "2", "2G"),
    "distill": ("4", "8", "16G"),
    "quantize": ("2", "4", "8G"),
    "promote": ("250m", "1", "1G"),
    "deploy": ("250m", "1", "1G"),
    "pipeline-end": ("500m", "1", "1G"),
}


def pod(
    task,
    name: str,
    secrets: Iterable[tuple[str, tuple[str, ...]]] = (),
    mlflow_auth: str = cluster.AUTH_SECRET,
):
    """A task as a cluster pod: its display name, requests and limits (RESOURCES), the
    ConfigMap and Secrets of `pipelines/cluster.py` (and `secrets`, pairs of name and keys; the
    MLflow identity `mlflow_auth`, the pipeline's unless the task releases) as
    environment variables (kfp-kubernetes), and the KFP run id as `KFP_RUN_ID` from the pod
    label (downward API); its container as the images' non-root user (RUN_AS_USER). Passed as
    an input, the run id would enter every step's cache key and no later run could reuse a
    step; an environment variable does not, so caching works across runs and each step still
    nests its MLflow run under its pipeline run."""
    from kfp import kubernetes

    cpu, cpu_limit, memory = RESOURCES[name]
    task.set_display_name(name).set_cpu_request(cpu).set_cpu_limit(cpu_limit)
    task.set_memory_request(memory).set_memory_limit(memory)
    kubernetes.use_config_map_as_env(
        task, cluster.CONFIG_MAP, {key: key for key in cluster.CONFIG_KEYS}
    )
    for secret, keys in [(cluster.SECRET, cluster.SECRET_KEYS), *secrets]:
        kubernetes.use_secret_as_env(task, secret, {key: key for key in keys})
    kubernetes.use_secret_as_env(
        task, mlflow_auth, {key: key for key in cluster.AUTH_KEYS}, optional=True
    )
    user = cluster.RUN_AS_USER
    kubernetes.set_security_context(task, run_as_user=user, run_as_group=user, run_as_non_root=True)
    return kubernetes.use_field_path_as_env(
        task, env_name=cluster.RUN_ID_ENV, field_path=cluster.RUN_ID_FIELD
    )


def build_pipeline():
    """The pipeline function: the DAG of the module docstring, its defaults FORM_DEFAULTS (but
    the fine-tuning image: `steps.TRAIN_IMAGE`, `--train-image` at compile time), its parameters'
    descriptions FORM's (KFP reads them from the docstring's Args).

    Its parameters are the run form (`FORM`): the SHOWN settings and `advanced_settings`, the
    object holding the ADVANCED ones (`--set` takes every setting by name: `form_arguments`).
    The body is `dag`."""
    dsl, steps = _kfp()
    D = {**FORM_DEFAULTS, "cluster_train_image": steps.TRAIN_IMAGE}

    def bert_pipeline(
        data_corpus: str = D["data_corpus"],
        data_glue: str = D["data_glue"],
        data_token: str = D["data_token"],
        model_preset: str = D["model_preset"],
        pretrain_steps: int = D["pretrain_steps"],
        pretrain_num_workers: int = D["pretrain_num_workers"],
        pretrain_use_gpu: bool = D["pretrain_use_gpu"],
        pretrain_init_model: str = D["pretrain_init_model"],
        pretrain_phase2_steps: int = D["pretrain_phase2_steps"],
        finetune_tasks: list = D["finetune_tasks"],
        finetune_epochs: int = D["finetune_epochs"],
        finetune_max_train_examples: int = D["finetune_max_train_examples"],
        finetune_control_tasks: list = D["finetune_control_tasks"],
        finetune_token_tasks: list = D["finetune_token_tasks"],
        compress_task: str = D["compress_task"],
        deploy_task: str = D["deploy_task"],
        cluster_train_image: str = D["cluster_train_image"],
        cluster_finetune_gpus: str = D["cluster_finetune_gpus"],
        cluster_gpu_node_selector: dict = D["cluster_gpu_node_selector"],
        cluster_gpu_tolerations: list = D["cluster_gpu_tolerations"],
        advanced_settings: dict = D["advanced_settings"],
    ):
        dag(dsl, steps, {k: v for k, v in locals().items() if k in FORM})  # by name

    args = "\n".join(f"    {name}: {text}" for name, text in FORM.items())
    bert_pipeline.__doc__ = f"{DESCRIPTION}\n\nArgs:\n{args}\n"
    return dsl.pipeline(name=NAME, description=DESCRIPTION)(bert_pipeline)


def dag(dsl, steps, s: dict[str, Any]) -> None:
    """The pipeline's body: the MLflow bracket (`pipeline-run` first, `pipeline-end` as the exit
    handler) around clean -> vocab -> instances -> pretrain -> the fine-tuning fan-out ->
    evaluate. `s`: the pipeline parameters; the advanced settings join them as the `settings`
    task's outputs, so the steps read every setting by its name."""
    # the exit handler closes the MLflow parent run, whatever becomes of the steps
    end = pod(steps.pipeline_end(), "pipeline-end")
    with dsl.ExitHandler(end.set_caching_options(False), name="bert"):
        defaults = json.dumps(ADVANCED_DEFAULTS)
        given = steps.settings(advanced=s["advanced_settings"], defaults=defaults)
        given = pod(given, "settings").outputs
        s = {**s, **{key: given[key] for key in ADVANCED}}
        start = pod(steps.pipeline_run(**parent_run(s)), "pipeline-run")
        digests = start.set_caching_options(False).outputs
        jobs = pod(steps.finetune_jobs(**parent_run(s)).after(start), "finetune-jobs")
        jobs.set_caching_options(False)
        cl = steps.clean(corpus=s["data_corpus"], corpus_digest=digests["corpus_digest"])
        pod(cl.after(jobs), "clean")  # nothing starts before the run's inputs are checked
        start = s["pretrain_init_model"]  # a checkpoint: its vocabulary, no WordPiece training
        vo = steps.vocab(cleaned=cl.outputs["cleaned"], init_model=start, **section(s, "vocab"))
        pod(vo, "vocab")
        ins = steps.instances(
            cleaned=cl.outputs["cleaned"],
            wordpiece=vo.outputs["wordpiece"],
            **section(s, "instances"),
        )
        pod(ins, "instances")
        # the shape and the run (phase two's steps are its own step's)
        pretrain = {**section(s, "model"), **section(s, "pretrain", leave_out=["phase2_steps"])}
        pre = steps.pretrain(shards=ins.outputs["Output"], **pretrain)  # the URI: read in place
        ray_auth = (cluster.RAY_AUTH_SECRET, cluster.RAY_AUTH_KEYS)
        pod(pre, "pretrain", secrets=[ray_auth]).set_retry(**PRETRAIN_RETRY)
        # The paper's phase two, on when pretrain_phase2_steps > 0: the fan-out fine-tunes its
        # model, else phase one's. Each branch holds the fan-out rather than one fan-out reading
        # dsl.OneOf of the two models: kfp.local (2.17) resolves one producer per DAG output
        # only (local/orchestrator/orchestrator_utils.py, get_dag_output_artifacts).
        with dsl.If(s["pretrain_phase2_steps"] > 0, name="phase2"):
            long = {**section(s, "instances"), **cluster.PHASE2_INSTANCES}
            ins2 = steps.instances(
                cleaned=cl.outputs["cleaned"], wordpiece=vo.outputs["wordpiece"], **long
            )
            pod(ins2, "instances-512")
            phase2 = section(s, "pretrain", leave_out=PHASE1_ONLY)
            pre2 = steps.pretrain_phase2(
                shards=ins2.outputs["Output"],
                phase1=pre.outputs["pretrained"],
                steps=s["pretrain_phase2_steps"],
                **phase2,
            )
            pod(pre2, "pretrain-phase2", secrets=[ray_auth]).set_retry(**PRETRAIN_RETRY)
            fan_out(dsl, steps, s, jobs, pre2)
        with dsl.Else(name="phase1-only"):
            fan_out(dsl, steps, s, jobs, pre)


# pretrain's settings phase two does not take: its start and shape are phase one's model, its
# steps pretrain_phase2_steps, and its exports (Figure 2's) are phase one's
PHASE1_ONLY = ("steps", "init_model", "export_every", "phase2_steps")


def fan_out(dsl, steps, s: dict[str, Any], jobs, pre) -> None:
    """The fine-tunings of `jobs`' list (one ParallelFor) from `pre`'s pre-trained model, the
    compression and release branches in their iterations, then evaluate over all of them."""
    with dsl.ParallelFor(jobs.output, name="finetune") as job:
        ft = pod(steps.finetune(pretrained=pre.outputs["pretrained"], job=job), "finetune")
        on_gpu_nodes(ft, s)
        # the job named compress_task (a GLUE task, from pre-trained weights) teaches
        with dsl.If(ft.outputs["Output"] == s["compress_task"], name="compress"):
            compress(steps, s, pre, ft, job)
        # and the job named deploy_task is released: promoted if better, then served
        with dsl.If(ft.outputs["Output"] == s["deploy_task"], name="deploy"):
            release(steps, s, ft)
    # never cached: each run's MLflow parent gets its own table (and the exit handler
    # reads this step's run to tell a finished run, lineage.end_status)
    ev = steps.evaluate(results=dsl.Collected(ft.outputs["result"]))  # metrics.json, no model
    pod(ev, "evaluate").set_caching_options(False)


def compress(steps, s: dict[str, Any], pre, ft, job) -> None:
    """distill -> quantize after the fine-tuning `ft` of `compress_task`: the student trains
    where the fine-tunings do (`on_gpu_nodes`), the int8 model is for CPUs."""
    glue = {"task": s["compress_task"], "data_glue": s["data_glue"]}
    glue["data_digest"] = job.data_digest
    options = section(s, "compress", leave_out=["task"])
    options |= {k: s[f"finetune_{k}"] for k in DISTILL_FINETUNE}
    teacher, start = ft.outputs["finetuned"], pre.outputs["pretrained"]
    di = steps.distill(teacher=teacher, pretrained=start, **glue, **options)
    on_gpu_nodes(pod(di, "distill"), s)
    pod(steps.quantize(model=di.outputs["distilled"], **glue), "quantize")


def release(steps, s: dict[str, Any], ft) -> None:
    """promote -> deploy after the fine-tuning `ft` of `deploy_task`: the registry's rule decides
    whether this run's model becomes the champion, then the champion is served. Never cached:
    both act on the registry and the cluster as they are now."""
    promote = steps.promote(finetuned=ft.outputs["finetuned"], task=s["deploy_task"])
    pr = pod(promote, "promote", mlflow_auth=cluster.RELEASE_SECRET)  # may move champion
    de = pod(steps.deploy(task=s["deploy_task"]).after(pr), "deploy")
    for task in (pr, de):
        task.set_caching_options(False)


# the fine-tuning settings a student trains with (bert distill's, as dvc.yaml's stage passes them;
# its epochs and learning rate are compress_*)
DISTILL_FINETUNE = ("batch_size", "max_seq_length", "max_train_examples")


def on_gpu_nodes(task, s: Mapping[str, Any]) -> None:
    """A fine-tuning pod: the `cluster_train_image` image, `cluster_finetune_gpus` GPUs, the
    nodes `cluster_gpu_node_selector` picks and the taints `cluster_gpu_tolerations` allows."""
    from kfp import kubernetes

    task.set_container_image(s["cluster_train_image"])
    task.set_accelerator_type("nvidia.com/gpu").set_accelerator_limit(s["cluster_finetune_gpus"])
    # kfp 2.17's set_accelerator_limit does not register its channel (set_container_image
    # does), so inside a ParallelFor the loop never receives it and the backend could not
    # resolve the GPU count: the pod harness found it. Register it by hand.
    task.register_pipeline_channels([s["cluster_finetune_gpus"]])
    kubernetes.add_node_selector_json(task, s["cluster_gpu_node_selector"])
    kubernetes.add_toleration_json(task, s["cluster_gpu_tolerations"])


# The list parameters, `finetune_<name>`: pipeline-run takes each as an input of its own.
LISTS = ("tasks", "control_tasks", "token_tasks")


def parent_run(s: Mapping[str, Any]) -> dict[str, Any]:
    """pipeline-run's inputs: every params.yaml parameter, `section_key` -> `section.key` as
    DVC's parent run logs them, RUNTIME's as `kfp.<name>`; the task lists as inputs of their
    own (inside a dict KFP breaks them)."""
    lists = {name: s[f"finetune_{name}"] for name in LISTS}
    settings = {k.replace("_", ".", 1): v for k, v in s.items() if k in P}
    settings |= {f"kfp.{k}": s[k] for k in RUNTIME}
    for name in LISTS:
        del settings[f"finetune.{name}"]
    return {"settings": settings, **lists}


def compile_spec(path: Path = SPEC) -> Path:
    """Compile the pipeline to `path`, its header comment made stable (`_stable_header`)."""
    from kfp import compiler

    compiler.Compiler().compile(build_pipeline(), str(path))
    path.write_text(_stable_header(path.read_text()))
    return path


def _stable_header(text: str) -> str:
    """kfp writes a dict default into the spec's header comment in the order of a protobuf map,
    which changes from one compile to the next: write those defaults as JSON with sorted keys,
    so the same pipeline always compiles to the same file (a test compares it)."""

    def stable(m: re.Match) -> str:
        default = FORM_DEFAULTS.get(m.group(1))
        return (
            f"{m.group(0).split(' [Default: ')[0]} [Default: {json.dumps(default, sort_keys=True)}]"
        )

    return re.sub(r"^#    (\w+): (?:list|dict) \[Default: .*\]$", stable, text, flags=re.M)


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """`--set finetune_tasks='["SST-2"]' --set pretrain_steps=50`: values parsed as YAML; a text
    parameter stays text (`--set cluster_finetune_gpus=1` is "1")."""
    out, names = {}, sorted(PARAMETERS)
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or key not in names:
            raise SystemExit(f"--set {pair!r}: expected KEY=VALUE with KEY one of {names}")
        parsed = yaml.safe_load(value)
        text = isinstance(DEFAULTS[key], str) and not isinstance(parsed, str)
        out[key] = value if text else parsed
    return out


def form_arguments(arguments: Mapping[str, Any]) -> dict[str, Any]:
    """A run's arguments by setting name (a preset's row, `--set`, params.yaml's) as the run form
    takes them: the SHOWN settings as fields, the ADVANCED ones inside `advanced_settings` (the
    settings task puts their defaults under the rest)."""
    advanced = {k: v for k, v in arguments.items() if k in ADVANCED}
    fields = {k: v for k, v in arguments.items() if k not in ADVANCED}
    return fields | ({"advanced_settings": advanced} if advanced else {})


def check(arguments: dict[str, Any]) -> dict[str, Any]:
    """A run's arguments, each a pipeline parameter with a value of its default's type (a
    preset's row or `--set`): the API server would take a wrong one and the run fail later."""
    for key, value in arguments.items():
        if key not in PARAMETERS:
            raise SystemExit(f"{key}: not a parameter of the pipeline ({', '.join(PARAMETERS)})")
        kind = type(DEFAULTS[key])
        if not isinstance(value, kind) and not (kind is float and type(value) is int):
            raise SystemExit(f"{key}={value!r}: expected a {kind.__name__}")
    return arguments


def check_spec(path: Path = SPEC) -> list[str]:
    """A compiled spec by the rules of the KFP backend users deploy (`kfp_backend.BACKEND`):
    [] when both documents parse strictly and the spec uses only what that backend implements
    (`kfp_backend.load_strict`, `kfp_backend.unsupported`), else one line per problem, each
    starting with the file."""
    from pipelines import kfp_backend

    try:
        spec, executors = kfp_backend.load_strict(path)
    except kfp_backend.StrictParseError as e:
        return [str(e)]
    except OSError as e:
        return [f"{path}: {e.strerror or e}"]
    except yaml.YAMLError as e:
        return [f"{path}: not YAML: {' '.join(str(e).split())}"]
    return [f"{path}: {line}" for line in kfp_backend.unsupported(spec, executors)]


def _shown(path: Path) -> Path:
    """`path` relative to the working directory when it is under it (as a user typed it)."""
    try:
        return path.resolve().relative_to(Path.cwd())
    except ValueError:
        return path


def run_local(overrides: dict[str, Any], pipeline_root: str) -> Any:
    """The whole DAG through kfp.local's SubprocessRunner in this environment (no containers;
    images, resources and the platform spec's ConfigMap / Secrets are ignored). The data
    settings are params.yaml's (the workstation's, not the cluster's), its data paths made
    absolute, no GPUs and one pre-training phase (as `make run`).
    There is no pod label here, so the run id the steps read (`KFP_RUN_ID`) is made up and
    inherited, and so is the tracking URI: `MLFLOW_TRACKING_URI`, else ./mlflow.db, named
    explicitly because a step under KFP refuses to guess one (`bert_core.cli.kfp_step`)."""
    import uuid

    from kfp import local

    args = {**P, "cluster_finetune_gpus": "0", "pretrain_phase2_steps": 0, **overrides}
    for key in DATA:
        if "://" not in str(args[key]):
            args[key] = str((ROOT / args[key]).resolve())
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=pipeline_root)
    os.environ["KFP_RUN_ID"] = f"local-{uuid.uuid4()}"
    os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{Path.cwd() / 'mlflow.db'}")
    return build_pipeline()(**form_arguments(args))


def client(host: str, namespace: str | None = None, token_file: Path | None = None):
    """A `kfp.Client` for the API at `host`, in a multi-user Kubeflow's profile `namespace`
    (None: a standalone KFP). Its token: `token_file`'s (e.g. `kubectl -n PROFILE create token
    default-editor --audience=pipelines.kubeflow.org > FILE`: the token is on no command line),
    else, inside a pod, the ServiceAccount token KFP projects at KF_PIPELINES_SA_TOKEN_PATH
    (kfp's `ServiceAccountTokenVolumeCredentials`, refreshed as it rotates), else none."""
    import kfp
    from kfp.client import (
        KF_PIPELINES_SA_TOKEN_ENV,
        KF_PIPELINES_SA_TOKEN_PATH,
        ServiceAccountTokenVolumeCredentials,
    )

    token = token_file.read_text().strip() if token_file else None
    projected = Path(os.environ.get(KF_PIPELINES_SA_TOKEN_ENV, KF_PIPELINES_SA_TOKEN_PATH))
    credentials = None
    if token is None and projected.is_file():
        credentials = ServiceAccountTokenVolumeCredentials(str(projected))
    return kfp.Client(
        host=host, namespace=namespace or "kubeflow", existing_token=token, credentials=credentials
    )


def submit(
    kfp_client,
    namespace: str | None,
    experiment: str,
    run_name: str | None,
    overrides: dict[str, Any],
    spec: Path = SPEC,
) -> str:
    """Upload a compiled spec (default: the committed one) through `kfp_client` (`client`) and
    start a run in `namespace` (its experiment made there if new); returns the run id."""
    run = kfp_client.create_run_from_pipeline_package(
        str(spec),
        arguments=form_arguments(overrides),
        run_name=run_name,
        experiment_name=experiment,
        namespace=namespace,
    )
    return run.run_id


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pipelines.bert_pipeline", description=__doc__.split("\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("compile", help="write the pipeline spec (YAML)")
    c.add_argument("--output", type=Path, default=SPEC)
    c.add_argument("--image", help="component image (default: $BERT_IMAGE or the project's)")
    c.add_argument("--train-image", help="default of cluster_train_image (default: the CUDA image)")
    lo = sub.add_parser("local", help="run the whole DAG here through kfp.local")
    lo.add_argument("--pipeline-root", default=str(ROOT / "runs" / "kfp"))
    lo.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    s = sub.add_parser("submit", help="upload the spec to a KFP endpoint and start a run")
    s.add_argument("--host", required=True, help="KFP API endpoint, e.g. http://localhost:8080")
    s.add_argument(
        "--namespace",
        help="a multi-user Kubeflow's profile namespace (default: none, a standalone KFP)",
    )
    s.add_argument(
        "--token-file",
        type=Path,
        help="a file holding a bearer token for the API "
        "(default: the pod's KFP ServiceAccount token, if any)",
    )
    s.add_argument("--experiment", default=NAME)
    s.add_argument("--run-name", default=None)
    s.add_argument("--spec", type=Path, default=SPEC, help="compiled spec (default: committed)")
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    s.add_argument(
        "--preset",
        choices=sorted(presets.PRESETS),
        help="one run per row of the paper's table (pipelines/presets.py), in the KFP "
        "experiment so named; --set applies to every row",
    )
    ch = sub.add_parser(
        "check",
        help="check a compiled spec by the rules of the KFP backend "
        "users deploy (before an upload); exit 2 on a problem",
    )
    ch.add_argument(
        "spec",
        nargs="?",
        type=Path,
        default=SPEC,
        metavar="FILE",
        help="compiled spec (default: the committed one)",
    )
    args = parser.parse_args(argv)
    if args.command == "compile":
        for var, value in (("BERT_IMAGE", args.image), ("BERT_TRAIN_IMAGE", args.train_image)):
            if value:
                os.environ[var] = value
                sys.modules.pop("components.steps", None)  # read at import
        print(compile_spec(args.output))
    elif args.command == "local":
        run_local(parse_overrides(args.set), args.pipeline_root)
    elif args.command == "check":
        from pipelines.kfp_backend import BACKEND

        path = _shown(args.spec)
        problems = check_spec(path)
        print(
            "\n".join(problems)
            or f"{path}: clean: parses strictly and uses only what KFP {BACKEND} implements"
        )
        return 2 if problems else 0
    else:
        experiment = args.preset or args.experiment
        runs = presets.runs(args.preset, parse_overrides(args.set))
        kfp_client = client(args.host, args.namespace, args.token_file)
        for row, overrides in runs:
            run_name = row or args.run_name
            run_id = submit(
                kfp_client, args.namespace, experiment, run_name, check(overrides), args.spec
            )
            print(json.dumps({"run_id": run_id, "run_name": run_name}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
