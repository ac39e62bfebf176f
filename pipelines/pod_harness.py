"""Run the compiled pipeline (`pipelines/bert_pipeline.yaml`) the way a Kubeflow cluster runs it,
without the cluster: the proof that the spec a user submits works, short of Kubernetes itself.

kfp.local runs the Python pipeline function; this runs the *compiled file*, task by task, in the
DAG's order (nested DAGs, the ParallelFor fan-outs, their `dsl.Collected` outputs, the exit
handler that runs whatever happened), and each task's executor exactly as its pod would:

- the container `command` + `args` from the spec (the lightweight component's `sh -ec` program
  that writes the function's source and runs `python3 -m kfp.dsl.executor_main`), with
  `{{$}}` replaced by an executor input built as the KFP launcher builds it: the input parameter
  values, input and output artifacts with `s3://` URIs under the pipeline root, and the output
  metadata file (`kfp_outputs/output_metadata.json`, in the pod's folder rather than the
  launcher's `/tmp`); any other placeholder fails;
- the environment the platform spec gives the pod (`pipelines/pod_env.py`: ConfigMap and Secret
  from the manifests in infra/k8s/env, service URLs mapped to the test's servers, `KFP_RUN_ID`
  from the `pipeline/runid` pod label), plus the image's own (`image_env`), and nothing from the
  harness's environment;
- its own mount namespace (`unshare --mount`) with a private `/s3` (where KFP's `Artifact.path`
  puts `s3://b/k`: `/s3/b/k`): the harness downloads the input artifacts into it before and
  uploads the output artifacts from it after, as the launcher does. (`/tmp` stays the host's:
  a private one would hide the harness's folders, and a longer TMPDIR breaks Ray's sockets);
- an empty working directory, and no workstation data: a parameter value that is a local path
  (`/...`, `./...`, `../...`, `~/...`) fails the task before it starts (`WorkstationPath`).

The image is stood for by `python`'s folder (this environment's, whose `python3` and console
scripts come first on PATH: a virtual environment's interpreter finds its packages only from
there) and a folder holding only the package the image installs, `bert_core`, on PYTHONPATH.
Images and GPU counts are resolved from their run-time placeholders and recorded per task
(`TaskRun`), not applied. Caching and retries are not modelled: every task runs once.

    harness = Harness(spec, objects, workdir, pipeline_root="s3://bert/kfp")
    state = harness.run({"pretrain_steps": 20})   # "SUCCEEDED" or "FAILED"

Needs root (or a user namespace allowing mounts) for `unshare --mount`; the empty mount point
`/s3` is made when missing (a fresh machine has none).
"""

from __future__ import annotations

import graphlib
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

import yaml

from pipelines import pod_env

ROOT = Path(__file__).resolve().parents[1]
MOUNT = "/s3"  # KFP's local path of s3:// URIs (kfp.dsl.types.artifact_types)
OUTPUTS = "kfp_outputs"  # in a pod's folder: the executor's output metadata and parameter files
SUCCEEDED, FAILED, SKIPPED = "SUCCEEDED", "FAILED", "SKIPPED"
PLACEHOLDER = re.compile(r"\{\{\$\.inputs\.parameters\['([^']+)'\]\}\}")
LOCAL_PATH = re.compile(r"^(/|\./|\.\./|~/|file:)|^\.{1,2}$")

# What `unshare` runs in the new mount namespace: a private /s3, then the container.
MOUNTS = 'mkdir -p /s3 && mount --bind "$1" /s3 && shift && exec "$@"'


class HarnessError(RuntimeError):
    """The spec asks for something the harness does not model, or a task cannot start."""


class WorkstationPath(HarnessError):
    """A task would read a path of this machine: nothing a pod could resolve."""


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
class TaskRun:
    """One executed pod: where in the DAG, what it would run on, how it ended."""

    path: str  # e.g. /exit-handler-1/glue-tasks[1]/finetune
    executor: str
    image: str
    accelerator: dict[str, str] | None
    env: dict[str, str]
    parameters: dict[str, Any]
    state: str
    seconds: float
    log: Path


@dataclass
class Scope:
    """The inputs of the DAG being run: parameter values and artifact lists, by input name."""

    parameters: dict[str, Any]
    artifacts: dict[str, list[Artifact]]


def load_spec(path: Path) -> tuple[dict, dict]:
    """The compiled file: (pipeline spec, kfp-kubernetes platform spec)."""
    pipeline, platform = yaml.safe_load_all(Path(path).read_text())
    return pipeline, platform


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


class Harness:
    """One pipeline run of a compiled spec; see the module docstring.

    `objects`: the ConfigMaps and Secrets of the cluster (`pod_env.manifest_objects`, localized);
    `workdir`: where the pods' private folders go; `pipeline_root`: an s3:// prefix; `site`: a
    folder holding what the image installs (default: a link to this repo's `bert_core`)."""

    def __init__(
        self,
        spec: Path,
        objects: pod_env.Objects,
        workdir: Path,
        pipeline_root: str,
        python: str = sys.executable,
        image_env: Mapping[str, str] | None = None,
        timeout: float = 900,
    ):
        self.pipeline, self.platform = load_spec(spec)
        self.objects, self.root = objects, pipeline_root.rstrip("/")
        self.workdir, self.timeout = Path(workdir), timeout
        self.run_id = str(uuid.uuid4())
        self.tasks: list[TaskRun] = []
        self.image_env = dict(image_env or {})
        self.bin = Path(python).parent
        self.site = self.workdir / "image" / "site"
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

    def _s3_client(self):
        """S3 as the launcher reaches it: the pods' endpoint and credentials (ConfigMap and
        Secret), not the harness's own environment."""
        import boto3

        env: dict[str, str] = {}
        for (_, _), data in self.objects.items():
            env |= data
        return boto3.client(
            "s3",
            endpoint_url=env.get("AWS_ENDPOINT_URL") or None,
            region_name=env.get("AWS_DEFAULT_REGION") or None,
            aws_access_key_id=env.get("AWS_ACCESS_KEY_ID"),
            aws_secret_access_key=env.get("AWS_SECRET_ACCESS_KEY"),
        )

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
        state, _ = self._dag(root, Scope(params, {}), "")
        return state

    def _dag(self, component: dict, scope: Scope, path: str) -> tuple[str, Outputs]:
        """Run a DAG's tasks in dependency order; a task whose upstream did not succeed is
        skipped unless its trigger policy runs it anyway (the exit handler)."""
        tasks = component["dag"]["tasks"]
        deps = {name: self._upstream(spec) for name, spec in tasks.items()}
        results: dict[str, tuple[str, Outputs]] = {}
        order = graphlib.TopologicalSorter(deps)
        order.prepare()
        while order.is_active():
            for name in sorted(order.get_ready()):
                spec = tasks[name]
                policy = spec.get("triggerPolicy", {})
                if "condition" in policy:
                    raise HarnessError(f"{path}/{name}: trigger conditions are not modelled")
                upstream_ok = all(results[d][0] == SUCCEEDED for d in deps[name])
                if upstream_ok or policy.get("strategy") == "ALL_UPSTREAM_TASKS_COMPLETED":
                    results[name] = self._task(name, spec, scope, results, f"{path}/{name}")
                else:
                    results[name] = (SKIPPED, Outputs())
                order.done(name)
        state = SUCCEEDED if all(s == SUCCEEDED for s, _ in results.values()) else FAILED
        return state, self._dag_outputs(component["dag"].get("outputs", {}), results)

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
    def _dag_outputs(outputs: dict, results: dict[str, tuple[str, Outputs]]) -> Outputs:
        out = Outputs()
        for key, spec in outputs.get("artifacts", {}).items():
            out.artifacts[key] = [
                a
                for sel in spec["artifactSelectors"]
                for a in results[sel["producerSubtask"]][1].artifacts.get(
                    sel["outputArtifactKey"], []
                )
            ]
        for key, spec in outputs.get("parameters", {}).items():
            sel = spec["valueFromParameter"]
            out.parameters[key] = results[sel["producerSubtask"]][1].parameters[
                sel["outputParameterKey"]
            ]
        return out

    def _task(self, name: str, spec: dict, scope: Scope, results: dict, path: str):
        component = self.pipeline["components"][spec["componentRef"]["name"]]
        params = self._parameters(spec, scope, results, path)
        artifacts = self._artifacts(spec, scope, results)
        if "parameterIterator" in spec:
            return self._loop(spec["parameterIterator"], component, params, artifacts, path)
        if "dag" in component:
            return self._dag(component, Scope(params, artifacts), path)
        return self._container(component, params, artifacts, path)

    def _parameters(self, spec: dict, scope: Scope, results: dict, path: str) -> dict[str, Any]:
        """A task's input parameter values; constants last, their placeholders filled from the
        others (as the KFP driver does for a dict holding pipeline parameters)."""
        values: dict[str, Any] = {}
        constants = {}
        for key, src in spec.get("inputs", {}).get("parameters", {}).items():
            if "componentInputParameter" in src:
                values[key] = scope.parameters[src["componentInputParameter"]]
            elif "taskOutputParameter" in src:
                ref = src["taskOutputParameter"]
                produced = results[ref["producerTask"]][1].parameters
                values[key] = produced[ref["outputParameterKey"]]
            elif "taskFinalStatus" in src:
                producer = src["taskFinalStatus"]["producerTask"]
                state = results[producer][0]
                values[key] = {
                    "state": state,
                    "pipelineJobResourceName": f"harness/{self.run_id}",
                    "pipelineTaskName": producer,
                    "error": {} if state == SUCCEEDED else {"code": 1, "message": f"{state}"},
                }
            elif "runtimeValue" in src:
                constants[key] = src["runtimeValue"]["constant"]
            else:
                raise HarnessError(f"{path}: input {key}: {src} is not modelled")
        values |= {k: _substitute_all(v, values) for k, v in constants.items()}
        return values

    @staticmethod
    def _artifacts(spec: dict, scope: Scope, results: dict) -> dict[str, list[Artifact]]:
        out = {}
        for key, src in spec.get("inputs", {}).get("artifacts", {}).items():
            if "componentInputArtifact" in src:
                out[key] = scope.artifacts[src["componentInputArtifact"]]
            else:
                ref = src["taskOutputArtifact"]
                out[key] = results[ref["producerTask"]][1].artifacts[ref["outputArtifactKey"]]
        return out

    def _loop(self, iterator: dict, component: dict, params: dict, artifacts: dict, path: str):
        """A ParallelFor: the loop's DAG once per item (in turn: 2 cores), each iteration's
        outputs collected into one list per output (what `dsl.Collected` consumers get)."""
        items = iterator["items"]
        values = json.loads(items["raw"]) if "raw" in items else params[items["inputParameter"]]
        values = json.loads(values) if isinstance(values, str) else values
        collected = Outputs(artifacts={k: [] for k in component["dag"].get("outputs", {}).get(
            "artifacts", {})})  # fmt: skip
        state = SUCCEEDED
        for i, item in enumerate(values):
            scope = Scope({**params, iterator["itemInput"]: item}, artifacts)
            s, out = self._dag(component, scope, f"{path}[{i}]")
            state = state if s == SUCCEEDED else FAILED
            for key, found in out.artifacts.items():
                collected.artifacts[key] += found
        return state, collected

    # -- one pod

    def _container(self, component: dict, params: dict, artifacts: dict, path: str):
        label = component["executorLabel"]
        container = self.pipeline["deploymentSpec"]["executors"][label]["container"]
        declared = component.get("inputDefinitions", {})
        values = {
            k: _go_number(params.get(k, spec.get("defaultValue")))
            for k, spec in declared.get("parameters", {}).items()
            if k in params or "defaultValue" in spec
        }
        reject_workstation_paths(path, values)
        pod = self.workdir / f"pod-{len(self.tasks):02d}-{label.removeprefix('exec-')}"
        for sub in ("s3", OUTPUTS, "work", "home"):
            (pod / sub).mkdir(parents=True, exist_ok=True)
        inputs = {k: artifacts.get(k, []) for k in declared.get("artifacts", {})}
        outputs = {
            k: [Artifact(k, spec["artifactType"], f"{self.root}/{self.run_id}{path}/{k}")]
            for k, spec in component.get("outputDefinitions", {}).get("artifacts", {}).items()
        }
        out_params = component.get("outputDefinitions", {}).get("parameters", {})
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
        accelerator = container.get("resources", {}).get("accelerator")
        task = TaskRun(
            path=path,
            executor=label,
            image=substitute(container["image"], params),
            accelerator=_substitute_all(accelerator, params) if accelerator else None,
            env=self._env(label, pod),
            parameters=values,
            state=FAILED,
            seconds=0.0,
            log=pod / "log.txt",
        )
        self.tasks.append(task)
        for artifact in (a for v in inputs.values() for a in v):
            self._download(artifact, pod / "s3")
        start = time.monotonic()
        code = self._exec(argv, task.env, pod)
        task.seconds = time.monotonic() - start
        if code != 0:
            return FAILED, Outputs()
        task.state = SUCCEEDED
        return SUCCEEDED, self._collect(outputs, out_params, pod)

    def _env(self, executor: str, pod: Path) -> dict[str, str]:
        """The pod's environment: the image's, then the platform spec's (ConfigMap, Secrets,
        the run id label); nothing of the harness's own environment."""
        env = {
            "PATH": f"{self.bin}:/usr/local/bin:/usr/bin:/bin",
            "HOME": str(pod / "home"),
            "PYTHONPATH": str(self.site),
            "LANG": "C.UTF-8",
            **self.image_env,
        }
        labels = {"pipeline/runid": self.run_id}
        return env | pod_env.pod_env(self.platform, executor, self.objects, labels)

    def _exec(self, argv: list[str], env: dict[str, str], pod: Path) -> int:
        """The container's process: its own mount namespace (a private /s3), an empty
        working directory, its own process group (ended afterwards, with anything it left, such
        as a local Ray's daemons)."""
        if not Path(MOUNT).is_dir():
            raise HarnessError(f"{MOUNT} does not exist: create it (as root) once")
        cmd = ["unshare", "--mount", "sh", "-c", MOUNTS, "sh", str(pod / "s3")]
        with open(pod / "log.txt", "wb") as log:
            proc = subprocess.Popen(
                [*cmd, *argv], env=env, cwd=pod / "work", stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
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
