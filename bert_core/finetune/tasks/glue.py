"""`bert finetune --task <GLUE task>`: sentence(-pair) classification, section 4.1 of the paper.

As `run_classifier.py`: inputs packed `[CLS] A [SEP] B [SEP]` (segment 0 up to the first [SEP],
then 1) with the longer sentence truncated first, a linear classifier on the pooled [CLS] vector
(MSE regression for STS-B). The tasks' files, labels and metrics are
`bert_core.finetune.tasks.glue_data`'s; the loop, optimizer and run are the engine's
(`bert_core.finetune.engine`).

Output (besides the engine's `model/` and `metrics.json`): `dev_predictions.tsv` and, when the
task folder has GLUE test files, `submission/<Task>.tsv` in the GLUE server's
`index<TAB>prediction` format.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from bert_core.finetune.engine import (
    Epoch,
    FinetuneTask,
    majority,
    pad,
    padding_mask,
    predict_batches,
    sample,
)
from bert_core.finetune.tasks.glue_data import (
    Example,
    GlueTask,
    compute_metrics,
    get_task,
    label_ids,
    prediction_names,
    read_task,
    task_metrics,
    task_score,
)


def truncate_pair_from_end(tokens_a: list, tokens_b: list, max_length: int) -> None:
    """Drop tokens from the end of the longer sequence (B on ties), one at a time, until the
    pair fits: `run_classifier.py`'s `_truncate_seq_pair`, deterministic (unlike pre-training's
    random truncation of an instance).

    Why not keep a fixed share of each: a short sentence keeps all of its tokens, which carry
    more information each than the tail of a long one.
    """
    while len(tokens_a) + len(tokens_b) > max_length:
        (tokens_a if len(tokens_a) > len(tokens_b) else tokens_b).pop()


@dataclass
class Features:
    """Tokenised examples (unpadded) and their targets."""

    input_ids: list[np.ndarray]
    token_type_ids: list[np.ndarray]
    labels: np.ndarray | None

    def __len__(self) -> int:
        return len(self.input_ids)


def featurize(
    task: GlueTask, examples: Sequence[Example], tokenizer, max_seq_length: int
) -> Features:
    """`[CLS] A [SEP]` or `[CLS] A [SEP] B [SEP]` ids (segment 0 up to the first [SEP], then 1),
    at most `max_seq_length` long, the longer sentence truncated first."""
    cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    a_enc = tokenizer.encode_batch([e.text_a for e in examples], add_special_tokens=False)
    pairs = [e.text_b for e in examples if e.text_b is not None]
    b_enc = iter(tokenizer.encode_batch(pairs, add_special_tokens=False))
    input_ids, token_type_ids = [], []
    for ex, a in zip(examples, a_enc, strict=True):
        a_ids = list(a.ids)
        if ex.text_b is None:
            del a_ids[max_seq_length - 2 :]
            ids, types = [cls, *a_ids, sep], [0] * (len(a_ids) + 2)
        else:
            b_ids = list(next(b_enc).ids)
            truncate_pair_from_end(a_ids, b_ids, max_seq_length - 3)
            ids = [cls, *a_ids, sep, *b_ids, sep]
            types = [0] * (len(a_ids) + 2) + [1] * (len(b_ids) + 1)
        input_ids.append(np.asarray(ids, dtype=np.int64))
        token_type_ids.append(np.asarray(types, dtype=np.int64))
    labelled = bool(examples) and examples[0].label is not None
    return Features(input_ids, token_type_ids, label_ids(task, examples) if labelled else None)


def collate(features: Features, index: Sequence[int], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """One batch padded to its longest sequence; attention_mask 1 = token, 0 = padding."""
    batch = {
        "input_ids": pad(features.input_ids, index, pad_id),
        "token_type_ids": pad(features.token_type_ids, index),
        "attention_mask": padding_mask(features.input_ids, index),
    }
    if features.labels is not None:
        batch["labels"] = torch.from_numpy(features.labels[list(index)])
    return batch


def predict(model, features: Features, device: torch.device, batch_size: int) -> np.ndarray:
    """Logits for every example, in input order."""
    out = np.zeros((len(features), model.config.num_labels), dtype=np.float32)
    lengths = [len(x) for x in features.input_ids]
    batches = predict_batches(model, lengths, lambda i: collate(features, i), device, batch_size)
    for index, outputs in batches:
        out[index] = outputs.logits.float().cpu().numpy()
    return out


def to_predictions(task: GlueTask, logits: np.ndarray) -> np.ndarray:
    return logits[:, 0] if task.is_regression else logits.argmax(-1)


def evaluate_dev(task: GlueTask, model, dev: dict[str, Features], device, batch_size):
    """(task metrics, per-split predictions) on every dev split."""
    preds = {s: to_predictions(task, predict(model, f, device, batch_size)) for s, f in dev.items()}
    per_split = {s: compute_metrics(task, preds[s], dev[s].labels) for s in dev}
    return task_metrics(task, per_split), preds


class GlueFinetune(FinetuneTask):
    """One GLUE task for the engine: its files, featurisation, dev metrics and submission."""

    model_class = "BertForSequenceClassification"
    replace_mismatched_head = True  # e.g. an MNLI (3-way) model fine-tuned on STS-B (1 output)

    def __init__(self, name: str):
        self.glue = get_task(name)
        super().__init__(self.glue.name)
        # config.json's id2label: what the labels mean (SST-2: negative, positive), the data's
        # values (0, 1) stay the targets' ids; STS-B (regression) has no label names
        self.labels = self.glue.label_names or None
        self.num_labels = self.glue.num_labels
        regression = self.glue.is_regression
        self.problem_type = "regression" if regression else "single_label_classification"
        names = self.glue.metric_names()  # the score: their mean (`task_score`)
        self.score_metric = names[0] if len(names) == 1 else f"mean({', '.join(names)})"

    def prepare(self, data_dir: Path, tokenizer, cfg) -> dict:
        task, n_train = self.glue, cfg.max_train_examples
        train = sample(read_task(task, data_dir, "train")["train"], n_train, cfg.seed)
        self.dev_examples = {
            s: sample(ex, cfg.max_eval_examples, cfg.seed)
            for s, ex in read_task(task, data_dir, "dev").items()
        }
        self.test_examples = read_task(task, data_dir, "test")
        self.tokenizer = tokenizer  # the test files are featurised after training
        self.train = featurize(task, train, tokenizer, cfg.max_seq_length)
        self.dev = {
            s: featurize(task, ex, tokenizer, cfg.max_seq_length)
            for s, ex in self.dev_examples.items()
        }
        self.num_train = self.num_train_examples = len(self.train)
        return {"num_train_examples": len(self.train)}

    def train_batch(self, index):
        return collate(self.train, index)

    def evaluate(self, model, device, cfg):
        metrics, preds = evaluate_dev(self.glue, model, self.dev, device, cfg.eval_batch_size)
        return metrics, task_score(self.glue, metrics), preds

    def baseline(self) -> tuple[float, str]:
        """The training labels' most frequent class for every dev example; a regression's
        constant answer has no correlation (0)."""
        if self.glue.is_regression:
            return 0.0, "a constant score"
        label = majority(self.train.labels)
        per_split = {
            s: compute_metrics(self.glue, np.full(len(f), label), f.labels)
            for s, f in self.dev.items()
        }
        metrics = task_metrics(self.glue, per_split)
        name = self.labels[label] if self.labels else label
        return task_score(self.glue, metrics), f"always {name} (the most frequent in training)"

    def summary(self, best: Epoch) -> dict:
        return {
            "num_train_examples": len(self.train),
            "num_dev_examples": {s: len(f) for s, f in self.dev.items()},
        }

    def write_outputs(self, out: Path, model, predictions, device, cfg) -> None:
        """dev_predictions.tsv and, with test files, the GLUE submission files."""
        task = self.glue
        with open(out / "dev_predictions.tsv", "w", encoding="utf-8") as f:
            f.write("split\tguid\tlabel\tprediction\n")
            for split, examples in self.dev_examples.items():
                names = prediction_names(task, predictions[split])
                for ex, pred in zip(examples, names, strict=True):
                    f.write(f"{split}\t{ex.guid}\t{ex.label}\t{pred}\n")

        for split in task.test:
            if split.name not in self.test_examples:
                continue
            examples = self.test_examples[split.name]
            feats = featurize(task, examples, self.tokenizer, cfg.max_seq_length)
            logits = predict(model, feats, device, cfg.eval_batch_size)
            names = prediction_names(task, to_predictions(task, logits))
            (out / "submission").mkdir(exist_ok=True)
            with open(out / "submission" / split.submission, "w", encoding="utf-8") as f:
                f.write("index\tprediction\n")
                f.writelines(f"{ex.index}\t{p}\n" for ex, p in zip(examples, names, strict=True))
