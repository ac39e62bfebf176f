"""The compiled pipeline by the rules of the KFP backend users deploy (pipelines/kfp_backend.py,
BACKEND = 2.17.0): it parses strictly, it uses nothing that backend does not implement, and the
checks can fail, in code and as the command a user runs before an upload
(`python -m pipelines.bert_pipeline check`). Sources cited are github.com/kubeflow/pipelines at
tag 2.17.0.

Besides the committed spec, small pipelines compiled here with the pinned SDK carry every
feature the pipeline uses or plans to (a ParallelFor over a task's list of dicts, each item a
`dict` input; dsl.Collected; an exit handler; limits; image, accelerator, node selector and
tolerations from pipeline parameters; optional Secrets; the run ID from a pod label; retries;
no caching; described parameters), and variants of them the backend gets wrong. (No
`from __future__ import annotations` here: kfp reads the components' annotations as types.)"""

import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path
from typing import List  # noqa: UP035 - the SDK reads List[dict] (a ParallelFor item's type)

import pytest
import yaml
from kfp import compiler, dsl, kubernetes
from kfp.dsl import Input, Model, Output

from pipelines import bert_pipeline, kfp_backend
from pipelines.kfp_backend import StrictParseError, load_strict, unsupported

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "pipelines" / "bert_pipeline.yaml"


def _compile(tmp_path: Path, pipeline) -> Path:
    path = tmp_path / f"{pipeline.name}.yaml"
    compiler.Compiler().compile(pipeline, str(path))
    return path


def _rewrite(tmp_path: Path, edit) -> Path:
    """The committed spec with `edit(pipeline_spec_dict, platform_spec_dict)` applied."""
    spec, platform = yaml.safe_load_all(SPEC.read_text())
    edit(spec, platform)
    path = tmp_path / "edited.yaml"
    path.write_text(yaml.safe_dump_all([spec, platform]))
    return path


# The committed spec ---------------------------------------------------------------------------


def test_committed_spec_parses_strictly():
    """Both documents parse with unknown fields as errors: the API server would reject one in the
    PipelineSpec (backend/src/apiserver/template/v2_template.go 226) or, at run creation, in a
    kubernetes executor config (backend/src/v2/compiler/argocompiler/container.go 322-328), and
    drop one in deploymentSpec (backend/src/v2/compiler/visitor.go GetDeploymentConfig)."""
    spec, executors = load_strict(SPEC)
    containers = kfp_backend.deployment(spec).executors
    assert executors and set(executors) <= set(containers)
    assert all(c.HasField("container") for c in containers.values())


def test_committed_spec_uses_only_what_the_backend_implements():
    """Every kind the spec uses has an IMPLEMENTED entry (read in the 2.17.0 source), its
    channels are wired and typed as the driver needs (backend/src/v2/driver/resolve.go
    resolveInputs, resolvePodSpecInputRuntimeParameter; k8s.go extendPodSpecPatch), and no
    Collected consumer of a ParallelFor gets no items by default."""
    lines = unsupported(*load_strict(SPEC))
    assert lines == [], "\n".join(lines)


def test_the_pinned_sdk_compiled_it():
    """The protos checked against are the installed ones: kfp-pipeline-spec 2.17.3 and
    kfp-kubernetes 2.17.0 are field for field the backend's api/v2alpha1/pipeline_spec.proto and
    kubernetes_platform/proto/kubernetes_executor_config.proto at 2.17.0 (its go.mod replaces
    both with those folders), so an upgrade here must re-check them."""
    assert importlib.metadata.version("kfp") == "2.17.0"
    assert importlib.metadata.version("kfp-kubernetes") == "2.17.0"
    assert importlib.metadata.version("kfp-pipeline-spec") == "2.17.3"
    spec, _ = load_strict(SPEC)
    assert spec.sdk_version == "kfp-2.17.0"
    assert kfp_backend.BACKEND == "2.17.0"


# Negative controls on the committed spec ------------------------------------------------------


def test_an_unknown_kubernetes_field_fails_naming_the_executor(tmp_path):
    """A field kfp-kubernetes 2.17.0 does not know (what a newer SDK would write) is an error
    naming the executor and the field: the 2.17.0 driver parses with DiscardUnknown
    (backend/src/common/util/json.go UnmarshalString) and would drop it."""
    executors = {}

    def edit(spec, platform):
        configs = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
        name = next(n for n, c in sorted(configs.items()) if c.get("secretAsEnv"))
        configs[name]["secretAsEnv"][0]["optionalX"] = True
        executors["name"] = name

    path = _rewrite(tmp_path, edit)
    with pytest.raises(StrictParseError) as error:
        load_strict(path)
    message = str(error.value)
    assert f"executors.{executors['name']}" in message and "optionalX" in message


def test_an_unknown_container_field_fails_naming_the_executor(tmp_path):
    """deploymentSpec is a Struct in PipelineSpec and the backend reads it with DiscardUnknown
    (backend/src/v2/compiler/visitor.go 176-190): only this check sees an unknown field there."""

    def edit(spec, platform):
        name = sorted(spec["deploymentSpec"]["executors"])[0]
        spec["deploymentSpec"]["executors"][name]["container"]["resources"]["gpuLimitX"] = 1

    with pytest.raises(StrictParseError, match=r"deploymentSpec\.executors\.exec-.*gpuLimitX"):
        load_strict(_rewrite(tmp_path, edit))


def test_an_unknown_pipeline_spec_field_fails(tmp_path):
    def edit(spec, platform):
        spec["root"]["dag"]["tasksX"] = {}

    with pytest.raises(StrictParseError, match="PipelineSpec.*tasksX"):
        load_strict(_rewrite(tmp_path, edit))


def test_an_artifact_iterator_is_reported(tmp_path):
    """The 2.17.0 backend has no artifact iterator: the Argo compiler refuses it ("artifact
    iterator not implemented yet", compiler/argocompiler/dag.go 68-70) and so does the DAG
    driver ("ArtifactIterator is not implemented", driver/dag.go 160-162)."""

    def edit(spec, platform):
        dags = [c["dag"] for c in [spec["root"], *spec["components"].values()] if "dag" in c]
        task = next(t for d in dags for t in d["tasks"].values() if "parameterIterator" in t)
        iterator = task.pop("parameterIterator")
        task["artifactIterator"] = {
            "itemInput": iterator["itemInput"],
            "items": {"inputArtifact": "some-artifacts"},
        }

    lines = unsupported(*load_strict(_rewrite(tmp_path, edit)))
    assert any(line.startswith("PipelineTaskSpec.artifactIterator ") for line in lines), lines


def test_a_placeholder_the_driver_does_not_resolve_is_reported(tmp_path):
    """The driver resolves {{$.pipeline_job_name}} only as a whole runtimeValue constant
    (driver/resolve.go 435-452); inside a longer string it reaches the component verbatim."""

    def edit(spec, platform):
        task = next(iter(spec["root"]["dag"]["tasks"].values()))
        task.setdefault("inputs", {}).setdefault("parameters", {})["run_label"] = {
            "runtimeValue": {"constant": "run {{$.pipeline_job_name}}"}
        }

    lines = unsupported(*load_strict(_rewrite(tmp_path, edit)))
    assert any("(part of a string): {{$.pipeline_job_name}}" in line for line in lines), lines


# The planned features, compiled by the pinned SDK ---------------------------------------------


@dsl.component(base_image="python:3.11")
def plan(n: int) -> List[dict]:  # noqa: UP006
    return [{"task": f"t{i}"} for i in range(n)]


@dsl.component(base_image="python:3.11")
def plan_untyped(n: int) -> list:
    return [{"task": f"t{i}"} for i in range(n)]


@dsl.component(base_image="python:3.11")
def train(job: dict, model: Output[Model]):
    pass


@dsl.component(base_image="python:3.11")
def gather(models: Input[List[Model]]):  # noqa: UP006
    pass


@dsl.component(base_image="python:3.11")
def end(status: dsl.PipelineTaskFinalStatus):
    pass


def _train_pod(task, image, accelerator, gpus, node_selector, tolerations):
    """A fine-tuning pod as bert_pipeline.py makes one, every setting a run-time parameter."""
    task.set_cpu_request("1").set_cpu_limit("2").set_memory_request("1G").set_memory_limit("2G")
    task.set_container_image(image)
    task.set_accelerator_type(accelerator).set_accelerator_limit(gpus)
    # kfp 2.17's accelerator setters do not register their channels (set_container_image does)
    task.register_pipeline_channels([accelerator, gpus])
    task.set_retry(
        num_retries=3, backoff_duration="60s", backoff_factor=2.0, backoff_max_duration="3600s"
    )
    kubernetes.add_node_selector_json(task, node_selector)
    kubernetes.add_toleration_json(task, tolerations)
    kubernetes.use_secret_as_env(task, "bert-s3", {"AWS_ACCESS_KEY_ID": "AWS_ACCESS_KEY_ID"})
    kubernetes.use_secret_as_env(task, "bert-auth", {"TOKEN": "TOKEN"}, optional=True)
    kubernetes.use_config_map_as_env(task, "bert-env", {"URI": "URI"}, optional=True)
    kubernetes.use_field_path_as_env(task, "KFP_RUN_ID", "metadata.labels['pipeline/runid']")


@dsl.pipeline(name="planned")
def planned(
    n: int = 2,
    image: str = "bert:0.1.0",
    accelerator: str = "nvidia.com/gpu",
    gpus: str = "1",
    node_selector: dict = {},  # noqa: B006 - a pipeline parameter's default, never mutated
    tolerations: list = [],  # noqa: B006
):
    """Planned.

    Args:
        n: How many jobs.
        image: The training image.
    """
    exit_task = end().set_caching_options(False)
    kubernetes.use_field_path_as_env(exit_task, "KFP_RUN_ID", "metadata.labels['pipeline/runid']")
    with dsl.ExitHandler(exit_task, name="body"):
        jobs = plan(n=n).set_caching_options(False)
        with dsl.ParallelFor(jobs.output, name="jobs") as job:
            trained = train(job=job)
            _train_pod(trained, image, accelerator, gpus, node_selector, tolerations)
        gather(models=dsl.Collected(trained.outputs["model"]))


@dsl.pipeline(name="untyped-items")
def untyped_items(n: int = 2):
    """The loop's items from an output annotated `list`: the SDK declares each item STRING."""
    with dsl.ParallelFor(plan_untyped(n=n).output) as job:
        train(job=job)


@dsl.pipeline(name="integer-gpus")
def integer_gpus(gpus: int = 1):
    task = train(job={"task": "t"})
    task.set_accelerator_type("nvidia.com/gpu").set_accelerator_limit(gpus)
    task.register_pipeline_channels([gpus])


@dsl.pipeline(name="unregistered-gpus")
def unregistered_gpus(gpus: str = "1"):
    with dsl.ExitHandler(end(), name="body"):
        train(job={"task": "t"}).set_accelerator_type("nvidia.com/gpu").set_accelerator_limit(gpus)


@dsl.pipeline(name="empty-fan-in")
def empty_fan_in(tasks: list = []):  # noqa: B006
    with dsl.ParallelFor(tasks) as task:
        trained = train(job={"task": task})
    gather(models=dsl.Collected(trained.outputs["model"]))


def test_the_planned_features_are_implemented(tmp_path):
    """Each planned feature compiles to kinds the 2.17.0 backend implements (IMPLEMENTED cites
    where), wired as its driver needs; the kinds checked are in the spec, so the test covers
    them: a struct item passed whole (driver/resolve.go 276-298, util.go getItems), optional
    Secrets and ConfigMaps (driver/k8s.go 353-356, 449-452), node selector and tolerations from
    parameters (k8s.go 193-299), limits (driver/driver.go 363-413), the image and GPUs from
    parameters (driver.go 415-452), retries (compiler/argocompiler/container.go 577-588)."""
    spec, executors = load_strict(_compile(tmp_path, planned))
    assert unsupported(spec, executors) == []
    used = kfp_backend.uses(spec, executors)
    for kind in [
        "ParameterIteratorSpec.ItemsSpec.inputParameter",
        "ComponentInputsSpec.ParameterSpec.parameterType=STRUCT",
        "ComponentInputsSpec.ParameterSpec.description",
        "TaskInputsSpec.InputArtifactSpec.taskOutputArtifact",
        "TaskInputsSpec.InputParameterSpec.taskFinalStatus",
        "PipelineTaskSpec.TriggerPolicy.strategy=ALL_UPSTREAM_TASKS_COMPLETED",
        "PipelineTaskSpec.cachingOptions",
        "PipelineTaskSpec.RetryPolicy.backoffMaxDuration",
        "PipelineDeploymentConfig.PipelineContainerSpec.ResourceSpec.resourceCpuLimit",
        "PipelineDeploymentConfig.PipelineContainerSpec.ResourceSpec.resourceMemoryLimit",
        "placeholder in container image: {{$.inputs.parameters[*]}}",
        "placeholder in container resources: {{$.inputs.parameters[*]}}",
        "kfp_kubernetes.NodeSelector.nodeSelectorJson",
        "kfp_kubernetes.Toleration.tolerationJson",
        "kfp_kubernetes.SecretAsEnv.optional",
        "kfp_kubernetes.ConfigMapAsEnv.optional",
        "kfp_kubernetes.FieldPathAsEnv.fieldPath",
    ]:
        assert kind in used, kind
    (fan_in,) = kfp_backend.fan_ins(spec)
    assert (fan_in.loop, fan_in.consumer) == ("for-loop-2", "gather")
    assert fan_in.items == "output Output of task plan"


def test_a_loop_over_an_untyped_list_fails_its_dict_input(tmp_path):
    """Items of an output annotated `list` are declared STRING: the iteration's DAG driver turns
    each dict into JSON text (driver/resolve.go 203-217) and the task's driver then refuses it
    for a STRUCT input (resolve.go 229-233)."""
    lines = unsupported(*load_strict(_compile(tmp_path, untyped_items)))
    assert any("input job gets a STRING value" in line for line in lines), lines


def test_an_integer_gpu_count_is_reported(tmp_path):
    """driver/resolve.go resolvePodSpecInputRuntimeParameter returns GetStringValue() (825):
    "" for a number, and driver/driver.go 440 then sets no GPU limit at all."""
    lines = unsupported(*load_strict(_compile(tmp_path, integer_gpus)))
    assert any("resourceCount" in line and "NUMBER_INTEGER" in line for line in lines), lines


def test_an_unregistered_channel_is_reported(tmp_path):
    """Without register_pipeline_channels the SDK passes `gpus` into no enclosing DAG: the driver
    fails 'parent DAG does not have input parameter' (driver/resolve.go 394-397)."""
    lines = unsupported(*load_strict(_compile(tmp_path, unregistered_gpus)))
    assert any("does not declare" in line for line in lines), lines


def test_an_empty_fan_in_by_default_is_reported(tmp_path):
    """With no items, dsl.Collected's consumer fails in its driver (driver/resolve.go 772-775:
    the loop's producer sub-task is not found; see kfp_backend.FanIn)."""
    spec, executors = load_strict(_compile(tmp_path, empty_fan_in))
    (fan_in,) = kfp_backend.fan_ins(spec)
    assert (fan_in.items, fan_in.items_default) == ("pipeline parameter tasks", [])
    assert any("are [] by default" in line for line in unsupported(spec, executors))


# The `check` command -------------------------------------------------------------------------


def test_check_passes_the_committed_spec_in_one_line():
    """`python -m pipelines.bert_pipeline check` with no FILE reads the committed spec."""
    result = subprocess.run(
        [sys.executable, "-m", "pipelines.bert_pipeline", "check"],
        cwd=ROOT,
        env=os.environ | {"PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines() == [
        "pipelines/bert_pipeline.yaml: clean: parses strictly and uses only what KFP 2.17.0 "
        "implements"
    ]


def test_check_exits_2_with_a_line_per_problem(tmp_path, capsys):
    """An unknown field (the strict parse), a wiring the backend gets wrong although the protos
    take it (`unsupported`: Argo parses backoffFactor with Atoi), a file that is not there."""

    def unknown_field(spec, platform):
        name = sorted(spec["deploymentSpec"]["executors"])[0]
        spec["deploymentSpec"]["executors"][name]["container"]["resources"]["gpuLimitX"] = 1

    def fractional_backoff(spec, platform):
        for component in [spec["root"], *spec["components"].values()]:
            for task in component.get("dag", {}).get("tasks", {}).values():
                if "retryPolicy" in task:
                    task["retryPolicy"]["backoffFactor"] = 1.5

    for edit, wanted, n in [
        (unknown_field, "gpuLimitX", 1),  # the strict parse stops at the first
        (fractional_backoff, "backoffFactor 1.5", 2),  # both pre-training phases are retried
    ]:
        path = _rewrite(tmp_path, edit)
        assert bert_pipeline.main(["check", str(path)]) == 2
        lines = capsys.readouterr().out.splitlines()
        assert len(lines) == n, lines
        assert all(line.startswith(f"{path}: ") and wanted in line for line in lines), lines
    assert bert_pipeline.main(["check", str(tmp_path / "none.yaml")]) == 2
    assert capsys.readouterr().out == f"{tmp_path / 'none.yaml'}: No such file or directory\n"
