"""Model folders of every kind `bert_core.serve.predictors` serves, built in seconds.

Each is the real 6-layer MiniLM encoder (`minilm_dir`) under a freshly initialised (seeded) head,
saved as `bert finetune` saves its model: label names and task in config.json, the vocab and
tokenizer_config.json beside it. The heads are untrained, so answers are arbitrary but
deterministic, which is what comparing two code paths needs; a real encoder spreads the logits
so that no two candidates tie.
"""

from __future__ import annotations

from pathlib import Path

import torch

from bert_core.finetune.tasks import ner
from bert_core.model import heads
from bert_core.model.modeling import BertForPreTraining

KINDS = {
    # kind: (head class, config overrides)
    "classification": (
        heads.BertForSequenceClassification,
        {"num_labels": 2, "id2label": {0: "negative", 1: "positive"}, "finetuning_task": "SST-2"},
    ),
    "pair": (
        heads.BertForSequenceClassification,
        {"num_labels": 2, "id2label": {0: "0", 1: "1"}, "finetuning_task": "MRPC"},
    ),
    "regression": (
        heads.BertForSequenceClassification,
        {"num_labels": 1, "finetuning_task": "STS-B"},
    ),
    "ner": (
        heads.BertForTokenClassification,
        {
            "num_labels": len(ner.LABELS),
            "id2label": dict(enumerate(ner.LABELS)),
            "finetuning_task": "conll2003",
        },
    ),  # fmt: skip
    "question-answering": (
        heads.BertForQuestionAnswering,
        {"num_labels": 2, "finetuning_task": "squad"},
    ),
    "fill-mask": (BertForPreTraining, {}),
    "multiple-choice": (heads.BertForMultipleChoice, {"num_labels": 1, "finetuning_task": "swag"}),
}


def build(kind: str, minilm_dir: Path, dest: Path, seed: int = 0) -> Path:
    """A model folder of `kind` (a key of KINDS) at `dest`."""
    cls, overrides = KINDS[kind]
    torch.manual_seed(seed)
    model = cls.from_pretrained(minilm_dir, **overrides)
    if kind == "fill-mask":  # MiniLM has no MLM head: a visible one, not one near zero
        torch.nn.init.normal_(model.cls.predictions.transform.dense.weight, std=0.2)
    model.save_pretrained(dest, vocab_file=minilm_dir / "vocab.txt")
    return dest
