"""The Kubeflow backend as the tests model it, to run the compiled pipeline without a cluster.

- `pod_harness`: runs pipelines/bert_pipeline.yaml task by task by the rules of the pinned
  backend (Argo scheduling, ML Metadata states, caching, the exit handler, trigger conditions),
  each container as its pod would run;
- `pod_env`: a pod's environment and placement from the platform spec and the manifests in
  infra/k8s/env (ConfigMap, Secrets, the run-id label);
- `kfp_cel`: the driver's CEL (trigger conditions, a loop item's field) on cel-python.
- `secrets`: fake credentials planted where a cluster puts the real ones, and the search of
  every output of a run for them.

Test code only: the product's check of a compiled spec before an upload (strict parse, what the
pinned backend implements) is `python -m pipelines.bert_pipeline check`
(pipelines/kfp_backend.py), which the harness also parses with.
"""
