"""The fine-tuning tasks, one family per module: what is each task's own.

GLUE (`glue_data`: the TSV layouts, labels and metrics; `glue`: the task), CoNLL-2003 NER
(`ner_data`, `ner`, `conlleval`), SQuAD v1.1/v2.0 (`squad_data`, `squad`, `squad_metrics`) and
SWAG (`swag`). A task reads and checks its data, featurises it, collates batches, decodes
predictions, scores them and writes its prediction files; training is the engine's.

May import: `bert_core.finetune.engine` and `config`, `bert_core.data`, `bert_core.model`,
`storage`, `errors`. Never `bert_core.finetune.command`, which imports them.
"""
