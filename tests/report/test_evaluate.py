"""`bert evaluate`: metrics.json folders -> GLUE results, Table-1 layout, plot, MLflow run."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import mlflow
import pytest

from bert_core import cli
from bert_core.report.evaluate import collect, evaluate

# BERT-Large's GLUE test numbers (paper Table 1 + leaderboard); the leaderboard's score is 80.5.
BERT_LARGE = {
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


@pytest.fixture
def mlflow_env(tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.chdir(tmp_path)  # artifacts of the sqlite store land under the cwd
    return uri


def _results(root, tasks: dict[str, dict]) -> list[str]:
    dirs = []
    for name, metrics in tasks.items():
        d = root / f"ft-{name}"
        d.mkdir(parents=True)
        (d / "metrics.json").write_text(json.dumps({"task": name, "metrics": metrics, "x": 1}))
        dirs.append(str(d))
    return dirs


def test_full_glue_table_plot_and_mlflow(tmp_path, mlflow_env):
    dirs = _results(tmp_path, BERT_LARGE)
    out = tmp_path / "glue"
    assert cli.main(["evaluate", "--results", *dirs, "--output", str(out)]) == 0

    results = json.loads((out / "glue_results.json").read_text())
    assert round(results["glue_score"], 1) == 80.5 and results["complete"] is True
    assert list(results["tasks"]) == [
        "MNLI",
        "QQP",
        "QNLI",
        "SST-2",
        "CoLA",
        "STS-B",
        "MRPC",
        "RTE",
        "WNLI",
    ]
    assert results["tasks"]["MRPC"]["score"] == pytest.approx(87.35)
    table = (out / "glue_table.md").read_text()
    header, _, row = table.splitlines()[:3]
    assert header.startswith("| System | MNLI-(m/mm) | QQP | QNLI | SST-2 | CoLA | STS-B | MRPC")
    # Paper's Table 1 row for BERT-Large, then WNLI and the GLUE score.
    assert row == (
        "| BERT (ours) | 86.7/85.9 | 72.1 | 92.7 | 94.9 | 60.5 | 86.5 | 89.3 | 70.1 | 65.1 | 80.5 |"
    )
    png = (out / "glue_scores.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000

    runs = mlflow.search_runs(experiment_names=["bert"], output_format="list")
    (run,) = [r for r in runs if r.data.tags.get("bert.step") == "evaluate"]
    # MLflow holds the table's numbers (percent), named by role (bert_core.metrics)
    assert run.data.metrics["eval/score"] == pytest.approx(results["glue_score"])
    assert run.data.metrics["eval/CoLA/mcc"] == pytest.approx(60.5)
    assert run.data.metrics["eval/MRPC/score"] == pytest.approx(87.35)
    arts = {a.path for a in mlflow.MlflowClient().list_artifacts(run.info.run_id, "glue")}
    assert arts == {
        "glue/glue_results.json",
        "glue/glue_table.md",
        "glue/glue_scores.png",
        "glue/scores",
        "glue/task_scores.csv",
        "glue/dev_curves.csv",
    }


def test_partial_results_are_marked(tmp_path):
    dirs = _results(tmp_path, {"SST-2": {"accuracy": 0.9}, "MRPC": {"f1": 0.8, "accuracy": 0.7}})
    results = collect(dirs)
    assert results["glue_score"] == pytest.approx((90 + 75) / 2)
    assert results["complete"] is False and results["num_tasks"] == 2


@pytest.mark.parametrize(
    "content,message",
    [
        ({"task": "SQuAD", "metrics": {"f1": 0.5}}, "unknown GLUE task 'SQuAD'"),
        ({"task": "STS-B", "metrics": {"pearson": 0.5}}, r"missing or non-finite .*spearman"),
        ({"metrics": {"accuracy": 0.5}}, "expected {'task'"),
        ("{not json", "not valid JSON"),
    ],
)
def test_bad_results_fail_without_output(tmp_path, content, message):
    d = tmp_path / "ft"
    d.mkdir()
    text = content if isinstance(content, str) else json.dumps(content)
    (d / "metrics.json").write_text(text)
    out = tmp_path / "glue"
    proc = subprocess.run(
        [sys.executable, "-m", "bert_core", "evaluate", "--results", str(d), "--output", str(out)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert "bert evaluate: error:" in proc.stderr and "metrics.json" in proc.stderr
    assert re.search(message, proc.stderr), proc.stderr
    assert not out.exists()


def test_duplicate_task_and_missing_folder(tmp_path):
    dirs = _results(tmp_path, {"RTE": {"accuracy": 0.6}})
    with pytest.raises(ValueError, match="RTE given twice"):
        collect(dirs + dirs)
    with pytest.raises(FileNotFoundError, match="is .* a `bert finetune` output"):
        collect([tmp_path / "nothing"])


def test_token_tasks_get_their_own_rows_outside_the_glue_score(tmp_path, mlflow_env):
    """NER F1 and SQuAD EM/F1 rows (the paper's Tables 2 and 3 layout); GLUE score unchanged."""
    glue = {"SST-2": {"accuracy": 0.9}, "MRPC": {"f1": 0.8, "accuracy": 0.7}}
    token = {
        "squad": {"exact_match": 0.841, "f1": 0.909},
        "squad_v2": {"exact_match": 0.787, "f1": 0.819, "has_ans_f1": 0.8},
        "conll2003": {"f1": 0.964, "precision": 0.96, "recall": 0.968, "accuracy": 0.99},
    }
    dirs = _results(tmp_path, glue | token)
    results = collect(dirs)
    assert results["glue_score"] == pytest.approx((90 + 75) / 2) and results["num_tasks"] == 2
    assert list(results["token_tasks"]) == ["squad", "squad_v2", "conll2003"]
    out = tmp_path / "eval"
    assert cli.main(["evaluate", "--results", *dirs, "--output", str(out)]) == 0
    table = (out / "glue_table.md").read_text()
    assert "| System | Dev EM | Dev F1 |\n|---|---|---|\n| BERT (ours) | 84.1 | 90.9 |" in table
    assert "**SQuAD v2.0 (Table 3 layout)**\n\n| System | Dev EM | Dev F1 |" in table
    assert "| BERT (ours) | 78.7 | 81.9 |" in table
    assert "**CoNLL-2003 NER**\n\n| System | Dev F1 |\n|---|---|\n| BERT (ours) | 96.4 |" in table
    saved = json.loads((out / "glue_results.json").read_text())
    assert saved["token_tasks"]["conll2003"]["metrics"]["f1"] == 0.964
    (run,) = [
        r
        for r in mlflow.search_runs(experiment_names=["bert"], output_format="list")
        if r.data.tags.get("bert.step") == "evaluate"
    ]
    assert run.data.metrics["eval/squad/f1"] == pytest.approx(90.9)
    assert run.data.metrics["eval/score"] == pytest.approx(82.5)
    # token-level results alone: their tables, no GLUE score
    only = evaluate(dirs[2:], tmp_path / "only")
    assert only["glue_score"] is None and only["tasks"] == {}
    assert (tmp_path / "only" / "glue_table.md").read_text().startswith("**SQuAD v1.1")
    assert (tmp_path / "only" / "glue_scores.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(
        ValueError, match="squad: missing or non-finite metrics \\['exact_match'\\]"
    ):
        collect(_results(tmp_path / "bad", {"squad": {"f1": 0.5}}))


def test_every_caller_logs_the_same_metrics_at_one_scale(tmp_path, mlflow_env, monkeypatch):
    """`bert evaluate`'s run, the DVC pipeline's parent run (pipelines/run_dvc.py) and the KFP
    components' Metrics carry the same names and values: percent, the table's numbers. The
    evaluate step publishes them, table and plot too, on the pipeline run it is nested under;
    `make run` does it from the files when DVC skipped a cached evaluate stage."""
    from mlflow import MlflowClient

    from bert_core.cli import dvc_log_results
    from bert_core.track import lineage

    for key in ("BERT_PARENT_RUN_ID", "MLFLOW_EXPERIMENT_NAME", "KFP_RUN_ID", "DVC_STAGE"):
        monkeypatch.delenv(key, raising=False)
    token = {"conll2003": {"f1": 0.964, "precision": 0.96, "recall": 0.968, "accuracy": 0.99}}
    dirs = _results(tmp_path, BERT_LARGE | token)
    out = tmp_path / "evaluate"
    with lineage.start_pipeline_run() as parent:
        assert cli.main(["evaluate", "--results", *dirs, "--output", str(out)]) == 0
        dvc_log_results(parent.info.run_id, out)  # what `make run` calls: nothing more here
    client = MlflowClient()  # after start_pipeline_run set this test's store
    (step,) = lineage.child_runs(parent.info.run_id, "evaluate")
    logged = client.get_run(parent.info.run_id).data.metrics
    assert logged == step.data.metrics
    history = client.get_metric_history(parent.info.run_id, "eval/score")
    assert len(history) == 1  # published once, by the step; not again by the runner
    on_parent = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert on_parent == {"glue_table.md", "glue_scores.png"}
    with lineage.start_pipeline_run() as cached:  # DVC skipped evaluate: the runner publishes
        assert dvc_log_results(cached.info.run_id, out)["glue_score"] == pytest.approx(80.5, 1e-3)
    assert client.get_run(cached.info.run_id).data.metrics == logged
    assert {a.path for a in client.list_artifacts(cached.info.run_id)} == on_parent
    assert cli.kfp_metrics(out / "glue_results.json") == logged  # the KFP evaluate component's
    assert cli.kfp_metrics(f"{dirs[0]}/metrics.json") == {"eval/mcc": pytest.approx(60.5)}
    expected = {f"eval/{t}/{k}" for t, m in (BERT_LARGE | token).items() for k in m}
    assert set(logged) == expected | {f"eval/{t}/score" for t in BERT_LARGE} | {"eval/score"}
    assert logged["eval/score"] == pytest.approx(80.5, abs=0.05)
    assert logged["eval/STS-B/score"] == pytest.approx((87.6 + 86.5) / 2)
    for name, value in logged.items():  # accuracy, F1, MCC, correlations: percent, the table's
        assert -100 <= value <= 100, name


def _system(root, tasks: dict[str, dict], init: str) -> list[str]:
    dirs = _results(root, tasks)
    for d in dirs:
        data = json.loads((root / d / "metrics.json").read_text())
        (root / d / "metrics.json").write_text(json.dumps(data | {"init": init}))
    return dirs


def test_control_and_systems_are_rows_of_one_table_with_the_gain(tmp_path, mlflow_env, capsys):
    """Pre-trained and random-init results side by side (grouped by their metrics.json `init`
    or named with --system), the gain row, MLflow names per system, and `bert runs`."""
    from bert_core.track import lineage

    ours = {
        "SST-2": {"accuracy": 0.9},
        "MRPC": {"f1": 0.8, "accuracy": 0.7},
        "conll2003": {"f1": 0.9, "strict_f1": 0.91},
    }
    control = {
        "SST-2": {"accuracy": 0.6},
        "MRPC": {"f1": 0.81, "accuracy": 0.69},
        "CoLA": {"mcc": 0.0},
        "conll2003": {"f1": 0.5, "strict_f1": 0.52},
    }
    a = _system(tmp_path / "ours", ours, "pretrained")
    b = _system(tmp_path / "control", control, "random")
    out = tmp_path / "eval"
    with lineage.start_pipeline_run():
        assert cli.main(["evaluate", "--results", *b, *a, "--output", str(out)]) == 0
    results = json.loads((out / "glue_results.json").read_text())
    assert results["system"] == "BERT (ours)" and results["control"] == "random init"
    assert list(results["systems"]) == ["BERT (ours)", "random init"]  # rows in ROWS' order
    assert results["glue_score"] == pytest.approx((90 + 75) / 2)  # the main system's, as before
    assert results["systems"]["random init"]["glue_score"] == pytest.approx((60 + 75 + 0) / 3)
    # gain over the tasks both have: SST-2 +30, MRPC (75 - 75) 0
    assert results["gain"]["glue_score"] == pytest.approx(15.0)
    assert results["gain"]["tasks"] == {"SST-2": pytest.approx(30), "MRPC": pytest.approx(0)}
    assert results["gain"]["token_tasks"]["conll2003"]["f1"] == pytest.approx(40)

    table = (out / "glue_table.md").read_text().splitlines()
    assert table[2:5] == [
        "| BERT (ours) | - | - | - | 90.0 | - | - | 80.0 | - | - | 82.5 (2/9 tasks) |",
        "| random init | - | - | - | 60.0 | 0.0 | - | 81.0 | - | - | 45.0 (3/9 tasks) |",
        # the paper's metric per task (MRPC: F1), the GLUE score over the tasks both have
        "| BERT (ours) gain over random init | - | - | - | +30.0 | - | - | -1.0 | - | - | +15.0 |",
    ]
    text = "\n".join(table)
    assert "| System | Dev F1 | Dev F1 (seqeval strict) |" in text
    assert "| BERT (ours) gain over random init | +40.0 | +39.0 |" in text
    assert "| random init | CoLA | mcc 0.0 | 0.0 |" in text

    runs = mlflow.search_runs(experiment_names=["bert-pipeline"], output_format="list")
    (step,) = [r for r in runs if r.data.tags.get("bert.step") == "evaluate"]
    m = step.data.metrics
    assert m["eval/score"] == pytest.approx(82.5) and m["eval/SST-2/score"] == pytest.approx(90)
    assert m["random_init/eval/score"] == pytest.approx(45)
    assert m["random_init/eval/SST-2/accuracy"] == pytest.approx(60)
    assert m["gain/eval/score"] == pytest.approx(15)
    assert m["gain/eval/SST-2/score"] == pytest.approx(30)
    assert m["gain/eval/conll2003/f1"] == pytest.approx(40)
    capsys.readouterr()
    assert cli.main(["runs"]) == 0  # the pipeline run's row: main score, control's, the gain
    header, row = capsys.readouterr().out.splitlines()
    columns = header.split()
    assert columns[-5:] == [
        "eval/score",
        "random_init/eval/score",
        "gain/eval/score",
        "eval/MRPC/score",
        "eval/SST-2/score",
    ]
    assert row.split()[-5:] == ["82.5", "45.0", "15.0", "75.0", "90.0"]

    # named systems: one --system per --results; a named group may not mix inits
    named = evaluate([("no NSP", a), ("control", b)], tmp_path / "named")
    assert list(named["systems"]) == ["no NSP", "control"] and named["control"] == "control"
    with pytest.raises(ValueError, match="--system 'X' mixes --init"):
        evaluate(a + b, tmp_path / "mixed", system="X")
    with pytest.raises(SystemExit):  # argparse: "give one --system per --results, or none"
        cli.main(
            [
                "evaluate",
                "--results",
                *a,
                "--results",
                *b,
                "--system",
                "only one",
                "--output",
                str(tmp_path / "x"),
            ]
        )


def test_rows_are_named_by_what_the_pretraining_started_from(tmp_path):
    """Unnamed results go to the row their metrics.json's `start_from` (`bert finetune`'s
    `pretraining`) says: ours from scratch, a public checkpoint pre-trained further on the
    corpus, one fine-tuned as it is; each gets its gain over the control. A result written
    before the field existed is ours."""
    starts = {
        "scratch": {"start_from": "random init", "continued_pretraining": False},
        "continued": {"start_from": "pypi:minilm==1", "continued_pretraining": True},
        "public": {"start_from": "hf:org/bert@abc", "continued_pretraining": False},
        "old": {},
    }
    folders = {}
    for name, start in starts.items():
        (d,) = _system(tmp_path / name, {"SST-2": {"accuracy": 0.5}}, "pretrained")
        data = json.loads((tmp_path / d / "metrics.json").read_text())
        (tmp_path / d / "metrics.json").write_text(json.dumps(data | start))
        folders[name] = d
    (control,) = _system(tmp_path / "control", {"SST-2": {"accuracy": 0.25}}, "random")
    results = evaluate([folders["continued"], folders["public"], control], tmp_path / "a")
    assert list(results["systems"]) == [
        "public checkpoint + continued pre-training",
        "public checkpoint",
        "random init",
    ]
    gains = {n: r["gain"]["tasks"]["SST-2"] for n, r in results["systems"].items() if "gain" in r}
    assert gains == {"public checkpoint + continued pre-training": 25, "public checkpoint": 25}
    with pytest.raises(ValueError, match="SST-2 given twice"):  # ours, whichever way written
        evaluate([folders["scratch"], folders["old"]], tmp_path / "b")


def test_feature_based_rows_are_table_7_with_the_papers_numbers(tmp_path):
    """Feature-based taggers (`bert finetune --feature-based C`) are one row per choice after
    the fine-tuned ones, in name order; the CoNLL table gets the paper's Table 7 column (its
    fine-tuning number for a fine-tuned row, none for the control)."""
    from bert_core.report.tables import markdown_table

    folders = []
    for choice, f1 in [("last", 0.7), ("embeddings", 0.6), ("none", 0.8)]:
        (d,) = _system(tmp_path / choice, {"conll2003": {"f1": f1}}, "pretrained")
        data = json.loads((tmp_path / d / "metrics.json").read_text())
        start = {"start_from": "pypi:minilm==1", "continued_pretraining": False}
        data |= start | {"config": {"feature_based": choice}}
        (tmp_path / d / "metrics.json").write_text(json.dumps(data))
        folders.append(d)
    folders += _system(tmp_path / "control", {"conll2003": {"f1": 0.3}}, "random")
    results = evaluate(folders, tmp_path / "out")
    assert list(results["systems"]) == [
        "public checkpoint",
        "random init",
        "feature-based (embeddings)",
        "feature-based (last)",
    ]
    table = markdown_table(results)
    assert "| System | Dev F1 | Paper Dev F1 (BERT-Base, Table 7) |" in table
    assert "| public checkpoint | 80.0 | 96.4 (fine-tuning) |" in table
    assert "| random init | 30.0 | - |" in table
    assert "| feature-based (embeddings) | 60.0 | 91.0 |" in table
    assert "| feature-based (last) | 70.0 | 94.9 |" in table


def test_table_5_rows_are_shown_beside_the_papers_numbers(tmp_path):
    """Systems named as Table 5's rows (`make table5`) get the paper's layout, each cell ours /
    the paper's (MRPC by accuracy, SQuAD by F1, as there); a task not run is '-'. Without such
    a row no Table 5 appears."""
    from bert_core.report.tables import markdown_table

    groups = []
    for name, (sst2, mrpc_acc, squad_f1) in {
        "BERT (MLM & NSP)": (0.81, 0.70, 0.20),
        "LTR & No NSP": (0.78, 0.68, 0.10),
    }.items():
        tasks = {
            "SST-2": {"accuracy": sst2},
            "MRPC": {"f1": 0.8, "accuracy": mrpc_acc},
            "squad": {"exact_match": squad_f1 / 2, "f1": squad_f1},
        }
        groups.append((name, _system(tmp_path / name, tasks, "pretrained")))
    table = markdown_table(evaluate(groups, tmp_path / "out"))
    assert "| System | MNLI-m (Acc) | QNLI (Acc) | MRPC (Acc) | SST-2 (Acc) | SQuAD (F1) |" in table
    rows = [line for line in table.splitlines() if "/ 8" in line]
    assert "**Table 5 layout: ours / the paper's (BERT-Base scale)**" in table
    assert "Table 6" not in table and "Table 8" not in table
    assert rows == [
        "| BERT (MLM & NSP) | - / 84.4 | - / 88.4 | 70.0 / 86.7 | 81.0 / 92.7 | 20.0 / 88.5 |",
        "| LTR & No NSP | - / 82.1 | - / 84.3 | 68.0 / 77.5 | 78.0 / 92.1 | 10.0 / 77.8 |",
    ]
    renamed = [("ours", folders) for _, folders in groups[:1]]
    assert "Table 5" not in markdown_table(evaluate(renamed, tmp_path / "out2"))
