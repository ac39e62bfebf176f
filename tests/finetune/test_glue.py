"""GLUE registry: every task's reader on real files (or synthetic rows in the original layout),
every metric against hand-computed values, and the leaderboard's GLUE-score rule."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bert_core.errors import InputError
from bert_core.finetune.config import FinetuneConfig
from bert_core.finetune.tasks.glue import Features, GlueFinetune
from bert_core.finetune.tasks.glue_data import (
    NLI2,
    TASKS,
    Example,
    compute_metrics,
    get_task,
    glue_score,
    label_ids,
    prediction_names,
    read_task,
    task_metrics,
    task_score,
)

# (task, split, rows, first text_a, first text_b, first label, label counts) on the shared files.
REAL = [
    ("CoLA", "train", 8551, "our friends wo n't buy this analysis", None, "1", {"1": 6023}),
    ("CoLA", "dev", 516, "somebody just left guess who", None, "1", {"0": 162}),
    ("SST-2", "train", 67349, "hide new secretions from the parental units", None, "0", {}),
    ("SST-2", "dev", 872, "it 's a charming and often affecting journey .", None, "1", {"1": 444}),
    ("MRPC", "train", 3668, "Amrozi accused his brother", "Referring to him", "1", {"0": 1194}),
    ("MRPC", "dev", 408, "He said the foodservice pie", '"The foodservice pie', "1", {"1": 279}),
    ("STS-B", "train", 4249, "A plane is taking off.", "An air plane is taking off.", "5.000", {}),
    ("STS-B", "dev", 1500, "A man is playing the cello.", "A man seated is playing", "4.250", {}),
    ("WNLI", "train", 565, "I stuck a pin through a carrot.", "The carrot had a hole.", "1", {}),
    ("WNLI", "dev", 70, "Jackson was greatly influenced", "Arnold lived two", "1", {"0": 35}),
]


@pytest.mark.parametrize("name,which,n,text_a,text_b,label,counts", REAL)
def test_reader_on_real_files(shared_data, name, which, n, text_a, text_b, label, counts):
    task = get_task(name)
    (examples,) = read_task(task, shared_data / "glue" / name, which).values()
    assert len(examples) == n
    first = examples[0]
    assert first.text_a.startswith(text_a)
    assert (first.text_b is None) == (text_b is None)
    if text_b is not None:
        assert first.text_b.startswith(text_b)
    assert first.label == label
    for lab, count in counts.items():
        assert sum(e.label == lab for e in examples) == count
    assert len(label_ids(task, examples)) == n


def test_mrpc_bom_and_stray_quotes_kept(shared_data):
    # The BOM must not leak into the header skip; quotes stay literal (QUOTE_NONE).
    dev = read_task(get_task("MRPC"), shared_data / "glue" / "MRPC", "dev")["dev"]
    assert dev[1].text_b.startswith('His wife said he was "100 percent behind George Bush"')


def _write(path, rows: list[list[str]], bom: bool = False):
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join("\t".join(r) + "\n" for r in rows)
    path.write_text(("\ufeff" if bom else "") + text, encoding="utf-8")


MNLI_TRAIN_HEAD = (
    "index promptID pairID genre sentence1_binary_parse sentence2_binary_parse "
    "sentence1_parse sentence2_parse sentence1 sentence2 label1 gold_label"
).split()
MNLI_DEV_HEAD = MNLI_TRAIN_HEAD[:-1] + ["label2", "label3", "label4", "label5", "gold_label"]
PARSES = ["( a )", "( b )", "(ROOT a)", "(ROOT b)"]


def _synthetic(root):
    """Each missing task's train/dev/test in its original GLUE layout (two rows each)."""
    _write(
        root / "QQP/train.tsv",
        [
            ["id", "qid1", "qid2", "question1", "question2", "is_duplicate"],
            ["0", "1", "2", 'How do I "learn" Python?', "How can I learn Python?", "1"],
            ["1", "3", "4", "What is AI?", "Who is Ada?", "0"],
        ],
    )
    _write(
        root / "QQP/dev.tsv",
        [
            ["id", "qid1", "qid2", "question1", "question2", "is_duplicate"],
            ["7", "9", "10", "Is tea good?", "Is tea healthy?", "1"],
        ],
    )
    _write(root / "QQP/test.tsv", [["id", "question1", "question2"], ["0", "Why?", "Why not?"]])
    _write(
        root / "MNLI/train.tsv",
        [
            MNLI_TRAIN_HEAD,
            [
                "0",
                "31193",
                "31193n",
                "government",
                *PARSES,
                "Conceptually cream",
                "Cream",
                "neutral",
                "neutral",
            ],
        ],
    )
    for name in ("dev_matched", "dev_mismatched"):
        _write(
            root / f"MNLI/{name}.tsv",
            [
                MNLI_DEV_HEAD,
                [
                    "0",
                    "1",
                    "1e",
                    "fiction",
                    *PARSES,
                    f"{name} premise",
                    "hypothesis",
                    "entailment",
                    "entailment",
                    "neutral",
                    "entailment",
                    "entailment",
                    "entailment",
                ],
                [
                    "1",
                    "2",
                    "2c",
                    "fiction",
                    *PARSES,
                    "A man.",
                    "No man.",
                    "contradiction",
                    "contradiction",
                    "contradiction",
                    "neutral",
                    "contradiction",
                    "contradiction",
                ],
            ],
        )
    test_head = MNLI_TRAIN_HEAD[:10]
    _write(root / "MNLI/test_matched.tsv", [test_head, ["0", "1", "1", "g", *PARSES, "P", "H"]])
    _write(root / "MNLI/test_mismatched.tsv", [test_head, ["9", "1", "1", "g", *PARSES, "P", "H"]])
    for name, h in (
        ("QNLI", ["index", "question", "sentence", "label"]),
        ("RTE", ["index", "sentence1", "sentence2", "label"]),
    ):
        for split in ("train", "dev"):
            _write(
                root / f"{name}/{split}.tsv",
                [
                    h,
                    ["0", "Who wrote it?", "Ada wrote it.", "entailment"],
                    ["1", "Where?", "Nowhere at all.", "not_entailment"],
                ],
            )
        _write(root / f"{name}/test.tsv", [h[:3], ["0", "Q?", "A."], ["1", "Q2?", "A2."]])


def test_reader_on_synthetic_original_layouts(tmp_path):
    _synthetic(tmp_path)
    qqp = get_task("qqp")
    train = read_task(qqp, tmp_path / "QQP", "train")["train"]
    assert [e.label for e in train] == ["1", "0"]
    assert train[0].text_a == 'How do I "learn" Python?'
    assert train[0].text_b == "How can I learn Python?"
    (test,) = read_task(qqp, tmp_path / "QQP", "test").values()
    assert (test[0].index, test[0].text_a, test[0].text_b, test[0].label) == (
        "0",
        "Why?",
        "Why not?",
        None,
    )

    mnli = get_task("MNLI")
    assert read_task(mnli, tmp_path / "MNLI", "train")["train"][0].label == "neutral"
    dev = read_task(mnli, tmp_path / "MNLI", "dev")
    assert list(dev) == ["matched", "mismatched"]
    assert dev["mismatched"][0].text_a == "dev_mismatched premise"
    assert [e.label for e in dev["matched"]] == ["entailment", "contradiction"]  # gold, last
    assert label_ids(mnli, dev["matched"]).tolist() == [1, 0]
    test = read_task(mnli, tmp_path / "MNLI", "test")
    assert [test[s][0].index for s in test] == ["0", "9"]

    for name in ("QNLI", "RTE"):
        task = get_task(name)
        dev = read_task(task, tmp_path / name, "dev")["dev"]
        assert [e.label for e in dev] == ["entailment", "not_entailment"]
        assert dev[1].text_b == "Nowhere at all."
        assert read_task(task, tmp_path / name, "test")["test"][1].text_a == "Q2?"


def test_test_layouts_of_real_tasks(tmp_path):
    # GLUE's test files for the tasks we have train/dev of: an index column, no label.
    _write(tmp_path / "CoLA/test.tsv", [["index", "sentence"], ["0", "Bill whistled."]])
    _write(tmp_path / "SST-2/test.tsv", [["index", "sentence"], ["0", "uneasy mishmash ."]])
    _write(
        tmp_path / "MRPC/test.tsv",
        [["index", "#1 ID", "#2 ID", "#1 String", "#2 String"], ["0", "1", "2", "A b.", "A c."]],
        bom=True,
    )
    sts = [
        "index",
        "genre",
        "filename",
        "year",
        "old_index",
        "source1",
        "source2",
        "sentence1",
        "sentence2",
    ]
    _write(tmp_path / "STS-B/test.tsv", [sts, ["0", "g", "f", "y", "o", "s", "s", "A x.", "A y."]])
    _write(tmp_path / "WNLI/test.tsv", [["index", "sentence1", "sentence2"], ["0", "P.", "H."]])
    expect = {
        "CoLA": ("Bill whistled.", None),
        "SST-2": ("uneasy mishmash .", None),
        "MRPC": ("A b.", "A c."),
        "STS-B": ("A x.", "A y."),
        "WNLI": ("P.", "H."),
    }
    for name, (a, b) in expect.items():
        (ex,) = read_task(get_task(name), tmp_path / name, "test")["test"]
        assert (ex.index, ex.text_a, ex.text_b, ex.label) == ("0", a, b, None)


def test_bad_rows_name_file_and_line(tmp_path):
    rte = get_task("RTE")
    _write(
        tmp_path / "dev.tsv",
        [
            ["index", "sentence1", "sentence2", "label"],
            ["0", "a", "b", "entailment"],
            ["1", "only two"],
        ],
    )
    with pytest.raises(InputError, match=r"dev\.tsv:3: RTE: expected at least 4"):
        read_task(rte, tmp_path, "dev")
    _write(
        tmp_path / "dev.tsv",
        [["index", "sentence1", "sentence2", "label"], ["0", "a", "b", "maybe"]],
    )
    with pytest.raises(InputError, match=r"dev\.tsv:2: RTE: label 'maybe' not in"):
        read_task(rte, tmp_path, "dev")
    _write(tmp_path / "dev.tsv", [["index", "sentence1", "sentence2", "label"]])
    with pytest.raises(InputError, match=r"dev\.tsv: RTE: no examples in dev"):
        read_task(rte, tmp_path, "dev")
    sts = get_task("STS-B")
    header = TASKS["STS-B"].train.layout.header
    _write(tmp_path / "dev.tsv", [list(header), ["0"] * 9 + ["5.5"]])
    with pytest.raises(InputError, match=r"dev\.tsv:2: STS-B: score '5.5'"):
        read_task(sts, tmp_path, "dev")
    _write(tmp_path / "dev.tsv", [["h"] * 10, ["0"] * 9 + ["5.0"]])  # another file's header
    with pytest.raises(InputError, match=r"dev\.tsv:1: STS-B: header column 8 is 'h', expected"):
        read_task(sts, tmp_path, "dev")
    with pytest.raises(FileNotFoundError, match="train file not found"):
        read_task(sts, tmp_path, "train")
    with pytest.raises(ValueError, match="unknown GLUE task 'SQuAD'"):
        get_task("SQuAD")
    assert get_task("sst2") is TASKS["SST-2"] and get_task("sts_b") is TASKS["STS-B"]


def test_metrics_against_hand_computed_values():
    pred, gold = [1, 0, 1, 1, 0], [1, 0, 0, 1, 1]  # TP 2, TN 1, FP 1, FN 1
    assert compute_metrics(get_task("SST-2"), pred, gold) == pytest.approx({"accuracy": 0.6})
    for name in ("QNLI", "RTE", "WNLI"):
        assert compute_metrics(get_task(name), pred, gold) == pytest.approx({"accuracy": 0.6})
    # F1 = 2PR/(P+R) with P = R = 2/3.
    for name in ("MRPC", "QQP"):
        got = compute_metrics(get_task(name), pred, gold)
        assert got == pytest.approx({"f1": 2 / 3, "accuracy": 0.6})
    # MCC = (TP*TN - FP*FN) / sqrt((TP+FP)(TP+FN)(TN+FP)(TN+FN)) = (2 - 1) / sqrt(3*3*2*2) = 1/6
    assert compute_metrics(get_task("CoLA"), pred, gold) == pytest.approx({"mcc": 1 / 6})
    # Pearson: dx = (-3,-2,-1,6), dy = (-1.5,.5,-.5,1.5): 13 / sqrt(50 * 5); Spearman on ranks
    # (1,2,3,4) vs (1,3,2,4): 1 - 6*2 / (4*15) = 0.8.
    got = compute_metrics(get_task("STS-B"), [1.0, 2.0, 3.0, 10.0], [1.0, 3.0, 2.0, 4.0])
    assert got == pytest.approx({"pearson": 13 / math.sqrt(250), "spearman": 0.8})
    # A constant prediction has no correlation: GLUE counts it as 0, not NaN.
    const = compute_metrics(get_task("STS-B"), [2.0, 2.0, 2.0], [1.0, 3.0, 2.0])
    assert const == {"pearson": 0.0, "spearman": 0.0}
    assert compute_metrics(get_task("CoLA"), [1, 1, 1], [1, 0, 1]) == {"mcc": 0.0}
    with pytest.raises(ValueError, match="predictions for"):
        compute_metrics(get_task("CoLA"), [1, 1], [1, 0, 1])


def test_task_scores_and_glue_score_rule():
    mnli = get_task("MNLI")
    m = task_metrics(mnli, {"matched": {"accuracy": 0.8}, "mismatched": {"accuracy": 0.7}})
    assert m == {"matched_accuracy": 0.8, "mismatched_accuracy": 0.7}
    assert task_score(mnli, m) == pytest.approx(75.0)
    assert task_score(get_task("MRPC"), {"f1": 0.9, "accuracy": 0.8}) == pytest.approx(85.0)
    with pytest.raises(ValueError, match="metric 'spearman' missing"):
        task_score(get_task("STS-B"), {"pearson": 0.9})
    # BERT-Large's GLUE test results (paper, Table 1 + leaderboard): the leaderboard says 80.5.
    bert_large = {
        "CoLA": {"mcc": 0.605},
        "SST-2": {"accuracy": 0.949},
        "MRPC": {"f1": 0.893, "accuracy": 0.854},
        "STS-B": {"pearson": 0.876, "spearman": 0.865},
        "QQP": {"f1": 0.721, "accuracy": 0.893},
        "MNLI": {"matched_accuracy": 0.867, "mismatched_accuracy": 0.859},
        "QNLI": {"accuracy": 0.927},
        "RTE": {"accuracy": 0.701},
        "WNLI": {"accuracy": 0.651},
    }
    scores = {t: task_score(get_task(t), ms) for t, ms in bert_large.items()}
    assert round(glue_score(scores), 1) == 80.5


def _features(labels: list) -> Features:
    rows = [np.zeros(1, dtype=np.int64)] * len(labels)
    return Features(rows, rows, np.asarray(labels))


def test_the_baseline_is_the_majority_label_scored_by_the_tasks_metrics():
    """What a champion must beat (registry): the training labels' most frequent class for every
    dev example, by the task's own score; a regression's constant or MCC's has no signal (0)."""
    mrpc = GlueFinetune("MRPC")
    mrpc.train, mrpc.dev = _features([1, 1, 0]), {"dev": _features([1, 0, 0, 0])}
    # always 1: accuracy 1/4; F1 with P = 1/4, R = 1: 2/5; the score their mean
    assert mrpc.baseline() == (
        pytest.approx(32.5),
        "always equivalent (the most frequent in training)",
    )
    sst2 = GlueFinetune("SST-2")
    sst2.train, sst2.dev = _features([0, 1, 0]), {"dev": _features([0, 0, 1])}
    assert sst2.baseline() == (
        pytest.approx(200 / 3),
        "always negative (the most frequent in training)",
    )
    cola = GlueFinetune("CoLA")
    cola.train, cola.dev = _features([1, 1, 0]), {"dev": _features([1, 0, 1])}
    assert cola.baseline()[0] == 0.0  # a constant answer's MCC
    assert GlueFinetune("STS-B").baseline() == (0.0, "a constant score")
    mnli = GlueFinetune("MNLI")  # two dev sets: the mean of both matched and mismatched
    mnli.train = _features([2, 2, 0])
    mnli.dev = {"matched": _features([2, 0]), "mismatched": _features([2, 2, 2, 1])}
    assert mnli.baseline()[0] == pytest.approx(62.5)


def test_submission_names():
    assert prediction_names(get_task("RTE"), np.array([1, 0])) == ["not_entailment", "entailment"]
    assert prediction_names(get_task("MNLI"), np.array([2])) == ["neutral"]
    assert prediction_names(get_task("SST-2"), np.array([1])) == ["1"]
    assert prediction_names(get_task("STS-B"), np.array([3.14159])) == ["3.142"]
    subs = [s.submission for t in TASKS.values() for s in t.test]
    assert subs == [
        "CoLA.tsv",
        "SST-2.tsv",
        "MRPC.tsv",
        "STS-B.tsv",
        "QQP.tsv",
        "MNLI-m.tsv",
        "MNLI-mm.tsv",
        "QNLI.tsv",
        "RTE.tsv",
        "WNLI.tsv",
    ]


NAMES = {
    "CoLA": ("unacceptable", "acceptable"),
    "SST-2": ("negative", "positive"),
    "MRPC": ("not_equivalent", "equivalent"),
    "QQP": ("not_duplicate", "duplicate"),
    "MNLI": ("contradiction", "entailment", "neutral"),
    "QNLI": ("entailment", "not_entailment"),
    "RTE": ("entailment", "not_entailment"),
    "WNLI": ("not_entailment", "entailment"),
    "STS-B": (),
}


@pytest.mark.parametrize("name", list(NAMES))
def test_label_names_say_what_the_data_values_mean(name, tiny_dir):
    """config.json's id2label/label2id carry the label names (SST-2: negative, positive), one
    set per task; the data's values keep their ids (the targets, hence the metrics) and GLUE's
    submission files keep the values GLUE's server reads."""
    from bert_core.finetune.engine import model_config
    from bert_core.finetune.tasks.glue import GlueFinetune

    task = get_task(name)
    assert task.label_names == NAMES[name]
    config = model_config(GlueFinetune(name), tiny_dir, FinetuneConfig())
    if task.is_regression:
        assert config.id2label is None and config.num_labels == 1
        return
    assert config.id2label == dict(enumerate(NAMES[name]))
    assert config.label2id == {n: i for i, n in enumerate(NAMES[name])}
    ids = np.arange(len(task.labels))
    examples = [Example(str(i), "a", None, value) for i, value in enumerate(task.labels)]
    assert label_ids(task, examples).tolist() == ids.tolist()
    assert prediction_names(task, ids) == list(task.labels)  # "0"/"1" for SST-2's server
    assert task.labels == (
        {"MNLI": task.label_names, "QNLI": NLI2, "RTE": NLI2}.get(name) or ("0", "1")
    )


def test_binary_names_match_the_data(shared_data):
    """What 1 means, read off rows of the shared files: WNLI's first pair is entailed, CoLA's
    first sentence acceptable, MRPC's first pair paraphrases, SST-2's second row negative."""
    glue = shared_data / "glue"
    first = {n: read_task(get_task(n), glue / n, "train")["train"] for n in ("WNLI", "CoLA")}
    wnli = first["WNLI"][0]
    assert wnli.text_b == "The carrot had a hole." and wnli.label == "1"
    assert get_task("WNLI").label_names[int(wnli.label)] == "entailment"
    cola = first["CoLA"][0]
    assert cola.text_a.startswith("our friends wo n't buy") and cola.label == "1"
    assert get_task("CoLA").label_names[1] == "acceptable"
    sst2 = read_task(get_task("SST-2"), glue / "SST-2", "train")["train"][1]
    assert sst2.text_a == "contains no wit , only labored gags" and sst2.label == "0"
    assert get_task("SST-2").label_names[0] == "negative"
    mrpc = read_task(get_task("MRPC"), glue / "MRPC", "train")["train"][0]
    assert mrpc.text_a.startswith("Amrozi accused his brother") and mrpc.label == "1"
    assert get_task("MRPC").label_names[1] == "equivalent"
