"""The Kubeflow pipeline: the committed spec is current, its parameters are params.yaml's (the
data's are the cluster's), every task gets the cluster's ConfigMap and Secrets, the fine-tuning
tasks' image and GPUs are run-time parameters, data digests reach the cache keys, pretrain is
retried, and the whole DAG runs end to end through kfp.local. (The compiled spec run as pods:
tests/test_cluster_harness.py.)"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from bert_core import cli, storage
from bert_core.errors import BertError
from pipelines import cluster
from pipelines.bert_pipeline import DEFAULTS, RUNTIME, P, fine_tunings, section
from tests.pipeline_helpers import ROOT, SMALL, env_for

SPEC = ROOT / "pipelines" / "bert_pipeline.yaml"


def _compile(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "spec.yaml"
    env = env_for(ROOT, "sqlite:///unused.db")
    env.pop("BERT_IMAGE", None)
    env.pop("BERT_TRAIN_IMAGE", None)
    cmd = [sys.executable, "-m", "pipelines.bert_pipeline", "compile", "--output", str(out)]
    subprocess.run([*cmd, *args], cwd=ROOT, env=env, check=True, capture_output=True)
    return out


def _load(path: Path) -> tuple[dict, dict]:
    """The compiled file: the pipeline spec, then the Kubernetes platform spec."""
    pipeline, platform = yaml.safe_load_all(path.read_text())
    return pipeline, platform


def _container_tasks(spec: dict) -> dict[str, dict]:
    """Every task that runs a container, by name (unique here), with its executor label."""
    components = spec["components"]
    out = {}
    for c in [*components.values(), spec["root"]]:
        for name, task in c.get("dag", {}).get("tasks", {}).items():
            label = components[task["componentRef"]["name"]].get("executorLabel")
            if label:
                assert name not in out, name
                out[name] = {**task, "executor": label}
    return out


def test_committed_spec_is_current(tmp_path):
    """Fails when pipelines/, components/ or params.yaml changed without recompiling:
    `python -m pipelines.bert_pipeline compile` rewrites pipelines/bert_pipeline.yaml."""
    fresh = _compile(tmp_path).read_text()
    assert fresh == SPEC.read_text(), "recompile: python -m pipelines.bert_pipeline compile"


def test_parameter_defaults_are_params_yaml_but_the_data_is_the_clusters():
    spec, _ = _load(SPEC)
    inputs = spec["root"]["inputDefinitions"]["parameters"]
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    expected = {
        f"{section}_{key}": value
        for section, values in params.items()
        for key, value in values.items()
        if (section, key) != ("data", "output")
    }
    assert set(inputs) == set(expected) | set(RUNTIME)
    for name, value in expected.items():
        wanted = cluster.DATA.get(name, value)  # a pod has no ../shared: s3:// defaults
        assert inputs[name]["defaultValue"] == wanted == DEFAULTS[name], name
    for name, uri in cluster.DATA.items():
        assert uri.startswith(f"{cluster.BUCKET}/data") and P[name] == params["data"][name[5:]]
    assert inputs["train_image"]["defaultValue"] == cluster.IMAGE
    assert inputs["gpus"] == {"defaultValue": 0.0, "isOptional": True, "parameterType": (
        "NUMBER_INTEGER")}  # fmt: skip


def test_settings_reach_each_step_grouped_by_params_yaml_section():
    """A params.yaml section is its step's inputs (`section_key` -> `key`); the control is the
    GLUE fine-tuning with `init=random` over its own task list; the token-level fine-tuning
    takes the GLUE batch size, learning rate and sweep, and its own slice sizes."""
    assert section(P, "instances") == {
        "max_seq_length": P["instances_max_seq_length"],
        "max_predictions_per_seq": P["instances_max_predictions_per_seq"],
        "masked_lm_prob": P["instances_masked_lm_prob"],
        "dupe_factor": P["instances_dupe_factor"],
        "random_seed": P["instances_random_seed"],
        "masking_recipe": P["instances_masking_recipe"],
    }
    glue, control, token = fine_tunings(P)
    assert (glue.tasks, glue.data_dir, glue.digest) == (
        P["finetune_tasks"], P["data_glue"], "glue_digest"
    )  # fmt: skip
    assert (token.tasks, token.data_dir, token.digest) == (
        P["finetune_token_tasks"], P["data_token"], "token_digest"
    )  # fmt: skip
    own = ["epochs", "max_seq_length", "max_train_examples"]
    shared_keys = ("batch_size", "learning_rate", "lr_sweep", "restarts")
    shared = {k: P[f"finetune_{k}"] for k in shared_keys}
    assert glue.inputs == {**shared, **{k: P[f"finetune_{k}"] for k in own}}
    assert (control.tasks, control.data_dir, control.digest) == (
        P["finetune_control_tasks"], P["data_glue"], "glue_digest"
    )  # fmt: skip
    assert control.inputs == {**glue.inputs, "init": "random"}
    own.append("max_eval_examples")
    assert token.inputs == {**shared, **{k: P[f"finetune_token_{k}"] for k in own}}


def test_every_task_gets_the_config_map_the_secrets_and_the_run_id(tmp_path):
    """Task by task, the platform spec loads the ConfigMap and the S3 Secret (required: a pod
    without them does not start), the MLflow auth Secret (optional), and the run id label."""
    spec, platform = _load(SPEC)
    env = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    tasks = _container_tasks(spec)
    assert set(tasks) == {
        "pipeline-run", "clean", "vocab", "instances", "pretrain", "finetune", "finetune-2",
        "finetune-3", "evaluate", "pipeline-end",
    }  # fmt: skip
    assert set(env) == {t["executor"] for t in tasks.values()}
    for name, task in tasks.items():
        pod = env[task["executor"]]
        assert set(pod) == {"configMapAsEnv", "secretAsEnv", "fieldPathAsEnv"}, name
        (config,) = pod["configMapAsEnv"]
        assert config["configMapName"] == cluster.CONFIG_MAP and config["optional"] is False
        assert [(k["configMapKey"], k["envVar"]) for k in config["keyToEnv"]] == [
            (key, key) for key in cluster.CONFIG_KEYS
        ], name
        s3, auth = pod["secretAsEnv"]
        assert (s3["secretName"], s3["optional"]) == (cluster.SECRET, False), name
        assert [k["secretKey"] for k in s3["keyToEnv"]] == list(cluster.SECRET_KEYS)
        assert (auth["secretName"], auth["optional"]) == (cluster.AUTH_SECRET, True), name
        assert [k["envVar"] for k in auth["keyToEnv"]] == list(cluster.AUTH_KEYS)
        assert pod["fieldPathAsEnv"] == [
            {"name": "KFP_RUN_ID", "fieldPath": "metadata.labels['pipeline/runid']"}
        ], name
    # the credentials are never in the pipeline spec itself
    assert not set(cluster.SECRET_KEYS) & set(yaml.safe_dump(spec).split())


def test_one_branch_the_training_image_and_gpus_are_run_time_parameters(tmp_path):
    """No GPU/CPU branches: the fine-tuning tasks run the `train_image` parameter's image with
    `gpus` GPUs (placeholders the backend fills per run); every other task, pretrain included
    (its training runs on the RayCluster), runs the CPU image and asks for no GPU."""
    spec, _ = _load(_compile(tmp_path, "--image", "reg.example/bert:1.2", "--train-image",
                             "reg.example/bert-cuda:1.2"))  # fmt: skip
    executors = spec["deploymentSpec"]["executors"]
    tasks = _container_tasks(spec)
    training = {"finetune", "finetune-2", "finetune-3"}  # GLUE, the control, token-level
    for name, task in tasks.items():
        container = executors[task["executor"]]["container"]
        accelerator = container.get("resources", {}).get("accelerator")
        if name in training:
            assert container["image"] == "{{$.inputs.parameters['pipelinechannel--train_image']}}"
            assert accelerator["resourceType"] == "nvidia.com/gpu"
            assert (
                accelerator["resourceCount"] == "{{$.inputs.parameters['pipelinechannel--gpus']}}"
            )
        else:
            assert container["image"] == "reg.example/bert:1.2", name
            assert accelerator is None, name
        assert "pip install" not in " ".join(container["command"])  # nothing installed at start
    params = spec["root"]["inputDefinitions"]["parameters"]
    assert params["train_image"]["defaultValue"] == "reg.example/bert-cuda:1.2"
    dags = [c["dag"]["tasks"] for c in spec["components"].values() if "dag" in c]
    assert not [t for d in dags for t in d.values() if "condition" in t.get("triggerPolicy", {})]
    assert tasks["pretrain"]["inputs"]["parameters"]["use_gpu"] == {
        "componentInputParameter": "pipelinechannel--pretrain_use_gpu"
    }  # the Ray job's workers: GPUs of the RayCluster


def test_every_input_a_task_reads_is_declared_by_its_dag():
    """A task's `componentInputParameter` / `componentInputArtifact` must be an input of the DAG
    that holds it, or the backend cannot resolve it at run time. kfp 2.17 forgets the channel of
    `set_accelerator_limit` inside a ParallelFor (the pod harness found it); the pipeline
    registers it by hand, and this keeps every such reference honest."""
    spec, _ = _load(SPEC)
    for name, component in [*spec["components"].items(), ("root", spec["root"])]:
        declared = component.get("inputDefinitions", {})
        for task_name, task in component.get("dag", {}).get("tasks", {}).items():
            for kind, ref in (("parameters", "componentInputParameter"),
                              ("artifacts", "componentInputArtifact")):  # fmt: skip
                for key, src in task.get("inputs", {}).get(kind, {}).items():
                    if ref in src:
                        assert src[ref] in declared.get(kind, {}), (name, task_name, key)
    loops = [c for n, c in spec["components"].items() if n.startswith("comp-for-loop")]
    assert len(loops) == 3
    for loop in loops:
        assert "pipelinechannel--gpus" in loop["inputDefinitions"]["parameters"]


def test_data_digests_reach_the_cache_keys_of_the_steps_reading_the_data():
    """KFP's cache key sees a step's parameter values, not the data behind a URI: the uncached
    first task outputs each data input's digest and the steps reading that data take it as an
    input, so new data at the same URI re-runs them."""
    spec, _ = _load(SPEC)
    outputs = spec["components"]["comp-pipeline-run"]["outputDefinitions"]["parameters"]
    assert set(outputs) == {"corpus_digest", "glue_digest", "token_digest"}
    tasks = _container_tasks(spec)
    assert tasks["clean"]["inputs"]["parameters"]["corpus_digest"] == {
        "taskOutputParameter": {
            "outputParameterKey": "corpus_digest",
            "producerTask": "pipeline-run",
        }
    }
    graph = spec["components"]["comp-exit-handler-1"]["dag"]["tasks"]
    for loop, digest in (("glue-tasks", "glue_digest"), ("token-tasks", "token_digest")):
        (task,) = [t for t in graph.values() if t["taskInfo"]["name"] == loop]
        channel = f"pipelinechannel--pipeline-run-{digest}"
        assert task["inputs"]["parameters"][channel]["taskOutputParameter"] == {
            "outputParameterKey": digest, "producerTask": "pipeline-run"
        }  # fmt: skip
        (finetune,) = spec["components"][task["componentRef"]["name"]]["dag"]["tasks"].values()
        assert finetune["inputs"]["parameters"]["data_digest"] == {
            "componentInputParameter": channel
        }
    assert tasks["pipeline-run"]["cachingOptions"] == {}  # never cached: always fresh digests


def test_pretrain_alone_is_retried_with_backoff():
    tasks = _container_tasks(_load(SPEC)[0])
    assert tasks["pretrain"]["retryPolicy"] == {
        "maxRetryCount": 3, "backoffDuration": "60s", "backoffFactor": 2.0,
        "backoffMaxDuration": "3600s",
    }  # fmt: skip
    assert [n for n, t in tasks.items() if "retryPolicy" in t] == ["pretrain"]


def test_caching_is_on_and_the_run_id_reaches_steps_outside_the_cache_key():
    """KFP's cache key is a step's inputs, outputs and command: a run id among the inputs would
    change every key, so no run could reuse a step. Every step is cached, takes nothing
    run-specific, and reads the run id from its pod's `pipeline/runid` label instead (see the
    platform spec test). Two small uncached tasks bracket the DAG: the first opens the MLflow
    parent run with the settings, the exit handler closes it."""
    spec, _ = _load(SPEC)
    named = _container_tasks(spec)
    uncached = {name for name, t in named.items() if t["cachingOptions"] != {"enableCache": True}}
    assert uncached == {"pipeline-run", "pipeline-end"}
    assert named["pipeline-run"]["cachingOptions"] == named["pipeline-end"]["cachingOptions"] == {}
    assert named["clean"]["dependentTasks"] == ["pipeline-run"]
    root = spec["root"]["dag"]["tasks"]
    assert root["pipeline-end"]["triggerPolicy"]["strategy"] == "ALL_UPSTREAM_TASKS_COMPLETED"
    (body,) = root["pipeline-end"]["dependentTasks"]  # the exit handler holds all the rest
    assert body in root and len(root) == 2
    inputs = named["pipeline-run"]["inputs"]["parameters"]
    settings = set(inputs["settings"]["runtimeValue"]["constant"])
    lists = {"finetune.tasks", "finetune.control_tasks", "finetune.token_tasks"}  # own inputs
    expected = {k.replace("_", ".", 1) for k in P} | {f"kfp.{k}" for k in RUNTIME}
    assert settings | lists == expected and not settings & lists
    assert inputs["tasks"]["componentInputParameter"] == "pipelinechannel--finetune_tasks"
    text = yaml.safe_dump(spec)
    assert "pipeline_job" not in text and "run_id" not in text


def _loop(spec: dict, tasks: str, display: str) -> tuple[dict, str, dict]:
    """The ParallelFor over the list parameter `tasks`: the graph holding it, its name, and its
    one task, a finetune component."""
    components = spec["components"]
    graph = components["comp-exit-handler-1"]["dag"]["tasks"]
    (loop_name,) = [
        name
        for name, task in graph.items()
        if task.get("parameterIterator", {}).get("items", {}).get("inputParameter")
        == f"pipelinechannel--{tasks}"
    ]
    assert graph[loop_name]["taskInfo"]["name"] == display
    loop = components[graph[loop_name]["componentRef"]["name"]]["dag"]["tasks"]
    (finetune,) = loop.values()
    assert components[finetune["componentRef"]["name"]]["executorLabel"].startswith("exec-finetune")
    return graph, loop_name, finetune


def test_the_random_init_control_fans_out_into_evaluate():
    """`finetune_control_tasks` (params.yaml's, the GLUE tasks by default) drives a ParallelFor
    over the same finetune component with `init=random`, collected into evaluate, which makes
    it the "random init" row; the sweep settings reach both GLUE loops."""
    spec, _ = _load(SPEC)
    root = spec["root"]["inputDefinitions"]["parameters"]
    assert root["finetune_control_tasks"]["defaultValue"] == P["finetune_control_tasks"]
    graph, loop_name, finetune = _loop(spec, "finetune_control_tasks", "control-tasks")
    inputs = finetune["inputs"]["parameters"]
    assert inputs["init"]["runtimeValue"]["constant"] == "random"
    assert inputs["data_dir"]["componentInputParameter"] == "pipelinechannel--data_glue"
    _, _, glue = _loop(spec, "finetune_tasks", "glue-tasks")
    assert "init" not in glue["inputs"]["parameters"]  # the default: pretrained
    for task in (finetune, glue):
        for key in ("lr_sweep", "restarts"):
            source = task["inputs"]["parameters"][key]["componentInputParameter"]
            assert source == f"pipelinechannel--finetune_{key}"
    evaluate = graph["evaluate"]["inputs"]["artifacts"]
    assert evaluate["control_results"]["taskOutputArtifact"]["producerTask"] == loop_name


def test_token_tasks_fan_out_into_evaluate():
    """`finetune_token_tasks` (empty by default) drives a second ParallelFor over the same
    finetune component, on `data_token/<task>`, collected into evaluate beside the GLUE loop."""
    spec, _ = _load(SPEC)
    root = spec["root"]["inputDefinitions"]["parameters"]
    assert root["finetune_token_tasks"]["parameterType"] == "LIST"
    assert root["finetune_token_tasks"]["defaultValue"] == []
    graph, loop_name, finetune = _loop(spec, "finetune_token_tasks", "token-tasks")
    inputs = finetune["inputs"]["parameters"]
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


def test_a_kfp_step_without_a_tracking_server_fails_at_once(tmp_path, monkeypatch):
    """Under KFP (KFP_RUN_ID set) without MLFLOW_TRACKING_URI a step would log to a SQLite file
    in its pod, lost with it: every kfp_* call refuses, before it runs anything."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KFP_RUN_ID", "run-without-config")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("BERT_PARENT_RUN_ID", "")
    for call in (
        lambda: cli.kfp_step(["runs"]),
        lambda: cli.kfp_pipeline_run({"data.corpus": str(tmp_path)}),
        lambda: cli.kfp_pipeline_end("SUCCEEDED"),
        lambda: cli.kfp_register_pretrained(tmp_path),
    ):
        with pytest.raises(BertError, match="without MLFLOW_TRACKING_URI.*bert-pipeline-env"):
            call()
    assert list(tmp_path.iterdir()) == []  # no mlflow.db


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
        "finetune_control_tasks": ["SST-2"],  # and one random-init control
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
    # the data inputs' content digests (local paths here), recorded as MLflow dataset inputs
    inputs = {d.dataset.name: d.dataset for d in parent.inputs.dataset_inputs}
    assert inputs["corpus"].digest == storage.digest(settings["data_corpus"])
    glue_dirs = [f"{settings['data_glue']}/{t}" for t in settings["finetune_tasks"]]
    assert inputs["glue"].digest == storage.digest(*glue_dirs) and "token" not in inputs
    steps = {r.data.tags["bert.step"]: r for r in lineage.child_runs(parent.info.run_id)}
    assert set(steps) == {
        "clean", "vocab", "instances", "pretrain", "finetune-SST-2", "finetune-STS-B",
        "finetune-SST-2-random", "evaluate",
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
