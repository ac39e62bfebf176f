"""The nine GLUE tasks: their original TSV layouts, label sets, metrics and the GLUE score.

Why a registry: every task ships in its own TSV layout (header or not, text and label columns in
different places, MNLI with two dev files), and GLUE scores each with its own official metric.
Keeping all of that as data in one table (like `run_classifier.py`'s processors, but declarative)
lets `bert finetune` and `bert evaluate` stay task-agnostic.

Files are read with quoting disabled (`csv.QUOTE_NONE`): GLUE sentences contain stray double
quotes that a quoting reader would join across tabs and lines. MRPC starts with a UTF-8 BOM, so
every file is read as `utf-8-sig`.

GLUE score (the leaderboard's rule, Wang et al. 2018, section 4): each task gets one score, the
unweighted mean of its metrics when it has two (MRPC F1/accuracy, QQP F1/accuracy, STS-B
Pearson/Spearman, MNLI matched/mismatched accuracy); the GLUE score is the unweighted mean of the
nine task scores, in percent. The diagnostic set (AX) is not part of it. With BERT-Large's test
results from the paper this gives the leaderboard's 80.5.
"""

from __future__ import annotations

import csv
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bert_core.errors import BadValue, InputError, NotFound, utf8_errors

csv.field_size_limit(sys.maxsize)


@dataclass(frozen=True)
class Layout:
    """Where a split's fields live: column indices (negative counts from the end), and the
    header row of GLUE's original file (empty: the file has none). The header is checked on
    the columns read, so a file of another task or layout is an error, not a run that trains
    on the wrong column and reports a meaningless score."""

    header: tuple[str, ...]
    text_a: int
    text_b: int | None = None
    label: int | None = None  # None: unlabelled (test)
    index: int | None = None  # the id column GLUE's submission format refers to (test)


@dataclass(frozen=True)
class Split:
    """One file of a task: `name` keys its metrics when a task has several dev files (MNLI)."""

    name: str
    file: str
    layout: Layout
    submission: str | None = None  # GLUE submission file name (test splits)


@dataclass(frozen=True)
class GlueTask:
    name: str
    labels: tuple[str, ...]  # the data's label values in id order; () for regression (STS-B)
    metrics: tuple[str, ...]  # official metrics, computed on every dev split
    train: Split
    dev: tuple[Split, ...]
    test: tuple[Split, ...]
    paper_metric: str  # the one number BERT's Table 1 shows for the task
    names: tuple[str, ...] = ()  # what each label means, in id order; () when the values say it

    @property
    def is_regression(self) -> bool:
        return not self.labels

    @property
    def label_names(self) -> tuple[str, ...]:
        """The labels as config.json's `id2label` and a model's answers name them."""
        return self.names or self.labels

    @property
    def num_labels(self) -> int:
        return len(self.labels) or 1

    def metric_names(self) -> list[str]:
        """Keys of the task's metrics: `accuracy`, or `matched_accuracy` with several dev files."""
        if len(self.dev) == 1:
            return list(self.metrics)
        return [f"{s.name}_{m}" for s in self.dev for m in self.metrics]


@dataclass(frozen=True)
class Example:
    guid: str  # "<split>-<line>": where the example came from
    text_a: str
    text_b: str | None
    label: str | None
    index: str | None = None


BINARY = ("0", "1")
NLI2 = ("entailment", "not_entailment")
MNLI_LABELS = ("contradiction", "entailment", "neutral")
# What 0 and 1 mean (GLUE's papers and files; the names of the `glue` set on the Hugging Face
# Hub): the data keep their values, a model's config.json and answers say these names.
BINARY_NAMES = {
    "CoLA": ("unacceptable", "acceptable"),
    "SST-2": ("negative", "positive"),
    "MRPC": ("not_equivalent", "equivalent"),
    "QQP": ("not_duplicate", "duplicate"),
    "WNLI": ("not_entailment", "entailment"),  # 1: sentence 2 follows from sentence 1
}


def _single(name: str, train: Layout, test: Layout) -> tuple[Split, tuple, tuple]:
    return (
        Split("train", "train.tsv", train),
        (Split("dev", "dev.tsv", train),),
        (Split("test", "test.tsv", test, submission=f"{name}.tsv"),),
    )


def _task(name: str, labels, metrics, train: Layout, test: Layout, paper_metric: str) -> GlueTask:
    """A task of one train, dev and test file each; a binary one's label names from BINARY_NAMES."""
    tr, dev, te = _single(name, train, test)
    names = BINARY_NAMES.get(name, ())
    return GlueTask(name, labels, metrics, tr, dev, te, paper_metric, names)


def _pair_indexed(a: str, b: str) -> tuple[Layout, Layout]:
    """QNLI, RTE, WNLI: `index A B label`; test `index A B`."""
    return Layout(("index", a, b, "label"), 1, 2, label=3), Layout(("index", a, b), 1, 2, index=0)


_MRPC = ("Quality", "#1 ID", "#2 ID", "#1 String", "#2 String")
_STSB = "index genre filename year old_index source1 source2 sentence1 sentence2 score".split()
_QQP = ("id", "qid1", "qid2", "question1", "question2", "is_duplicate")
_MNLI = tuple(
    "index promptID pairID genre sentence1_binary_parse sentence2_binary_parse sentence1_parse "
    "sentence2_parse sentence1 sentence2 label1 gold_label".split()
)  # dev files have label1..label5 before gold_label: the columns read are the same
_INDEX_SENTENCE = Layout(("index", "sentence"), text_a=1, index=0)

TASKS: dict[str, GlueTask] = {
    t.name: t
    for t in [
        # CoLA train/dev: no header, `source label mark sentence`; test: `index sentence`.
        _task(
            "CoLA",
            BINARY,
            ("mcc",),
            Layout((), text_a=3, label=1),
            _INDEX_SENTENCE,
            "mcc",
        ),
        # SST-2: `sentence label`; test `index sentence`.
        _task(
            "SST-2",
            BINARY,
            ("accuracy",),
            Layout(("sentence", "label"), text_a=0, label=1),
            _INDEX_SENTENCE,
            "accuracy",
        ),
        # MRPC: `Quality #1 ID #2 ID #1 String #2 String`; test `index #1 ID #2 ID #1 .. #2 ..`.
        _task(
            "MRPC",
            BINARY,
            ("f1", "accuracy"),
            Layout(_MRPC, text_a=3, text_b=4, label=0),
            Layout(("index", *_MRPC[1:]), text_a=3, text_b=4, index=0),
            "f1",
        ),
        # STS-B: `index genre filename year old_index source1 source2 sentence1 sentence2 score`.
        _task(
            "STS-B",
            (),
            ("pearson", "spearman"),
            Layout(tuple(_STSB), text_a=7, text_b=8, label=9),
            Layout(tuple(_STSB[:9]), text_a=7, text_b=8, index=0),
            "spearman",
        ),
        # QQP: `id qid1 qid2 question1 question2 is_duplicate`; test `id question1 question2`.
        _task(
            "QQP",
            BINARY,
            ("f1", "accuracy"),
            Layout(_QQP, text_a=3, text_b=4, label=5),
            Layout(("id", "question1", "question2"), text_a=1, text_b=2, index=0),
            "f1",
        ),
        # MNLI: sentence1/sentence2 at 8/9, gold_label last (train 12 columns, dev 16).
        GlueTask(
            "MNLI",
            MNLI_LABELS,
            ("accuracy",),
            Split("train", "train.tsv", Layout(_MNLI, text_a=8, text_b=9, label=-1)),
            (
                Split("matched", "dev_matched.tsv", Layout(_MNLI, 8, 9, label=-1)),
                Split("mismatched", "dev_mismatched.tsv", Layout(_MNLI, 8, 9, label=-1)),
            ),
            (
                Split(
                    "test_matched", "test_matched.tsv", Layout(_MNLI, 8, 9, index=0), "MNLI-m.tsv"
                ),
                Split(
                    "test_mismatched",
                    "test_mismatched.tsv",
                    Layout(_MNLI, 8, 9, index=0),
                    "MNLI-mm.tsv",
                ),
            ),
            "accuracy",
        ),
        # QNLI: `index question sentence label`; RTE, WNLI: `index sentence1 sentence2 label`.
        _task("QNLI", NLI2, ("accuracy",), *_pair_indexed("question", "sentence"), "accuracy"),
        _task("RTE", NLI2, ("accuracy",), *_pair_indexed("sentence1", "sentence2"), "accuracy"),
        _task("WNLI", BINARY, ("accuracy",), *_pair_indexed("sentence1", "sentence2"), "accuracy"),
    ]
}


def get_task(name: str) -> GlueTask:
    """Look a task up by name, forgiving case and the dash (`sst2`, `STS-B`, `mnli`)."""
    key = name.replace("-", "").replace("_", "").lower()
    for task in TASKS.values():
        if task.name.replace("-", "").lower() == key:
            return task
    raise BadValue(f"unknown GLUE task {name!r}; known tasks: {', '.join(TASKS)}")


# ---------------------------------------------------------------------------------------------
# Reading


def _field(row: list[str], col: int) -> str:
    return row[col].strip()


def read_split(task: GlueTask, split: Split, path: str | Path) -> list[Example]:
    """Read one GLUE TSV in the task's original layout, checking every row.

    A header that is not the task's, a row with too few columns or a label outside the task's
    set is an `InputError` naming the file and line; so is a file without a single example (an
    empty dev set scores nothing) and one that is not UTF-8.
    """
    path = Path(path)
    lay = split.layout
    cols = [c for c in (lay.text_a, lay.text_b, lay.label, lay.index) if c is not None]
    # A negative column ("last") sits after all the positive ones (MNLI's gold_label).
    need = max(c + 1 for c in cols if c >= 0) + any(c < 0 for c in cols)
    examples: list[Example] = []
    with utf8_errors(path), open(path, encoding="utf-8-sig", newline="") as f:
        reader = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        for row in reader:
            line = reader.line_num
            if lay.header and line == 1:
                _check_header(task, split, row, path)
                continue
            if not row or row == [""]:
                continue  # blank line (e.g. a trailing one)
            if len(row) < need:
                raise InputError(
                    path,
                    f"{task.name}: expected at least {need} tab-separated columns, got {len(row)}",
                    line=line,
                )
            label = None
            if lay.label is not None:
                label = _check_label(task, _field(row, lay.label), path, line)
            examples.append(
                Example(
                    guid=f"{split.name}-{line}",
                    text_a=_field(row, lay.text_a),
                    text_b=_field(row, lay.text_b) if lay.text_b is not None else None,
                    label=label,
                    index=_field(row, lay.index) if lay.index is not None else str(line),
                )
            )
    if not examples:
        raise InputError(path, f"{task.name}: no examples in {split.name} file")
    return examples


def _check_header(task: GlueTask, split: Split, row: list[str], path: Path) -> None:
    """The header row names the columns read as GLUE's original file does (case aside)."""
    lay = split.layout
    for col in (c for c in (lay.text_a, lay.text_b, lay.label, lay.index) if c is not None):
        expected = lay.header[col]
        found = row[col].strip() if -len(row) <= col < len(row) else None
        if found is None or found.lower() != expected.lower():
            where = f"column {col + 1 if col >= 0 else 'last'}"
            raise InputError(
                path,
                f"{task.name}: header {where} is {found!r}, expected {expected!r} (is this "
                f"GLUE's {task.name} {split.name} file?)",
                line=1,
            )


def _check_label(task: GlueTask, label: str, path: Path, line: int) -> str:
    if task.is_regression:
        try:
            value = float(label)
        except ValueError:
            value = math.nan
        if not 0.0 <= value <= 5.0:  # also rejects NaN
            raise InputError(path, f"{task.name}: score {label!r} is not a number in [0, 5]", line)
        return label
    if label not in task.labels:
        raise InputError(
            path, f"{task.name}: label {label!r} not in the task's labels {list(task.labels)}", line
        )
    return label


def read_task(task: GlueTask, data_dir: str | Path, which: str) -> dict[str, list[Example]]:
    """All files of one kind ("train", "dev" or "test") present in `data_dir`, by split name.

    Train and dev files must exist; test files are optional (returns {} when absent).
    """
    data_dir = Path(data_dir)
    splits = {"train": (task.train,), "dev": task.dev, "test": task.test}[which]
    out: dict[str, list[Example]] = {}
    for split in splits:
        path = data_dir / split.file
        if not path.is_file():
            if which == "test":
                continue
            raise NotFound(f"{path}: {task.name} {which} file not found")
        out[split.name] = read_split(task, split, path)
    return out


def label_ids(task: GlueTask, examples: Sequence[Example]) -> np.ndarray:
    """Labels as model targets: class ids (int64) or STS-B scores (float32)."""
    if task.is_regression:
        return np.array([float(e.label) for e in examples], dtype=np.float32)
    return np.array([task.labels.index(e.label) for e in examples], dtype=np.int64)


def prediction_names(task: GlueTask, predictions: np.ndarray) -> list[str]:
    """Predictions as GLUE's submission format writes them: label names, or scores to 3 places."""
    if task.is_regression:
        return [f"{float(p):.3f}" for p in predictions]
    return [task.labels[int(p)] for p in predictions]


# ---------------------------------------------------------------------------------------------
# Metrics


def compute_metrics(task: GlueTask, predictions, labels) -> dict[str, float]:
    """The task's official metrics for one dev split (fractions, not percent). `predictions` and
    `labels` are class ids (or scores for STS-B), as from `label_ids`."""
    from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef

    def correlation(name: str) -> float:  # scipy.stats: over a second to import, STS-B's only
        from scipy import stats

        return 0.0 if constant else getattr(stats, f"{name}r")(y_pred, y_true)[0]

    y_pred, y_true = np.asarray(predictions), np.asarray(labels)
    if y_pred.shape != y_true.shape or y_true.size == 0:
        raise ValueError(f"{task.name}: {y_pred.shape} predictions for {y_true.shape} labels")
    constant = np.ptp(y_pred) == 0 or np.ptp(y_true) == 0
    fns = {
        "accuracy": lambda: accuracy_score(y_true, y_pred),
        "f1": lambda: f1_score(y_true, y_pred, pos_label=1, zero_division=0.0),
        "mcc": lambda: matthews_corrcoef(y_true, y_pred),
        # A constant prediction has no correlation: scipy says NaN, GLUE would count it as 0.
        "pearson": lambda: correlation("pearson"),
        "spearman": lambda: correlation("spearman"),
    }
    return {m: float(fns[m]()) for m in task.metrics}


def task_metrics(task: GlueTask, per_split: dict[str, dict[str, float]]) -> dict[str, float]:
    """Merge per-dev-split metrics into the task's metric names (prefix the split for MNLI)."""
    if len(task.dev) == 1:
        return dict(per_split[task.dev[0].name])
    return {f"{s}_{m}": v for s, ms in per_split.items() for m, v in ms.items()}


def task_score(task: GlueTask, metrics: dict[str, float]) -> float:
    """One number per task, in percent: the mean of its metrics (GLUE's rule for two metrics)."""
    try:
        values = [metrics[name] for name in task.metric_names()]
    except KeyError as e:
        raise BadValue(f"{task.name}: metric {e.args[0]!r} missing from {sorted(metrics)}") from e
    return 100.0 * float(np.mean(values))


def glue_score(scores: dict[str, float]) -> float:
    """The GLUE score: unweighted mean of the task scores (percent) it is given."""
    if not scores:
        raise BadValue("no task scores to average")
    return float(np.mean(list(scores.values())))
