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

import argparse
import json
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch

from bert_core.errors import InputError, atomic_dir
from bert_core.finetune import pad, padding_mask

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


@torch.inference_mode()
def predict(
    model, windows: Windows, sentences: Sequence[Sentence], device, batch_size: int
) -> list[list[str]]:
    """The predicted IOB2 tag of every word (argmax at its first sub-token)."""
    from bert_core.finetune import _autocast

    model.eval()
    pred = [["O"] * len(s.words) for s in sentences]
    order = np.argsort([len(x) for x in windows.input_ids], kind="stable")
    for start in range(0, len(order), batch_size):
        index = order[start : start + batch_size]
        batch = collate(windows, index)
        batch.pop("labels")
        with _autocast(device):
            logits = model(**{k: v.to(device) for k, v in batch.items()}).logits
        best = logits.argmax(-1).cpu().numpy()
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


def save_model(model, model_dir: Path, task: str, labels: Sequence[str] | None) -> None:
    """save_pretrained, then label names and the task in config.json (read by transformers)."""
    model.save_pretrained(model_dir)
    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    if labels is not None:
        config["id2label"] = dict(enumerate(labels))
        config["label2id"] = {name: i for i, name in enumerate(labels)}
    config["finetuning_task"] = task
    path.write_text(json.dumps(config, indent=2) + "\n")


def config_from_args(args: argparse.Namespace, cls):
    """The config dataclass from finetune's parser: option names are the field names."""
    cfg = cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})
    if cfg.epochs < 1 or cfg.batch_size < 1 or cfg.max_seq_length < 8:
        raise ValueError("--epochs and --batch-size must be >= 1, --max-seq-length >= 8")
    return cfg


def result_record(task: str, best: dict, history: list[dict], cfg, **extra) -> dict:
    """metrics.json's content, in the same shape as GLUE fine-tuning's."""
    return {
        "task": task,
        "metrics": {k: v for k, v in best["metrics"].items() if isinstance(v, int | float)},
        "score": best["score"],
        "best_epoch": best["epoch"],
        "epochs": history,
        "config": asdict(cfg),
        **extra,
    }


# ---------------------------------------------------------------------------------------------
# The step


def finetune(data_dir: str | Path, model_dir: str | Path, output: str | Path, cfg) -> dict:
    """Fine-tune on CoNLL-2003, keep the best epoch by dev F1, write the output folder."""
    from bert_core.finetune import fit, load_tokenizer, resolve_device, sample
    from bert_core.model import BertForTokenClassification
    from bert_core.tracking import start_run

    # everything that can be wrong with the input fails here, before any training
    train_path, dev_path = find_split(data_dir, "train"), find_split(data_dir, "dev")
    train_sents = sample(read_conll(train_path), cfg.max_train_examples, cfg.seed)
    dev_sents = sample(read_conll(dev_path), cfg.max_eval_examples, cfg.seed)
    tokenizer = load_tokenizer(model_dir)
    tokenizer.no_truncation()  # windows, not truncation
    train = featurize(train_sents, tokenizer, cfg.max_seq_length)
    dev = featurize(dev_sents, tokenizer, cfg.max_seq_length)

    device = resolve_device(cfg.device)
    torch.manual_seed(cfg.seed)
    model = BertForTokenClassification.from_pretrained(model_dir, num_labels=len(LABELS))
    if cfg.max_seq_length > model.config.max_position_embeddings:
        raise ValueError(
            f"max_seq_length {cfg.max_seq_length} exceeds the model's max_position_embeddings "
            f"{model.config.max_position_embeddings}"
        )
    model.to(device)

    def evaluate(m):
        pred = predict(m, dev, dev_sents, device, cfg.eval_batch_size)
        metrics = entity_metrics([s.tags for s in dev_sents], pred)
        return metrics, metrics["f1"], pred

    params = {"task": TASK, "data": str(data_dir), "model": str(model_dir), **asdict(cfg)}
    params |= {"num_train_sentences": len(train_sents), "num_train_windows": len(train)}
    with start_run(f"finetune-{TASK}", params | {"device": str(device)}), atomic_dir(output) as tmp:
        import mlflow

        best, history, train_seconds = fit(
            model, len(train), lambda i: collate(train, i), evaluate, cfg, device,
            f"finetune {TASK}", mlflow.log_metrics,
        )  # fmt: skip
        result = result_record(
            TASK, best, history, cfg,
            per_type=best["metrics"]["per_type"],
            num_train_sentences=len(train_sents),
            num_dev_sentences=len(dev_sents),
            num_train_windows=len(train),
            train_seconds=train_seconds,
            train_examples_per_second=len(train_sents) * cfg.epochs / train_seconds,
            files={"train": str(train_path), "dev": str(dev_path)},
            model=str(model_dir),
            device=str(device),
        )  # fmt: skip
        save_model(model, tmp / "model", TASK, LABELS)
        write_conll(tmp / "dev_predictions.txt", dev_sents, best["preds"])
        (tmp / "metrics.json").write_text(json.dumps(result, indent=2) + "\n")
        mlflow.log_metrics({"best_epoch": best["epoch"], "best_dev_score": best["score"]})
        mlflow.log_metrics({f"best_dev_{k}": v for k, v in result["metrics"].items()})
        mlflow.log_artifact(str(tmp / "metrics.json"))
    return result


def main(argv: list[str] | None = None) -> int:
    """`bert finetune --task conll2003 ...`: finetune's options (defaults: the paper's)."""
    from bert_core.finetune import FinetuneConfig, build_parser

    parser = build_parser()
    parser.add_argument(
        "--download", action="store_true",
        help=f"first fetch train.txt/valid.txt into --data when missing ({CONLL_URL})",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.task.lower() != TASK:
        raise ValueError(f"bert_core.ner handles --task {TASK}, not {args.task!r}")
    cfg = config_from_args(args, FinetuneConfig)
    if args.download and not (Path(args.data) / "train.txt").is_file():
        download(args.data)
    result = finetune(args.data, args.model, args.output, cfg)
    print(json.dumps({"task": TASK, "metrics": result["metrics"],
                      "best_epoch": result["best_epoch"], "output": str(args.output)}))  # fmt: skip
    return 0
