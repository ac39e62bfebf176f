"""Run the compiled pipeline (`pipelines/bert_pipeline.yaml`) by the rules of the Kubeflow
Pipelines backend users deploy (the pinned release, `pipelines/kfp_backend.py`), without a
cluster: the proof that the spec a user submits works, short of Kubernetes itself.

kfp.local runs the Python pipeline function by rules of its own; this runs the *compiled file*
and follows the backend's source (kubeflow/pipelines at the pinned tag; each rule names its file):

- parsing: both documents parse strictly with the pinned protos (`kfp_backend.load_strict`: the
  driver would drop an unknown field without a word, cmd/driver/main.go, common/util/json.go);
- scheduling: Argo starts a task once every task it depends on succeeded (`depends:
  X.Succeeded`, compiler/argocompiler/dag.go); the exit handler (trigger strategy
  ALL_UPSTREAM_TASKS_COMPLETED) runs whatever happened, as an exit hook; a ParallelFor runs its
  iteration DAG once per item (`withSequence`), here one after the other (2 cores);
- ML Metadata: every task and DAG is an execution with the backend's state names. A container
  is RUNNING once its driver created it, then COMPLETE or FAILED when its launcher publishes
  (component/launcher_v2.go), or CACHED at once on a cache hit, with no launcher
  (driver/container.go). A DAG stays RUNNING until a launcher publishing inside it settles it
  (metadata/client.go UpdateDAGExecutionsState: COMPLETE when all its expected tasks are
  COMPLETE, CACHED or CANCELED, FAILED when one failed; then its parents, up to the root);
- the exit handler's `PipelineTaskFinalStatus`: the last known state of the exit handler's DAG
  execution, an empty error (driver/resolve.go, case TaskFinalStatus). A DAG of cache hits, or
  one whose failing task never reached its launcher, hands over RUNNING;
- caching: a task with caching on reuses the outputs of the last COMPLETE execution with its
  cache key (cacheutils/cache.go GenerateCacheKey: input parameter values, input artifacts,
  output names and types, command, args, image); a `Cache` keeps the entries across runs, as the
  KFP database does;
- trigger conditions (`dsl.If`) and parameter expression selectors (a loop item's field): the
  driver's CEL over the task's resolved inputs (`tests/cluster/kfp_cel.py`, cel-python);
  an untriggered task's execution is created CANCELED and Argo skips it and what depends on it,
  failing nothing; nothing settles its DAG afterwards unless a later launcher publishes there;
- a `dsl.Collected` input from a loop that ran no iteration fails its consumer's driver
  (driver/resolve.go resolveUpstreamArtifacts: iteration_count 0 skips CollectInputs, and
  GetProducerTask then names an iteration that does not exist).

And each container runs as its pod would:

- the container `command` + `args` from the spec (the lightweight component's `sh -ec` program
  that writes the function's source and runs `python3 -m kfp.dsl.executor_main`), with `{{$}}`
  replaced by an executor input built as the launcher builds it: the input parameter values,
  input and output artifacts with `s3://` URIs under the pipeline root, and the output metadata
  file (in the pod's folder rather than the launcher's `/tmp`); any other placeholder fails;
- the environment the platform spec gives the pod (`tests/cluster/pod_env.py`: ConfigMap and
  Secrets from the manifests in infra/k8s/env, service URLs mapped to the test's servers,
  `KFP_RUN_ID` from the `pipeline/runid` pod label), plus the image's own (`image_env`), and
  nothing of the harness's environment; node selector and tolerations resolved and recorded;
- a folder of its own: KFP's `Artifact.path` puts `s3://b/k` at `/s3/b/k`, where the launcher
  downloads the inputs and uploads the outputs from. A pod has that folder; a test machine has
  no `/s3`, and making one needs root. So the stand-in image's `sitecustomize` points KFP's
  prefix at the pod's own `s3/` folder (`kfp.dsl.types.artifact_types._S3_LOCAL_MOUNT_PREFIX`,
  set when the executor imports that module): no root, no mount, nothing outside the test's
  folders. `/tmp` stays the host's (a longer TMPDIR breaks Ray's sockets);
- an empty working directory, and no workstation data: a parameter value that is a local path
  (`/...`, `./...`, `../...`, `~/...`) fails the task before it starts (`WorkstationPath`).

The image is stood for by `python`'s folder (this environment's, whose `python3` and console
scripts come first on PATH) and a folder holding only the package the image installs,
`bert_core`, and the `sitecustomize` above, on PYTHONPATH. Images, GPU counts, node selectors and
tolerations are resolved from their run-time placeholders and recorded per task (`TaskRun`), not
applied. Retries are not modelled: every task runs once.

    harness = Harness(spec, objects, workdir, cache=Cache())
    state = harness.run({"pretrain_steps": 20})   # the run's: "SUCCEEDED" or "FAILED"
"""

from __future__ import annotations

import graphlib
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from google.protobuf import json_format

from pipelines import kfp_backend
from tests.cluster import kfp_cel, pod_env

ROOT = Path(__file__).resolve().parents[2]
OUTPUTS = "kfp_outputs"  # in a pod's folder: the executor's output metadata and parameter files
# ML Metadata execution states, as the backend records them and hands them to an exit handler
RUNNING, COMPLETE, CACHED, FAILED, CANCELED = "RUNNING", "COMPLETE", "CACHED", "FAILED", "CANCELED"
DONE = (COMPLETE, CACHED, CANCELED)  # what UpdateDAGExecutionsState counts as completed
SUCCEEDED = "SUCCEEDED"  # a run's state in the KFP API (FAILED is the other one here)
PLACEHOLDER = re.compile(r"\{\{\$\.inputs\.parameters\['([^']+)'\]\}\}")
LOCAL_PATH = re.compile(r"^(/|\./|\.\./|~/|file:)|^\.{1,2}$")

# The stand-in image's sitecustomize: KFP's local folder for s3:// artifacts is the pod's own.
SITECUSTOMIZE = '''\
"""The stand-in image of tests/cluster/pod_harness.py: KFP's /s3/ is this pod's folder."""
import importlib.abc
import importlib.util
import os
import sys

_PREFIX = os.environ.get("KFP_HARNESS_S3_PREFIX")
_MODULE = "kfp.dsl.types.artifact_types"


class _PodS3(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module._S3_LOCAL_MOUNT_PREFIX = _PREFIX

        spec.loader.exec_module = exec_module
        return spec


if _PREFIX:
    sys.meta_path.insert(0, _PodS3())
'''


class HarnessError(RuntimeError):
    """The spec asks for something the harness does not model, or a task cannot start."""


class WorkstationPath(HarnessError):
    """A task would read a path of this machine: nothing a pod could resolve."""


class DriverError(HarnessError):
    """What the backend's driver fails on: the task never gets a pod."""


@dataclass
class Artifact:
    """A runtime artifact as the launcher hands it to an executor."""

    name: str
    schema: dict[str, str]  # {"schemaTitle": ..., "schemaVersion": ...}
    uri: str
    metadata: dict[str, Any] = field(default_factory=dict)

    def runtime(self) -> dict[str, Any]:
        return {"name": self.name, "type": self.schema, "uri": self.uri, "metadata": self.metadata}


@dataclass
class Outputs:
    parameters: dict[str, Any] = field(default_factory=dict)
    artifacts: dict[str, list[Artifact]] = field(default_factory=dict)


@dataclass
class Execution:
    """An ML Metadata execution: a container task, or a DAG (`expected`: how many tasks settle
    it, its iteration count for a loop; None for the root, which nothing settles)."""

    name: str
    state: str = RUNNING
    parent: Execution | None = None
    expected: int | None = None
    children: list[Execution] = field(default_factory=list)

    def child(self, name: str, expected: int | None = None, state: str = RUNNING) -> Execution:
        execution = Execution(name, state, self, expected)
        self.children.append(execution)
        return execution

    def settle(self) -> None:
        """metadata/client.go UpdateDAGExecutionsState, after a launcher published a task of
        this DAG: COMPLETE when every expected task is done, FAILED when one failed, else left
        RUNNING; a change goes on up to the parent."""
        dag: Execution | None = self
        while dag is not None and dag.expected is not None:
            done = sum(c.state in DONE for c in dag.children)
            if done == dag.expected:
                dag.state = COMPLETE
            elif any(c.state == FAILED for c in dag.children):
                dag.state = FAILED
            else:
                return
            dag = dag.parent


@dataclass
class TaskRun:
    """One container task: where in the DAG, what it would run on, how it ended."""

    path: str  # e.g. /exit-handler-1/finetune-jobs[1]/finetune
    executor: str
    image: str
    accelerator: dict[str, str] | None
    placement: pod_env.Placement
    env: dict[str, str]
    parameters: dict[str, Any]
    state: str  # COMPLETE, CACHED or FAILED
    seconds: float
    log: Path
    cache_key: str = ""


@dataclass
class Result:
    """A task as the DAG above it sees it: did Argo's node succeed, its outputs, its execution
    (None where the driver failed before creating one)."""

    ok: bool
    outputs: Outputs
    execution: Execution | None
    skipped: bool = False  # its trigger condition was false: not run, and no failure


@dataclass
class Scope:
    """The inputs of the DAG being run: parameter values and artifact lists, by input name."""

    parameters: dict[str, Any]
    artifacts: dict[str, list[Artifact]]


@dataclass
class Cache:
    """The backend's cache: cache key -> the outputs of a COMPLETE execution (the KFP API
    server's task table on a cluster). Share one between harness runs to see cache hits."""

    entries: dict[str, Outputs] = field(default_factory=dict)


def load_spec(path: Path) -> tuple[dict, dict]:
    """The compiled file: (pipeline spec, kfp-kubernetes platform spec), after the strict parse
    of both with the pinned backend's protos."""
    pipeline, executors = kfp_backend.load_strict(path)
    platform = {
        "platforms": {
            "kubernetes": {
                "deploymentSpec": {
                    "executors": {
                        name: json_format.MessageToDict(config)
                        for name, config in executors.items()
                    }
                }
            }
        }
    }
    return json_format.MessageToDict(pipeline), platform


def _cel(path: str, evaluate, *args) -> Any:
    """A CEL evaluation (`kfp_cel`) as the driver meets it: what CEL fails on fails the driver
    (DriverError)."""
    try:
        return evaluate(*args)
    except kfp_cel.EvaluationError as e:
        raise DriverError(f"{path}: {e}") from None


def reject_workstation_paths(where: str, value: Any) -> None:
    """Fail on any local path among a task's parameter values (nested in dicts and lists)."""
    if isinstance(value, Mapping):
        for v in value.values():
            reject_workstation_paths(where, v)
    elif isinstance(value, list):
        for v in value:
            reject_workstation_paths(where, v)
    elif isinstance(value, str) and LOCAL_PATH.match(value.strip()):
        raise WorkstationPath(f"{where}: parameter value {value!r} is a path on this machine")


def _go_number(value: Any) -> Any:
    """A parameter value as the KFP backend (Go, protojson) writes it: whole numbers without a
    `.0` (a compiled spec stores every number as a double: `defaultValue: 20.0`)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def substitute(text: str, parameters: Mapping[str, Any]) -> str:
    """`{{$.inputs.parameters['x']}}` -> the value of x (strings as they are, else JSON)."""

    def value(m: re.Match) -> str:
        if m.group(1) not in parameters:
            raise HarnessError(f"placeholder {m.group(0)}: no such input")
        v = parameters[m.group(1)]
        return v if isinstance(v, str) else json.dumps(_go_number(v))

    return PLACEHOLDER.sub(value, text)


def _substitute_all(value: Any, parameters: Mapping[str, Any]) -> Any:
    if isinstance(value, str):
        return substitute(value, parameters)
    if isinstance(value, Mapping):
        return {k: _substitute_all(v, parameters) for k, v in value.items()}
    if isinstance(value, list):
        return [_substitute_all(v, parameters) for v in value]
    return value


def _artifact_lists(artifacts: Mapping[str, list[Artifact]]) -> dict[str, Any]:
    return {k: {"artifacts": [a.runtime() for a in v]} for k, v in artifacts.items()}


def cache_key(
    container: Mapping[str, Any],
    values: Mapping[str, Any],
    inputs: Mapping[str, list[Artifact]],
    outputs: Mapping[str, list[Artifact]],
    out_params: Mapping[str, Any],
) -> str:
    """cacheutils/cache.go GenerateCacheKey, hashed: the input parameter values, the input
    artifacts (by identity: a re-run producer makes new ones), the output artifacts' names and
    types (URIs wiped), the output parameters' types, command + args and image as the spec
    has them (placeholders unresolved: their values are among the inputs)."""
    key = {
        "inputParameterValues": {k: _go_number(v) for k, v in values.items()},
        "inputArtifactNames": {k: [a.uri for a in v] for k, v in inputs.items()},
        "outputArtifactsSpec": {k: [a.name, a.schema] for k, (a, *_) in outputs.items()},
        "outputParametersSpec": {k: v.get("parameterType") for k, v in out_params.items()},
        "containerSpec": {
            "image": container["image"],
            "cmdArgs": [*container["command"], *container.get("args", [])],
        },
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


class Harness:
    """One pipeline run of a compiled spec; see the module docstring.

    `objects`: the ConfigMaps and Secrets of the cluster (`pod_env.manifest_objects`, localized);
    `workdir`: where the pods' private folders go; `pipeline_root`: the run's own, an s3://
    prefix ("": the namespace's `kfp-launcher`, as the backend decides: `pod_env.pipeline_root`);
    `cache`: the backend's cache, shared with other runs (default: a new, empty one)."""

    def __init__(
        self,
        spec: Path,
        objects: pod_env.Objects,
        workdir: Path,
        pipeline_root: str = "",
        python: str = sys.executable,
        image_env: Mapping[str, str] | None = None,
        timeout: float = 900,
        cache: Cache | None = None,
    ):
        self.pipeline, self.platform = load_spec(spec)
        self.objects = objects
        self.root = pod_env.pipeline_root(objects, pipeline_root).rstrip("/")
        self.workdir, self.timeout = Path(workdir), timeout
        self.cache = cache if cache is not None else Cache()
        self.run_id = str(uuid.uuid4())
        self.tasks: list[TaskRun] = []
        self.image_env = dict(image_env or {})
        self.bin = Path(python).parent
        self.site = self.workdir / "image" / "site"
        self.dag = Execution("root")  # the run's root DAG execution
        self._install_image()
        self.s3 = self._s3_client()

    # -- the stand-in for the image, and the launcher's S3 client

    def _install_image(self) -> None:
        if not (self.bin / "python3").exists():
            raise HarnessError(f"{self.bin} has no python3: pass a virtual environment's python")
        self.site.mkdir(parents=True, exist_ok=True)
        package = self.site / "bert_core"
        if not package.exists():
            package.symlink_to(ROOT / "bert_core", target_is_directory=True)
        (self.site / "sitecustomize.py").write_text(SITECUSTOMIZE)

    def _s3_client(self):
        """S3 as the launcher reaches it: the `kfp-launcher` providers' endpoint and the keys of
        the Secret they name (`pod_env.s3_session`), not the harness's own environment."""
        import boto3

        session = pod_env.s3_session(self.objects, self.root)
        return boto3.client("s3", **{k: v or None for k, v in session.items()})

    # -- the DAG

    def run(self, arguments: Mapping[str, Any] | None = None) -> str:
        """Run the pipeline with `arguments` over the spec's parameter defaults; returns the
        run's final state (SUCCEEDED or FAILED). The tasks are in `self.tasks`."""
        root = self.pipeline["root"]
        declared = root.get("inputDefinitions", {}).get("parameters", {})
        unknown = set(arguments or {}) - set(declared)
        if unknown:
            raise HarnessError(f"not pipeline parameters: {sorted(unknown)}")
        params = {k: v["defaultValue"] for k, v in declared.items() if "defaultValue" in v}
        params |= dict(arguments or {})
        ok, _ = self._dag(root, Scope(params, {}), "", self.dag)
        return SUCCEEDED if ok else FAILED

    def _dag(self, component: dict, scope: Scope, path: str, dag: Execution):
        """Run a DAG's tasks in dependency order. A task runs when every task it depends on
        succeeded (Argo's `depends`), the exit handler whatever happened; the DAG succeeded
        when every task that ran did (a task never started fails no DAG by itself)."""
        tasks = component["dag"]["tasks"]
        deps = {name: self._upstream(spec) for name, spec in tasks.items()}
        results: dict[str, Result] = {}
        order = graphlib.TopologicalSorter(deps)
        order.prepare()
        ok = True
        while order.is_active():
            for name in sorted(order.get_ready()):
                spec = tasks[name]
                policy = spec.get("triggerPolicy", {})
                ready = all(d in results and results[d].ok for d in deps[name])
                if ready or policy.get("strategy") == "ALL_UPSTREAM_TASKS_COMPLETED":
                    results[name] = self._task(name, spec, scope, results, f"{path}/{name}", dag)
                    ok = ok and (results[name].ok or results[name].skipped)
                order.done(name)
        return ok, self._dag_outputs(component["dag"].get("outputs", {}), results, path)

    @staticmethod
    def _upstream(spec: dict) -> set[str]:
        inputs = spec.get("inputs", {})
        producers = {
            ref["producerTask"]
            for kind in ("parameters", "artifacts")
            for value in inputs.get(kind, {}).values()
            for ref in [
                value.get("taskOutputParameter")
                or value.get("taskOutputArtifact")
                or value.get("taskFinalStatus")
            ]
            if ref
        }
        return producers | set(spec.get("dependentTasks", []))

    @staticmethod
    def _dag_outputs(outputs: dict, results: dict[str, Result], path: str) -> Outputs:
        out = Outputs()
        for key, spec in outputs.get("artifacts", {}).items():
            out.artifacts[key] = [
                a
                for sel in spec["artifactSelectors"]
                if sel["producerSubtask"] in results
                for a in results[sel["producerSubtask"]].outputs.artifacts.get(
                    sel["outputArtifactKey"], []
                )
            ]
        for key, spec in outputs.get("parameters", {}).items():
            sel = spec["valueFromParameter"]
            produced = results.get(sel["producerSubtask"])
            if produced is not None and sel["outputParameterKey"] in produced.outputs.parameters:
                out.parameters[key] = produced.outputs.parameters[sel["outputParameterKey"]]
        return out

    def _task(self, name: str, spec: dict, scope: Scope, results: dict, path: str, dag):
        component = self.pipeline["components"][spec["componentRef"]["name"]]
        try:
            params = self._parameters(spec, scope, results, path, dag)
            artifacts = self._artifacts(spec, scope, results, path)
            runs = self._triggered(spec, params, path)
        except DriverError as e:
            self._driver_failed(spec, component, path, str(e))
            return Result(False, Outputs(), None)
        if not runs:  # not triggered: created CANCELED (metadata/client.go), Argo skips it
            return Result(False, Outputs(), dag.child(name, state=CANCELED), skipped=True)
        if "parameterIterator" in spec:
            return self._loop(name, spec, component, params, artifacts, path, dag)
        if "dag" in component:
            execution = dag.child(name, expected=len(component["dag"]["tasks"]))
            ok, outputs = self._dag(component, Scope(params, artifacts), path, execution)
            return Result(ok, outputs, execution)
        return self._container(name, spec, component, params, artifacts, path, dag, scope)

    @staticmethod
    def _triggered(spec: dict, params: dict[str, Any], path: str) -> bool:
        """The driver's trigger condition over the task's resolved inputs (`kfp_cel.condition`;
        driver/dag.go 84-91, container.go 88-95); a task without one always runs. Nothing
        settles its DAG when it is not triggered: no launcher publishes (as on the backend)."""
        condition = spec.get("triggerPolicy", {}).get("condition")
        return _cel(path, kfp_cel.condition, condition, params) if condition else True

    def _driver_failed(self, spec: dict, component: dict, path: str, why: str) -> None:
        """A container whose driver failed: recorded FAILED, with the driver's error as its
        log; no execution, so no DAG above it is settled."""
        if "executorLabel" not in component:
            return
        pod = self._pod_folder(component["executorLabel"])
        (pod / "log.txt").write_text(f"driver: {why}\n")
        self.tasks.append(
            TaskRun(
                path,
                component["executorLabel"],
                "",
                None,
                pod_env.Placement(),
                {},
                {},
                FAILED,
                0.0,
                pod / "log.txt",
            )
        )

    def _parameters(
        self, spec: dict, scope: Scope, results: dict, path: str, dag: Execution
    ) -> dict[str, Any]:
        """A task's input parameter values; constants last, their placeholders filled from the
        others (as the KFP driver does for a dict holding pipeline parameters)."""
        values: dict[str, Any] = {}
        constants = {}
        for key, src in spec.get("inputs", {}).get("parameters", {}).items():
            if "componentInputParameter" in src:
                values[key] = scope.parameters[src["componentInputParameter"]]
                if "parameterExpressionSelector" in src:  # driver/resolve.go 145-165
                    selector = src["parameterExpressionSelector"]
                    values[key] = _cel(path, kfp_cel.select, selector, values[key])
            elif "taskOutputParameter" in src:
                ref = src["taskOutputParameter"]
                produced = results[ref["producerTask"]].outputs.parameters
                if ref["outputParameterKey"] not in produced:
                    raise DriverError(f"{path}: no output {ref} to resolve input {key}")
                values[key] = produced[ref["outputParameterKey"]]
            elif "taskFinalStatus" in src:
                values[key] = self._final_status(spec, dag, path)
            elif "runtimeValue" in src:
                constants[key] = src["runtimeValue"]["constant"]
            else:
                raise HarnessError(f"{path}: input {key}: {src} is not modelled")
        values |= {k: _substitute_all(v, values) for k, v in constants.items()}
        return values

    def _final_status(self, spec: dict, dag: Execution, path: str) -> dict[str, Any]:
        """driver/resolve.go, case TaskFinalStatus: the producer is the task's first dependent
        task; its state is its execution's last known state, the error always empty."""
        producer = spec["dependentTasks"][0]
        execution = next((c for c in dag.children if c.name == producer), None)
        if execution is None:
            raise DriverError(f"{path}: producer task, {producer}, not in tasks")
        return {
            "state": execution.state,
            "pipelineJobResourceName": f"bert-pipeline-{self.run_id[:8]}",
            "pipelineTaskName": producer,
            "error": {},
        }

    @staticmethod
    def _artifacts(spec: dict, scope: Scope, results: dict, path: str):
        out = {}
        for key, src in spec.get("inputs", {}).get("artifacts", {}).items():
            if "componentInputArtifact" in src:
                out[key] = scope.artifacts[src["componentInputArtifact"]]
                continue
            ref = src["taskOutputArtifact"]
            produced = results[ref["producerTask"]]
            found = produced.outputs.artifacts.get(ref["outputArtifactKey"])
            if produced.execution is not None and produced.execution.expected == 0:
                # a loop of no iterations: resolveUpstreamArtifacts finds no producer
                raise DriverError(
                    f"{path}: input {key}: {ref['producerTask']} ran no iteration, so the "
                    f"driver finds no producer of {ref['outputArtifactKey']} (subTaskName not "
                    "in tasks)"
                )
            if found is None:
                raise DriverError(f"{path}: input {key}: no artifact {ref}")
            out[key] = found
        return out

    def _loop(self, name, spec: dict, component: dict, params: dict, artifacts: dict, path, dag):
        """A ParallelFor: its DAG execution (settled by iteration count), then the iteration DAG
        once per item (in turn: 2 cores), each iteration's outputs collected into one list per
        output (what `dsl.Collected` consumers get)."""
        iterator = spec["parameterIterator"]
        items = iterator["items"]
        values = json.loads(items["raw"]) if "raw" in items else params[items["inputParameter"]]
        values = json.loads(values) if isinstance(values, str) else values
        loop = dag.child(name, expected=len(values))
        collected = Outputs(
            artifacts={k: [] for k in component["dag"].get("outputs", {}).get("artifacts", {})}
        )
        ok = True
        for i, item in enumerate(values):
            iteration = loop.child(f"iteration-{i}", expected=len(component["dag"]["tasks"]))
            scope = Scope({**params, iterator["itemInput"]: item}, artifacts)
            done, out = self._dag(component, scope, f"{path}[{i}]", iteration)
            ok = ok and done
            for key, found in out.artifacts.items():
                collected.artifacts[key] += found
        return Result(ok, collected, loop)

    # -- one pod

    def _pod_folder(self, label: str) -> Path:
        pod = self.workdir / f"pod-{len(self.tasks):02d}-{label.removeprefix('exec-')}"
        for sub in ("s3", OUTPUTS, "work", "home"):
            (pod / sub).mkdir(parents=True, exist_ok=True)
        return pod

    def _container(
        self, name, spec_task: dict, component: dict, params, artifacts, path, dag, scope: Scope
    ):
        label = component["executorLabel"]
        container = self.pipeline["deploymentSpec"]["executors"][label]["container"]
        declared = component.get("inputDefinitions", {})
        values = {
            k: _go_number(params.get(k, spec.get("defaultValue")))
            for k, spec in declared.get("parameters", {}).items()
            if k in params or "defaultValue" in spec
        }
        reject_workstation_paths(path, values)
        pod = self._pod_folder(label)
        inputs = {k: artifacts.get(k, []) for k in declared.get("artifacts", {})}
        outputs = {
            k: [Artifact(k, spec["artifactType"], f"{self.root}/{self.run_id}{path}/{k}")]
            for k, spec in component.get("outputDefinitions", {}).get("artifacts", {}).items()
        }
        out_params = component.get("outputDefinitions", {}).get("parameters", {})
        accelerator = container.get("resources", {}).get("accelerator")
        task = TaskRun(
            path=path,
            executor=label,
            image=substitute(container["image"], params),
            accelerator=_substitute_all(accelerator, params) if accelerator else None,
            placement=pod_env.placement(self.platform, label, scope.parameters),
            env=self._env(label, pod),
            parameters=values,
            state=FAILED,
            seconds=0.0,
            log=pod / "log.txt",
            cache_key=cache_key(container, params, inputs, outputs, out_params),
        )
        self.tasks.append(task)
        execution = dag.child(name)
        caching = spec_task.get("cachingOptions", {}).get("enableCache", False)
        if caching and task.cache_key in self.cache.entries:
            task.state = execution.state = CACHED  # published by the driver: nothing settles
            task.log.write_text("cache hit: outputs reused, no pod\n")
            return Result(True, self.cache.entries[task.cache_key], execution)
        executor_input = {
            "inputs": {"parameterValues": values, "artifacts": _artifact_lists(inputs)},
            "outputs": {
                "parameters": {k: {"outputFile": str(pod / OUTPUTS / k)} for k in out_params},
                "artifacts": _artifact_lists(outputs),
                "outputFile": str(pod / OUTPUTS / "output_metadata.json"),
            },
        }
        argv = [
            a.replace("{{$}}", json.dumps(executor_input))
            for a in [*container["command"], *container.get("args", [])]
        ]
        if any("{{$" in a for a in argv):
            raise HarnessError(f"{path}: unresolved placeholders in {argv}")
        for artifact in (a for v in inputs.values() for a in v):
            self._download(artifact, pod / "s3")
        start = time.monotonic()
        code = self._exec(argv, task.env, pod)
        task.seconds = time.monotonic() - start
        produced = self._collect(outputs, out_params, pod) if code == 0 else None
        task.state = execution.state = COMPLETE if produced is not None else FAILED
        dag.settle()  # the launcher's deferred UpdateDAGExecutionsState
        if produced is None:
            return Result(False, Outputs(), execution)
        if caching:  # the launcher's cache entry: only a COMPLETE execution makes one
            self.cache.entries[task.cache_key] = produced
        return Result(True, produced, execution)

    def _env(self, executor: str, pod: Path) -> dict[str, str]:
        """The pod's environment: the image's, then the platform spec's (ConfigMap, Secrets,
        the run id label); nothing of the harness's own environment."""
        env = {
            "PATH": f"{self.bin}:/usr/local/bin:/usr/bin:/bin",
            "HOME": str(pod / "home"),
            "PYTHONPATH": str(self.site),
            "LANG": "C.UTF-8",
            "KFP_HARNESS_S3_PREFIX": f"{pod / 's3'}/",
            **self.image_env,
        }
        labels = {"pipeline/runid": self.run_id}
        return env | pod_env.pod_env(self.platform, executor, self.objects, labels)

    def _exec(self, argv: list[str], env: dict[str, str], pod: Path) -> int:
        """The container's process: an empty working directory, its own process group (ended
        afterwards, with anything it left, such as a local Ray's daemons)."""
        with open(pod / "log.txt", "wb") as log:
            proc = subprocess.Popen(
                argv,
                env=env,
                cwd=pod / "work",
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            try:
                return proc.wait(self.timeout)
            except subprocess.TimeoutExpired:
                return -1
            finally:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()

    # -- the launcher's side: artifacts in and out of S3, the executor's output

    def _local(self, uri: str, mount: Path) -> tuple[str, str, Path]:
        if not uri.startswith("s3://"):
            raise WorkstationPath(f"artifact URI {uri} is not in S3")
        bucket, _, key = uri[len("s3://") :].partition("/")
        return bucket, key, mount / bucket / key

    def _download(self, artifact: Artifact, mount: Path) -> None:
        """An input artifact into the pod's /s3: one object (a file) or a prefix (a folder)."""
        bucket, key, local = self._local(artifact.uri, mount)
        pages = self.s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=key)
        keys = [
            o["Key"]
            for page in pages
            for o in page.get("Contents", [])
            if o["Key"] == key or o["Key"].startswith(f"{key}/")
        ]
        for k in keys:
            target = local if k == key else local / k[len(key) + 1 :]
            target.parent.mkdir(parents=True, exist_ok=True)
            self.s3.download_file(bucket, k, str(target))
        if not keys and artifact.schema.get("schemaTitle") != "system.Metrics":
            raise HarnessError(f"input artifact {artifact.uri} has no objects")

    def _upload(self, artifact: Artifact, mount: Path) -> None:
        bucket, key, local = self._local(artifact.uri, mount)
        files = [local] if local.is_file() else sorted(p for p in local.rglob("*") if p.is_file())
        for f in files:
            name = key if f == local else f"{key}/{f.relative_to(local).as_posix()}"
            self.s3.upload_file(str(f), bucket, name)

    def _collect(self, outputs: dict[str, list[Artifact]], out_params: dict, pod: Path) -> Outputs:
        """After a successful executor: upload its output artifacts, read its output parameters
        and the artifacts' metadata from the output metadata file (else the parameter files)."""
        meta_file = pod / OUTPUTS / "output_metadata.json"
        meta = json.loads(meta_file.read_text()) if meta_file.exists() else {}
        for key, [artifact] in outputs.items():
            self._upload(artifact, pod / "s3")
            for written in meta.get("artifacts", {}).get(key, {}).get("artifacts", []):
                artifact.metadata = written.get("metadata", {})
        produced = Outputs(artifacts=outputs)
        for key in out_params:
            if key in meta.get("parameterValues", {}):
                produced.parameters[key] = meta["parameterValues"][key]
            else:
                produced.parameters[key] = (pod / OUTPUTS / key).read_text()
        return produced
