"""bert_core: BERT pre-training and fine-tuning, one sub-package per part of the pipeline.

The folder listing is the architecture (docs/architecture.md): `data/` (clean, vocab,
instances), `model/`, `pretrain/`, `finetune/` (the engine and `tasks/`), `serve/`, `report/`,
`track/`, and the few cross-cutting modules at the top: `cli` (the `bert` command, and what the
Kubeflow components and the DVC runner call), `tracking` (one step's MLflow run), `storage`
(local or s3:// paths, atomic outputs), `options` (config dataclasses as command lines), `errors`.
Imports point down the layers docs/architecture.md states; tests/test_architecture.py checks.
The library has no orchestration imports.
"""

__version__ = "0.1.0"
