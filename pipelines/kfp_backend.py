"""The compiled pipeline as the pinned Kubeflow Pipelines backend reads it.

Users run the open-source KFP backend, pinned at `BACKEND`. Whatever the SDK writes into
pipelines/bert_pipeline.yaml, that backend only runs what its Argo compiler, driver and launcher
implement; the rest fails late (a driver pod's error in the middle of a run) or silently (a field
dropped, a GPU limit never set). This module checks the compiled file by the backend's rules:

* `load_strict` parses both YAML documents with unknown fields as errors. The backend's own
  parsers differ: the API server rejects unknown fields in the PipelineSpec and, at run creation,
  in a task's kubernetes executor config (backend/src/v2/compiler/argocompiler/container.go
  containerExecutorTask: strict protojson.Unmarshal), but it reads `deploymentSpec` (the
  containers: image, command, resources) with DiscardUnknown (backend/src/v2/compiler/visitor.go
  GetDeploymentConfig) and the driver reads everything with DiscardUnknown
  (backend/src/common/util/json.go UnmarshalString): there a field it does not know is dropped.
* `unsupported` walks every field the spec sets, every placeholder and the wiring of pipeline
  channels, and returns what the pinned backend does not implement, one line each. What it
  implements is the `IMPLEMENTED` table: kind -> where in the backend source at tag `BACKEND`
  it is handled (each entry read there, not assumed).
* What a ParallelFor with no iterations does to a `dsl.Collected` consumer (`FanIn`,
  `fan_ins`); the state an exit handler is handed is `bert_core.track.lineage.end_status`'s and the
  pod harness's business (both cite the source).

Source citations are paths in github.com/kubeflow/pipelines at tag 2.17.0, and for Argo
(the workflow controller the 2.17.0 manifests deploy: v4.0.5) in argoproj/argo-workflows.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final, NamedTuple

import yaml
from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from kfp.kubernetes.kubernetes_executor_config_pb2 import KubernetesExecutorConfig
from kfp.pipeline_spec.pipeline_spec_pb2 import (
    ComponentSpec,
    ParameterType,
    PipelineDeploymentConfig,
    PipelineSpec,
    PipelineTaskSpec,
    PlatformSpec,
    TaskInputsSpec,
)

BACKEND: Final = "2.17.0"
"""The KFP backend release users deploy (API server, driver, launcher; Argo v4.0.5)."""

_DRV = "backend/src/v2/driver/"
_ARGO = "backend/src/v2/compiler/argocompiler/"
_LAUNCHER = "backend/src/v2/component/launcher_v2.go"
_K8S = _DRV + "k8s.go extendPodSpecPatch"
_API = "backend/src/apiserver/template/v2_template.go"
_TYPES = _DRV + "resolve.go resolveInputs handleParamTypeValidationAndConversion (202-253)"
_RES = _DRV + "driver.go initPodSpecPatch"
_OUT_TYPES = _LAUNCHER + " collectOutputParameters, v2/metadata/converter.go TextToPbValue"
_DEFAULTS = _ARGO + "argo.go Compile (97-107); " + _LAUNCHER + " addDefaultParams"
_C = "PipelineDeploymentConfig.PipelineContainerSpec."
_K = "kfp_kubernetes."
_IN = "TaskInputsSpec.InputParameterSpec."
_PH_ARGS = "placeholder in container command/args: "
_PH_CONST = "placeholder in a runtimeValue constant: "

IMPLEMENTED: Final[Mapping[str, str]] = MappingProxyType(
    {
        # The spec's frame
        "PipelineSpec.schemaVersion": _API + " (230): must be 2.1.0",
        "PipelineSpec.sdkVersion": "informational: no backend code reads it",
        "PipelineSpec.deploymentSpec": "backend/src/v2/compiler/visitor.go GetDeploymentConfig",
        "PipelineInfo.name": _API + " (233-238); the driver's --pipeline_name",
        "PipelineInfo.description": "informational (the API server's pipeline description)",
        "ComponentSpec.dag": _ARGO + "dag.go task (249-281)",
        "ComponentSpec.executorLabel": _ARGO + "dag.go task (282-336)",
        "ComponentRef.name": _ARGO + "dag.go task (229-233)",
        "PipelineTaskInfo.name": _DRV + "dag.go DAG (106), container.go (130): display name",
        "PipelineTaskSpec.dependentTasks": _ARGO + "dag.go depends (713-726): Argo X.Succeeded",
        # Parameter and artifact declarations
        "ComponentInputsSpec.ParameterSpec.parameterType=STRING": _TYPES,
        "ComponentInputsSpec.ParameterSpec.parameterType=NUMBER_INTEGER": _TYPES,
        "ComponentInputsSpec.ParameterSpec.parameterType=NUMBER_DOUBLE": _TYPES,
        "ComponentInputsSpec.ParameterSpec.parameterType=BOOLEAN": _TYPES,
        "ComponentInputsSpec.ParameterSpec.parameterType=LIST": _TYPES,
        "ComponentInputsSpec.ParameterSpec.parameterType=STRUCT": _TYPES,
        "ComponentInputsSpec.ParameterSpec.parameterType=TASK_FINAL_STATUS": _TYPES + " (246-247)",
        "ComponentInputsSpec.ParameterSpec.defaultValue": _DEFAULTS,
        "ComponentInputsSpec.ParameterSpec.isOptional": _DRV + "resolve.go resolveInputs (186-200)",
        "ComponentInputsSpec.ParameterSpec.description": _API + " (226) parses it; no runtime use",
        "ComponentOutputsSpec.ParameterSpec.description": "parsed, no backend code reads it",
        "ComponentInputsSpec.ArtifactSpec.description": "parsed, no backend code reads it",
        "ComponentOutputsSpec.ArtifactSpec.description": "parsed, no backend code reads it",
        "ComponentOutputsSpec.ParameterSpec.parameterType=STRING": _OUT_TYPES,
        "ComponentOutputsSpec.ParameterSpec.parameterType=NUMBER_INTEGER": _OUT_TYPES,
        "ComponentOutputsSpec.ParameterSpec.parameterType=NUMBER_DOUBLE": _OUT_TYPES,
        "ComponentOutputsSpec.ParameterSpec.parameterType=BOOLEAN": _OUT_TYPES,
        "ComponentOutputsSpec.ParameterSpec.parameterType=LIST": _OUT_TYPES,
        "ComponentOutputsSpec.ParameterSpec.parameterType=STRUCT": _OUT_TYPES,
        "ArtifactTypeSchema.schemaTitle": _LAUNCHER
        + " getArtifactSchema; driver.go provisionOutputs",
        "ArtifactTypeSchema.schemaVersion": _DRV
        + "driver.go provisionOutputs: carried in the type",
        "ComponentInputsSpec.ArtifactSpec.isArtifactList": (
            "not read by the backend: an input is always an ArtifactList (resolve.go "
            "resolveInputArtifact, CollectInputs); the SDK executor makes the Python list"
        ),
        "ComponentOutputsSpec.ArtifactSpec.isArtifactList": "as ArtifactSpec.isArtifactList above",
        # Task inputs
        _IN + "componentInputParameter": _DRV + "resolve.go resolveInputParameter (389-405)",
        _IN + "taskOutputParameter": _DRV + "resolve.go resolveUpstreamParameters (577-694)",
        _IN + "runtimeValue": _DRV + "resolve.go resolveInputParameter (422-457)",
        "ValueOrRuntimeParameter.constant": _DRV + "resolve.go resolveInputParameter (425-454)",
        _IN + "taskFinalStatus": (
            _DRV + "resolve.go resolveInputParameter (458-493); the producer is "
            "task.dependentTasks[0] (464-467), TaskFinalStatus.producerTask is not read"
        ),
        "TaskInputsSpec.InputParameterSpec.TaskFinalStatus.producerTask": (
            "compiled by the SDK, ignored by the driver (it uses dependentTasks[0])"
        ),
        _IN + "TaskOutputParameterSpec.producerTask": _DRV + "resolve.go resolveUpstreamParameters",
        _IN + "TaskOutputParameterSpec.outputParameterKey": _DRV + "resolve.go (584-587)",
        _IN + "parameterExpressionSelector": _DRV + "resolve.go resolveInputs (145-165), CEL",
        "TaskInputsSpec.InputArtifactSpec.componentInputArtifact": _DRV + "resolve.go (544-553)",
        "TaskInputsSpec.InputArtifactSpec.taskOutputArtifact": _DRV
        + "resolve.go (554-567, 700-805)",
        "TaskInputsSpec.InputArtifactSpec.TaskOutputArtifactSpec.producerTask": (
            _DRV + "resolve.go resolveUpstreamArtifacts (704-711)"
        ),
        "TaskInputsSpec.InputArtifactSpec.TaskOutputArtifactSpec.outputArtifactKey": (
            _DRV + "resolve.go resolveUpstreamArtifacts (738)"
        ),
        # Fan-out, fan-in, exit handler, conditions
        "PipelineTaskSpec.parameterIterator": (
            _ARGO + "dag.go iteratorTask/iterationItemTask (withSequence count = the DAG driver's "
            "iteration count); " + _DRV + "dag.go DAG (163-203)"
        ),
        "ParameterIteratorSpec.itemInput": _DRV + "resolve.go resolveInputs (276-298)",
        "ParameterIteratorSpec.ItemsSpec.inputParameter": (
            _DRV
            + "dag.go DAG (174-179), util.go getItems; items may be structs, each passed whole "
            "(resolve.go 290-298)"
        ),
        "ParameterIteratorSpec.ItemsSpec.raw": _DRV + "dag.go DAG (180-192)",
        "PipelineTaskSpec.IteratorPolicy.parallelismLimit": _ARGO + "dag.go iteratorTask (382-385)",
        "DagOutputsSpec.ArtifactSelectorSpec.producerSubtask": (
            _DRV + "resolve.go GetProducerTask (1039-1091); over a loop: CollectInputs (869-996)"
        ),
        "DagOutputsSpec.ArtifactSelectorSpec.outputArtifactKey": _DRV
        + "resolve.go GetProducerTask",
        "DagOutputsSpec.DagOutputParameterSpec.valueFromParameter": _DRV + "resolve.go (1107-1109)",
        "DagOutputsSpec.DagOutputParameterSpec.valueFromOneof": _DRV + "resolve.go (1110-1146)",
        "DagOutputsSpec.ParameterSelectorSpec.producerSubtask": _DRV + "resolve.go GetProducerTask",
        "DagOutputsSpec.ParameterSelectorSpec.outputParameterKey": _DRV
        + "resolve.go GetProducerTask",
        "PipelineTaskSpec.TriggerPolicy.strategy=ALL_UPSTREAM_TASKS_COMPLETED": (
            _ARGO + "dag.go DAG (62-110): an Argo exit lifecycle hook on the dependent DAG task "
            "(common.go addExitTask)"
        ),
        "PipelineTaskSpec.TriggerPolicy.condition": (
            _DRV
            + "dag.go DAG (84-91), container.go Container (88-95); "
            + _ARGO
            + "dag.go task (278-280), container.go containerExecutorTask (311-314)"
        ),
        # Caching and retries
        "PipelineTaskSpec.cachingOptions": _DRV + "container.go Container (217): {} = no cache",
        "PipelineTaskSpec.CachingOptions.enableCache": _DRV + "container.go Container (214-240)",
        "PipelineTaskSpec.RetryPolicy.maxRetryCount": (
            _ARGO + "container.go getTaskRetryParametersWithValues, getTaskRetryStrategyFromInput: "
            "Argo retryStrategy on the launcher pod only (577-588)"
        ),
        "PipelineTaskSpec.RetryPolicy.backoffDuration": _ARGO + "container.go: Backoff.Duration",
        "PipelineTaskSpec.RetryPolicy.backoffFactor": (
            _ARGO + "container.go: Backoff.Factor as a string; argo-workflows v4.0.5 "
            "util/intstr/parametrizable.go Int32 parses it with Atoi (integers only)"
        ),
        "PipelineTaskSpec.RetryPolicy.backoffMaxDuration": (
            _ARGO + "container.go: Backoff.MaxDuration; argo-workflows v4.0.5 workflow/controller/"
            "operator.go (1028-1041): no retry once this long has passed since the FIRST attempt "
            "started"
        ),
        # Containers
        "PipelineDeploymentConfig.ExecutorSpec.container": _ARGO + "dag.go task (288-336)",
        _C + "image": _RES + " (449-452)",
        _C + "command": _RES + " (307-319); " + _LAUNCHER + " compileCmdAndArgs",
        _C + "args": _RES + " (307-319); " + _LAUNCHER + " compileCmdAndArgs",
        _C + "EnvVar.name": _RES + " (290-293)",
        _C + "EnvVar.value": _RES + " (290-293): copied verbatim, no placeholders",
        _C + "ResourceSpec.cpuRequest": _RES + " (402-413) getPodResource",
        _C + "ResourceSpec.cpuLimit": _RES + " (389-400) getPodResource",
        _C + "ResourceSpec.memoryRequest": _RES + " (376-387) getPodResource",
        _C + "ResourceSpec.memoryLimit": _RES + " (363-374) getPodResource",
        _C + "ResourceSpec.resourceCpuRequest": _RES + " (402-413): wins over cpuRequest",
        _C + "ResourceSpec.resourceCpuLimit": _RES + " (389-400): wins over cpuLimit",
        _C + "ResourceSpec.resourceMemoryRequest": _RES + " (376-387): wins over memoryRequest",
        _C + "ResourceSpec.resourceMemoryLimit": _RES + " (363-374): wins over memoryLimit",
        _C + "ResourceSpec.AcceleratorConfig.type": _RES + " (423-425), if resourceType is empty",
        _C + "ResourceSpec.AcceleratorConfig.count": _RES + " (436-438), if resourceCount is empty",
        _C + "ResourceSpec.AcceleratorConfig.resourceType": _RES + " (418-422): limits only",
        _C + "ResourceSpec.AcceleratorConfig.resourceCount": _RES + " (429-446): limits only",
        # Placeholders (kinds made by `_placeholder_kinds`; [*] stands for any name)
        _PH_ARGS + "{{$}}": _LAUNCHER + " compileCmdAndArgs (1051-1074)",
        _PH_ARGS + "{{$.inputs.parameters[*]}}": (
            _DRV + "util.go resolveContainerArgs (263-288); " + _LAUNCHER + " getPlaceholders"
        ),
        _PH_ARGS + "{{$.inputs.artifacts[*].path}}": _LAUNCHER + " getPlaceholders (1089-1122)",
        _PH_ARGS + "{{$.inputs.artifacts[*].uri}}": _LAUNCHER + " getPlaceholders (1089-1122)",
        _PH_ARGS + "{{$.outputs.artifacts[*].path}}": _LAUNCHER + " getPlaceholders (1124-1137)",
        _PH_ARGS + "{{$.outputs.artifacts[*].uri}}": _LAUNCHER + " getPlaceholders (1124-1137)",
        _PH_ARGS + "{{$.outputs.parameters[*].output_file}}": _LAUNCHER + " getPlaceholders (1166)",
        _PH_ARGS + "IfPresent": _DRV + "util.go resolveCondition (211-261)",
        "placeholder in container image: {{$.inputs.parameters[*]}}": (
            _DRV + "resolve.go resolvePodSpecInputRuntimeParameter (818-831): the whole string, "
            "and only a STRING value (GetStringValue)"
        ),
        "placeholder in container resources: {{$.inputs.parameters[*]}}": (
            _DRV + "driver.go getPodResource / initPodSpecPatch via "
            "resolvePodSpecInputRuntimeParameter: the whole string, only a STRING value"
        ),
        _PH_CONST + "{{$.inputs.parameters[*]}}": (
            "not resolved by the driver (resolve.go 450-451 passes the constant as is); "
            + _LAUNCHER
            + " compileCmdAndArgs replaces it as text inside the {{$}} JSON: "
            "STRING/NUMBER/BOOLEAN channels only"
        ),
        "placeholder in a runtimeValue constant (part of a string): {{$.inputs.parameters[*]}}": (
            "as the whole-constant case: text substitution by the launcher"
        ),
        _PH_CONST + "{{$.pipeline_job_name}}": _DRV + "resolve.go (436-437), whole constant only",
        _PH_CONST + "{{$.pipeline_job_resource_name}}": _DRV + "resolve.go (438-439)",
        _PH_CONST + "{{$.pipeline_job_uuid}}": _DRV + "resolve.go (440-441), whole constant only",
        _PH_CONST + "{{$.pipeline_task_name}}": _DRV + "resolve.go (442-443), whole constant only",
        _PH_CONST + "{{$.pipeline_task_uuid}}": _DRV + "resolve.go (444-445), whole constant only",
        _PH_CONST + "{{$.pipeline_job_create_time_utc}}": _DRV + "resolve.go (446-447)",
        _PH_CONST + "{{$.pipeline_job_schedule_time_utc}}": _DRV + "resolve.go (448-449)",
        # The platform spec: every field of a task's KubernetesExecutorConfig
        _K + "KubernetesExecutorConfig.secretAsEnv": _K8S + " (346-393)",
        _K + "KubernetesExecutorConfig.configMapAsEnv": _K8S + " (442-489)",
        _K + "KubernetesExecutorConfig.secretAsVolume": _K8S + " (301-344)",
        _K + "KubernetesExecutorConfig.configMapAsVolume": _K8S + " (395-440)",
        _K + "KubernetesExecutorConfig.fieldPathAsEnv": _K8S + " (519-537)",
        _K + "KubernetesExecutorConfig.nodeSelector": _K8S + " (193-222)",
        # the user's identity fields only; the compiler's defaults add the rest of "restricted"
        _K + "KubernetesExecutorConfig.securityContext": _K8S + " (749-785)",
        _K + "SecurityContext.runAsUser": _K8S + " (755-765), unless an admin default is set",
        _K + "SecurityContext.runAsGroup": _K8S + " (766-773), unless an admin default is set",
        _K + "SecurityContext.runAsNonRoot": _K8S + " (774-781), unless an admin default is set",
        _K + "KubernetesExecutorConfig.tolerations": _K8S + " (224-299)",
        _K + "KubernetesExecutorConfig.podMetadata": _ARGO + "container.go containerExecutorTask",
        _K + "SecretAsEnv.keyToEnv": _K8S + " (348)",
        _K + "ConfigMapAsEnv.keyToEnv": _K8S + " (444)",
        _K + "SecretAsEnv.secretName": _K8S + " (346-393)",
        _K + "SecretAsEnv.secretNameParameter": _K8S + " (366-375), resolveInputParameterStr",
        _K + "SecretAsEnv.optional": _K8S + " (353-356): SecretKeySelector.optional",
        _K + "SecretAsEnv.SecretKeyToEnvMap.secretKey": _K8S + " (349-351)",
        _K + "SecretAsEnv.SecretKeyToEnvMap.envVar": _K8S + " (358-363)",
        _K + "ConfigMapAsEnv.configMapName": _K8S + " (442-489)",
        _K + "ConfigMapAsEnv.configMapNameParameter": _K8S + " (462-471), resolveInputParameterStr",
        _K + "ConfigMapAsEnv.optional": _K8S + " (449-452): ConfigMapKeySelector.optional",
        _K + "ConfigMapAsEnv.ConfigMapKeyToEnvMap.configMapKey": _K8S + " (445-447)",
        _K + "ConfigMapAsEnv.ConfigMapKeyToEnvMap.envVar": _K8S + " (454-459)",
        _K + "SecretAsVolume.secretName": _K8S + " (301-344)",
        _K + "SecretAsVolume.secretNameParameter": _K8S + " (304-313)",
        _K + "SecretAsVolume.mountPath": _K8S + " (330-333)",
        _K + "SecretAsVolume.optional": _K8S + " (320)",
        _K + "ConfigMapAsVolume.configMapName": _K8S + " (395-440)",
        _K + "ConfigMapAsVolume.configMapNameParameter": _K8S + " (398-407)",
        _K + "ConfigMapAsVolume.mountPath": _K8S + " (426-429)",
        _K + "ConfigMapAsVolume.optional": _K8S + " (414)",
        _K + "FieldPathAsEnv.name": _K8S + " (519-537)",
        _K + "FieldPathAsEnv.fieldPath": (
            _K8S
            + " (519-537): a downward-API fieldRef; the pipeline/runid pod label is set by "
            + _API
            + " (420) and, for recurring runs, "
            "backend/src/crd/controller/scheduledworkflow/util/scheduled_workflow.go (181), as the "
            "workflow's spec.podMetadata, which argo-workflows v4.0.5 workflow/controller/"
            "workflowpod.go (907-910) copies onto every pod"
        ),
        _K + "NodeSelector.labels": _K8S + " (209-211)",
        _K + "NodeSelector.nodeSelectorJson": (
            _K8S + " (193-222), resolve.go resolveK8sJsonParameter: a STRUCT; {} sets no selector"
        ),
        _K + "Toleration.key": _K8S + " (281-288)",
        _K + "Toleration.operator": _K8S + " (281-288)",
        _K + "Toleration.value": _K8S + " (281-288)",
        _K + "Toleration.effect": _K8S + " (281-288)",
        _K + "Toleration.tolerationSeconds": _K8S + " (281-288)",
        _K + "Toleration.tolerationJson": (
            _K8S + " (232-280): a STRUCT (one) or LIST; {} and [] add none"
        ),
        _K + "KubernetesExecutorConfig.imagePullPolicy": _K8S + " (175-191)",
        _K + "KubernetesExecutorConfig.activeDeadlineSeconds": _K8S + " (539-543)",
        _K + "PodMetadata.labels": _ARGO + "container.go extendPodMetadata (744-790)",
        _K + "PodMetadata.annotations": _ARGO + "container.go extendPodMetadata (744-790)",
    }
)
"""Kind -> where the 2.17.0 source implements it (paths under kubeflow/pipelines, lines at the
tag). A kind is a proto field the spec sets (`Message.field`, enums as `Message.field=VALUE`,
kubernetes ones prefixed `kfp_kubernetes.`) or a placeholder and where it sits. Kinds only of
what this pipeline uses or plausibly will; anything else the spec uses is `unsupported`."""

# (b) ParallelFor with no iterations feeding dsl.Collected -------------------------------------


class FanIn(NamedTuple):
    """A task in `dag` that collects outputs of the ParallelFor task `loop` (dsl.Collected).

    With zero items the loop's DAG driver records iteration_count 0 (driver/dag.go 196-202),
    Argo expands `withSequence` count 0 to nothing and marks the iterations node Skipped
    ("Skipped, empty params": argo-workflows v4.0.5 workflow/controller/operator.go
    expandSequence 3986-3988, dag.go 587-592); a Skipped leaf does not fail the loop's DAG
    (dag.go assessDAGPhase 134-228), so `loop.Succeeded` holds and the consumer's driver is
    scheduled (compiler/argocompiler/dag.go depends 713-726). That driver then fails: with
    iteration_count 0, resolveUpstreamArtifacts / resolveUpstreamParameters skip CollectInputs
    (driver/resolve.go 751-758 / 654-661, getParallelForIterationCount 1171-1180), follow the
    loop's output selector to its producer sub-task (GetProducerTask) and do not find it:
    "subTaskName, <task>_<loop DAG id>, not in tasks" (resolve.go 772-775 / 680-683). The
    consumer never runs, and the empty loop's DAG execution stays RUNNING (no launcher in it
    ever calls UpdateDAGExecutionsState), so the enclosing DAGs never become COMPLETE: an exit
    handler sees RUNNING (or FAILED, if a task failed too).
    """

    dag: str
    loop: str
    consumer: str
    items: str
    """Where the loop's items come from: `pipeline parameter <name>`, `output <key> of task
    <task>` or `raw <json>`, traced out of nested DAGs."""
    items_default: Any
    """The default of that pipeline parameter, or the raw items; None otherwise."""


def fan_ins(spec: PipelineSpec) -> list[FanIn]:
    """Every ParallelFor whose outputs another task collects, and where its items come from: a
    run must give each of them at least one item (see `FanIn`)."""
    found = []
    for dag_name, component, loop_name, loop in _tasks(spec):
        if not loop.HasField("parameter_iterator"):
            continue
        items = _trace_items(spec, dag_name, loop)
        for name, task in component.dag.tasks.items():
            if loop_name in _producers(task):
                found.append(FanIn(dag_name, loop_name, name, *items))
    return found


# Parsing -------------------------------------------------------------------------------------


class StrictParseError(ValueError):
    """A compiled spec the pinned backend's protos cannot read field for field."""


def _parse(data: Any, message: Message, where: str) -> Any:
    try:
        return json_format.ParseDict(data, message, ignore_unknown_fields=False)
    except json_format.ParseError as e:
        raise StrictParseError(f"{where}: {str(e).splitlines()[0]}") from e


def deployment(spec: PipelineSpec) -> PipelineDeploymentConfig:
    """The spec's `deploymentSpec` (a Struct in PipelineSpec) as the real message, strictly: the
    backend reads it with DiscardUnknown (backend/src/v2/compiler/visitor.go GetDeploymentConfig
    176-190), so a field it does not know would be dropped silently."""
    data = json_format.MessageToDict(spec.deployment_spec)
    for name, executor in data.get("executors", {}).items():
        where = f"deploymentSpec.executors.{name}"
        _parse(executor, PipelineDeploymentConfig.ExecutorSpec(), where)
    return _parse(data, PipelineDeploymentConfig(), "deploymentSpec")


def load_strict(path: str | Path) -> tuple[PipelineSpec, dict[str, KubernetesExecutorConfig]]:
    """The compiled file's PipelineSpec and each executor's KubernetesExecutorConfig (by executor
    label, e.g. `exec-finetune`), parsed with unknown fields as errors (`StrictParseError`,
    naming the document, the executor and the field): the backend would reject them at upload
    or run creation, or drop them (deploymentSpec, and everything the driver reads)."""
    documents = [d for d in yaml.safe_load_all(Path(path).read_text()) if d is not None]
    if not 1 <= len(documents) <= 2 or not all(isinstance(d, dict) for d in documents):
        raise StrictParseError(f"{path}: expected a PipelineSpec and a platform spec document")
    spec = _parse(documents[0], PipelineSpec(), f"{path}: PipelineSpec")
    try:
        deployment(spec)
    except StrictParseError as e:
        raise StrictParseError(f"{path}: {e}") from e
    executors: dict[str, KubernetesExecutorConfig] = {}
    if len(documents) == 2:
        _parse(documents[1], PlatformSpec(), f"{path}: PlatformSpec")
        platforms = documents[1].get("platforms", {})
        unknown = sorted(set(platforms) - {"kubernetes"})
        if unknown:
            raise StrictParseError(f"{path}: platforms {unknown}: the backend reads kubernetes")
        configs = platforms.get("kubernetes", {}).get("deploymentSpec", {}).get("executors", {})
        for name, config in configs.items():
            where = f"{path}: platforms.kubernetes.deploymentSpec.executors.{name}"
            executors[name] = _parse(config, KubernetesExecutorConfig(), where)
    return spec, executors


# What the spec uses --------------------------------------------------------------------------

_LEAVES = frozenset(
    {
        "google.protobuf.Value",
        "google.protobuf.Struct",
        "google.protobuf.ListValue",
        "google.protobuf.Duration",
    }
)
_PLACEHOLDER = re.compile(r"\{\{\$(?:\.[^{}]*)?\}\}")
_NAMED = re.compile(r"\['[^']*'\]")
_PARAM = re.compile(r"\{\{\$\.inputs\.parameters\['([^']*)'\]\}\}")
_SCALAR_TYPES = frozenset({"STRING", "NUMBER_INTEGER", "NUMBER_DOUBLE", "BOOLEAN"})
_NUMBERS = frozenset({"NUMBER_INTEGER", "NUMBER_DOUBLE"})
_STRUCTS = frozenset({"STRUCT", "TASK_FINAL_STATUS"})
_ACCEPTS: Final = MappingProxyType(
    {
        "NUMBER_INTEGER": _NUMBERS,
        "NUMBER_DOUBLE": _NUMBERS,
        "BOOLEAN": frozenset({"BOOLEAN"}),
        "LIST": frozenset({"LIST"}),
        "STRUCT": _STRUCTS,
        "TASK_FINAL_STATUS": _STRUCTS,
    }
)
"""Declared input type -> the value types the driver lets through (resolve.go resolveInputs
218-249); a STRING input takes any value, as JSON text (203-217). A value's type is what its
source declares: a DAG driver has already converted its own inputs to their declared types (a
STRING one to text), the API server checked the run's (backend/src/apiserver/template/
v2_template.go validatePipelineJobInputs) and the launcher typed the outputs (TextToPbValue)."""


def _kind_name(message: Message) -> str:
    package, _, name = message.DESCRIPTOR.full_name.partition(".")
    return name if package == "ml_pipelines" else f"{package}.{name}"


def _field_kinds(message: Message, where: str, every: bool = False) -> Iterator[tuple[str, str]]:
    """(kind, where) for every field set in `message`, recursively; Values, Structs and Durations
    are leaves. With `every` (a kubernetes executor config) every field set is a kind; else a
    message field is one only when it is a oneof's choice (which input kind, which iterator ...)
    or set but empty (`cachingOptions: {}`), and otherwise stands for its fields."""
    for field, value in message.ListFields():
        kind = f"{_kind_name(message)}.{field.json_name}"
        at = f"{where}.{field.json_name}"
        if field.type == FieldDescriptor.TYPE_ENUM:
            for number in value if field.is_repeated else [value]:
                yield f"{kind}={field.enum_type.values_by_number[number].name}", where
        elif field.type != FieldDescriptor.TYPE_MESSAGE or field.message_type.full_name in _LEAVES:
            yield kind, where
        elif field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            if value_field.message_type is None or value_field.message_type.full_name in _LEAVES:
                yield kind, where
            else:
                if every:
                    yield kind, where
                for key, item in value.items():
                    yield from _field_kinds(item, f"{at}.{key}", every)
        else:
            oneof = field.containing_oneof
            if (
                every
                or (oneof is not None and len(oneof.fields) > 1)
                or not (field.is_repeated or value.ListFields())
            ):
                yield kind, where
            items = enumerate(value) if field.is_repeated else [(None, value)]
            for index, item in items:
                yield from _field_kinds(item, at if index is None else f"{at}[{index}]", every)


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def _placeholder_kinds(where: str, text: str) -> Iterator[str]:
    """Placeholder kinds in `text` found at `where` (command/args, image, resources, env, a
    runtimeValue constant). In an image, a resource or a constant the backend only resolves a
    placeholder that is the whole string, so a partial one is a kind of its own."""
    stripped = text.strip()
    if where.startswith("container command/args") and stripped.startswith('{"'):
        try:
            yield f"placeholder in {where}: {next(iter(json.loads(stripped)))}"  # IfPresent
            return
        except (ValueError, StopIteration, TypeError):
            pass
    for match in _PLACEHOLDER.finditer(text):
        partial = (
            ""
            if where.startswith("container command/args") or match.group() == text
            else (" (part of a string)")
        )
        yield f"placeholder in {where}{partial}: {_NAMED.sub('[*]', match.group())}"


def _component_of(spec: PipelineSpec, task: PipelineTaskSpec) -> ComponentSpec:
    """The component a task runs (an empty one if the spec lacks it)."""
    return spec.components.get(task.component_ref.name, ComponentSpec())


def _tasks(spec: PipelineSpec) -> Iterator[tuple[str, ComponentSpec, str, PipelineTaskSpec]]:
    """(DAG component name, its spec, task name, task spec) for the root and every DAG."""
    for dag_name, component in [("root", spec.root), *spec.components.items()]:
        for name, task in component.dag.tasks.items():
            yield dag_name, component, name, task


def _producers(task: PipelineTaskSpec) -> set[str]:
    parameters = task.inputs.parameters.values()
    artifacts = task.inputs.artifacts.values()
    return {p.task_output_parameter.producer_task for p in parameters} | {
        a.task_output_artifact.producer_task for a in artifacts
    } - {""}


def _value_type(value: Any) -> str:
    kind = value.WhichOneof("kind")
    return {
        "string_value": "STRING",
        "number_value": "NUMBER_DOUBLE",
        "bool_value": "BOOLEAN",
        "list_value": "LIST",
        "struct_value": "STRUCT",
    }.get(kind, "NULL")


def _source_type(
    spec: PipelineSpec, parent: ComponentSpec, source: TaskInputsSpec.InputParameterSpec
) -> str | None:
    """The parameter type an input parameter spec resolves to in DAG `parent`; None when the
    driver would not find it (resolve.go resolveInputParameter)."""
    kind = source.WhichOneof("kind")
    if kind == "component_input_parameter":
        declared = parent.input_definitions.parameters.get(source.component_input_parameter)
        return None if declared is None else _type_name(declared.parameter_type)
    if kind == "task_output_parameter":
        producer = parent.dag.tasks.get(source.task_output_parameter.producer_task)
        component = producer and spec.components.get(producer.component_ref.name)
        key = source.task_output_parameter.output_parameter_key
        declared = component and component.output_definitions.parameters.get(key)
        return _type_name(declared.parameter_type) if declared else None
    if kind == "runtime_value":
        return _value_type(source.runtime_value.constant)
    return "TASK_FINAL_STATUS" if kind == "task_final_status" else None


def _type_name(number: int) -> str:
    return ParameterType.ParameterTypeEnum.Name(number)


def _trace_items(spec: PipelineSpec, dag_name: str, loop: PipelineTaskSpec) -> tuple[str, Any]:
    """Where a ParallelFor's items come from, followed out through the enclosing DAGs."""
    items = loop.parameter_iterator.items
    if items.WhichOneof("kind") == "raw":
        return f"raw {items.raw}", json.loads(items.raw)
    source, task, name = items.input_parameter, loop, dag_name
    for _ in range(len(spec.components) + 1):
        spec_in = task.inputs.parameters.get(source)
        if spec_in is None or spec_in.WhichOneof("kind") != "component_input_parameter":
            if spec_in is not None and spec_in.HasField("task_output_parameter"):
                out = spec_in.task_output_parameter
                return f"output {out.output_parameter_key} of task {out.producer_task}", None
            return f"input {source} of DAG {name}", None
        source = spec_in.component_input_parameter
        if name == "root":
            default = spec.root.input_definitions.parameters[source].default_value
            return f"pipeline parameter {source}", json_format.MessageToDict(default)
        users = [(d, t) for d, _, _, t in _tasks(spec) if t.component_ref.name == name]
        if not users:
            break
        name, task = users[0]
    return f"input {source} of DAG {name}", None


def uses(
    spec: PipelineSpec, executors: Mapping[str, KubernetesExecutorConfig]
) -> dict[str, list[str]]:
    """Every kind (see `IMPLEMENTED`) the spec uses -> the places (paths in the spec) using it."""
    places: dict[str, list[str]] = {}
    found = list(_field_kinds(spec, "spec"))
    found += _field_kinds(deployment(spec), "deploymentSpec")
    for name, config in executors.items():
        where = f"platforms.kubernetes.deploymentSpec.executors.{name}"
        found += _field_kinds(config, where, every=True)
    for name, executor in deployment(spec).executors.items():
        container = json_format.MessageToDict(executor.container)
        where = f"deploymentSpec.executors.{name}.container"
        for field, label in [
            ("command", "command/args"),
            ("args", "command/args"),
            ("image", "image"),
            ("resources", "resources"),
            ("env", "env"),
        ]:
            for text in _strings(container.get(field)):
                found += [(k, where) for k in _placeholder_kinds(f"container {label}", text)]
    for dag_name, _, task_name, task in _tasks(spec):
        for input_name, source in task.inputs.parameters.items():
            if source.HasField("runtime_value"):
                constant = json_format.MessageToDict(source.runtime_value.constant)
                where = f"{dag_name}.{task_name}.inputs.{input_name}"
                for text in _strings(constant):
                    found += [
                        (k, where) for k in _placeholder_kinds("a runtimeValue constant", text)
                    ]
    for kind, where in found:
        places.setdefault(kind, []).append(where)
    return places


def _wiring(spec: PipelineSpec, executors: Mapping[str, KubernetesExecutorConfig]) -> list[str]:
    """What the driver would reject or get wrong although every kind is implemented: a channel
    a DAG does not pass down, a channel of a type its use cannot take, an Argo-invalid retry."""
    problems = []
    containers = deployment(spec).executors
    for dag_name, parent, task_name, task in _tasks(spec):
        at = f"{dag_name}.{task_name}"
        for name, source in task.inputs.parameters.items():
            if (
                source.HasField("component_input_parameter")
                and _source_type(spec, parent, source) is None
            ):
                problems.append(
                    f"{at}: input {name} reads {source.component_input_parameter}, which DAG "
                    f"{dag_name} does not declare: the driver fails 'parent DAG does not have "
                    "input parameter' (resolve.go 394-397)"
                )
            declared = _component_of(spec, task).input_definitions.parameters.get(name)
            found = _source_type(spec, parent, source)
            if (
                declared
                and found
                and found not in _ACCEPTS.get(_type_name(declared.parameter_type), {found})
            ):
                hint = (
                    ""
                    if not source.component_input_parameter.endswith("-loop-item")
                    else (
                        "; a ParallelFor item is STRING unless the items are typed List[T], e.g. "
                        "an output annotated List[dict]"
                    )
                )
                problems.append(
                    f"{at}: input {name} gets a {found} value, {task.component_ref.name} declares "
                    f"{_type_name(declared.parameter_type)}: the driver fails 'type mismatch' "
                    f"(resolve.go 218-249{hint})"
                )
            if not source.HasField("runtime_value"):
                continue
            constant = json_format.MessageToDict(source.runtime_value.constant)
            for channel in sorted({m for s in _strings(constant) for m in _PARAM.findall(s)}):
                channel_source = task.inputs.parameters.get(channel)
                found = channel_source and _source_type(spec, parent, channel_source)
                if found not in _SCALAR_TYPES:
                    problems.append(
                        f"{at}: input {name} embeds {channel} ({found or 'unresolved'}): "
                        "the launcher pastes it "
                        "as text into the {{$}} JSON (launcher_v2.go compileCmdAndArgs), which "
                        "only works for STRING, NUMBER and BOOLEAN values"
                    )
        factor = task.retry_policy.backoff_factor
        if factor != int(factor):
            problems.append(
                f"{at}: retry backoffFactor {factor} is not an integer: argo-workflows v4.0.5 "
                "parses it with Atoi (util/intstr/parametrizable.go Int32), the retry fails"
            )
        component = spec.components.get(task.component_ref.name)
        label = component.executor_label if component else ""
        if label not in containers:
            continue
        container = json_format.MessageToDict(containers[label].container)
        pod_fields = [("image", container.get("image", ""))]
        pod_fields += [
            (f"resources.{k}", v)
            for k, v in container.get("resources", {}).items()
            if isinstance(v, str)
        ]
        pod_fields += [
            (f"accelerator.{k}", v)
            for k, v in container.get("resources", {}).get("accelerator", {}).items()
            if isinstance(v, str)
        ]
        for field, text in pod_fields:
            for channel in _PARAM.findall(text):
                source = task.inputs.parameters.get(channel)
                found = source and _source_type(spec, parent, source)
                if found != "STRING":
                    effect = (
                        "the GPU limit is silently not set"
                        if field.endswith("Count")
                        else "the driver gets '' for it"
                    )
                    problems.append(
                        f"{at}: container {field} reads {channel} ({found or 'unresolved'}): "
                        "the driver takes only a STRING value (resolve.go "
                        f"resolvePodSpecInputRuntimeParameter: GetStringValue), {effect}"
                    )
        for kind, source, wanted in _k8s_channels(executors.get(label)):
            found = _source_type(spec, parent, source)
            if found not in wanted:
                problems.append(
                    f"{at}: kubernetes {kind} reads {json_format.MessageToDict(source)} "
                    f"({found or 'not in DAG ' + dag_name}), the driver needs {sorted(wanted)} "
                    "(k8s.go extendPodSpecPatch)"
                )
    return problems


def _k8s_channels(
    config: KubernetesExecutorConfig | None,
) -> Iterator[tuple[str, TaskInputsSpec.InputParameterSpec, frozenset[str]]]:
    """The parameter specs a kubernetes executor config resolves at run time, with the types
    k8s.go accepts for each (resolveK8sJsonParameter, the toleration switch,
    resolveInputParameterStr)."""
    if config is None:
        return
    names = frozenset({"STRING"})
    if config.node_selector.HasField("node_selector_json"):
        yield "nodeSelectorJson", config.node_selector.node_selector_json, frozenset({"STRUCT"})
    for toleration in config.tolerations:
        if toleration.HasField("toleration_json"):
            yield "tolerationJson", toleration.toleration_json, frozenset({"STRUCT", "LIST"})
    for group, field in [
        (config.secret_as_env, "secret_name_parameter"),
        (config.secret_as_volume, "secret_name_parameter"),
        (config.config_map_as_env, "config_map_name_parameter"),
        (config.config_map_as_volume, "config_map_name_parameter"),
    ]:
        for item in group:
            if item.HasField(field):
                yield field, getattr(item, field), names


def unsupported(spec: PipelineSpec, executors: Mapping[str, KubernetesExecutorConfig]) -> list[str]:
    """Every feature the compiled spec uses that KFP `BACKEND` does not implement (a kind not in
    `IMPLEMENTED`), every wiring its driver would reject or get silently wrong (`_wiring`), and
    every fan-in whose default run gives its ParallelFor no items (`FanIn`); one line each,
    [] when the backend runs the spec as written."""
    lines = [
        f"{kind} (at {places[0]}, {len(places)} uses): not implemented by KFP {BACKEND}"
        for kind, places in sorted(uses(spec, executors).items())
        if kind not in IMPLEMENTED
    ]
    lines += sorted(_wiring(spec, executors))
    for fan_in in fan_ins(spec):
        if fan_in.items_default == []:
            lines.append(
                f"{fan_in.dag}.{fan_in.consumer} collects {fan_in.loop}, whose items "
                f"({fan_in.items}) are [] by default: the consumer's driver fails "
                "(resolve.go 772-775; see FanIn)"
            )
    return lines
