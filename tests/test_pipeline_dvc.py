"""`make run` (dvc repro in an MLflow pipeline run) end to end, in a copy of the project.

Small settings (tests/pipeline_helpers.py): the same stages and commands as the default run.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.pipeline_helpers import env_for, project_copy


@pytest.fixture(scope="module")
def dvc_run(tmp_path_factory, shared_data):
    """The DAG run twice by `pipelines/run_dvc.py` (what `make run` runs)."""
    tmp = tmp_path_factory.mktemp("dvc")
    repo = project_copy(tmp, shared_data)
    env = env_for(repo, f"sqlite:///{tmp / 'mlflow.db'}")
    runs = []
    for _ in range(2):
        proc = subprocess.run(
            [sys.executable, "pipelines/run_dvc.py"],
            cwd=repo,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        runs.append(proc.stdout)
    return repo, env, runs


def _dvc(repo: Path, env: dict, *args: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "dvc", *args], cwd=repo, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.slow
def test_make_run_prints_glue_table_and_mlflow_command(dvc_run):
    repo, env, (first, _) = dvc_run
    results = json.loads((repo / "runs/dvc/evaluate/glue_results.json").read_text())
    assert sorted(results["tasks"]) == ["MRPC", "SST-2", "STS-B"]
    for task, row in results["tasks"].items():
        assert f"| {task} |" in first
        assert -100 <= row["score"] <= 100
    assert "GLUE score" in first
    assert f"mlflow ui --backend-store-uri {env['MLFLOW_TRACKING_URI']}" in first
    shown = json.loads(_dvc(repo, env, "metrics", "show", "--json"))
    (metrics,) = [d["data"] for d in shown.values()]
    (glue,) = metrics.values()
    assert glue["data"]["glue_score"] == pytest.approx(results["glue_score"])


@pytest.mark.slow
def test_second_repro_is_a_no_op(dvc_run):
    repo, env, (first, second) = dvc_run
    assert "Running stage 'pretrain'" in first
    assert "Running stage" not in second
    assert "none, all cached" in second
    assert "Data and pipelines are up to date" in _dvc(repo, env, "repro")


@pytest.mark.slow
def test_params_are_wired_to_their_stages(dvc_run):
    """`dvc exp run -S model.preset=mini` works through the same params: changing a key marks
    exactly the stages reading it as changed (a whole mini run is too slow for CI)."""
    repo, env, _ = dvc_run
    original = (repo / "params.yaml").read_text()
    cases = [
        ("model", "preset", "mini", {"pretrain"}),
        ("vocab", "vocab_size", 1200, {"vocab"}),
        ("instances", "dupe_factor", 2, {"instances"}),
        ("finetune", "epochs", 2, {"finetune@SST-2", "finetune@MRPC", "finetune@STS-B"}),
        ("finetune", "tasks", ["SST-2", "MRPC", "STS-B", "CoLA"], {"evaluate", "finetune@CoLA"}),
    ]
    try:
        for section, key, value, stages in cases:
            params = yaml.safe_load(original)
            params[section][key] = value
            (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
            changed = set(json.loads(_dvc(repo, env, "status", "--json")))
            assert changed == stages, (section, key, changed)
    finally:
        (repo / "params.yaml").write_text(original)
    assert json.loads(_dvc(repo, env, "status", "--json")) == {}


@pytest.mark.slow
def test_mlflow_pipeline_run_with_nested_steps_and_lineage(dvc_run, monkeypatch):
    from mlflow import MlflowClient

    from bert_core import lineage

    repo, env, _ = dvc_run
    monkeypatch.setenv("MLFLOW_TRACKING_URI", env["MLFLOW_TRACKING_URI"])
    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    experiment = client.get_experiment_by_name(lineage.PIPELINE_EXPERIMENT)
    parents = client.search_runs(
        [experiment.experiment_id],
        filter_string="tags.`bert.step` = 'pipeline'",
        order_by=["attributes.start_time ASC"],
    )
    assert len(parents) == 2
    first, second = parents
    lock = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]
    corpus_md5 = lock["clean"]["deps"][0]["md5"]
    assert first.data.tags["dvc.input.../shared/data/corpus/a_christmas_carol.txt"] == corpus_md5
    assert (
        first.data.tags["mlflow.source.git.commit"]
        == subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True
        ).stdout.strip()
    )
    assert first.data.params["model.preset"] == "tiny"
    assert first.data.metrics["glue_score"] == pytest.approx(second.data.metrics["glue_score"])

    children = {r.data.tags["dvc.stage"]: r for r in lineage.child_runs(first.info.run_id)}
    assert set(children) == set(lock)  # one nested run per stage, all in this experiment
    for stage, run in children.items():
        assert run.info.experiment_id == experiment.experiment_id
        assert run.info.status == "FINISHED"
        for dep in lock[stage]["deps"]:
            assert run.data.tags[f"dvc.dep.{dep['path']}"] == dep["md5"], stage
    assert children["pretrain"].data.metrics["loss"] > 0
    assert 0 <= children["finetune@SST-2"].data.metrics["best_dev_accuracy"] <= 1
    assert children["evaluate"].data.metrics["glue_score"] == first.data.metrics["glue_score"]
    # the parent run holds the evaluate step's metrics, at its scale (fractions)
    results = {k: v for k, v in first.data.metrics.items() if k != "pipeline_seconds"}
    assert results == children["evaluate"].data.metrics
    assert {"glue_score", "SST-2.score", "SST-2.accuracy", "STS-B.pearson"} <= set(results)
    assert all(-1 <= v <= 1 for v in results.values()), results
    assert lineage.child_runs(second.info.run_id) == []  # cached: nothing re-ran

    (version,) = client.search_model_versions(f"name='{lineage.REGISTERED_MODEL}'")
    assert version.run_id == children["pretrain"].info.run_id
    from bert_core.serving import local_model

    # an MLflow model (pyfunc: masked-token filling) holding the HF-layout folder
    with local_model(f"models:/{lineage.REGISTERED_MODEL}/1") as (folder, _):
        files = {f.name for f in folder.iterdir()}
    assert {"config.json", "model.safetensors", "vocab.txt"} <= files

    table = subprocess.run(
        [sys.executable, "-m", "bert_core", "runs"],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert first.info.run_id[:8] in table and second.info.run_id[:8] in table
    shown = [float(x) for x in re.findall(r"-?\d+\.\d+", table)]  # 40.20 may print as 40.2
    percent = 100 * first.data.metrics["glue_score"]  # `bert runs` shows scores in percent
    assert any(abs(x - percent) < 0.006 for x in shown), table


def test_token_tasks_are_a_foreach_stage_feeding_evaluate(tmp_path, shared_data):
    """No training: an empty `finetune.token_tasks` (the default) makes no token stage, and
    listing conll2003 adds `finetune-token@conll2003` (on the shared CoNLL folder, after
    pretrain) upstream of `evaluate`."""
    repo = project_copy(tmp_path, shared_data)
    env = env_for(repo, f"sqlite:///{tmp_path / 'mlflow.db'}")
    params = yaml.safe_load((repo / "params.yaml").read_text())
    assert params["finetune"]["token_tasks"] == []
    assert "finetune-token" not in _dvc(repo, env, "stage", "list")
    assert '"finetune@SST-2" -> "evaluate"' in _dvc(repo, env, "dag", "--dot")

    params["finetune"]["token_tasks"] = ["conll2003"]
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    stages = {
        line.split()[0]: line for line in _dvc(repo, env, "stage", "list").splitlines() if line
    }
    assert "finetune-token@conll2003" in stages
    assert stages["finetune-token@conll2003"].endswith("runs/dvc/glue/conll2003")
    dag = _dvc(repo, env, "dag", "--dot")
    assert '"pretrain" -> "finetune-token@conll2003"' in dag
    assert '"finetune-token@conll2003" -> "evaluate"' in dag
    status = json.loads(_dvc(repo, env, "status", "--json"))  # nothing has run in this copy
    assert {"finetune-token@conll2003", "evaluate"} <= set(status)
    (deps,) = [d["changed deps"] for d in status["finetune-token@conll2003"] if "changed deps" in d]
    assert any(Path(dep).as_posix().endswith("shared/data/conll2003") for dep in deps), deps
