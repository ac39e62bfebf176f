"""The report: `bert evaluate`, every system's results as the paper's tables, one plot.

Owns the step (`evaluate`: collecting metrics.json files, the MLflow run, the metric names the
pipeline logs) and the tables (`tables`: Table 1's GLUE layout, SQuAD, CoNLL-2003, SWAG, the
gain over a control).

May import: `bert_core.finetune.tasks` (GLUE's task table and score), `storage`, `tracking`,
`errors`. Not `serve` (a sibling) nor anything above.
"""
