"""`bert finetune --task conll2003`: named-entity recognition, as in section 4.3 of the paper.

The recipe is the paper's: a linear layer on every token's final hidden state; each word is split
into WordPiece tokens and only its first sub-token carries the label (the others are ignored in
the loss and at prediction), no CRF. Sentences longer than `max_seq_length` are split at word
boundaries into consecutive windows, so every word is predicted exactly once: never silently
truncated. The headline scores are entity-level precision, recall and F1 per type and overall by
the CoNLL shared task's own scorer, `conlleval` (`bert_core.finetune.tasks.conlleval`: its
tolerant chunk reading), the metric the paper reports; epochs are chosen by its F1. seqeval's
strict IOB2 mode (an entity counts only if it starts with B- and its type and both boundaries
are right) is the second metric, `strict_precision/recall/f1` and `strict_per_type`.

Input: the task folder holds the original CoNLL-2003 files (`train.txt`/`valid.txt`, or the
official `eng.train`/`eng.testa`): one token a line with four space-separated columns
`token POS chunk NER`, a blank line after each sentence, `-DOCSTART-` lines between documents.
IOB1 (the original files) and IOB2 are both accepted; tags are normalised to IOB2. When the folder
also has the test split (`test.txt` or `eng.testb`), the kept model is scored on it too
(`test_metrics`; never used to choose anything).

Two things from the paper beside the default recipe:
- `--document-context`: "we include the maximal document context provided by the data": each
  window is filled up with the document's neighbouring tokens on both sides (as many left as
  right, the rest to whichever side has more), labels only on the target sentence's words;
- the official `conlleval` score as the headline, seqeval's strict one beside it.

And the feature-based approach of section 5.3 (`--feature-based CHOICE`, the paper's Table 7):
BERT frozen, a two-layer BiLSTM trained on the hidden states CHOICE names
(`bert_core.model.heads.BertFeatureTagger`): `embeddings`, `second-to-last`, `last`,
`weighted-sum-last4`, `concat-last4`, `weighted-sum-all`. Only the tagger learns, so it wants
a far larger learning rate than fine-tuning (docs/experiments.md: 1e-3). Such a model is a
measurement, not registered as the task's model.

Output (atomic: all or nothing): `model/` (HF layout, label names in config.json),
`metrics.json`, and `dev_predictions.txt` (and `test_predictions.txt`): the split back in CoNLL
format, `token POS chunk gold predicted` (conlleval's input).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from bert_core.errors import BadValue
from bert_core.finetune.engine import (
    Epoch,
    FinetuneConfig,
    FinetuneTask,
    option,
    pad,
    padding_mask,
    predict_batches,
    sample,
)
from bert_core.finetune.tasks.conlleval import conlleval
from bert_core.finetune.tasks.ner_data import (  # noqa: F401 (re-exported: the task's data)
    CONLL_URL,
    DOCSTART,
    ENTITY_TYPES,
    LABELS,
    SPLIT_FILES,
    Sentence,
    download,
    find_split,
    iob1_to_iob2,
    read_conll,
    write_conll,
)
from bert_core.metrics import percent
from bert_core.model.heads import FEATURE_LAYERS

TASK = "conll2003"


@dataclass
class NerConfig(FinetuneConfig):
    document_context: bool = option(
        False,
        "fill each window with the document's neighbouring tokens (the paper's maximal "
        "document context); labels stay on the target sentence only",
    )
    feature_based: str = option(
        "none",
        "the feature-based approach (paper section 5.3, Table 7): BERT frozen, a "
        "2-layer BiLSTM trained on these hidden states: embeddings, second-to-last, last, "
        "weighted-sum-last4, concat-last4, weighted-sum-all; none: fine-tuning",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.feature_based not in ("none", *FEATURE_LAYERS):
            raise BadValue(
                f"--feature-based {self.feature_based!r}: none or one of "
                + ", ".join(FEATURE_LAYERS)
            )
        if self.feature_based != "none" and self.top_bilstm:
            raise BadValue(
                "--top-bilstm: the feature-based tagger has its own BiLSTM; "
                "use one of --top-bilstm and --feature-based"
            )


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


def word_pieces(sentences: Sequence[Sentence], tokenizer, capacity: int) -> list[list[list[int]]]:
    """Each word's WordPiece ids; a word the normaliser empties is [UNK] (still predicted), one
    longer than a window is cut to it."""
    unk_id = tokenizer.token_to_id("[UNK]")
    encs = tokenizer.encode_batch(
        [s.words for s in sentences], is_pretokenized=True, add_special_tokens=False
    )
    out = []
    for sent, enc in zip(sentences, encs, strict=True):
        pieces: list[list[int]] = [[] for _ in sent.words]
        for tid, wid in zip(enc.ids, enc.word_ids, strict=True):
            if wid is not None:
                pieces[wid].append(tid)
        out.append([(p or [unk_id])[:capacity] for p in pieces])
    return out


class DocumentContext:
    """Every document of a file as one token stream, for filling windows with context."""

    def __init__(self, documents: Sequence[Sentence], pieces: Sequence[list[list[int]]]):
        streams: dict[int, list[int]] = {}
        self.start: dict[int, tuple[int, np.ndarray]] = {}  # sentence index -> (doc, word starts)
        for sent, words in zip(documents, pieces, strict=True):
            stream = streams.setdefault(sent.doc, [])
            starts = len(stream) + np.cumsum([0] + [len(p) for p in words])
            self.start[sent.index] = (sent.doc, starts)
            stream.extend(t for p in words for t in p)
        self.streams = {d: np.asarray(ids, dtype=np.int64) for d, ids in streams.items()}

    def around(self, sent: Sentence, first_word: int, end_word: int, budget: int):
        """(left, right) context token ids around words [first_word, end_word) of `sent`: up to
        `budget` in all, as many on each side as the other side leaves room for."""
        doc, starts = self.start[sent.index]
        stream = self.streams[doc]
        a, b = int(starts[first_word]), int(starts[end_word])
        left = min(a, budget // 2)
        right = min(len(stream) - b, budget - left)
        left = min(a, budget - right)
        return stream[a - left : a].tolist(), stream[b : b + right].tolist()


def featurize(
    sentences: Sequence[Sentence],
    tokenizer,
    max_seq_length: int,
    documents: Sequence[Sentence] | None = None,
) -> Windows:
    """Split words into WordPieces and sentences into windows of at most max_seq_length.

    With `documents` (every sentence of the file `sentences` were drawn from), each window is
    filled up to max_seq_length with its document's neighbouring tokens (`DocumentContext`),
    which carry no label."""
    cls_id, sep_id = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    capacity = max_seq_length - 2
    context = None
    if documents is None:
        pieces = word_pieces(sentences, tokenizer, capacity)
    else:
        every = word_pieces(documents, tokenizer, capacity)
        context = DocumentContext(documents, every)
        pieces = [every[s.index] for s in sentences]
    out = Windows([], [], [], [])

    def emit(si: int, window: list[int], used: int) -> None:
        left, right = [], []
        if context is not None:
            sent = sentences[si]
            left, right = context.around(sent, window[0], window[-1] + 1, capacity - used)
        ids, labels, first, words = [cls_id, *left], [-100] * (len(left) + 1), [], []
        for wi in window:
            p = pieces[si][wi]
            first.append(len(ids))
            words.append((si, wi))
            labels += [LABELS.index(sentences[si].tags[wi])] + [-100] * (len(p) - 1)
            ids += p
        out.input_ids.append(np.asarray(ids + right + [sep_id], dtype=np.int64))
        out.labels.append(np.asarray(labels + [-100] * (len(right) + 1), dtype=np.int64))
        out.first.append(np.asarray(first, dtype=np.int64))
        out.words.append(np.asarray(words, dtype=np.int64).reshape(-1, 2))

    for si, words in enumerate(pieces):
        window: list[int] = []
        used = 0
        for wi, p in enumerate(words):
            if used + len(p) > capacity:
                emit(si, window, used)
                window, used = [], 0
            window.append(wi)
            used += len(p)
        emit(si, window, used)
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
    """conlleval's entity-level P/R/F1 (the paper's), overall (micro) and `per_type`; seqeval's
    strict IOB2 ones as `strict_*` and `strict_per_type`; the word-level tag accuracy."""
    from seqeval.metrics import accuracy_score, classification_report
    from seqeval.scheme import IOB2

    gold, pred = [list(s) for s in gold], [list(s) for s in pred]
    report = classification_report(
        gold, pred, mode="strict", scheme=IOB2, output_dict=True, zero_division=0
    )
    micro = report["micro avg"]
    official = conlleval(gold, pred)
    return {
        **{k: official[k] for k in ("precision", "recall", "f1")},
        "per_type": official["per_type"],
        "strict_precision": float(micro["precision"]),
        "strict_recall": float(micro["recall"]),
        "strict_f1": float(micro["f1-score"]),
        "accuracy": float(accuracy_score(gold, pred)),
        "strict_per_type": {
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


# ---------------------------------------------------------------------------------------------
# The task


class NerFinetune(FinetuneTask):
    """CoNLL-2003 for the engine: windows of sentences, a tag per word, conlleval's entity F1."""

    config_class = NerConfig
    model_class = "BertForTokenClassification"
    download_help = CONLL_URL
    score_metric = "f1"

    def __init__(self, name: str = TASK):
        super().__init__(name)
        self.labels, self.num_labels = LABELS, len(LABELS)

    def download(self, data_dir: Path) -> None:
        if not (Path(data_dir) / "train.txt").is_file():
            download(data_dir)

    def head(self, cfg: NerConfig) -> tuple[str, dict]:
        """The feature-based approach (section 5.3, `--feature-based`) trains a BiLSTM tagger on
        the frozen encoder's layers: its own class, and the layers it reads in config.json."""
        if cfg.feature_based == "none":
            return super().head(cfg)
        return "BertFeatureTagger", {"feature_layers": cfg.feature_based}

    def prepare(self, data_dir: Path, tokenizer, cfg: NerConfig) -> dict:
        self.files = {s: find_split(data_dir, s, s != "test") for s in SPLIT_FILES}
        tokenizer.no_truncation()  # windows, not truncation
        self.sentences, windows = {}, {}
        for split, path in self.files.items():
            if path is None:
                continue
            every = read_conll(path)
            n = cfg.max_train_examples if split == "train" else cfg.max_eval_examples
            self.sentences[split] = sample(every, n, cfg.seed)
            documents = every if cfg.document_context else None
            windows[split] = featurize(
                self.sentences[split], tokenizer, cfg.max_seq_length, documents
            )
        self.train, self.dev, self.test = windows["train"], windows["dev"], windows.get("test")
        self.dev_sentences = self.sentences["dev"]
        self.num_train, self.num_train_examples = len(self.train), len(self.sentences["train"])
        return {"num_train_sentences": self.num_train_examples, "num_train_windows": self.num_train}

    def train_batch(self, index):
        return collate(self.train, index)

    def evaluate(self, model, device, cfg):
        pred = predict(model, self.dev, self.dev_sentences, device, cfg.eval_batch_size)
        metrics = entity_metrics([s.tags for s in self.dev_sentences], pred)
        return metrics, percent("f1", metrics["f1"]), pred

    def evaluate_test(self, model, device, cfg):
        if self.test is None:
            return None
        sentences = self.sentences["test"]
        self.test_pred = predict(model, self.test, sentences, device, cfg.eval_batch_size)
        self.test_metrics = entity_metrics([s.tags for s in sentences], self.test_pred)
        return self.test_metrics

    def summary(self, best: Epoch) -> dict:
        test = {"test_per_type": self.test_metrics["per_type"]} if self.test else {}
        return {
            "per_type": best.metrics["per_type"],
            "strict_per_type": best.metrics["strict_per_type"],
            **test,
            "num_train_sentences": self.num_train_examples,
            "num_dev_sentences": len(self.dev_sentences),
            **({"num_test_sentences": len(self.sentences["test"])} if self.test else {}),
            "num_train_windows": self.num_train,
            "files": {k: str(v) for k, v in self.files.items() if v},
        }

    def write_outputs(self, out: Path, model, predictions, device, cfg) -> None:
        write_conll(out / "dev_predictions.txt", self.dev_sentences, predictions)
        if self.test is not None:
            write_conll(out / "test_predictions.txt", self.sentences["test"], self.test_pred)
