"""Fine-tuning: one engine for every task, the tasks, the sweep, and `bert finetune`.

Owns the engine (`engine`: what a task is to it, batching and padding, the model loader, the
training and prediction loops), its settings (`config`), the paper's learning-rate sweep and
restarts (`sweep`), the pipeline's fan-out of fine-tunings (`jobs`), the task families
(`tasks/`) and the step itself (`command`: the task table, MLflow, metrics.json, registering the
model).

May import: `bert_core.data` (the tokenizer), `bert_core.model`, `storage`, `tracking`,
`options`, `errors`. Only `command` may also import `bert_core.serve` (the step ends by
registering its model), a unit of its own above serve in docs/architecture.md; the engine and
the tasks stay below serve, whose predictors reuse their featurisation.
"""
