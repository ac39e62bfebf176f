"""`bert evaluate`'s flat files (bert_core/report/scores.py): numbers only, on the table's scale,
a row per system and task, the long tables DVC plots."""

from __future__ import annotations

import csv
import json

import pytest

from bert_core.report.evaluate import evaluate

NER = {"f1": 0.9, "strict_f1": 0.91, "precision": 0.9, "recall": 0.9}  # P/R: not in its table
PRETRAINED = {
    "SST-2": {"accuracy": 0.9},
    "STS-B": {"pearson": 0.8, "spearman": 0.7},
    "conll2003": NER,
}
RANDOM = {
    "SST-2": {"accuracy": 0.6},
    "STS-B": {"pearson": 0.1, "spearman": 0.2},
    "conll2003": {"f1": 0.5, "strict_f1": 0.52},
}


def _finetuned(root, init: str, tasks: dict[str, dict]) -> list[str]:
    """`bert finetune` outputs as `bert evaluate` reads them: metrics.json with the config,
    strings and the per-epoch history (two epochs, the second the best)."""
    dirs = []
    for name, metrics in tasks.items():
        d = root / f"{init}-{name}"
        d.mkdir(parents=True)
        first = {k: v / 2 for k, v in metrics.items()}
        epochs = [
            {"epoch": 1, "metrics": first, "train_loss": 1.0},
            {"epoch": 2, "metrics": metrics, "train_loss": 0.5},
        ]
        content = {
            "task": name,
            "init": init,
            "metrics": metrics,
            "best_epoch": 2,
            "epochs": epochs,
            "config": {"lr": 1e-4},
            "device": "cpu",
        }
        (d / "metrics.json").write_text(json.dumps(content))
        dirs.append(str(d))
    return dirs


@pytest.fixture
def written(tmp_path):
    dirs = _finetuned(tmp_path, "pretrained", PRETRAINED) + _finetuned(tmp_path, "random", RANDOM)
    results = evaluate(dirs, tmp_path / "eval")
    return tmp_path / "eval", results


def _rows(out) -> dict[str, dict]:
    return {
        p.relative_to(out).as_posix(): json.loads(p.read_text())
        for p in out.rglob("*.json")
        if p.parent.parent.name == "scores"
    }


def test_a_row_per_system_and_task_numbers_only_on_the_table_scale(written):
    out, results = written
    rows = _rows(out)
    systems, tasks = ("bert_ours", "random_init"), ("SST-2", "STS-B", "conll2003", "GLUE")
    assert set(rows) == {f"scores/{s}/{t}.json" for s in systems for t in tasks}
    for row in rows.values():  # flat, numbers only, a handful of columns
        assert all(type(v) in (int, float) for v in row.values()) and len(row) <= 8, row
    sts = rows["scores/bert_ours/STS-B.json"]
    assert sts == pytest.approx(
        {"score": 75.0, "pearson": 80.0, "spearman": 70.0, "best_epoch": 2, "gain": 75.0 - 15.0}
    )
    assert sts["score"] == pytest.approx(results["tasks"]["STS-B"]["score"])  # the table's number
    # another task: its table's columns, its first one as the score; the control has no gain
    assert rows["scores/bert_ours/conll2003.json"] == pytest.approx(
        {"score": 90.0, "f1": 90.0, "strict_f1": 91.0, "best_epoch": 2, "gain": 40.0}
    )
    assert "gain" not in rows["scores/random_init/SST-2.json"]
    glue = rows["scores/bert_ours/GLUE.json"]
    assert glue == pytest.approx(
        {"score": results["glue_score"], "tasks": 2, "gain": results["gain"]["glue_score"]}
    )


def test_long_tables_for_the_plots(written):
    out, results = written
    with (out / "task_scores.csv").open() as f:
        bars = list(csv.DictReader(f))
    assert list(bars[0]) == ["task", "system", "score"]
    scores = {(r["task"], r["system"]): float(r["score"]) for r in bars}
    assert scores[("SST-2", "BERT (ours)")] == pytest.approx(90.0)
    assert scores[("SST-2", "random init")] == pytest.approx(60.0)
    assert scores[("GLUE", "random init")] == pytest.approx(
        results["systems"]["random init"]["glue_score"]
    )
    with (out / "dev_curves.csv").open() as f:
        curves = list(csv.DictReader(f))
    assert list(curves[0]) == ["task", "system", "epoch", "score"]
    sst2 = [
        (r["epoch"], float(r["score"]))
        for r in curves
        if r["task"] == "SST-2" and r["system"] == "BERT (ours)"
    ]
    assert sst2 == [("1", pytest.approx(45.0)), ("2", pytest.approx(90.0))]
    assert len(curves) == 2 * 2 * 3  # epochs x systems x tasks


def test_results_without_history_still_get_their_rows(tmp_path):
    """metrics.json from before `epochs` / `best_epoch` (or hand-made): rows without best_epoch,
    a header-only curve table."""
    d = tmp_path / "ft"
    d.mkdir()
    (d / "metrics.json").write_text(json.dumps({"task": "RTE", "metrics": {"accuracy": 0.6}}))
    evaluate([str(d)], tmp_path / "eval")
    rows = _rows(tmp_path / "eval")
    assert rows["scores/bert_ours/RTE.json"] == pytest.approx({"score": 60.0, "accuracy": 60.0})
    assert (tmp_path / "eval/dev_curves.csv").read_text().strip() == "task,system,epoch,score"
