"""Serving: raw text in, answers out, the same code behind every way a model answers.

Owns the predictors (`predictor`: the base; `predictors`: the sequence-level kinds and the table
of kinds; `predictors_span`: entities and answers), the MLflow model (`mlflow_model`, with
`pyfunc_model`, the model-from-code file), the registry (`registry`: versions, aliases,
`bert promote`), batch inference (`predict`, `records`), feature-based use (`embed`) and the
HTTP endpoint (`server`: `bert serve`, MLflow's scoring app behind `limits` and `batching`).

May import: `bert_core.finetune` engine and tasks (a predictor featurises as its task did in
fine-tuning), `bert_core.data`, `bert_core.model`, `storage`, `tracking`, `options`, `errors`.
Not `report` (a sibling), `finetune.command`, `track` or the CLI.
"""
