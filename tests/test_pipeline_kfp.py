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

from pipelines.bert_pipeline import TRAINING, P, fine_tunings, section
from tests.pipeline_helpers import ROOT, SMALL, env_for

SPEC = ROOT / "pipelines" / "bert_pipeline.yaml"


def _compile(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "spec.yaml"
    env = env_for(ROOT, "sqlite:///unused.db")
    env.pop("BERT_IMAGE", None)
    cmd = [sys.executable, "-m", "pipelines.bert_pipeline", "compile", "--output", str(out)]
    subprocess.run([*cmd, *args], cwd=ROOT, env=env, check=True, capture_output=True)
    return out


def _load(path: Path) -> tuple[dict, dict]:
    """The compiled file: the pipeline spec, then the Kubernetes platform spec."""
    pipeline, platform = yaml.safe_load_all(path.read_text())
    return pipeline, platform


def test_committed_spec_is_current(tmp_path):
    """Fails when pipelines/, components/ or params.yaml changed without recompiling:
    `python -m pipelines.bert_pipeline compile` rewrites pipelines/bert_pipeline.yaml."""
    fresh = _compile(tmp_path).read_text()
    assert fresh == SPEC.read_text(), "recompile: python -m pipelines.bert_pipeline compile"


def test_parameters_and_defaults_come_from_params_yaml():
    spec, _ = _load(SPEC)
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


def test_settings_reach_each_step_grouped_by_params_yaml_section():
    """A params.yaml section is its step's inputs (`section_key` -> `key`); the token-level
    fine-tuning takes the GLUE batch size and learning rate, and its own slice sizes."""
    assert section(P, "instances") == {
        "max_seq_length": P["instances_max_seq_length"],
        "max_predictions_per_seq": P["instances_max_predictions_per_seq"],
        "masked_lm_prob": P["instances_masked_lm_prob"],
        "dupe_factor": P["instances_dupe_factor"],
        "random_seed": P["instances_random_seed"],
    }
    glue, token = fine_tunings(P)
    assert (glue.tasks, glue.data_dir) == (P["finetune_tasks"], P["data_glue"])
    assert (token.tasks, token.data_dir) == (P["finetune_token_tasks"], P["data_token"])
    own = ["epochs", "max_seq_length", "max_train_examples"]
    shared = {k: P[f"finetune_{k}"] for k in ("batch_size", "learning_rate")}
    assert glue.inputs == {**shared, **{k: P[f"finetune_{k}"] for k in own}}
    own.append("max_eval_examples")
    assert token.inputs == {**shared, **{k: P[f"finetune_token_{k}"] for k in own}}
    assert "pretrain_use_gpu" not in TRAINING and "data_corpus" not in TRAINING


def test_gpu_requests_follow_use_gpu_and_image_is_configurable(tmp_path):
    spec, _ = _load(_compile(tmp_path, "--image", "registry.example/bert:1.2"))
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


def test_caching_is_on_and_the_run_id_reaches_steps_outside_the_cache_key():
    """KFP's cache key is a step's inputs, outputs and command: a run id among the inputs would
    change every key, so no run could reuse a step. Every step is cached, takes nothing
    run-specific, and reads the run id from its pod's `pipeline/runid` label instead. Two small
    uncached tasks bracket the DAG: the first opens the MLflow parent run with the settings,
    the exit handler closes it."""
    spec, platform = _load(SPEC)
    tasks = [
        (name, t)
        for c in [*spec["components"].values(), spec["root"]]
        for name, t in c.get("dag", {}).get("tasks", {}).items()
        if "executorLabel" in spec["components"][t["componentRef"]["name"]]
    ]
    # pipeline-run, clean, vocab, instances + 2 branches x (pretrain, 2 finetune, evaluate),
    # and the exit handler's pipeline-end
    assert len(tasks) == 13
    named = dict(tasks)  # the names used below are unique
    uncached = {name for name, t in tasks if t["cachingOptions"] != {"enableCache": True}}
    assert uncached == {"pipeline-run", "pipeline-end"}
    assert named["pipeline-run"]["cachingOptions"] == named["pipeline-end"]["cachingOptions"] == {}
    assert named["clean"]["dependentTasks"] == ["pipeline-run"]
    root = spec["root"]["dag"]["tasks"]
    assert root["pipeline-end"]["triggerPolicy"]["strategy"] == "ALL_UPSTREAM_TASKS_COMPLETED"
    (body,) = root["pipeline-end"]["dependentTasks"]  # the exit handler holds all the rest
    assert body in root and len(root) == 2
    inputs = named["pipeline-run"]["inputs"]["parameters"]
    settings = set(inputs["settings"]["runtimeValue"]["constant"])
    lists = {"finetune.tasks", "finetune.token_tasks"}  # their own inputs, not inside the dict
    assert settings | lists == {k.replace("_", ".", 1) for k in P} and not settings & lists
    assert inputs["tasks"]["componentInputParameter"] == "pipelinechannel--finetune_tasks"
    text = yaml.safe_dump(spec)
    assert "pipeline_job" not in text and "run_id" not in text
    executors = spec["deploymentSpec"]["executors"]
    env = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    assert set(env) == set(executors)
    for name in executors:
        assert env[name]["fieldPathAsEnv"] == [
            {"name": "KFP_RUN_ID", "fieldPath": "metadata.labels['pipeline/runid']"}
        ], name


def test_token_tasks_fan_out_into_evaluate():
    """`finetune_token_tasks` (empty by default) drives a second ParallelFor over the same
    finetune component, on `data_token/<task>`, collected into evaluate beside the GLUE loop."""
    spec, _ = _load(SPEC)
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
            == "pipelinechannel--finetune_token_tasks"
        ]
        assert graph[loop_name]["taskInfo"]["name"] == "token-tasks"
        loop = components[graph[loop_name]["componentRef"]["name"]]["dag"]["tasks"]
        (finetune,) = loop.values()
        assert components[finetune["componentRef"]["name"]]["executorLabel"].startswith(
            "exec-finetune"
        )
        inputs = finetune["inputs"]["parameters"]
        # the sub-pipeline's inputs keep the pipeline parameters' names
        assert inputs["data_dir"]["componentInputParameter"] == "pipelinechannel--data_token"
        assert inputs["task"]["componentInputParameter"] == (
            "pipelinechannel--finetune_token_tasks-loop-item"
        )
        assert inputs["max_eval_examples"]["componentInputParameter"] == (
            "pipelinechannel--finetune_token_max_eval_examples"
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
        assert wired["finetune_token_tasks"]["componentInputParameter"] == (
            "pipelinechannel--finetune_token_tasks"
        )
        assert wired["data_token"]["componentInputParameter"] == "pipelinechannel--data_token"


@pytest.mark.slow
def test_whole_dag_runs_through_kfp_local(tmp_path, shared_data, monkeypatch):
    from mlflow import MlflowClient

    from bert_core import lineage

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
        [client.get_experiment_by_name(lineage.PIPELINE_EXPERIMENT).experiment_id],
        filter_string="tags.`bert.step` = 'pipeline'",
    )
    kfp_run_id = parent.data.tags["kfp.run_id"]
    assert kfp_run_id.startswith("local-")
    assert parent.info.status == "FINISHED"  # closed by the exit handler
    # the settings, logged by the uncached first task as DVC's parent logs them (types restored)
    assert parent.data.params["pretrain.steps"] == "20"
    assert parent.data.params["model.preset"] == P["model_preset"]
    assert parent.data.params["finetune.tasks"] == "['SST-2', 'STS-B']"
    assert parent.data.params["pretrain.learning_rate"] == str(P["pretrain_learning_rate"])
    steps = {r.data.tags["bert.step"]: r for r in lineage.child_runs(parent.info.run_id)}
    assert set(steps) == {
        "clean", "vocab", "instances", "pretrain", "finetune-SST-2", "finetune-STS-B", "evaluate",
    }  # fmt: skip
    for run in steps.values():
        assert run.data.tags["kfp.run_id"] == kfp_run_id
        assert run.info.status == "FINISHED"
    assert steps["evaluate"].data.metrics["glue_score"] == pytest.approx(scores["glue_score"])
    # the KFP UI's numbers are the evaluate step's MLflow metrics: same names, same scale
    assert steps["evaluate"].data.metrics == pytest.approx(scores)
    assert all(-1 <= v <= 1 for v in scores.values()), scores
    (version,) = client.search_model_versions(f"name='{lineage.REGISTERED_MODEL}'")
    assert version.run_id == steps["pretrain"].info.run_id
