"""The Kubeflow pipeline: the committed spec is current, its parameters are the KFP UI's run form
(described, grouped, with a cluster's defaults; params.yaml's settings are all there), every
task gets the cluster's ConfigMap and Secrets and its requests and limits, the fine-tuning
tasks' image, GPUs and nodes are run-time parameters, one fan-out runs every fine-tuning, data
digests reach the cache keys, pretrain is retried, and the whole DAG runs end to end through
kfp.local. (The compiled spec by the backend's rules: tests/pipelines/test_kfp_backend.py; run as
pods: tests/pipelines/test_cluster_harness.py.)"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from bert_core import cli, storage
from bert_core.errors import BertError
from bert_core.finetune.jobs import finetune_jobs
from pipelines import cluster, presets
from pipelines.bert_pipeline import (
    ADVANCED,
    ADVANCED_DEFAULTS,
    DEFAULTS,
    FORM,
    PARAMETERS,
    RESOURCES,
    RUNTIME,
    P,
    check,
    form_arguments,
    parse_overrides,
    section,
)
from tests.pipeline_helpers import ROOT, SMALL, env_for, shared_slice

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


def _container_tasks(spec: dict, branch: str = "phase2") -> dict[str, dict]:
    """Every task that runs a container, by its display name (`pod`'s), with its executor label.
    The fan-out is in both branches of phase two (`branch`: the one whose copy is returned;
    `test_both_branches_hold_the_same_fan_out` checks that the copies are the same)."""
    components = spec["components"]
    out = {}

    def walk(component: dict) -> None:
        for task in component.get("dag", {}).get("tasks", {}).values():
            name, sub = task["taskInfo"]["name"], components[task["componentRef"]["name"]]
            if "dag" in sub:
                if name in ("phase2", "phase1-only") and name != branch:
                    continue
                walk(sub)
            elif label := sub.get("executorLabel"):
                assert name not in out, name
                out[name] = {**task, "executor": label}

    walk(spec["root"])
    return out


def _branches(spec: dict) -> dict[str, dict]:
    """Phase two's branches (`dsl.If` / `dsl.Else`) by display name: their task specs."""
    body = spec["components"]["comp-exit-handler-1"]["dag"]["tasks"]
    (branches,) = [t for t in body.values() if t["taskInfo"]["name"].startswith("condition-")]
    tasks = spec["components"][branches["componentRef"]["name"]]["dag"]["tasks"]
    return {t["taskInfo"]["name"]: t for t in tasks.values()}


@dataclass
class FanOut:
    """A branch's fine-tuning fan-out in the compiled spec: the loop task (`name`, `task`), the
    tasks beside it in the branch, and those in each iteration (`body`), by spec name."""

    name: str
    task: dict
    beside: dict[str, dict]
    body: dict[str, dict]

    def named(self, display: str) -> tuple[str, dict]:
        """(spec name, task) of the iteration's task shown as `display`."""
        (found,) = [(n, t) for n, t in self.body.items() if t["taskInfo"]["name"] == display]
        return found


def _fan_outs(spec: dict) -> dict[str, FanOut]:
    """The fine-tuning fan-out of each branch of phase two, by the branch's display name."""
    components, out = spec["components"], {}
    for name, branch in _branches(spec).items():
        tasks = components[branch["componentRef"]["name"]]["dag"]["tasks"]
        ((loop, task),) = [(n, t) for n, t in tasks.items() if "parameterIterator" in t]
        body = components[task["componentRef"]["name"]]["dag"]["tasks"]
        out[name] = FanOut(loop, task, tasks, body)
    return out


def test_committed_spec_is_current(tmp_path):
    """Fails when pipelines/, components/ or params.yaml changed without recompiling:
    `python -m pipelines.bert_pipeline compile` rewrites pipelines/bert_pipeline.yaml."""
    fresh = _compile(tmp_path).read_text()
    assert fresh == SPEC.read_text(), "recompile: python -m pipelines.bert_pipeline compile"


def test_the_run_form_has_the_clusters_defaults_and_a_description_for_every_parameter():
    """The KFP UI's run form: a setting per params.yaml key (`section_key`) and the `cluster_*`
    ones, the usual ones as fields and the others inside the one `advanced_settings` object,
    each field with a description saying its group, named so the UI (which lists them by name)
    keeps each group together; the defaults are a cluster's (a first run, data in the bucket),
    not params.yaml's, which stay the workstation's."""
    spec, _ = _load(SPEC)
    inputs = spec["root"]["inputDefinitions"]["parameters"]
    assert set(inputs) == set(FORM) and len(FORM) == 21
    assert set(FORM) - {"advanced_settings"} | set(ADVANCED) == set(PARAMETERS)
    assert set(PARAMETERS) == set(cluster.SETTINGS) and not set(FORM) & set(ADVANCED)
    assert set(P) < set(PARAMETERS)  # every params.yaml setting is a run setting
    assert inputs["advanced_settings"]["defaultValue"] == ADVANCED_DEFAULTS
    assert ADVANCED_DEFAULTS == {k: cluster.SETTINGS[k] for k in ADVANCED}
    groups = {
        "advanced": "[advanced]",
        "cluster": "[cluster]",
        "data": "[data]",
        "vocab": "[pre-training data]",
        "instances": "[pre-training data]",
        "model": "[model]",
        "pretrain": "[pre-training]",
        "finetune": "[fine-tuning]",
        "compress": "[compression]",
        "deploy": "[serving]",
    }
    for name in PARAMETERS:
        assert PARAMETERS[name].startswith(groups[name.split("_")[0]]), name
    for name, param in inputs.items():
        assert param["description"] == FORM[name] and len(param["description"]) > 30, name
        assert param["description"].startswith(groups[name.split("_")[0]]), name
        if name != "advanced_settings":
            assert param["defaultValue"] == DEFAULTS[name] == cluster.SETTINGS[name], name
    for name, uri in cluster.DATA.items():
        assert uri.startswith(f"{cluster.BUCKET}/data") and inputs[name]["defaultValue"] == uri
    defaults = {name: param["defaultValue"] for name, param in inputs.items()}
    defaults |= defaults.pop("advanced_settings")
    # a first run that ends the same day (BERT-Small, 18k + 2k steps, a GLUE slice), changing
    # only the data locations; the paper's BERT-Base run is the `paper` preset; both have the
    # paper's two phases, 90 % of the steps at 128 tokens and 10 % at 512
    assert defaults["model_preset"] == "small" and defaults["pretrain_num_workers"] == 1
    assert (defaults["pretrain_steps"], defaults["pretrain_batch_size"]) == (18_000, 256)
    assert defaults["pretrain_phase2_steps"] == 2_000
    assert defaults["finetune_max_train_examples"] == 20_000
    assert "squad" not in defaults["finetune_token_tasks"]
    paper = dict(presets.runs("paper", {})[0][1])
    assert set(paper) <= set(defaults) and paper["model_preset"] == "base"
    assert (paper["pretrain_steps"], paper["instances_dupe_factor"]) == (900_000, 10)
    assert paper["pretrain_phase2_steps"] == 100_000
    assert paper["finetune_lr_sweep"] == "paper" and "squad" in paper["finetune_token_tasks"]
    assert defaults["cluster_train_image"] == cluster.CUDA_IMAGE
    assert defaults["cluster_finetune_gpus"] == "1" and defaults["pretrain_use_gpu"] is True
    assert defaults != {**defaults, **{k: P[k] for k in P if k not in cluster.DATA}}  # not DVC's
    assert P["model_preset"] == "tiny"  # make run keeps the 2-core default


def test_set_parses_yaml_but_a_text_parameter_stays_text():
    assert parse_overrides(["pretrain_steps=50", 'finetune_tasks=["SST-2"]']) == {
        "pretrain_steps": 50,
        "finetune_tasks": ["SST-2"],
    }
    assert parse_overrides(["cluster_finetune_gpus=1", 'data_corpus="s3://b/c"']) == {
        "cluster_finetune_gpus": "1",
        "data_corpus": "s3://b/c",
    }
    with pytest.raises(SystemExit, match="expected KEY=VALUE"):
        parse_overrides(["pretrain_stepz=5"])


def test_presets_are_a_run_per_row_of_the_papers_tables_with_valid_arguments():
    """`submit --preset NAME`: one run per row, each row's arguments pipeline parameters of the
    compiled spec's types (what the API server checks a run's parameters against), `--set` on
    top of every row; the rows of Tables 5, 6 and 8 are named as `bert evaluate` knows them;
    a wrong key or type stops before anything is submitted."""
    from bert_core.report.tables import PAPER_TABLES

    spec = next(yaml.safe_load_all(SPEC.read_text()))  # the pipeline spec, then the platform's
    types = {
        name: p["parameterType"]
        for name, p in spec["root"]["inputDefinitions"]["parameters"].items()
    }
    accepts = {
        "NUMBER_INTEGER": int,
        "NUMBER_DOUBLE": (int, float),
        "BOOLEAN": bool,
        "STRING": str,
        "LIST": list,
        "STRUCT": dict,
    }
    for name in presets.PRESETS:
        rows = presets.runs(name, {"pretrain_steps": 5})
        assert len(rows) == len(presets.PRESETS[name]) and all(row for row, _ in rows)
        for _, arguments in rows:
            assert check(arguments) == arguments and arguments["pretrain_steps"] == 5
            form = form_arguments(arguments)
            for key, value in form.items():
                assert isinstance(value, accepts[types[key]]), (key, value)
            given = form.get("advanced_settings", {})  # what the settings task takes
            taken = cli.kfp_settings(given, json.dumps(ADVANCED_DEFAULTS))._asdict()
            assert taken == ADVANCED_DEFAULTS | given
    for table in ("table5", "table6", "table8"):  # `bert evaluate` shows the paper's numbers
        assert list(presets.PRESETS[table]) == list(PAPER_TABLES[f"Table {table[-1]}"][1])
    assert presets.runs(None, {"pretrain_steps": 5}) == [(None, {"pretrain_steps": 5})]
    with pytest.raises(SystemExit, match="pretrain_stepz"):
        check({"pretrain_stepz": 5})
    with pytest.raises(SystemExit, match="expected a bool"):
        check({"finetune_top_bilstm": "yes"})
    with pytest.raises(SystemExit, match="--preset 'table9'"):
        presets.runs("table9", {})


def test_the_advanced_settings_are_one_object_split_into_typed_outputs_by_a_task():
    """`advanced_settings` (one STRUCT field) goes to the first task, `settings`, with the
    defaults as JSON text; its outputs are ADVANCED, each of its default's type, and every step
    reads them from it (e.g. instances' masking recipe, as the phase-one field fed it before).
    The task refuses an unknown key or a value of another type, and takes Struct's doubles for
    whole numbers; `form_arguments` routes a run's settings to fields and the object."""
    spec, _ = _load(SPEC)
    component = spec["components"]["comp-settings"]
    outputs = component["outputDefinitions"]["parameters"]
    kinds = {int: "NUMBER_INTEGER", float: "NUMBER_DOUBLE", bool: "BOOLEAN", str: "STRING"}
    assert {k: v["parameterType"] for k, v in outputs.items()} == {
        k: kinds[type(v)] for k, v in ADVANCED_DEFAULTS.items()
    }
    from components import steps  # the executor reads the outputs in the annotation's order

    assert steps.settings.python_func.__annotations__["return"]._fields == ADVANCED
    task = spec["root"]["dag"]["tasks"]["exit-handler-1"]
    body = spec["components"][task["componentRef"]["name"]]["dag"]["tasks"]
    given = body["settings"]["inputs"]["parameters"]
    assert given["advanced"] == {"componentInputParameter": "pipelinechannel--advanced_settings"}
    assert json.loads(given["defaults"]["runtimeValue"]["constant"]) == ADVANCED_DEFAULTS
    instances = _container_tasks(spec)["instances"]["inputs"]["parameters"]
    assert instances["masking_recipe"] == {
        "taskOutputParameter": {
            "producerTask": "settings",
            "outputParameterKey": "instances_masking_recipe",
        }
    }
    defaults = json.dumps(ADVANCED_DEFAULTS)
    doubles = {"vocab_vocab_size": 1000.0, "compress_alpha": 1, "finetune_top_bilstm": True}
    taken = cli.kfp_settings(doubles, defaults)._asdict()
    assert taken["vocab_vocab_size"] == 1000 and type(taken["vocab_vocab_size"]) is int
    assert taken["compress_alpha"] == 1.0 and type(taken["compress_alpha"]) is float
    assert taken["finetune_top_bilstm"] is True and taken["pretrain_objective"] == "mlm+nsp"
    with pytest.raises(BertError, match="advanced_settings: no setting pretrain_stepz"):
        cli.kfp_settings({"pretrain_stepz": 5}, defaults)
    with pytest.raises(BertError, match="vocab_vocab_size = 1000.5: expected int"):
        cli.kfp_settings({"vocab_vocab_size": 1000.5}, defaults)
    with pytest.raises(BertError, match='finetune_top_bilstm = "yes": expected bool'):
        cli.kfp_settings({"finetune_top_bilstm": "yes"}, defaults)
    assert form_arguments({"pretrain_steps": 5, "instances_dupe_factor": 1}) == {
        "pretrain_steps": 5,
        "advanced_settings": {"instances_dupe_factor": 1},
    }
    assert form_arguments({"pretrain_steps": 5}) == {"pretrain_steps": 5}


def test_settings_reach_each_step_grouped_by_params_yaml_section():
    """A params.yaml section is its step's inputs (`section_key` -> `key`)."""
    assert section(P, "instances") == {
        "max_seq_length": P["instances_max_seq_length"],
        "max_predictions_per_seq": P["instances_max_predictions_per_seq"],
        "masked_lm_prob": P["instances_masked_lm_prob"],
        "dupe_factor": P["instances_dupe_factor"],
        "random_seed": P["instances_random_seed"],
        "masking_recipe": P["instances_masking_recipe"],
    }


def _settings(**changes) -> dict:
    """A run's typed settings as pipeline-run gets them (`section.key`), params.yaml's."""
    return {k.replace("_", ".", 1): v for k, v in P.items()} | changes


def test_finetune_jobs_end_with_the_flags_their_settings_ask_for():
    """finetune_top_bilstm (Table 5's "+ BiLSTM") reaches every job, the NER document context
    only conll2003's (SQuAD's `bert finetune` has no such option); off, neither appears."""
    lists = {
        "finetune.tasks": ["SST-2"],
        "finetune.control_tasks": ["SST-2"],
        "finetune.token_tasks": ["conll2003", "squad"],
    }
    on = _settings(
        **lists, **{"finetune.top_bilstm": True, "finetune.token_document_context": True}
    )
    jobs = {j["name"]: j["options"] for j in finetune_jobs(on, str)}
    flags = {
        name: [x for x in o if x in ("--top-bilstm", "--document-context")]
        for name, o in jobs.items()
    }
    assert flags == {
        "SST-2": ["--top-bilstm"],
        "SST-2 (random init)": ["--top-bilstm"],
        "conll2003": ["--top-bilstm", "--document-context"],
        "squad": ["--top-bilstm"],
    }
    assert all(o[-len(flags[name]) :] == flags[name] for name, o in jobs.items())  # at the end
    off = _settings(
        **lists, **{"finetune.top_bilstm": False, "finetune.token_document_context": False}
    )
    for options in (j["options"] for j in finetune_jobs(off, str)):
        assert not {"--top-bilstm", "--document-context"} & set(options)
    from bert_core.finetune import command as finetune

    for name, options in jobs.items():  # each a command line `bert finetune` takes
        task = finetune.load_task(options[1])
        args = finetune.build_parser(task).parse_args([*options, "--model", "m", "--output", "o"])
        cfg = finetune.config_from_args(args, task.config_class)
        assert cfg.top_bilstm
        assert getattr(cfg, "document_context", False) == (name == "conll2003")


def test_finetune_jobs_are_one_list_with_each_jobs_options_and_data_digest():
    """The GLUE tasks from the pre-trained model, the control from random weights and the
    token-level tasks with their own sizes, in one list: the pipeline's one fan-out. Each job's
    options are a `bert finetune` command line; its digest is its own task folder's."""
    settings = _settings(
        **{
            "data.glue": "s3://b/glue",
            "data.token": "s3://b/data",
            "finetune.max_train_examples": 0,
            "finetune.tasks": ["SST-2", "MRPC"],
            "finetune.control_tasks": ["SST-2"],
            "finetune.token_tasks": ["squad"],
            "finetune.token_max_eval_examples": 50,
        }
    )
    jobs = finetune_jobs(settings, lambda uri: f"md5:{uri}")
    assert [j["name"] for j in jobs] == ["SST-2", "MRPC", "SST-2 (random init)", "squad"]
    assert [j["data_digest"] for j in jobs] == [
        "md5:s3://b/glue/SST-2",
        "md5:s3://b/glue/MRPC",
        "md5:s3://b/glue/SST-2",
        "md5:s3://b/data/squad",
    ]
    options = [dict(zip(j["options"][::2], j["options"][1::2], strict=True)) for j in jobs]
    assert options[0] == {
        "--task": "SST-2",
        "--data": "s3://b/glue/SST-2",
        "--init": "pretrained",
        "--device": "auto",
        "--batch-size": str(P["finetune_batch_size"]),
        "--learning-rate": str(P["finetune_learning_rate"]),
        "--lr-sweep": P["finetune_lr_sweep"],
        "--restarts": str(P["finetune_restarts"]),
        "--epochs": str(P["finetune_epochs"]),
        "--max-seq-length": str(P["finetune_max_seq_length"]),
        "--max-train-examples": "none",
    }
    assert options[2]["--init"] == "random" and options[2]["--task"] == "SST-2"
    assert options[3]["--epochs"] == str(P["finetune_token_epochs"])
    assert options[3]["--max-seq-length"] == str(P["finetune_token_max_seq_length"])
    assert options[3]["--max-eval-examples"] == "50"
    assert options[3]["--batch-size"] == options[0]["--batch-size"]  # shared with GLUE
    # every job's options parse as `bert finetune`'s own, with a model and output added
    from bert_core.finetune import command as finetune

    for job in jobs:
        task = finetune.load_task(job["options"][1])
        args = finetune.build_parser(task).parse_args(
            [*job["options"], "--model", "m", "--output", "o"]
        )
        cfg = finetune.config_from_args(args, task.config_class)
        token = job["name"] == "squad"
        assert cfg.max_train_examples == (P["finetune_token_max_train_examples"] if token else None)
    empty = _settings(**{f"finetune.{k}": [] for k in ("tasks", "control_tasks", "token_tasks")})
    with pytest.raises(BertError, match="nothing to fine-tune"):
        finetune_jobs(empty, lambda uri: "")


def test_every_task_gets_the_config_map_the_secrets_and_the_run_id(tmp_path):
    """Task by task, the platform spec loads the ConfigMap and the S3 Secret (required: a pod
    without them does not start), the MLflow auth Secret (optional), and the run id label;
    pretrain, which submits the Ray job, also the RayCluster's token (required)."""
    spec, platform = _load(SPEC)
    env = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    tasks = _container_tasks(spec)
    assert set(tasks) == {
        "settings",
        "pipeline-run",
        "finetune-jobs",
        "clean",
        "vocab",
        "instances",
        "pretrain",
        "instances-512",
        "pretrain-phase2",
        "finetune",
        "evaluate",
        "distill",
        "quantize",
        "promote",
        "deploy",
        "pipeline-end",
    }
    both = [*tasks.values(), *_container_tasks(spec, "phase1-only").values()]
    assert set(env) == {t["executor"] for t in both}  # the other branch's fan-out: its copy
    for name, task in tasks.items():
        pod = env[task["executor"]]
        on_gpus = name in ("finetune", "distill")
        placement = {"nodeSelector", "tolerations"} if on_gpus else set()
        assert set(pod) == {
            "configMapAsEnv",
            "secretAsEnv",
            "fieldPathAsEnv",
            "securityContext",
            *placement,
        }, name
        # the images' user, never root (the compiler adds the rest of "restricted")
        user = str(cluster.RUN_AS_USER)
        assert pod["securityContext"] == {
            "runAsUser": user,
            "runAsGroup": user,
            "runAsNonRoot": True,
        }, name
        assert user != "0"
        (config,) = pod["configMapAsEnv"]
        assert config["configMapName"] == cluster.CONFIG_MAP and config["optional"] is False
        assert [(k["configMapKey"], k["envVar"]) for k in config["keyToEnv"]] == [
            (key, key) for key in cluster.CONFIG_KEYS
        ], name
        s3, *ray, auth = pod["secretAsEnv"]
        assert (s3["secretName"], s3["optional"]) == (cluster.SECRET, False), name
        assert [k["secretKey"] for k in s3["keyToEnv"]] == list(cluster.SECRET_KEYS)
        if name in ("pretrain", "pretrain-phase2"):
            (ray,) = ray
            assert (ray["secretName"], ray["optional"]) == (cluster.RAY_AUTH_SECRET, False)
            assert [k["secretKey"] for k in ray["keyToEnv"]] == list(cluster.RAY_AUTH_KEYS)
        else:
            assert ray == [], name
        # MLflow's identity: the pipeline's; the release one, which may move champion, for promote
        identity = cluster.RELEASE_SECRET if name == "promote" else cluster.AUTH_SECRET
        assert (auth["secretName"], auth["optional"]) == (identity, True), name
        assert [k["envVar"] for k in auth["keyToEnv"]] == list(cluster.AUTH_KEYS)
        assert pod["fieldPathAsEnv"] == [
            {"name": "KFP_RUN_ID", "fieldPath": "metadata.labels['pipeline/runid']"}
        ], name
    # the credentials are never in the pipeline spec itself
    assert not set(cluster.SECRET_KEYS) & set(yaml.safe_dump(spec).split())


def test_every_task_has_cpu_and_memory_requests_and_limits():
    spec, _ = _load(SPEC)
    executors = spec["deploymentSpec"]["executors"]
    for name, task in _container_tasks(spec).items():
        resources = executors[task["executor"]]["container"]["resources"]
        cpu, cpu_limit, memory = RESOURCES[name]
        assert resources["resourceCpuRequest"] == cpu and resources["resourceCpuLimit"] == cpu_limit
        assert resources["resourceMemoryRequest"] == resources["resourceMemoryLimit"] == memory


def test_one_branch_the_training_image_gpus_and_gpu_nodes_are_run_time_parameters(tmp_path):
    """No GPU/CPU branches: the fine-tuning tasks (and distill, the student's training) run the
    `cluster_train_image` image with `cluster_finetune_gpus` GPUs, on the nodes
    `cluster_gpu_node_selector` picks, tolerating `cluster_gpu_tolerations` (all filled by the
    backend per run); every other task, pretrain included (its training runs on the
    RayCluster) and quantize (int8 is for CPUs), runs the CPU image and asks for no GPU."""
    spec, platform = _load(
        _compile(
            tmp_path,
            "--image",
            "reg.example/bert:1.2",
            "--train-image",
            "reg.example/bert-cuda:1.2",
        )
    )
    executors = spec["deploymentSpec"]["executors"]
    pods = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    channel = "{{$.inputs.parameters['pipelinechannel--%s']}}"
    for name, task in _container_tasks(spec).items():
        container = executors[task["executor"]]["container"]
        accelerator = container.get("resources", {}).get("accelerator")
        if name in ("finetune", "distill"):
            assert container["image"] == channel % "cluster_train_image"
            assert accelerator["resourceType"] == "nvidia.com/gpu"
            assert accelerator["resourceCount"] == channel % "cluster_finetune_gpus"
            pod = pods[task["executor"]]
            assert pod["nodeSelector"] == {
                "nodeSelectorJson": {
                    "componentInputParameter": "pipelinechannel--cluster_gpu_node_selector"
                }
            }
            assert pod["tolerations"] == [
                {
                    "tolerationJson": {
                        "componentInputParameter": "pipelinechannel--cluster_gpu_tolerations"
                    }
                }
            ]
        else:
            assert container["image"] == "reg.example/bert:1.2", name
            assert accelerator is None, name
        assert "pip install" not in " ".join(container["command"])  # nothing installed at start
    params = spec["root"]["inputDefinitions"]["parameters"]
    assert params["cluster_train_image"]["defaultValue"] == "reg.example/bert-cuda:1.2"
    assert params["cluster_gpu_tolerations"]["defaultValue"] == cluster.GPU_TOLERATIONS
    assert _container_tasks(spec)["pretrain"]["inputs"]["parameters"]["use_gpu"] == {
        "componentInputParameter": "pipelinechannel--pretrain_use_gpu"
    }  # the Ray job's workers: GPUs of the RayCluster


def test_every_input_a_task_reads_is_declared_by_its_dag():
    """A task's `componentInputParameter` / `componentInputArtifact`, in the pipeline spec or in
    its platform spec (node selector, tolerations), must be an input of the DAG that holds it,
    or the backend cannot resolve it at run time. kfp 2.17 forgets the channel of
    `set_accelerator_limit` inside a ParallelFor (the pod harness found it); the pipeline
    registers it by hand, and this keeps every such reference honest."""
    spec, platform = _load(SPEC)
    pods = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    for name, component in [*spec["components"].items(), ("root", spec["root"])]:
        declared = component.get("inputDefinitions", {})
        for task_name, task in component.get("dag", {}).get("tasks", {}).items():
            for kind, ref in (
                ("parameters", "componentInputParameter"),
                ("artifacts", "componentInputArtifact"),
            ):
                for key, src in task.get("inputs", {}).get(kind, {}).items():
                    if ref in src:
                        assert src[ref] in declared.get(kind, {}), (name, task_name, key)
            label = spec["components"][task["componentRef"]["name"]].get("executorLabel")
            for found in re.findall(r"'componentInputParameter': '([^']+)'", str(pods.get(label))):
                assert found in declared["parameters"], (name, task_name, found)
    loops = [c for n, c in spec["components"].items() if n.startswith("comp-for-loop")]
    assert len(loops) == 2  # one fan-out per branch of phase two: every fine-tuning
    for loop in loops:
        assert "pipelinechannel--cluster_finetune_gpus" in loop["inputDefinitions"]["parameters"]


def test_one_fan_out_over_the_finetune_jobs_collected_into_evaluate():
    """KFP's cache key sees a step's parameter values, not the data behind a URI: the uncached
    first task outputs the corpus digest (clean's input), the uncached `finetune-jobs` the
    fine-tuning jobs, each with its data's digest, which the one ParallelFor hands whole to the
    finetune component; its results (each one's metrics.json, not its model: the launcher
    downloads an input whole) are collected into evaluate. Nothing starts before both."""
    spec, _ = _load(SPEC)
    outputs = spec["components"]["comp-pipeline-run"]["outputDefinitions"]["parameters"]
    assert set(outputs) == {"corpus_digest", "glue_digest", "token_digest"}
    jobs = spec["components"]["comp-finetune-jobs"]["outputDefinitions"]["parameters"]
    assert jobs == {"Output": {"parameterType": "LIST"}}
    tasks = _container_tasks(spec)
    assert tasks["clean"]["inputs"]["parameters"]["corpus_digest"] == {
        "taskOutputParameter": {
            "outputParameterKey": "corpus_digest",
            "producerTask": "pipeline-run",
        }
    }
    assert set(tasks["clean"]["dependentTasks"]) == {"pipeline-run", "finetune-jobs"}
    assert sorted(tasks["finetune-jobs"]["dependentTasks"]) == ["pipeline-run", "settings"]
    channel = "pipelinechannel--finetune-jobs-Output"
    for fan_out in _fan_outs(spec).values():
        loop = fan_out.task
        assert loop["taskInfo"]["name"] == "finetune"
        assert loop["parameterIterator"]["items"] == {"inputParameter": channel}
        assert loop["inputs"]["parameters"][channel] == {"componentInputParameter": channel}
        finetune, task = fan_out.named("finetune")
        assert task["inputs"]["parameters"]["job"] == {
            "componentInputParameter": loop["parameterIterator"]["itemInput"]
        }
        beside = {t["taskInfo"]["name"]: t for t in fan_out.beside.values()}
        assert set(beside["evaluate"]["inputs"]["artifacts"]) == {"results"}
        assert beside["evaluate"]["inputs"]["artifacts"]["results"]["taskOutputArtifact"] == {
            "outputArtifactKey": f"pipelinechannel--{finetune}-result",  # metrics.json only
            "producerTask": fan_out.name,
        }
    # the branches take the list from finetune-jobs, outside them
    (branches,) = [
        t
        for t in spec["components"]["comp-exit-handler-1"]["dag"]["tasks"].values()
        if t["taskInfo"]["name"].startswith("condition-branches")
    ]
    assert branches["inputs"]["parameters"][channel]["taskOutputParameter"] == {
        "outputParameterKey": "Output",
        "producerTask": "finetune-jobs",
    }
    for name in ("pipeline-run", "finetune-jobs"):
        assert tasks[name]["cachingOptions"] == {}  # never cached: always fresh digests


def test_one_parameter_starts_the_run_from_a_public_checkpoint():
    """`pretrain_init_model` (params.yaml's `pretrain.init_model`; none on the form) reaches the
    vocab step (the checkpoint's vocabulary instead of WordPiece) and pretrain (continued
    pre-training) as an input, so it is part of both steps' cache keys; params.yaml's DVC-only
    `public` branch is no run parameter."""
    tasks = _container_tasks(_load(SPEC)[0])
    for name in ("vocab", "pretrain"):
        given = tasks[name]["inputs"]["parameters"]["init_model"]
        assert given == {"componentInputParameter": "pipelinechannel--pretrain_init_model"}, name
    assert DEFAULTS["pretrain_init_model"] == "none" and P["pretrain_init_model"] == "none"
    assert not [k for k in PARAMETERS if k.startswith("public")]


def _after_the_named_job(spec: dict, display: str, parameter: str) -> None:
    """The branch shown as `display`, in each iteration of both fan-outs, runs after the
    iteration's finetune when its output (the job's name) is `parameter`'s value."""
    for fan_out in _fan_outs(spec).values():
        finetune, _ = fan_out.named("finetune")
        _, branch = fan_out.named(display)
        assert branch["dependentTasks"] == [finetune]
        assert branch["triggerPolicy"]["condition"] == (
            f"inputs.parameter_values['pipelinechannel--{finetune}-Output'] == "
            f"inputs.parameter_values['pipelinechannel--{parameter}']"
        )
        assert branch["inputs"]["parameters"][f"pipelinechannel--{finetune}-Output"] == {
            "taskOutputParameter": {"outputParameterKey": "Output", "producerTask": finetune}
        }


def test_release_is_a_condition_in_each_fine_tuning_off_by_default():
    """promote -> deploy run in the iteration whose job is `deploy_task` ("none" by default:
    no job), promote on that iteration's own fine-tuned model (the candidate it registered,
    not the newest by then), deploy after it; neither cached (they act on the
    registry and the cluster as they are), each with its pod's resources."""
    spec, _ = _load(SPEC)
    _after_the_named_job(spec, "deploy", "deploy_task")
    tasks = _container_tasks(spec)
    promote, deploy = tasks["promote"], tasks["deploy"]
    assert promote["inputs"]["artifacts"]["finetuned"] == {
        "componentInputArtifact": "pipelinechannel--finetune-finetuned"
    }
    for task in (promote, deploy):
        assert task["inputs"]["parameters"]["task"] == {
            "componentInputParameter": "pipelinechannel--deploy_task"
        }
        assert task["cachingOptions"] == {}  # enableCache false is left out of the spec
    assert deploy["dependentTasks"] == ["promote"]
    assert DEFAULTS["deploy_task"] == "none" and "deploy_task" not in P
    assert RESOURCES["promote"] and RESOURCES["deploy"]


def test_compression_is_a_condition_in_each_fine_tuning_off_by_default():
    """distill -> quantize run inside the fine-tuning loop under a trigger condition: the
    iteration whose job name (the finetune step's output) is `compress_task`; "none", the
    form's default, names no job. The teacher is that iteration's own model (no pick among the
    collected outputs), the student starts from the run's pre-trained model by default, and the
    task data's digest (the loop item's field, a parameterExpressionSelector) keys the cache."""
    spec, _ = _load(SPEC)
    _after_the_named_job(spec, "compress", "compress_task")
    tasks = _container_tasks(spec)
    distill, quantize = tasks["distill"]["inputs"], tasks["quantize"]["inputs"]
    assert distill["artifacts"]["teacher"] == {
        "componentInputArtifact": "pipelinechannel--finetune-finetuned"
    }
    assert distill["artifacts"]["pretrained"] == {  # phase two's model, in its branch
        "componentInputArtifact": "pipelinechannel--pretrain-phase2-pretrained"
    }
    assert quantize["artifacts"]["model"]["taskOutputArtifact"]["producerTask"] == "distill"
    for inputs in (distill, quantize):
        assert inputs["parameters"]["data_digest"]["parameterExpressionSelector"] == (
            'parseJson(string_value)["data_digest"]'
        )
        assert inputs["parameters"]["task"] == {
            "componentInputParameter": "pipelinechannel--compress_task"
        }
    for key in ("student", "student_layers", "student_ffn_share", "temperature", "alpha"):
        channel = f"pipelinechannel--settings-compress_{key}"  # the settings task's outputs
        assert distill["parameters"][key] == {"componentInputParameter": channel}, key
    assert DEFAULTS["compress_task"] == "none" and DEFAULTS["compress_student"] == "pretrained"
    assert "compress_task" not in P and P["compress_student_layers"] == 2  # DVC's, for local
    lists = {"finetune.tasks": ["SST-2"], "finetune.control_tasks": ["SST-2"]}
    names = [job["name"] for job in finetune_jobs(_settings(**lists), lambda uri: "d")]
    assert names == ["SST-2", "SST-2 (random init)"]  # the control is no teacher; none: no job


def test_phase_two_is_a_branch_on_by_default_whose_model_the_fan_out_fine_tunes():
    """The paper's two phases: with pretrain_phase2_steps > 0 (the form's default, 10 % of its
    steps), instances at 512 tokens from the same corpus and vocabulary, then pretrain-phase2
    from phase one's model for that many steps, and the fan-out fine-tunes its model; with 0
    (make run's, `local`'s), the other branch fine-tunes phase one's. Phase two takes its
    shape and start from phase one's model, and no settings of its own but its steps."""
    spec, _ = _load(SPEC)
    branches = _branches(spec)
    on = "int(inputs.parameter_values['pipelinechannel--pretrain_phase2_steps']) > 0"
    assert branches["phase2"]["triggerPolicy"]["condition"] == on
    assert branches["phase1-only"]["triggerPolicy"]["condition"] == f"!({on})"
    phase2 = _container_tasks(spec)
    instances = phase2["instances-512"]["inputs"]
    assert instances["artifacts"] == {  # phase one's corpus and vocabulary
        "cleaned": {"componentInputArtifact": "pipelinechannel--clean-cleaned"},
        "wordpiece": {"componentInputArtifact": "pipelinechannel--vocab-wordpiece"},
    }
    for key, value in cluster.PHASE2_INSTANCES.items():
        assert instances["parameters"][key] == {"runtimeValue": {"constant": value}}, key
    assert (
        cluster.PHASE2_INSTANCES["max_seq_length"],
        cluster.PHASE2_INSTANCES["max_predictions_per_seq"],
    ) == (512, 80)
    inputs = phase2["pretrain-phase2"]["inputs"]
    assert inputs["artifacts"]["phase1"] == {
        "componentInputArtifact": "pipelinechannel--pretrain-pretrained"
    }
    # the instances' URI, not the artifact: the launcher would download every shard into the pod
    assert set(inputs["artifacts"]) == {"phase1"}
    first = _container_tasks(spec)["pretrain"]["inputs"]
    assert "artifacts" not in first and first["parameters"]["shards"] == {
        "taskOutputParameter": {"producerTask": "instances", "outputParameterKey": "Output"}
    }
    assert inputs["parameters"]["shards"] == {
        "taskOutputParameter": {"producerTask": "instances-2", "outputParameterKey": "Output"}
    }
    assert inputs["parameters"]["steps"] == {
        "componentInputParameter": "pipelinechannel--pretrain_phase2_steps"
    }
    assert set(inputs["parameters"]) == {
        "shards",
        "steps",
        "batch_size",
        "num_workers",
        "cpus_per_worker",
        "learning_rate",
        "use_gpu",
        "objective",
    }
    reads = {
        branch: _container_tasks(spec, branch)["finetune"]["inputs"]["artifacts"]["pretrained"]
        for branch in branches
    }
    assert reads == {
        "phase2": {"componentInputArtifact": "pipelinechannel--pretrain-phase2-pretrained"},
        "phase1-only": {"componentInputArtifact": "pipelinechannel--pretrain-pretrained"},
    }
    assert DEFAULTS["pretrain_phase2_steps"] > 0 and "pretrain_phase2_steps" not in P


def test_both_branches_hold_the_same_fan_out():
    """The fan-out is written once (`fan_out`) and compiled into each branch: the copies differ
    only in KFP's names for them (`finetune-2`, `exec-finetune-2`, ...) and in the model they
    read, so every check of one branch's tasks holds for the other's."""
    spec, platform = _load(SPEC)
    executors = spec["deploymentSpec"]["executors"]
    pods = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]

    def copy_of(branch: str) -> dict[str, str]:
        tasks = _container_tasks(spec, branch)
        tasks = {k: t for k, t in tasks.items() if k in FAN_OUT}
        return {
            name: re.sub(
                r"(finetune|evaluate|distill|quantize|promote|deploy|condition|for-loop)-\d+",
                r"\1",
                json.dumps([t, executors[t["executor"]], pods[t["executor"]]], sort_keys=True),
            ).replace("pretrain-phase2-pretrained", "pretrain-pretrained")
            for name, t in tasks.items()
        }

    assert copy_of("phase2") == copy_of("phase1-only")
    assert set(copy_of("phase2")) == set(FAN_OUT)


FAN_OUT = ("finetune", "distill", "quantize", "promote", "deploy", "evaluate")


def test_pretraining_alone_is_retried_with_backoff():
    tasks = _container_tasks(_load(SPEC)[0])
    for name in ("pretrain", "pretrain-phase2"):
        assert tasks[name]["retryPolicy"] == {
            "maxRetryCount": 3,
            "backoffDuration": "60s",
            "backoffFactor": 2.0,
            "backoffMaxDuration": "2592000s",  # Argo counts it from the first attempt: 30 days
        }
    assert sorted(n for n, t in tasks.items() if "retryPolicy" in t) == [
        "pretrain",
        "pretrain-phase2",
    ]


def test_caching_is_on_and_the_run_id_reaches_steps_outside_the_cache_key():
    """KFP's cache key is a step's inputs, outputs and command: a run id among the inputs would
    change every key, so no run could reuse a step. Every step is cached, takes nothing
    run-specific, and reads the run id from its pod's `pipeline/runid` label instead (see the
    platform spec test). Four small tasks are never cached: the first opens the MLflow parent
    run with the settings, the second lists the fine-tunings with fresh digests, evaluate writes
    the run's table on the parent, the exit handler closes it; nor are promote and deploy, which
    act on the registry and the cluster as they are."""
    spec, _ = _load(SPEC)
    named = _container_tasks(spec)
    uncached = {name for name, t in named.items() if t["cachingOptions"] != {"enableCache": True}}
    assert uncached == {
        "pipeline-run",
        "finetune-jobs",
        "evaluate",
        "pipeline-end",
        "promote",
        "deploy",
    }
    assert all(named[name]["cachingOptions"] == {} for name in uncached)
    root = spec["root"]["dag"]["tasks"]
    assert root["pipeline-end"]["triggerPolicy"]["strategy"] == "ALL_UPSTREAM_TASKS_COMPLETED"
    (body,) = root["pipeline-end"]["dependentTasks"]  # the exit handler holds all the rest
    assert body in root and len(root) == 2
    inputs = named["pipeline-run"]["inputs"]["parameters"]
    assert named["finetune-jobs"]["inputs"]["parameters"] == inputs  # the same settings
    settings = set(inputs["settings"]["runtimeValue"]["constant"])
    lists = {"finetune.tasks", "finetune.control_tasks", "finetune.token_tasks"}  # own inputs
    expected = {k.replace("_", ".", 1) for k in P} | {f"kfp.{k}" for k in RUNTIME}
    assert settings | lists == expected and not settings & lists
    assert inputs["tasks"]["componentInputParameter"] == "pipelinechannel--finetune_tasks"
    text = yaml.safe_dump(spec)
    assert "pipeline_job" not in text and "run_id" not in text


def test_a_kfp_step_without_a_tracking_server_fails_at_once(tmp_path, monkeypatch):
    """Under KFP (KFP_RUN_ID set) without MLFLOW_TRACKING_URI a step would log to a SQLite file
    in its pod, lost with it: every kfp_* call refuses, before it runs anything."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KFP_RUN_ID", "run-without-config")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("BERT_PARENT_RUN_ID", "")
    for call in (
        lambda: cli.kfp_step(["runs"]),
        lambda: cli.kfp_pipeline_run({"data.corpus": str(tmp_path)}, [], [], []),
        lambda: cli.kfp_pipeline_end("SUCCEEDED"),
        lambda: cli.kfp_register_pretrained(tmp_path),
    ):
        with pytest.raises(BertError, match="without MLFLOW_TRACKING_URI.*bert-pipeline-env"):
            call()
    assert list(tmp_path.iterdir()) == []  # no mlflow.db


@pytest.mark.slow
def test_whole_dag_runs_through_kfp_local(tmp_path, shared_data, monkeypatch):
    from mlflow import MlflowClient

    from bert_core.serve import registry
    from bert_core.track import lineage

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = env_for(ROOT, uri)
    settings = {
        "data_corpus": str(shared_data / "corpus" / "a_christmas_carol.txt"),
        "data_glue": str(shared_slice(tmp_path / "data", shared_data) / "glue"),
        "finetune_tasks": ["SST-2", "STS-B"],  # a fan-out of two keeps CI time down; the
        "finetune_control_tasks": [],  # random-init control, a third item of that loop, runs
        # in the cluster harness's whole run (tests/pipelines/test_cluster_harness.py)
        "compress_task": "STS-B",  # the compression branch, for one iteration: a regression
        "compress_student_layers": 1,
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
    assert {"eval/score", "eval/SST-2/score", "eval/STS-B/score"} <= set(scores)

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
        "clean",
        "vocab",
        "instances",
        "pretrain",
        "finetune-SST-2",
        "finetune-STS-B",
        "evaluate",
        "distill-STS-B",
        "quantize",
    }
    assert steps["distill-STS-B"].data.params["student_layers"] == "1"
    assert steps["distill-STS-B"].data.params["student_ffn_share"] == "0.5"  # params.yaml's
    # one pre-training phase (`local`'s, make run's): the other branch's fan-out ran (KFP names
    # its tasks `-2`), no phase two
    (run_root,) = (tmp_path / "root").glob("bert-pipeline-*")
    ran = {p.name for p in run_root.iterdir()}
    assert "evaluate-2" in ran and not {"pretrain-phase2", "instances-2", "evaluate"} & ran, ran
    (student,) = run_root.glob("for-loop-*/distill-2/distilled/metrics.json")  # STS-B's only
    assert json.loads(student.read_text())["student"]["layers"] == [0]  # 1 of 2: the first
    for run in steps.values():
        assert run.data.tags["kfp.run_id"] == kfp_run_id
        assert run.info.status == "FINISHED"
    assert steps["evaluate"].data.metrics["eval/score"] == pytest.approx(scores["eval/score"])
    # the KFP UI's numbers are the evaluate step's MLflow metrics: same names, same scale
    assert steps["evaluate"].data.metrics == pytest.approx(scores)
    assert all(-100 <= v <= 100 for v in scores.values()), scores  # percent, the table's
    (version,) = client.search_model_versions(f"name='{registry.PRETRAINED}'")
    assert version.run_id == steps["pretrain"].info.run_id
