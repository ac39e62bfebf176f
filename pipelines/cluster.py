"""What a pipeline pod gets from the cluster, defined once for the pipeline, its tests and the
pod harness: the ConfigMap and Secrets every task loads as environment variables, the key of
each, and the pipeline's cluster defaults (data under the bucket, the images).

Why one module: the compiled spec (`pipelines/bert_pipeline.py` wires these into every task with
kfp-kubernetes), the manifests in `infra/k8s/env/` (which must hold exactly these keys: a test
compares them) and the tests' pod harness (`tests/cluster/`, which builds a pod's environment
from the manifests the way Kubernetes does) must never drift apart. A key the spec names but the
ConfigMap lacks stops the pod before it starts (`CreateContainerConfigError`); a key the
ConfigMap has but the spec does not name never reaches the step, which then quietly logs to a
local file.

The data defaults are the cluster's, not params.yaml's: a pod has no `../shared/data`. DVC and
`make run` keep reading the workstation paths in params.yaml; `python -m pipelines.bert_pipeline
local` replaces these with them.
"""

from __future__ import annotations

# The ConfigMap `bert-pipeline-env` (infra/k8s/env/pipeline-env.yaml): service addresses.
CONFIG_MAP = "bert-pipeline-env"
CONFIG_KEYS = (
    "MLFLOW_TRACKING_URI",  # the MLflow server (never a pod-local SQLite file)
    "AWS_ENDPOINT_URL",  # S3 endpoint for boto3 / pyarrow (MinIO)
    "MLFLOW_S3_ENDPOINT_URL",  # the same, for MLflow's S3 artifact client
    "AWS_DEFAULT_REGION",
    "RAY_ADDRESS",  # the RayCluster's dashboard / Jobs API, http://<head-svc>:8265
    "BERT_BUCKET",  # s3://bert: data, DVC remote, MLflow artifacts, Ray checkpoints
    "BERT_RAY_STORAGE",  # s3://bert/ray: `bert pretrain --storage-path` default
    "RAY_AUTH_MODE",  # token: the Ray Jobs API refuses a request without the token below
    "MLFLOW_DISABLE_TELEMETRY",  # true: no usage reports (see pipeline-env.yaml)
)

# The Secret `bert-s3` (generated from infra/k8s/env/s3.env): S3 credentials, required.
SECRET = "bert-s3"
SECRET_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")

# The Secret `bert-mlflow-auth`: MLflow basic auth, only where the server has it enabled. The
# pods mount it with `optional: true`, so a cluster without it runs unchanged.
AUTH_SECRET = "bert-mlflow-auth"
AUTH_KEYS = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")
# The Secret `bert-mlflow-release`: the release identity, the one MLflow lets move `champion`
# (infra/scripts/mlflow_users.py), with the same keys; only the promote task mounts it, instead
# of bert-mlflow-auth (optional too: without auth, neither exists).
RELEASE_SECRET = "bert-mlflow-release"

# The Secret `bert-ray-auth` (generated from infra/k8s/env/ray-auth.env): the RayCluster's token
# (Ray's token authentication), loaded only by the pretrain task, the one that submits Ray jobs.
RAY_AUTH_SECRET = "bert-ray-auth"
RAY_AUTH_KEYS = ("RAY_AUTH_TOKEN",)

# The KFP run id, from the pod label the KFP backend sets (Kubernetes downward API).
RUN_ID_ENV = "KFP_RUN_ID"
RUN_ID_FIELD = "metadata.labels['pipeline/runid']"

# Every task's container runs as the images' own user (infra/docker: `useradd --uid 1000`), never
# root: KFP 2.17's compiler adds the rest of the "restricted" standard to the task pods
# (allowPrivilegeEscalation false, capabilities drop ALL, seccomp RuntimeDefault:
# backend/src/v2/compiler/argocompiler/security_context.go) but leaves the user to the image.
RUN_AS_USER = 1000

# Pipeline parameter defaults that are valid in a pod: the data under the bucket (upload it
# there first, docs/cluster.md); the workstation paths of params.yaml stay DVC's.
BUCKET = "s3://bert"
DATA = {
    "data_corpus": f"{BUCKET}/data/corpus",
    "data_glue": f"{BUCKET}/data/glue",
    "data_token": f"{BUCKET}/data",
}

# Images (infra/docker): every task runs IMAGE but the fine-tuning fan-out, which runs the
# `cluster_train_image` pipeline parameter (default CUDA_IMAGE). Overridden at compile time with
# `--image` / `--train-image` (or BERT_IMAGE / BERT_TRAIN_IMAGE).
# Fully qualified (registry/repository:tag): a short name resolves to whatever registry the node's
# container runtime searches first. registry.example.com stands for yours: compile with --image.
IMAGE = "registry.example.com/bert/bert:0.1.0"
CUDA_IMAGE = "registry.example.com/bert/bert-cuda:0.1.0"

# The taint GPU nodes usually carry (NVIDIA's GPU operator, the managed clouds' GPU pools): the
# fine-tuning pods tolerate it by default; harmless where no node has it.
GPU_TOLERATIONS = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]

# The pipeline's parameter defaults on a cluster (what the KFP UI's run form shows): a first run
# that ends the same day, changing only the data locations: BERT-Small (4 layers, H 512) pre-trained
# for 18,000 steps of 256 sequences of 128 tokens on one GPU worker (dupe factor 2) and 2,000 at
# 512 tokens (the paper's two phases, 90 % and 10 % of the steps: PHASE2_INSTANCES), then five
# GLUE tasks on a 20,000-example slice of each training set and CoNLL-2003, one learning rate, 3
# epochs, one GPU each. Estimated at about an hour on one GPU node from bench/model_step.py's H100
# row in the README (BERT-Base at batch 256: 640,728 tokens/s, about 20 steps a second; Small is
# about a tenth of its compute per token), not measured. The paper's BERT-Base run is the
# `paper` preset (PAPER below, `submit --preset paper`), which the ablation presets build on.
# params.yaml holds the 2-core workstation's (`make run`, DVC); the test harness runs smoke
# sizes. 0 for a `max_*_examples`: every example.
SETTINGS = {
    **DATA,
    "vocab_vocab_size": 30522,
    "instances_max_seq_length": 128,
    "instances_max_predictions_per_seq": 20,
    "instances_masked_lm_prob": 0.15,
    "instances_dupe_factor": 2,
    "instances_random_seed": 12345,
    "instances_masking_recipe": "80/10/10",
    "model_preset": "small",
    "model_num_layers": 0,
    "model_hidden_size": 0,
    "model_num_heads": 0,
    "model_intermediate_size": 0,
    "pretrain_steps": 18_000,
    "pretrain_export_every": 0,
    "pretrain_phase2_steps": 2_000,
    "pretrain_batch_size": 256,
    "pretrain_num_workers": 1,
    "pretrain_cpus_per_worker": 8,
    "pretrain_learning_rate": 1e-4,
    "pretrain_use_gpu": True,
    "pretrain_objective": "mlm+nsp",
    "pretrain_init_model": "none",
    "finetune_tasks": ["CoLA", "SST-2", "MRPC", "STS-B", "RTE"],
    "finetune_epochs": 3,
    "finetune_batch_size": 32,
    "finetune_learning_rate": 5e-5,
    "finetune_max_seq_length": 128,
    "finetune_max_train_examples": 20_000,
    "finetune_control_tasks": [],
    "finetune_lr_sweep": "none",
    "finetune_restarts": 1,
    "finetune_top_bilstm": False,
    "finetune_token_tasks": ["conll2003"],
    "finetune_token_epochs": 3,
    "finetune_token_max_seq_length": 128,
    "finetune_token_max_train_examples": 0,
    "finetune_token_max_eval_examples": 0,
    "finetune_token_document_context": True,  # the paper's (section 5.3)
    "compress_task": "none",
    "compress_student": "pretrained",
    "compress_student_layers": 6,
    "compress_student_ffn_share": 1.0,  # DistilBERT keeps the width
    "compress_temperature": 2.0,
    "compress_alpha": 0.5,
    "compress_epochs": 3,
    "compress_learning_rate": 1e-4,
    "deploy_task": "none",
    "cluster_train_image": CUDA_IMAGE,
    # text, not a number: the backend fills a GPU count only from a STRING parameter; a number
    # resolves to "" and the pod gets no GPU, without an error (driver/resolve.go,
    # resolvePodSpecInputRuntimeParameter: GetStringValue)
    "cluster_finetune_gpus": "1",
    "cluster_gpu_node_selector": {},
    "cluster_gpu_tolerations": GPU_TOLERATIONS,
}

# Phase two's instances (`pretrain_phase2_steps`): the paper's 512 tokens, at most 80 masked
# positions each (the original's setting at 512: 20 x 512 / 128, so ~15 % stay predicted); the
# other instance settings are the form's instances_*.
PHASE2_INSTANCES = {"max_seq_length": 512, "max_predictions_per_seq": 80}

# The paper's BERT-Base run (section 3.1, appendix A.2: 1,000,000 steps of 256 sequences, 90 % of
# them of 128 tokens and 10 % of 512, learning rate 1e-4, 15% masked, at most 20 predictions at 128
# tokens, dupe factor 10) on 4 GPU
# workers, then its eight GLUE tasks, CoNLL-2003 and SQuAD v1.1 with its protocol (3 epochs,
# batch 32, best of 5e-5, 4e-5, 3e-5, 2e-5 on dev; SQuAD at 384 tokens), one GPU each: what
# SETTINGS changes, as the `paper` preset (pipelines/presets.py). Days of GPU time.
PAPER = {
    "instances_dupe_factor": 10,
    "model_preset": "base",
    "pretrain_steps": 900_000,
    "pretrain_phase2_steps": 100_000,
    "pretrain_num_workers": 4,
    "finetune_tasks": ["CoLA", "SST-2", "MRPC", "STS-B", "QQP", "MNLI", "QNLI", "RTE"],
    "finetune_max_train_examples": 0,
    "finetune_lr_sweep": "paper",
    "finetune_learning_rate": 2e-5,
    "finetune_token_tasks": ["conll2003", "squad"],
    "finetune_token_max_seq_length": 384,
}
