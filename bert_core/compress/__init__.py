"""Cheaper models from fine-tuned ones: `quantize` (`bert quantize`: dynamic int8 for the CPU)
and `distill` (`bert distill`: a smaller student trained on a fine-tuned teacher's soft targets,
Hinton et al.), with `distill_loss` (the loss and the `Distiller` student wrapper) and `student`
(the teacher/student checks before compute, a student cut to K of the teacher's layers).

The models made here are ordinary model folders that every loader reads (`bert predict`,
`bert serve`, the MLflow model), scored on the task's dev set beside the model they came from.

May import: `finetune.command` (the task table, to score a model on its task's dev set),
`serve` (the MLflow model it logs), `finetune`, `model`, `storage`, `tracking`, `metrics`,
`options`, `errors`. Not `track` or the CLI.
"""
