"""What a pipeline pod gets from the cluster, defined once for the pipeline, its tests and the
pod harness: the ConfigMap and Secrets every task loads as environment variables, the key of
each, and the pipeline's cluster defaults (data under the bucket, the images).

Why one module: the compiled spec (`pipelines/bert_pipeline.py` wires these into every task with
kfp-kubernetes), the manifests in `infra/k8s/env/` (which must hold exactly these keys: a test
compares them) and `pipelines/pod_harness.py` (which builds a pod's environment from the
manifests the way Kubernetes does) must never drift apart. A key the spec names but the
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
)

# The Secret `bert-s3` (generated from infra/k8s/env/s3.env): S3 credentials, required.
SECRET = "bert-s3"
SECRET_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")

# The Secret `bert-mlflow-auth`: MLflow basic auth, only where the server has it enabled. The
# pods mount it with `optional: true`, so a cluster without it runs unchanged.
AUTH_SECRET = "bert-mlflow-auth"
AUTH_KEYS = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")

# The KFP run id, from the pod label the KFP backend sets (Kubernetes downward API).
RUN_ID_ENV = "KFP_RUN_ID"
RUN_ID_FIELD = "metadata.labels['pipeline/runid']"

# Pipeline parameter defaults that are valid in a pod: the data under the bucket (upload it
# there first, docs/cluster.md); the workstation paths of params.yaml stay DVC's.
BUCKET = "s3://bert"
DATA = {
    "data_corpus": f"{BUCKET}/data/corpus",
    "data_glue": f"{BUCKET}/data/glue",
    "data_token": f"{BUCKET}/data",
}

# Images (infra/docker): every task runs IMAGE but the fine-tuning fan-out, which runs the
# `train_image` pipeline parameter (default IMAGE; the CUDA image for GPU runs). Overridden
# at compile time with `--image` / `--train-image` (or BERT_IMAGE / BERT_TRAIN_IMAGE).
IMAGE = "bert-pipeline/bert:0.1.0"
CUDA_IMAGE = "bert-pipeline/bert-cuda:0.1.0"
