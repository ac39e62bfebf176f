"""`bert finetune --task swag`: multiple choice, section 4.4 of the paper (SWAG).

SWAG (Zellers et al., 2018) gives a sentence and four possible continuations; the task is to
choose the most plausible one. As the paper: "we construct four input sequences, each containing
the concatenation of the given sentence (sentence A) and a possible continuation (sentence B).
The only task-specific parameters introduced is a vector whose dot product with the [CLS] token
representation C denotes a score for each choice which is normalized with a softmax layer"
(`heads.BertForMultipleChoice`); 3 epochs, learning rate 2e-5, batch size 16. Sentence A is
`sent1`, sentence B is `sent2` (the start of the next sentence) followed by the ending; the
longer side is truncated first, as for GLUE pairs. The metric is accuracy.

Input: the official csv files, as https://github.com/rowanz/swagaf/tree/master/data has them:
`train.csv` and `val.csv` (the dev set), header
`,video-id,fold-ind,startphrase,sent1,sent2,gold-source,ending0,ending1,ending2,ending3,label`
(the first column is a row index); `test.csv` has no label and is not read. `--download` fetches
the two files from there.

Output (besides the engine's `model/` and `metrics.json`): `dev_predictions.csv`, one row per
dev example: `id,label,prediction,score0..score3`.
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from bert_core import storage
from bert_core.errors import InputError, NotFound, utf8_errors
from bert_core.finetune.engine import (
    Epoch,
    FinetuneConfig,
    FinetuneTask,
    majority,
    pad,
    padding_mask,
    predict_batches,
)
from bert_core.finetune.engine import sample as sample_examples
from bert_core.finetune.tasks.glue import truncate_pair_from_end
from bert_core.metrics import percent

TASK = "swag"
OFFICIAL_URL = "https://raw.githubusercontent.com/rowanz/swagaf/master/data/"
SPLIT_FILES = {"train": "train.csv", "dev": "val.csv"}
NUM_CHOICES = 4
ENDINGS = tuple(f"ending{i}" for i in range(NUM_CHOICES))
COLUMNS = ("sent1", "sent2", *ENDINGS)


@dataclass
class SwagConfig(FinetuneConfig):
    """The paper's SWAG settings (section 4.4): 3 epochs, lr 2e-5, batch 16."""

    batch_size: int = 16
    eval_batch_size: int = 32  # examples: x 4 sequences per example


@dataclass
class SwagExample:
    id: str
    context: str  # sent1: sentence A
    start: str  # sent2: the start of the next sentence, before each ending
    endings: tuple[str, ...]
    label: int | None


def read_swag(path: str | Path, labelled: bool = True) -> list[SwagExample]:
    """Examples of an official SWAG csv, checked (columns, labels 0..3, no empty text)."""
    path = Path(path)
    with utf8_errors(path), open(path, encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        need = COLUMNS + (("label",) if labelled else ())
        missing = [c for c in need if c not in (reader.fieldnames or [])]
        if missing:
            raise InputError(path, f"not a SWAG csv: no column {missing} (header {need})", 1)
        examples = []
        for row in reader:
            n = reader.line_num
            if any(row[c] is None for c in need):
                raise InputError(path, f"expected {len(reader.fieldnames)} columns", n)
            if not row["sent1"].strip() or not all(row[e].strip() for e in ENDINGS):
                raise InputError(path, "empty sent1 or ending", n)
            label = None
            if labelled:
                if row["label"].strip() not in {str(i) for i in range(NUM_CHOICES)}:
                    raise InputError(path, f"label {row['label']!r} is not 0..3", n)
                label = int(row["label"])
            qid = row.get("") or f"{row.get('video-id', '')}-{row.get('fold-ind', n)}"
            endings = tuple(row[e] for e in ENDINGS)
            examples.append(SwagExample(qid, row["sent1"], row["sent2"], endings, label))
    if not examples:
        raise InputError(path, "no examples")
    return examples


def download(dest: str | Path, base_url: str = OFFICIAL_URL) -> Path:
    """Fetch train.csv and val.csv into `dest`; each is parsed before it is kept, so a truncated
    or wrong download leaves nothing behind."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for name in SPLIT_FILES.values():
        storage.download(base_url.rstrip("/") + "/" + name, dest / name, read_swag)
    return dest


@dataclass
class Choices:
    """Per example, NUM_CHOICES unpadded `[CLS] A [SEP] B [SEP]` sequences, and the answer."""

    input_ids: list[list[np.ndarray]]
    token_type_ids: list[list[np.ndarray]]
    labels: np.ndarray

    def __len__(self) -> int:
        return len(self.input_ids)


def featurize(examples: Sequence[SwagExample], tokenizer, max_seq_length: int) -> Choices:
    """Sentence A = the context, sentence B = the next sentence's start + one ending, the longer
    truncated first to fit `max_seq_length`; segment 0 up to the first [SEP], then 1."""
    cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    contexts = tokenizer.encode_batch([e.context for e in examples], add_special_tokens=False)
    texts = [f"{e.start} {end}".strip() for e in examples for end in e.endings]
    continuations = iter(tokenizer.encode_batch(texts, add_special_tokens=False))
    out = Choices([], [], np.asarray([e.label or 0 for e in examples], dtype=np.int64))
    for a in contexts:
        ids, types = [], []
        for _ in range(NUM_CHOICES):
            a_ids, b_ids = list(a.ids), list(next(continuations).ids)
            truncate_pair_from_end(a_ids, b_ids, max_seq_length - 3)
            ids.append(np.asarray([cls, *a_ids, sep, *b_ids, sep], dtype=np.int64))
            types.append(
                np.r_[np.zeros(len(a_ids) + 2, np.int64), np.ones(len(b_ids) + 1, np.int64)]
            )
        out.input_ids.append(ids)
        out.token_type_ids.append(types)
    return out


def collate(f: Choices, index: Sequence[int], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """[B, NUM_CHOICES, L] batch, L the longest sequence of any choice in it."""
    ids = [x for i in index for x in f.input_ids[i]]
    types = [x for i in index for x in f.token_type_ids[i]]
    rows, shape = range(len(ids)), (len(index), NUM_CHOICES, -1)
    return {
        "input_ids": pad(ids, rows, pad_id).view(shape),
        "token_type_ids": pad(types, rows).view(shape),
        "attention_mask": padding_mask(ids, rows).view(shape),
        "labels": torch.from_numpy(f.labels[list(index)]),
    }


def predict(model, f: Choices, device, batch_size: int) -> np.ndarray:
    """[N, NUM_CHOICES] scores, in input order."""
    out = np.zeros((len(f), NUM_CHOICES), dtype=np.float32)
    lengths = [max(len(x) for x in choices) for choices in f.input_ids]
    for index, o in predict_batches(model, lengths, lambda i: collate(f, i), device, batch_size):
        out[index] = o.logits.float().cpu().numpy()
    return out


class SwagFinetune(FinetuneTask):
    """SWAG for the engine: four sequences per example, one score each, accuracy."""

    config_class = SwagConfig
    model_class = "BertForMultipleChoice"
    replace_mismatched_head = True  # e.g. a GLUE classifier (2 outputs) in the checkpoint
    download_help = OFFICIAL_URL
    score_metric = "accuracy"

    def download(self, data_dir: Path) -> None:
        if not all((Path(data_dir) / n).is_file() for n in SPLIT_FILES.values()):
            download(data_dir)

    def prepare(self, data_dir: Path, tokenizer, cfg) -> dict:
        self.files = {s: Path(data_dir) / n for s, n in SPLIT_FILES.items()}
        for split, path in self.files.items():
            if not path.is_file():
                raise NotFound(f"{data_dir}: no {path.name} (SWAG's {split} file)")
        train = sample_examples(read_swag(self.files["train"]), cfg.max_train_examples, cfg.seed)
        self.dev_examples = sample_examples(
            read_swag(self.files["dev"]), cfg.max_eval_examples, cfg.seed
        )
        self.train = featurize(train, tokenizer, cfg.max_seq_length)
        self.dev = featurize(self.dev_examples, tokenizer, cfg.max_seq_length)
        self.num_train = self.num_train_examples = len(self.train)
        return {"num_train_examples": len(self.train)}

    def train_batch(self, index):
        return collate(self.train, index)

    def evaluate(self, model, device, cfg):
        scores = predict(model, self.dev, device, cfg.eval_batch_size)
        accuracy = float((scores.argmax(-1) == self.dev.labels).mean())
        return {"accuracy": accuracy}, percent("accuracy", accuracy), scores

    def baseline(self) -> tuple[float, str]:
        label = majority(self.train.labels)
        share = float((self.dev.labels == label).mean())
        return percent("accuracy", share), f"always ending {label} (the most frequent in training)"

    def summary(self, best: Epoch) -> dict:
        return {
            "num_train_examples": self.num_train_examples,
            "num_dev_examples": len(self.dev),
            "files": {k: str(v) for k, v in self.files.items()},
        }

    def write_outputs(self, out: Path, model, predictions, device, cfg) -> None:
        with open(out / "dev_predictions.csv", "w", encoding="utf-8", newline="") as f:
            w = csv.writer(f)
            w.writerow(["id", "label", "prediction", *(f"score{i}" for i in range(NUM_CHOICES))])
            for ex, scores in zip(self.dev_examples, predictions, strict=True):
                row = [ex.id, ex.label, int(scores.argmax())]
                w.writerow(row + [f"{s:.6g}" for s in scores])
