"""`bert finetune --task conll2003`: named-entity recognition, as in section 4.3 of the paper.

The recipe is the paper's: a linear layer on every token's final hidden state; each word is split
into WordPiece tokens and only its first sub-token carries the label (the others are ignored in
the loss and at prediction), no CRF. Sentences longer than `max_seq_length` are split at word
boundaries into consecutive windows, so every word is predicted exactly once: never silently
truncated. Scores are entity-level precision, recall and F1 per type and overall with `seqeval`
in strict IOB2 mode (an entity counts only if its type and both boundaries are right), the
CoNLL-2003 shared task's metric and the one the paper reports.

Input: the task folder holds the original CoNLL-2003 files (`train.txt`/`valid.txt`, or the
official `eng.train`/`eng.testa`): one token a line with four space-separated columns
`token POS chunk NER`, a blank line after each sentence, `-DOCSTART-` lines between documents.
IOB1 (the original files) and IOB2 are both accepted; tags are normalised to IOB2.

Output (atomic: all or nothing): `model/` (HF layout, label names in config.json),
`metrics.json`, and `dev_predictions.txt`: the dev set back in CoNLL format,
`token POS chunk gold predicted` (conlleval's input).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from bert_core.errors import InputError
from bert_core.finetune import FinetuneTask, pad, padding_mask, predict_batches, sample

TASK = "conll2003"
ENTITY_TYPES = ("PER", "ORG", "LOC", "MISC")
LABELS = ("O",) + tuple(f"{p}-{t}" for t in ENTITY_TYPES for p in "BI")
DOCSTART = "-DOCSTART-"
# (train, dev) file names: the commonly distributed copies, then the original shared-task ones
SPLIT_FILES = {"train": ("train.txt", "eng.train"), "dev": ("valid.txt", "dev.txt", "eng.testa")}
# the copy the Hugging Face `conll2003` dataset used (train.txt, valid.txt, test.txt; IOB2)
CONLL_URL = "https://data.deepai.org/conll2003.zip"
_TAG = re.compile(r"^(?:O|[BI]-([A-Z]+))$")


@dataclass
class Sentence:
    words: list[str]
    pos: list[str]
    chunk: list[str]
    tags: list[str]  # IOB2
    line: int  # first line in the file, for messages


# ---------------------------------------------------------------------------------------------
# Reading


def iob1_to_iob2(tags: Sequence[str]) -> list[str]:
    """IOB1 marks B- only between two adjacent entities of one type; IOB2 starts every entity
    with B-. An I-X that follows O or another type starts an entity. IOB2 input is unchanged."""
    out: list[str] = []
    for i, tag in enumerate(tags):
        if tag.startswith("I-"):
            prev = out[i - 1] if i else "O"
            if prev == "O" or prev[2:] != tag[2:]:
                tag = "B-" + tag[2:]
        out.append(tag)
    return out


def read_conll(path: str | Path) -> list[Sentence]:
    """Sentences of a CoNLL-2003 file, tags checked against the four entity types."""
    path = Path(path)
    sentences: list[Sentence] = []
    rows: list[list[str]] = []
    first = 0

    def flush() -> None:
        if rows:
            cols = list(zip(*rows, strict=True))
            tags = iob1_to_iob2(cols[3])
            sentences.append(Sentence(list(cols[0]), list(cols[1]), list(cols[2]), tags, first))
            rows.clear()

    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            parts = line.split()
            if not parts:
                flush()
                continue
            if parts[0] == DOCSTART:
                flush()
                continue
            if len(parts) != 4:
                raise InputError(
                    path, f"expected 4 columns 'token POS chunk NER', got {len(parts)}", line=n
                )
            m = _TAG.match(parts[3])
            if m is None or (m.group(1) is not None and m.group(1) not in ENTITY_TYPES):
                raise InputError(
                    path, f"unknown NER tag {parts[3]!r} (expected O, B-/I- + {ENTITY_TYPES})", n
                )
            if not rows:
                first = n
            rows.append(parts)
    flush()
    if not sentences:
        raise InputError(path, "no sentences")
    return sentences


def find_split(data_dir: str | Path, split: str) -> Path:
    data_dir = Path(data_dir)
    for name in SPLIT_FILES[split]:
        if (data_dir / name).is_file():
            return data_dir / name
    raise FileNotFoundError(f"{data_dir}: no {split} file (looked for {SPLIT_FILES[split]})")


def download(dest: str | Path, url: str = CONLL_URL) -> Path:
    """Fetch train.txt/valid.txt into `dest` from a .zip or a folder URL. Each file is parsed
    before it is kept, so a truncated or wrong download leaves nothing behind."""
    import io
    import urllib.request
    import zipfile

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    names = ("train.txt", "valid.txt")
    if url.endswith(".zip"):
        with urllib.request.urlopen(url, timeout=60) as r:
            archive = zipfile.ZipFile(io.BytesIO(r.read()))
        members = {Path(m).name: m for m in archive.namelist()}
        missing = [n for n in names if n not in members]
        if missing:
            raise InputError(url, f"archive has no {missing}")
        fetch = lambda n: archive.read(members[n])  # noqa: E731
    else:

        def fetch(n: str) -> bytes:
            with urllib.request.urlopen(url.rstrip("/") + "/" + n, timeout=60) as r:
                return r.read()

    for name in names:
        part = dest / f".{name}.part"
        try:
            part.write_bytes(fetch(name))
            read_conll(part)
            part.replace(dest / name)
        finally:
            part.unlink(missing_ok=True)
    return dest


# ---------------------------------------------------------------------------------------------
# Features: windows of WordPiece tokens, the label on each word's first sub-token


@dataclass
class Windows:
    """Unpadded `[CLS] ... [SEP]` windows; labels -100 except at each word's first sub-token."""

    input_ids: list[np.ndarray]
    labels: list[np.ndarray]
    first: list[np.ndarray]  # positions of the words' first sub-tokens in the window
    words: list[np.ndarray]  # (sentence, word) of each of those positions, shape [n, 2]

    def __len__(self) -> int:
        return len(self.input_ids)


def featurize(sentences: Sequence[Sentence], tokenizer, max_seq_length: int) -> Windows:
    """Split words into WordPieces and sentences into windows of at most max_seq_length."""
    cls_id, sep_id, unk_id = (tokenizer.token_to_id(t) for t in ("[CLS]", "[SEP]", "[UNK]"))
    capacity = max_seq_length - 2
    encs = tokenizer.encode_batch(
        [s.words for s in sentences], is_pretokenized=True, add_special_tokens=False
    )
    out = Windows([], [], [], [])

    def emit(si: int, window: list[tuple[int, list[int]]]) -> None:
        ids, labels, first, words = [cls_id], [-100], [], []
        for wi, p in window:
            first.append(len(ids))
            words.append((si, wi))
            labels += [LABELS.index(sentences[si].tags[wi])] + [-100] * (len(p) - 1)
            ids += p
        out.input_ids.append(np.asarray(ids + [sep_id], dtype=np.int64))
        out.labels.append(np.asarray(labels + [-100], dtype=np.int64))
        out.first.append(np.asarray(first, dtype=np.int64))
        out.words.append(np.asarray(words, dtype=np.int64).reshape(-1, 2))

    for si, (sent, enc) in enumerate(zip(sentences, encs, strict=True)):
        pieces: list[list[int]] = [[] for _ in sent.words]
        for tid, wid in zip(enc.ids, enc.word_ids, strict=True):
            if wid is not None:
                pieces[wid].append(tid)
        window: list[tuple[int, list[int]]] = []
        used = 0
        for wi, p in enumerate(pieces):
            p = (p or [unk_id])[:capacity]  # a word the normaliser empties is still predicted
            if used + len(p) > capacity:
                emit(si, window)
                window, used = [], 0
            window.append((wi, p))
            used += len(p)
        emit(si, window)
    return out


def collate(windows: Windows, index: Sequence[int], pad_id: int = 0) -> dict[str, torch.Tensor]:
    ids = pad(windows.input_ids, index, pad_id)
    return {
        "input_ids": ids,
        "token_type_ids": torch.zeros_like(ids),
        "attention_mask": padding_mask(windows.input_ids, index),
        "labels": pad(windows.labels, index, -100),
    }


def predict(
    model, windows: Windows, sentences: Sequence[Sentence], device, batch_size: int
) -> list[list[str]]:
    """The predicted IOB2 tag of every word (argmax at its first sub-token)."""
    pred = [["O"] * len(s.words) for s in sentences]
    lengths = [len(x) for x in windows.input_ids]
    batches = predict_batches(model, lengths, lambda i: collate(windows, i), device, batch_size)
    for index, outputs in batches:
        best = outputs.logits.argmax(-1).cpu().numpy()
        for row, i in enumerate(index):
            for pos, (si, wi) in zip(windows.first[i], windows.words[i], strict=True):
                pred[si][wi] = LABELS[best[row, pos]]
    return pred


# ---------------------------------------------------------------------------------------------
# Metrics


def entity_metrics(gold: Sequence[Sequence[str]], pred: Sequence[Sequence[str]]) -> dict:
    """Entity-level P/R/F1 (seqeval, strict IOB2), overall (micro) and per type, plus the
    word-level tag accuracy."""
    from seqeval.metrics import accuracy_score, classification_report
    from seqeval.scheme import IOB2

    gold, pred = [list(s) for s in gold], [list(s) for s in pred]
    report = classification_report(
        gold, pred, mode="strict", scheme=IOB2, output_dict=True, zero_division=0
    )
    micro = report["micro avg"]
    return {
        "precision": float(micro["precision"]),
        "recall": float(micro["recall"]),
        "f1": float(micro["f1-score"]),
        "accuracy": float(accuracy_score(gold, pred)),
        "per_type": {
            t: {
                "precision": float(r["precision"]),
                "recall": float(r["recall"]),
                "f1": float(r["f1-score"]),
                "support": int(r["support"]),
            }
            for t, r in report.items()
            if t in ENTITY_TYPES
        },
    }


def write_conll(path: Path, sentences: Sequence[Sentence], pred: Sequence[Sequence[str]]) -> None:
    """`token POS chunk gold predicted`, a blank line after each sentence (conlleval's input)."""
    with open(path, "w", encoding="utf-8") as f:
        for s, p in zip(sentences, pred, strict=True):
            for row in zip(s.words, s.pos, s.chunk, s.tags, p, strict=True):
                f.write(" ".join(row) + "\n")
            f.write("\n")


# ---------------------------------------------------------------------------------------------
# The task


class NerFinetune(FinetuneTask):
    """CoNLL-2003 for the engine: windows of sentences, a tag per word, seqeval's entity F1."""

    model_class = "BertForTokenClassification"
    download_help = CONLL_URL

    def __init__(self, name: str = TASK):
        super().__init__(name)
        self.labels, self.num_labels = LABELS, len(LABELS)

    def download(self, data_dir: Path) -> None:
        if not (Path(data_dir) / "train.txt").is_file():
            download(data_dir)

    def prepare(self, data_dir: Path, tokenizer, cfg) -> dict:
        self.files = {"train": find_split(data_dir, "train"), "dev": find_split(data_dir, "dev")}
        train = sample(read_conll(self.files["train"]), cfg.max_train_examples, cfg.seed)
        self.dev_sentences = sample(read_conll(self.files["dev"]), cfg.max_eval_examples, cfg.seed)
        tokenizer.no_truncation()  # windows, not truncation
        self.train = featurize(train, tokenizer, cfg.max_seq_length)
        self.dev = featurize(self.dev_sentences, tokenizer, cfg.max_seq_length)
        self.num_train, self.num_train_examples = len(self.train), len(train)
        return {"num_train_sentences": len(train), "num_train_windows": len(self.train)}

    def train_batch(self, index):
        return collate(self.train, index)

    def evaluate(self, model, device, cfg):
        pred = predict(model, self.dev, self.dev_sentences, device, cfg.eval_batch_size)
        metrics = entity_metrics([s.tags for s in self.dev_sentences], pred)
        return metrics, metrics["f1"], pred

    def summary(self, best: dict) -> dict:
        return {
            "per_type": best["metrics"]["per_type"],
            "num_train_sentences": self.num_train_examples,
            "num_dev_sentences": len(self.dev_sentences),
            "num_train_windows": self.num_train,
            "files": {k: str(v) for k, v in self.files.items()},
        }

    def write_outputs(self, out: Path, model, predictions, device, cfg) -> None:
        write_conll(out / "dev_predictions.txt", self.dev_sentences, predictions)
