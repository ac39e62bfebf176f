"""`make table7` (pipelines/experiments.py): the paper's Table 7 as one named experiment set."""

from __future__ import annotations

import json
import os
from pathlib import Path

import mlflow
import pytest
import torch

from bert_core.model.modeling import BertConfig, BertForPreTraining
from pipelines import experiments


@pytest.mark.slow
def test_table7_runs_every_row_into_one_experiment_and_resumes(
    tmp_path: Path, minilm_dir: Path, shared_data: Path, monkeypatch, capsys
) -> None:
    """Six feature-based rows and fine-tuning, each a `bert finetune` output, all in the MLflow
    experiment `table7`, one report in the Table 7 layout; a second call runs nothing again."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    monkeypatch.chdir(tmp_path)
    # a tiny random BERT: the set's plumbing, not its scores (docs/experiments.md has those)
    torch.manual_seed(0)
    model = BertForPreTraining(BertConfig.from_preset("tiny", max_position_embeddings=64))
    model.save_pretrained(tmp_path / "tiny", vocab_file=minilm_dir / "vocab.txt")
    out = tmp_path / "t7"
    argv = [
        "table7",
        "--model",
        str(tmp_path / "tiny"),
        "--data",
        str(shared_data / "conll2003"),
        "--output",
        str(out),
        "--max-train-examples",
        "24",
        "--max-eval-examples",
        "24",
        "--max-seq-length",
        "32",
        "--epochs",
        "1",
        "--lr",
        "1e-3",
    ]
    assert experiments.main(argv) == 0
    assert "MLFLOW_EXPERIMENT_NAME" not in os.environ  # the caller's environment as it was
    rows = [
        "embeddings",
        "second-to-last",
        "last",
        "weighted-sum-last4",
        "concat-last4",
        "weighted-sum-all",
        "fine-tuning",
    ]
    for row in rows:
        config = json.loads((out / row / "metrics.json").read_text())["config"]
        assert config["feature_based"] == ("none" if row == "fine-tuning" else row)
    table = (out / "report" / "glue_table.md").read_text()
    assert "Paper Dev F1 (BERT-Base, Table 7)" in table
    for choice, paper in [("embeddings", "91.0"), ("concat-last4", "96.1")]:
        assert any(
            line.startswith(f"| feature-based ({choice}) |") and line.endswith(f"| {paper} |")
            for line in table.splitlines()
        )
    assert "| 96.4 (fine-tuning) |" in table
    runs = mlflow.search_runs(experiment_names=["table7"], output_format="list")
    steps = sorted(r.data.tags.get("bert.step") for r in runs)
    assert steps == ["evaluate"] + ["finetune-conll2003"] * 7, steps
    capsys.readouterr()
    assert experiments.main(argv) == 0  # complete rows are kept, only the report is redone
    assert capsys.readouterr().out.count("done already") == 7
    runs = mlflow.search_runs(experiment_names=["table7"], output_format="list")
    assert sorted(r.data.tags.get("bert.step") for r in runs).count("finetune-conll2003") == 7


def test_figure2_fine_tunes_from_each_export_and_plots_score_against_steps(
    tmp_path: Path, minilm_dir: Path, shared_data: Path, monkeypatch
) -> None:
    """One fine-tuning per `exports/step-N` of a pre-training, a row per step ("step N") in
    step order (10 before 100, not as text), the plot drawn as score against steps; no exports
    is an error that names the option."""
    from bert_core.report import tables

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    monkeypatch.chdir(tmp_path)
    pretrain = tmp_path / "pretrain"
    for step in (100, 10):
        torch.manual_seed(step)
        model = BertForPreTraining(BertConfig.from_preset("tiny", max_position_embeddings=64))
        model.save_pretrained(
            pretrain / "exports" / f"step-{step}", vocab_file=minilm_dir / "vocab.txt"
        )
    drawn = []
    real = tables.plot_steps
    monkeypatch.setattr(
        tables, "plot_steps", lambda r, p: (drawn.append(list(r["systems"])), real(r, p))
    )
    out = tmp_path / "f2"
    argv = [
        "figure2",
        "--pretrain",
        str(pretrain),
        "--glue",
        str(shared_data / "glue"),
        "--task",
        "SST-2",
        "--output",
        str(out),
        "--max-train-examples",
        "24",
        "--max-eval-examples",
        "24",
        "--max-seq-length",
        "32",
        "--epochs",
        "1",
    ]
    assert experiments.main(argv) == 0
    results = json.loads((out / "report" / "glue_results.json").read_text())
    assert list(results["systems"]) == ["step 10", "step 100"]
    assert drawn == [["step 10", "step 100"]]
    assert (out / "report" / "glue_scores.png").stat().st_size > 1000
    for step in (10, 100):
        data = json.loads((out / f"step-{step}" / "metrics.json").read_text())
        assert data["model"] == str(pretrain / "exports" / f"step-{step}")
    runs = mlflow.search_runs(experiment_names=["figure2"], output_format="list")
    assert sorted(r.data.tags.get("bert.step") for r in runs).count("finetune-SST-2") == 2
    assert experiments.main([*argv[:2], str(tmp_path / "nothing"), *argv[3:]]) == 2


@pytest.fixture(scope="module")
def ray_after():
    """`bert pretrain` in this process starts a local Ray and keeps it for the next call; shut it
    down after the module, as tests later in the process expect no Ray (test_bad_inputs)."""
    yield
    import ray

    ray.shutdown()


@pytest.fixture(scope="module")
def instances(tmp_path_factory, shared_data: Path, ray_after) -> Path:
    """Real `bert clean`/`vocab`/`instances` output, small enough to pre-train in seconds."""
    from tests.pipeline_helpers import pretraining_instances

    return pretraining_instances(
        tmp_path_factory.mktemp("data"),
        shared_data,
        chars=20_000,
        num_shards=1,
        vocab_size=500,
        max_seq_length=32,
    )


def pretraining_set(name: str, instances: Path, out: Path, shared_data: Path, *extra) -> list:
    """A pre-training table's command line at the smallest settings: MRPC, a few steps."""
    return [
        name,
        "--instances",
        str(instances),
        "--output",
        str(out),
        "--tasks",
        "MRPC",
        "--glue",
        str(shared_data / "glue"),
        "--steps",
        "3",
        "--pretrain-batch-size",
        "8",
        "--cpus-per-worker",
        "1",
        "--max-train-examples",
        "24",
        "--max-eval-examples",
        "24",
        "--max-seq-length",
        "32",
        "--epochs",
        "1",
        *extra,
    ]


@pytest.mark.slow
def test_table5_pretrains_each_objective_and_fine_tunes_every_row(
    tmp_path: Path, instances: Path, shared_data: Path, monkeypatch
) -> None:
    """Three pre-trainings (mlm+nsp, mlm, ltr) from the same instances, each row fine-tuned
    (the ltr model twice, once with the BiLSTM), one report in Table 5's layout; the ltr
    models are causal and the BiLSTM row has its BiLSTM; a second call trains nothing."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "t5"
    argv = pretraining_set("table5", instances, out, shared_data)
    assert experiments.main(argv) == 0
    for objective in ("mlm+nsp", "mlm", "ltr"):
        config = json.loads((out / "pretrain" / objective / "model" / "config.json").read_text())
        assert config.get("is_decoder", False) == (objective == "ltr")
    for folder, bilstm in [
        ("mlm-nsp", False),
        ("no-nsp", False),
        ("ltr", False),
        ("ltr-bilstm", True),
    ]:
        config = json.loads((out / folder / "MRPC" / "model" / "config.json").read_text())
        assert config.get("top_bilstm", False) == bilstm
        assert config.get("is_decoder", False) == folder.startswith("ltr")
    table = (out / "report" / "glue_table.md").read_text()
    assert "Table 5 layout" in table
    for row, paper in [
        ("BERT (MLM & NSP)", "86.7"),
        ("No NSP", "86.5"),
        ("LTR & No NSP", "77.5"),
        ("+ BiLSTM", "75.7"),
    ]:
        assert any(
            line.startswith(f"| {row} |") and f" / {paper} |" in line for line in table.splitlines()
        ), row
    runs = mlflow.search_runs(experiment_names=["table5"], output_format="list")
    steps = sorted(r.data.tags.get("bert.step") for r in runs)
    assert steps.count("pretrain") == 3 and steps.count("finetune-MRPC") == 4, steps
    assert experiments.main(argv) == 0  # nothing trained again
    runs = mlflow.search_runs(experiment_names=["table5"], output_format="list")
    steps = sorted(r.data.tags.get("bert.step") for r in runs)
    assert steps.count("pretrain") == 3 and steps.count("finetune-MRPC") == 4, steps


@pytest.mark.slow
def test_table6_and_table8_pretrain_a_model_per_shape_and_recipe(
    tmp_path: Path, instances: Path, shared_data: Path, monkeypatch
) -> None:
    """Table 6's row is a model of its L/H/A (feed-forward 4H); Table 8's is pre-trained with
    dynamic masking by its recipe and gets the paper's numbers beside ours."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    monkeypatch.chdir(tmp_path)
    t6, t8 = tmp_path / "t6", tmp_path / "t8"
    assert (
        experiments.main(pretraining_set("table6", instances, t6, shared_data, "--grid", "1/32/2"))
        == 0
    )
    config = json.loads((t6 / "pretrain" / "L1-H32-A2" / "model" / "config.json").read_text())
    assert (
        config["num_hidden_layers"],
        config["hidden_size"],
        config["num_attention_heads"],
        config["intermediate_size"],
    ) == (1, 32, 2, 128)
    assert "| L=1 H=32 A=2 |" in (t6 / "report" / "glue_table.md").read_text()
    assert (
        experiments.main(
            pretraining_set("table8", instances, t8, shared_data, "--recipes", "100/0/0")
        )
        == 0
    )
    (run,) = mlflow.search_runs(
        experiment_names=["table8"],
        output_format="list",
        filter_string="tags.`bert.step` = 'pretrain'",
    )
    assert run.data.params["masking_recipe"] == "100/0/0"
    assert run.data.params["dynamic_masking"] == "True"
    # the row's recipe given as an option, the rest the instances' own (the run records which)
    assert run.data.params["dynamic_masking.masking_recipe"] == "100/0/0 (option)"
    assert run.data.params["dynamic_masking.masked_lm_prob"] == "0.15 (instances)"
    table = (t8 / "report" / "glue_table.md").read_text()
    assert "| masking 100/0/0 | - / 84.3 | - / 94.9 |" in table
