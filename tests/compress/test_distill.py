"""`bert distill`: the loss is Hinton et al.'s combination, training lowers it, `--student-layers`
keeps the teacher's chosen layers, the output reads as a fine-tuned model's with both scores, and
a student of another vocabulary is refused before any work."""

from __future__ import annotations

import json
import math
import shutil

import mlflow
import numpy as np
import pytest
import torch

from bert_core import cli
from bert_core.compress.distill_loss import Distiller, distillation_loss
from bert_core.compress.student import cut, make_student, pick_layers
from bert_core.finetune.command import load_task
from bert_core.finetune.config import FinetuneConfig
from bert_core.finetune.engine import fit, load_model, load_tokenizer, save_model, train
from bert_core.finetune.tasks.glue import predict
from bert_core.model.heads import BertForSequenceClassification

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

CPU = torch.device("cpu")
SMALL = {"max_seq_length": 32, "max_train_examples": 160, "max_eval_examples": 64}


def glue_slice(root, shared_data, task: str, train: int, dev: int):
    """The first rows of a real GLUE task's train.tsv and dev.tsv (header kept)."""
    data = root / task
    data.mkdir()
    for split, rows in (("train", train), ("dev", dev)):
        lines = (shared_data / "glue" / task / f"{split}.tsv").read_text().splitlines()
        (data / f"{split}.tsv").write_text("\n".join(lines[: rows + 1]) + "\n")
    return data


@pytest.fixture(scope="module")
def made(tmp_path_factory, shared_data, tiny_dir):
    """A tiny SST-2 teacher fine-tuned for a few steps (library calls, no MLflow), its dev
    score, and the data slice; then `bert distill` run once in a fresh store: the tiny model's
    first layer (pre-trained: the teacher's start) distilled from the teacher."""
    root = tmp_path_factory.mktemp("distill")
    data = glue_slice(root, shared_data, "SST-2", 200, 100)
    task = load_task("SST-2")
    cfg = FinetuneConfig(epochs=1, learning_rate=1e-3, **SMALL)
    task.prepare(data, load_tokenizer(tiny_dir), cfg)
    teacher, fitted = train(task, tiny_dir, cfg, CPU)
    save_model(task, teacher, root / "teacher")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
        for key in ("BERT_PARENT_RUN_ID", "MLFLOW_EXPERIMENT_NAME"):
            mp.delenv(key, raising=False)
        mp.chdir(root)  # the sqlite store keeps artifacts under the cwd
        argv = [
            "distill",
            "--teacher",
            root / "teacher",
            "--student",
            tiny_dir,
            "--student-layers",
            "1",
            "--task",
            "sst2",
            "--data",
            data,
            "--output",
            root / "student",
            "--epochs",
            "2",
            "--lr",
            "1e-3",
            *[f"--{k.replace('_', '-')}={v}" for k, v in SMALL.items()],
        ]
        assert cli.main([str(a) for a in argv]) == 0
        yield {"root": root, "data": data, "teacher_score": fitted.best.score}


def test_loss_is_hintons_weighted_sum_of_soft_and_hard():
    student, teacher, label = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]]), [0]
    label = torch.tensor(label)
    # T = 2: softmax(s / T) = (sigmoid(.5), sigmoid(-.5)), the teacher's the reverse, so
    # KL = (p - q) * ln(p / q) with ln(p / q) = 0.5; times T^2 = 4. Hard: -ln softmax(s)[0].
    p = 1 / (1 + math.exp(-0.5))
    soft = 4 * (p - (1 - p)) * 0.5
    hard = math.log(1 + math.exp(-1.0))
    assert soft == pytest.approx(0.48984, abs=1e-5) and hard == pytest.approx(0.31326, abs=1e-5)
    got = distillation_loss(student, teacher, label, temperature=2.0, alpha=0.25)
    assert got.item() == pytest.approx(0.25 * soft + 0.75 * hard, rel=1e-6)
    assert distillation_loss(student, student, label, 3.0, 1.0).item() == pytest.approx(0, abs=1e-7)
    # regression (one output, STS-B): squared error to the teacher, then to the label; no T
    s, t, y = torch.tensor([[2.0]]), torch.tensor([[3.0]]), torch.tensor([5.0])
    assert distillation_loss(s, t, y, 7.0, 0.25).item() == pytest.approx(0.25 * 1 + 0.75 * 9)


@pytest.mark.parametrize("name", ["SST-2", "STS-B"])
def test_training_lowers_the_distillation_loss(tmp_path, shared_data, tiny_dir, name):
    task = load_task(name)
    cfg = FinetuneConfig(epochs=3, learning_rate=1e-3, batch_size=8, **SMALL)
    task.prepare(glue_slice(tmp_path, shared_data, name, 160, 32), load_tokenizer(tiny_dir), cfg)
    # any teacher will do if it is sure of its answers: a random tiny encoder's [CLS] barely
    # varies with the input, so its bias makes it sure (with the weight alone, some draws gave a
    # teacher near 50/50 that the untrained student already matched: nothing left to lower)
    teacher = load_model(task, tiny_dir).eval()
    torch.manual_seed(1)
    torch.nn.init.normal_(teacher.classifier.weight, std=0.5)
    torch.nn.init.normal_(teacher.classifier.bias, std=1.0)
    soft = torch.from_numpy(predict(teacher, task.train, CPU, 64))
    torch.manual_seed(2)
    student, _ = make_student(task, tiny_dir, 1, FinetuneConfig(init="random"))
    model = Distiller(student, temperature=2.0, alpha=0.7)
    batch = lambda i: {**task.train_batch(i), "teacher_logits": soft[i]}  # noqa: E731

    def mean_loss() -> float:
        model.eval()
        with torch.no_grad():
            return model(**batch(np.arange(task.num_train))).loss.item()

    before = mean_loss()
    fit(model, task.num_train, batch, lambda m: task.evaluate(m.student, CPU, cfg), cfg, CPU, "t")
    # measured: SST-2 0.58 -> 0.31; STS-B 3.50 -> 3.09 (near the labels' variance, which a
    # 1-layer student on 160 pairs cannot explain)
    assert mean_loss() < 0.95 * before, (before, mean_loss())


@pytest.fixture(scope="module")
def six_layers(tmp_path_factory, tiny_dir):
    """A 6-layer `tiny`-width BERT folder (random, as MiniLM's depth but 8x cheaper to load)."""
    from bert_core.model.modeling import BertConfig, BertForPreTraining

    path = tmp_path_factory.mktemp("six") / "model"
    torch.manual_seed(0)
    BertForPreTraining(BertConfig.from_preset("tiny", num_hidden_layers=6)).save_pretrained(
        path, vocab_file=tiny_dir / "vocab.txt"
    )
    return path


def test_student_layers_are_the_chosen_layers_of_the_source(six_layers):
    assert pick_layers(6, 2) == [0, 5] and pick_layers(6, 3) == [0, 3, 5]
    assert pick_layers(6, 1) == [0] and pick_layers(6, 6) == list(range(6))
    with pytest.raises(ValueError, match="--student-layers must be 1..6"):
        pick_layers(6, 7)
    task = load_task("SST-2")
    torch.manual_seed(0)
    full = load_model(task, six_layers).state_dict()
    torch.manual_seed(0)  # the same fresh head as `full`'s
    student, kept = make_student(task, six_layers, 2, FinetuneConfig())
    assert kept == [0, 5] and student.config.num_hidden_layers == 2
    small = student.state_dict()
    for key, value in small.items():
        source = key.replace("encoder.layer.1.", "encoder.layer.5.")
        assert torch.equal(value, full[source]), key
    dropped = [f"bert.encoder.layer.{i}." for i in (1, 2, 3, 4)]
    expected = {k.replace("layer.5.", "layer.1.") for k in full if not k.startswith(tuple(dropped))}
    assert set(small) == expected  # nothing else kept or added
    random, _ = make_student(task, six_layers, 2, FinetuneConfig(init="random"))
    shapes = {k: v.shape for k, v in random.state_dict().items()}
    assert shapes == {k: v.shape for k, v in small.items()}
    assert not torch.equal(
        random.state_dict()["bert.encoder.layer.1.output.dense.weight"],
        small["bert.encoder.layer.1.output.dense.weight"],
    )


def test_a_narrower_student_keeps_the_neurons_that_weigh_most(six_layers):
    """--student-ffn-share 0.5: each kept layer keeps the half of its feed-forward neurons
    whose weights weigh most, in order, cut alike from both matrices. With half the neurons of
    each layer made silent (zero output weights) those are the ones dropped, and the narrow
    student computes exactly what the full-width one does."""
    task = load_task("SST-2")
    torch.manual_seed(0)
    model = load_model(task, six_layers).eval()
    width = model.config.intermediate_size
    silent = {}
    for i in (0, 5):
        silent[i] = torch.randperm(width, generator=torch.Generator().manual_seed(i))[: width // 2]
        with torch.no_grad():
            model.bert.encoder.layer[i].output.dense.weight[:, silent[i]] = 0
    narrow, wide = cut(model, [0, 5], 0.5).eval(), cut(model, [0, 5]).eval()
    assert narrow.config.intermediate_size == width // 2 and narrow.config.num_hidden_layers == 2
    assert wide.config.intermediate_size == width
    for new, i in enumerate((0, 5)):
        kept = torch.ones(width, dtype=torch.bool)
        kept[silent[i]] = False
        source, small = model.bert.encoder.layer[i], narrow.bert.encoder.layer[new]
        assert torch.equal(small.intermediate.dense.weight, source.intermediate.dense.weight[kept])
        assert torch.equal(small.intermediate.dense.bias, source.intermediate.dense.bias[kept])
        assert torch.equal(small.output.dense.weight, source.output.dense.weight[:, kept])
    ids = torch.randint(5, model.config.vocab_size, (3, 12), generator=torch.Generator())
    with torch.no_grad():
        assert torch.allclose(narrow(ids).logits, wide(ids).logits, atol=1e-6)
    # a student's config says its width, so transformers and our loaders rebuild it
    student, kept_layers = make_student(task, six_layers, 2, FinetuneConfig(), ffn_share=0.25)
    assert kept_layers == [0, 5] and student.config.intermediate_size == width // 4


def test_output_reads_as_a_finetuned_model_with_both_scores(made, tmp_path):
    out = made["root"] / "student"
    result = json.loads((out / "metrics.json").read_text())
    assert result["task"] == "SST-2" and result["init"] == "pretrained"
    assert 0 <= result["score"] <= 100 and set(result["metrics"]) == {"accuracy"}
    assert result["score"] == pytest.approx(100 * result["metrics"]["accuracy"])
    # the teacher scored on the same dev sample as when it was fine-tuned
    assert result["teacher"]["score"] == pytest.approx(made["teacher_score"])
    assert result["student"]["layers"] == [0]
    assert result["student"]["parameters"] < result["teacher"]["parameters"]
    assert result["distillation"] == result["distillation"] | {"temperature": 2.0, "alpha": 0.5}
    assert result["num_dev_examples"] == {"dev": 64} and len(result["epochs"]) == 2

    model = BertForSequenceClassification.from_pretrained(out / "model")
    assert model.config.num_hidden_layers == 1
    assert model.config.id2label == {0: "negative", 1: "positive"}
    rows = (out / "dev_predictions.tsv").read_text().splitlines()
    assert len(rows) == 65 and rows[0] == "split\tguid\tlabel\tprediction"

    text = tmp_path / "in.txt"
    text.write_text("a gripping , funny film .\ndull and far too long .\n")
    argv = ["predict", "--model", out, "--input", text, "--output", tmp_path / "out.jsonl"]
    assert cli.main([str(a) for a in argv]) == 0
    answers = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [a["label"] in ("negative", "positive") for a in answers] == [True, True]


def test_mlflow_run_records_teacher_student_and_scores(made, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{made['root'] / 'mlflow.db'}")
    result = json.loads((made["root"] / "student" / "metrics.json").read_text())
    runs = mlflow.search_runs(experiment_names=["bert"], output_format="list")
    (run,) = [r for r in runs if r.data.tags.get("bert.step") == "distill-SST-2"]
    params, metrics = run.data.params, run.data.metrics
    assert params["teacher"] == str(made["root"] / "teacher") and params["init"] == "pretrained"
    assert params["student_layers"] == "1" and params["student_layer_ids"] == "0"
    assert params["temperature"] == "2.0" and params["alpha"] == "0.5"
    assert metrics["eval/score"] == result["score"]
    assert metrics["teacher/eval/score"] == pytest.approx(result["teacher"]["score"])
    assert metrics["student/parameters"] < metrics["teacher/parameters"]
    record = json.loads((made["root"] / "student" / "mlflow_model.json").read_text())
    assert record["run_id"] == run.info.run_id and "registered_model" not in record


def test_student_of_another_vocabulary_is_refused_before_any_work(
    made, tiny_dir, capsys, monkeypatch
):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{made['root'] / 'mlflow.db'}")
    runs = len(mlflow.search_runs(experiment_names=["bert"], output_format="list"))
    student = made["root"] / "other-vocab"
    shutil.copytree(tiny_dir, student)
    lines = (student / "vocab.txt").read_text().splitlines()
    lines[1000], lines[1001] = lines[1001], lines[1000]
    (student / "vocab.txt").write_text("\n".join(lines) + "\n")
    out = made["root"] / "refused"
    argv = [
        "distill",
        "--teacher",
        made["root"] / "teacher",
        "--student",
        student,
        "--task",
        "SST-2",
        "--data",
        made["data"],
        "--output",
        out,
    ]
    assert cli.main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not the teacher's vocabulary" in err, err
    assert "first difference at id 1000" in err
    assert not out.exists() and not list(out.parent.glob(".refused*"))
    assert len(mlflow.search_runs(experiment_names=["bert"], output_format="list")) == runs


def test_quantize_and_evaluate_read_the_student_unchanged(made, monkeypatch):
    root = made["root"]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
    monkeypatch.chdir(root)
    argv = [
        "quantize",
        "--model",
        root / "student",
        "--output",
        root / "int8",
        "--data",
        made["data"],
        "--max-eval-examples",
        "64",
    ]
    assert cli.main([str(a) for a in argv]) == 0
    quantized = json.loads((root / "int8" / "metrics.json").read_text())
    student = json.loads((root / "student" / "metrics.json").read_text())
    assert quantized["fp32"]["score"] == pytest.approx(student["score"])  # same cut, same dev
    assert (
        cli.main(["evaluate", "--results", str(root / "student"), "--output", str(root / "table")])
        == 0
    )
    assert "SST-2" in (root / "table" / "glue_table.md").read_text()
