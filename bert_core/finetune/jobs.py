"""The fine-tuning fan-out of a Kubeflow run: one job per fine-tuning, all in one list.

A pipeline run fine-tunes the GLUE tasks from the pre-trained model, the control tasks from
random weights (the "random init" row) and the token-level tasks (CoNLL-2003, SQuAD), each list
a run parameter that may be empty. Three `dsl.ParallelFor` loops, one per list, fail on the
Kubeflow backend as soon as one list is empty: the driver of the task collecting a loop's
outputs (`dsl.Collected`) looks for an iteration that never ran and stops the run (KFP backend
2.17.0, `backend/src/v2/driver/resolve.go`, `resolveUpstreamArtifacts`: with `iteration_count`
0 it skips `CollectInputs` and `GetProducerTask` names a sub-task that does not exist). So a task
at the start of the run turns the three lists into one (`finetune_jobs`), refuses an empty one,
and the pipeline fans out once over it.

Each job carries the `bert finetune` options of its fine-tuning (all but `--model` and
`--output`, which the step adds) and the content digest of its task's data, so the KFP cache
key of a fine-tuning changes when its own data does, not when another task's does. Flags close
the list: `--top-bilstm` (finetune.top_bilstm) for every job, `--document-context`
(finetune.token_document_context) for conll2003's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from bert_core.errors import BertError

# (list setting, data folder setting, init, settings prefix of its own values)
FAMILIES = (
    ("finetune.tasks", "data.glue", "pretrained", "finetune."),
    ("finetune.control_tasks", "data.glue", "random", "finetune."),
    ("finetune.token_tasks", "data.token", "pretrained", "finetune.token_"),
)
# options every fine-tuning takes from finetune.*, and those a family may set for itself
SHARED = ("batch_size", "learning_rate", "lr_sweep", "restarts")
OWN = ("epochs", "max_seq_length", "max_train_examples", "max_eval_examples")


def _option(value: Any) -> str:
    return "none" if value is None else str(value)


def finetune_jobs(settings: Mapping[str, Any], digest: Callable[[str], str]) -> list[dict]:
    """The run's fine-tunings from its typed settings (`finetune.tasks`, `data.glue`, ...):
    GLUE from the pre-trained model, the control from random weights, the token-level tasks
    with their own epochs and lengths; `digest(uri)` gives a task folder's content digest."""
    jobs = []
    for list_key, data_key, init, prefix in FAMILIES:
        for task in settings.get(list_key) or []:
            data = f"{str(settings[data_key]).rstrip('/')}/{task}"
            options = ["--task", task, "--data", data, "--init", init, "--device", "auto"]
            for name in SHARED:
                options += [f"--{name.replace('_', '-')}", _option(settings[f"finetune.{name}"])]
            for name in OWN:
                value = settings.get(f"{prefix}{name}")
                if name.startswith("max_") and value in (None, 0, "none"):
                    if name == "max_eval_examples":
                        continue  # the whole dev set: the option's default
                    value = None  # every training example
                options += [f"--{name.replace('_', '-')}", _option(value)]
            if settings.get("finetune.top_bilstm"):  # Table 5's "+ BiLSTM", every head
                options.append("--top-bilstm")
            if task == "conll2003" and settings.get("finetune.token_document_context"):
                options.append("--document-context")  # NER's option alone
            name = task if init == "pretrained" else f"{task} (random init)"
            jobs.append({"name": name, "options": options, "data_digest": digest(data)})
    if not jobs:
        raise BertError(
            "nothing to fine-tune: finetune_tasks, finetune_control_tasks and "
            "finetune_token_tasks are all empty; list at least one task"
        )
    return jobs
