"""The Kubeflow pipeline: the committed spec is current, its parameters are params.yaml's, GPU
requests follow `use_gpu`, and the whole DAG runs end to end through kfp.local."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.pipeline_helpers import ROOT, SMALL, env_for

SPEC = ROOT / "pipelines" / "bert_pipeline.yaml"


def _compile(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "spec.yaml"
    env = env_for(ROOT, "sqlite:///unused.db")
    env.pop("BERT_IMAGE", None)
    cmd = [sys.executable, "-m", "pipelines.bert_pipeline", "compile", "--output", str(out)]
    subprocess.run([*cmd, *args], cwd=ROOT, env=env, check=True, capture_output=True)
    return out


def test_committed_spec_is_current(tmp_path):
    """Fails when pipelines/, components/ or params.yaml changed without recompiling:
    `python -m pipelines.bert_pipeline compile` rewrites pipelines/bert_pipeline.yaml."""
    fresh = _compile(tmp_path).read_text()
    assert fresh == SPEC.read_text(), "recompile: python -m pipelines.bert_pipeline compile"


def test_parameters_and_defaults_come_from_params_yaml():
    spec = yaml.safe_load(SPEC.read_text())
    inputs = spec["root"]["inputDefinitions"]["parameters"]
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    expected = {
        f"{section}_{key}": value
        for section, values in params.items()
        for key, value in values.items()
        if (section, key) != ("data", "output")
    }
    assert set(inputs) == set(expected)
    for name, value in expected.items():
        assert inputs[name]["defaultValue"] == value, name


def test_gpu_requests_follow_use_gpu_and_image_is_configurable(tmp_path):
    spec = yaml.safe_load(_compile(tmp_path, "--image", "registry.example/bert:1.2").read_text())
    executors = spec["deploymentSpec"]["executors"]
    images = {e["container"]["image"] for e in executors.values()}
    assert images == {"registry.example/bert:1.2"}
    gpu = {
        name: e["container"]["resources"]["accelerator"]
        for name, e in executors.items()
        if "accelerator" in e["container"].get("resources", {})
    }
    # pretrain and finetune (GLUE and token-level) of the GPU branch only, one GPU each
    assert sorted(n.removeprefix("exec-").rsplit("-", 1)[0] for n in gpu) == [
        "finetune",
        "finetune",
        "pretrain",
    ]
    for accelerator in gpu.values():
        assert accelerator["resourceType"] == "nvidia.com/gpu"
        assert accelerator["resourceCount"] == "1"
    dags = [c["dag"]["tasks"] for c in spec["components"].values() if "dag" in c]
    conditions = [
        t["triggerPolicy"]["condition"] for d in dags for t in d.values() if "triggerPolicy" in t
    ]
    assert len(conditions) == 2 and all("pretrain_use_gpu" in c for c in conditions)
    for executor in executors.values():  # nothing installed when a step starts
        assert "pip install" not in " ".join(executor["container"]["command"])


def test_token_tasks_fan_out_into_evaluate():
    """`finetune_token_tasks` (empty by default) drives a second ParallelFor over the same
    finetune component, on `data_token/<task>`, collected into evaluate beside the GLUE loop."""
    spec = yaml.safe_load(SPEC.read_text())
    root = spec["root"]["inputDefinitions"]["parameters"]
    assert root["finetune_token_tasks"]["parameterType"] == "LIST"
    assert root["finetune_token_tasks"]["defaultValue"] == []
    components = spec["components"]
    for variant in ("cpu", "gpu"):
        graph = components[f"comp-train-and-evaluate-{variant}"]["dag"]["tasks"]
        (loop_name,) = [
            name
            for name, task in graph.items()
            if task.get("parameterIterator", {}).get("items", {}).get("inputParameter")
            == "pipelinechannel--token_tasks"
        ]
        assert graph[loop_name]["taskInfo"]["name"] == "token-tasks"
        loop = components[graph[loop_name]["componentRef"]["name"]]["dag"]["tasks"]
        (finetune,) = loop.values()
        assert components[finetune["componentRef"]["name"]]["executorLabel"].startswith(
            "exec-finetune"
        )
        inputs = finetune["inputs"]["parameters"]
        assert inputs["glue_dir"]["componentInputParameter"] == "pipelinechannel--token_dir"
        assert inputs["task"]["componentInputParameter"] == "pipelinechannel--token_tasks-loop-item"
        assert inputs["max_eval_examples"]["componentInputParameter"] == (
            "pipelinechannel--tok_max_eval_examples"
        )
        evaluate = graph["evaluate"]["inputs"]["artifacts"]
        assert evaluate["token_results"]["taskOutputArtifact"]["producerTask"] == loop_name
        assert evaluate["results"]["taskOutputArtifact"]["producerTask"] != loop_name
    branches = [
        t
        for c in components.values()
        for t in c.get("dag", {}).get("tasks", {}).values()
        if t["componentRef"]["name"].startswith("comp-train-and-evaluate")
    ]
    assert len(branches) == 2
    for task in branches:
        wired = task["inputs"]["parameters"]
        assert wired["token_tasks"]["componentInputParameter"] == (
            "pipelinechannel--finetune_token_tasks"
        )
        assert wired["token_dir"]["componentInputParameter"] == "pipelinechannel--data_token"


@pytest.mark.slow
def test_whole_dag_runs_through_kfp_local(tmp_path, shared_data, monkeypatch):
    from mlflow import MlflowClient

    from bert_core import tracking

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = env_for(ROOT, uri)
    settings = {
        "data_corpus": str(shared_data / "corpus" / "a_christmas_carol.txt"),
        "data_glue": str(shared_data / "glue"),
        "finetune_tasks": ["SST-2", "STS-B"],  # a fan-out of two keeps CI time down
        **{
            f"{section}_{key}": value
            for section, values in SMALL.items()
            for key, value in values.items()
            if section != "data"
        },
    }
    cmd = [sys.executable, "-m", "pipelines.bert_pipeline", "local"]
    cmd += ["--pipeline-root", str(tmp_path / "root")]
    cmd += [a for k, v in settings.items() for a in ("--set", f"{k}={json.dumps(v)}")]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-5000:]
    plain = re.sub(r"\x1b\[[0-9;]*m", "", log)  # kfp.local colours its log
    assert "Pipeline 'bert-pipeline' finished with status SUCCESS" in plain

    (table,) = (tmp_path / "root").glob("bert-pipeline-*/evaluate*/table")
    markdown = table.read_text()
    for task in ("SST-2", "STS-B"):
        assert f"| {task} |" in markdown
    (metrics,) = (tmp_path / "root").glob("bert-pipeline-*/evaluate*/executor_output.json")
    scores = json.loads(metrics.read_text())["artifacts"]["metrics"]["artifacts"][0]["metadata"]
    assert {"glue_score", "SST-2.score", "STS-B.score"} <= set(scores)

    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    client = MlflowClient(uri)
    (parent,) = client.search_runs(
        [client.get_experiment_by_name(tracking.PIPELINE_EXPERIMENT).experiment_id],
        filter_string="tags.`bert.step` = 'pipeline'",
    )
    kfp_run_id = parent.data.tags["kfp.run_id"]
    steps = {r.data.tags["bert.step"]: r for r in tracking.child_runs(parent.info.run_id)}
    assert set(steps) == {
        "clean", "vocab", "instances", "pretrain", "finetune-SST-2", "finetune-STS-B", "evaluate",
    }  # fmt: skip
    for run in steps.values():
        assert run.data.tags["kfp.run_id"] == kfp_run_id
        assert run.info.status == "FINISHED"
    assert steps["evaluate"].data.metrics["glue_score"] == pytest.approx(scores["glue_score"])
    (version,) = client.search_model_versions(f"name='{tracking.REGISTERED_MODEL}'")
    assert version.run_id == steps["pretrain"].info.run_id
