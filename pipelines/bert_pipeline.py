"""The BERT DAG as a Kubeflow Pipelines v2 pipeline: compile it, run it locally, or submit it.

    pipeline-run -> clean -> vocab -> instances -> pretrain -> finetune (ParallelFor: GLUE)
                                                          -> finetune (ParallelFor: control)
                                                          -> finetune (ParallelFor: token)
                                                             all -> evaluate
    pipeline-end (the exit handler, after everything)

The random-init control (`finetune_control_tasks`: the GLUE tasks fine-tuned from random weights,
the "random init" row and the gain of evaluate's table) and the token-level tasks
(`finetune_token_tasks`: conll2003, squad) reuse the finetune component; an empty list runs
nothing (the token list is empty by default). The first task,
`pipeline-run` (uncached), opens the run's MLflow parent run with its settings and outputs a
content digest of each data input, which the steps reading that data take as an input, so new
data under the same URI changes their cache keys. The exit handler (`pipeline-end`) closes the
parent run with the run's final state. The steps read the KFP run id from the environment, so it
never enters their cache keys (see `pod`).

Every task runs as a cluster pod needs it to (`pod`): the ConfigMap `bert-pipeline-env` and the
Secrets `bert-s3` (and, optional, `bert-mlflow-auth`) as environment variables
(`pipelines/cluster.py` names them). The fine-tuning tasks run the `train_image` parameter's
image with `gpus` GPUs each (both run-time parameters: `gpus=0` and the CPU image by default);
everything else, pretrain included, runs the CPU image: pretrain submits its training to the
RayCluster as a Ray job, whose workers use the GPUs (`pretrain_use_gpu`) there, and KFP retries
it with backoff (it resumes from its last checkpoint).

Parameter defaults come from params.yaml (the file `dvc repro` reads too), so the KFP UI, DVC
and `make run` start from the same settings, except the data inputs, whose defaults are the
cluster's s3:// URIs (`pipelines/cluster.py`: a pod has no workstation paths; `local` puts
params.yaml's back). A parameter is `section_key`; its step's component takes it as `key`, so
each params.yaml section is the keyword arguments of its step (`section`).

    python -m pipelines.bert_pipeline compile [--image IMAGE] [--train-image IMAGE]
    python -m pipelines.bert_pipeline local [--set KEY=VALUE ...]  # whole DAG via kfp.local
    python -m pipelines.bert_pipeline submit --host URL [--spec FILE] [--run-name R] [--set ..]
"""

import argparse
import json
import os
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from pipelines import cluster

ROOT = Path(__file__).resolve().parents[1]
SPEC = Path(__file__).with_name("bert_pipeline.yaml")
NAME = "bert-pipeline"
DESCRIPTION = "BERT: corpus -> WordPiece -> MLM/NSP -> pre-train -> GLUE (+ NER, SQuAD)"
DATA = tuple(cluster.DATA)  # the data inputs: data_corpus, data_glue, data_token


def load_params(path: Path = ROOT / "params.yaml") -> dict[str, Any]:
    """params.yaml flattened to pipeline parameter names (`section_key`, `data.output` left out:
    under KFP the artifact store decides where outputs go)."""
    params = yaml.safe_load(path.read_text())
    flat = {
        f"{section}_{key}": value
        for section, values in params.items()
        for key, value in values.items()
    }
    flat.pop("data_output")
    return flat


P = load_params()  # params.yaml's settings (DVC's), workstation data paths included
DEFAULTS = {**P, **cluster.DATA}  # the pipeline's parameter defaults from params.yaml

# The pipeline's own parameters, beside params.yaml's: the fine-tuning tasks' image and GPUs.
# Logged on the MLflow parent run under `kfp.<name>`.
RUNTIME = ("train_image", "gpus")


def section(settings: Mapping[str, Any], name: str, leave_out: Iterable[str] = ()) -> dict:
    """One params.yaml section of the pipeline parameters as its step's component inputs: the
    parameter `section_key` is the component's `key` (params.yaml mirrors the `bert` options)."""
    prefix = f"{name}_"
    keys = {k: k.removeprefix(prefix) for k in settings if k.startswith(prefix)}
    return {key: settings[k] for k, key in keys.items() if key not in set(leave_out)}


@dataclass(frozen=True)
class FineTuning:
    """One fine-tuning fan-out: the tasks it loops over, the folder holding their data (one
    sub-folder per task), that data's digest output of `pipeline-run`, the finetune component's
    other inputs, and its names in the KFP UI."""

    tasks: Any
    data_dir: Any
    digest: str
    inputs: dict[str, Any]
    loop: str
    display: str


def fine_tunings(s: Mapping[str, Any]) -> list[FineTuning]:
    """GLUE (`finetune.*`), its random-init control (`finetune.control_tasks`, the same settings
    with `init=random`) and the token-level tasks (`finetune.token_*`; batch size, learning rate
    and sweep are the GLUE ones), in this order: evaluate's `results`, `control_results`,
    `token_results`."""
    finetune = section(s, "finetune", leave_out=["tasks", "control_tasks"])
    glue = {k: v for k, v in finetune.items() if not k.startswith("token_")}
    token = {**glue, **section(s, "finetune_token", leave_out=["tasks"])}
    return [
        FineTuning(
            s["finetune_tasks"], s["data_glue"], "glue_digest", glue, "glue-tasks", "finetune"
        ),
        FineTuning(
            s["finetune_control_tasks"],
            s["data_glue"],
            "glue_digest",
            {**glue, "init": "random"},
            "control-tasks",
            "finetune-control",
        ),  # fmt: skip
        FineTuning(
            s["finetune_token_tasks"],
            s["data_token"],
            "token_digest",
            token,
            "token-tasks",
            "finetune-token",
        ),  # fmt: skip
    ]


def _kfp():
    # imported lazily: `load_params` and `--help` work without KFP installed
    from kfp import dsl

    from components import steps

    return dsl, steps


# Retries of the pretrain task: its Ray job resumes from the last checkpoint in the bucket, so a
# lost pod or a failed job costs minutes; backoff 1, 2, 4 minutes lets a restarted head settle.
PRETRAIN_RETRY = {"num_retries": 3, "backoff_duration": "60s", "backoff_factor": 2.0}


def pod(task, name: str, cpu: str, memory: str):
    """A task as a cluster pod: its display name and resources, the ConfigMap and Secrets of
    `pipelines/cluster.py` as environment variables (kfp-kubernetes), and the KFP run id as
    `KFP_RUN_ID` from the pod label (downward API). Passed as an input, the run id would enter
    every step's cache key and no later run could reuse a step; an environment variable does
    not, so caching works across runs and each step still nests its MLflow run under its
    pipeline run."""
    from kfp import kubernetes

    task.set_display_name(name).set_cpu_request(cpu).set_memory_request(memory)
    kubernetes.use_config_map_as_env(
        task, cluster.CONFIG_MAP, {key: key for key in cluster.CONFIG_KEYS}
    )
    kubernetes.use_secret_as_env(task, cluster.SECRET, {key: key for key in cluster.SECRET_KEYS})
    kubernetes.use_secret_as_env(
        task, cluster.AUTH_SECRET, {key: key for key in cluster.AUTH_KEYS}, optional=True
    )
    return kubernetes.use_field_path_as_env(
        task, env_name=cluster.RUN_ID_ENV, field_path=cluster.RUN_ID_FIELD
    )


def build_pipeline():
    """The pipeline function: the DAG of the module docstring, its defaults DEFAULTS.

    Its parameters are what a user sets for a run (KFP UI, `--set`): one per params.yaml key,
    `section_key`, and RUNTIME's. The body is `dag`."""
    dsl, steps = _kfp()
    D = DEFAULTS

    def bert_pipeline(
        data_corpus: str = D["data_corpus"],
        data_glue: str = D["data_glue"],
        data_token: str = D["data_token"],
        vocab_vocab_size: int = D["vocab_vocab_size"],
        instances_max_seq_length: int = D["instances_max_seq_length"],
        instances_max_predictions_per_seq: int = D["instances_max_predictions_per_seq"],
        instances_masked_lm_prob: float = D["instances_masked_lm_prob"],
        instances_dupe_factor: int = D["instances_dupe_factor"],
        instances_random_seed: int = D["instances_random_seed"],
        instances_masking_recipe: str = D["instances_masking_recipe"],
        model_preset: str = D["model_preset"],
        pretrain_steps: int = D["pretrain_steps"],
        pretrain_batch_size: int = D["pretrain_batch_size"],
        pretrain_num_workers: int = D["pretrain_num_workers"],
        pretrain_learning_rate: float = D["pretrain_learning_rate"],
        pretrain_use_gpu: bool = D["pretrain_use_gpu"],
        pretrain_objective: str = D["pretrain_objective"],
        finetune_tasks: list = D["finetune_tasks"],
        finetune_epochs: int = D["finetune_epochs"],
        finetune_batch_size: int = D["finetune_batch_size"],
        finetune_learning_rate: float = D["finetune_learning_rate"],
        finetune_max_seq_length: int = D["finetune_max_seq_length"],
        finetune_max_train_examples: int = D["finetune_max_train_examples"],
        finetune_control_tasks: list = D["finetune_control_tasks"],
        finetune_lr_sweep: str = D["finetune_lr_sweep"],
        finetune_restarts: int = D["finetune_restarts"],
        finetune_token_tasks: list = D["finetune_token_tasks"],
        finetune_token_epochs: int = D["finetune_token_epochs"],
        finetune_token_max_seq_length: int = D["finetune_token_max_seq_length"],
        finetune_token_max_train_examples: int = D["finetune_token_max_train_examples"],
        finetune_token_max_eval_examples: int = D["finetune_token_max_eval_examples"],
        train_image: str = steps.TRAIN_IMAGE,
        gpus: int = 0,
    ):
        settings = {k: v for k, v in locals().items() if k in D or k in RUNTIME}  # by name
        dag(dsl, steps, settings)

    return dsl.pipeline(name=NAME, description=DESCRIPTION)(bert_pipeline)


def dag(dsl, steps, s: dict[str, Any]) -> None:
    """The pipeline's body: the MLflow bracket (`pipeline-run` first, `pipeline-end` as the exit
    handler) around clean -> vocab -> instances -> pretrain -> the fine-tuning fan-outs ->
    evaluate. `s`: the pipeline parameters."""
    # the exit handler closes the MLflow parent run, whatever becomes of the steps
    end = pod(steps.pipeline_end(), "pipeline-end", cpu="1", memory="1G")
    with dsl.ExitHandler(end.set_caching_options(False), name="bert"):
        start = pod(steps.pipeline_run(**parent_run(s)), "pipeline-run", cpu="1", memory="1G")
        digests = start.set_caching_options(False).outputs
        cl = steps.clean(corpus=s["data_corpus"], corpus_digest=digests["corpus_digest"])
        pod(cl, "clean", cpu="2", memory="4G")
        vo = steps.vocab(cleaned=cl.outputs["cleaned"], **section(s, "vocab"))
        pod(vo, "vocab", cpu="2", memory="4G")
        ins = steps.instances(
            cleaned=cl.outputs["cleaned"],
            wordpiece=vo.outputs["wordpiece"],
            **section(s, "instances"),
        )
        pod(ins, "instances", cpu="2", memory="8G")
        pretrain = {"preset": s["model_preset"], **section(s, "pretrain")}
        pre = steps.pretrain(shards=ins.outputs["shards"], **pretrain)
        pod(pre, "pretrain", cpu="2", memory="8G").set_retry(**PRETRAIN_RETRY)
        results, control_results, token_results = [
            finetune_loop(dsl, steps, pre.outputs["pretrained"], f, digests[f.digest], s)
            for f in fine_tunings(s)
        ]
        ev = steps.evaluate(
            results=results, control_results=control_results, token_results=token_results
        )
        pod(ev, "evaluate", cpu="1", memory="2G")


# The list parameters, `finetune_<name>`: pipeline-run takes each as an input of its own.
LISTS = ("tasks", "control_tasks", "token_tasks")


def parent_run(s: Mapping[str, Any]) -> dict[str, Any]:
    """pipeline-run's inputs: every params.yaml parameter, `section_key` -> `section.key` as
    DVC's parent run logs them, RUNTIME's as `kfp.<name>`; the task lists as inputs of their
    own (inside a dict KFP breaks them)."""
    lists = {name: s[f"finetune_{name}"] for name in LISTS}
    settings = {k.replace("_", ".", 1): v for k, v in s.items() if k in P}
    settings |= {f"kfp.{k}": s[k] for k in RUNTIME}
    for name in LISTS:
        del settings[f"finetune.{name}"]
    return {"settings": settings, **lists}


def finetune_loop(dsl, steps, pretrained, fine_tuning: FineTuning, digest, s: Mapping[str, Any]):
    """One `dsl.ParallelFor` of the finetune component, each task in the `train_image` image
    with `gpus` GPUs; returns its collected models."""
    f = fine_tuning
    with dsl.ParallelFor(f.tasks, name=f.loop) as task:
        ft = steps.finetune(
            pretrained=pretrained, data_dir=f.data_dir, task=task, data_digest=digest, **f.inputs
        )
        pod(ft, f.display, cpu="2", memory="8G").set_container_image(s["train_image"])
        ft.set_accelerator_type("nvidia.com/gpu").set_accelerator_limit(s["gpus"])
        # kfp 2.17's set_accelerator_limit does not register its channel (set_container_image
        # does), so inside a ParallelFor the loop never receives `gpus` and the backend could
        # not resolve the GPU count: the pod harness found it. Register it by hand.
        ft.register_pipeline_channels([s["gpus"]])
    return dsl.Collected(ft.outputs["finetuned"])


def compile_spec(path: Path = SPEC) -> Path:
    from kfp import compiler

    compiler.Compiler().compile(build_pipeline(), str(path))
    return path


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """`--set finetune_tasks='["SST-2"]' --set pretrain_steps=50`: values parsed as YAML."""
    out, names = {}, sorted([*P, *RUNTIME])
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or key not in names:
            raise SystemExit(f"--set {pair!r}: expected KEY=VALUE with KEY one of {names}")
        out[key] = yaml.safe_load(value)
    return out


def _kfp_local_empty_loops() -> None:
    """kfp.local (2.17) publishes no outputs for a ParallelFor over an empty list, so a
    `dsl.Collected` consumer of it fails ("task 'for-loop-2' not found"): with the default
    empty `finetune_token_tasks`, `evaluate` could not start. Publish an empty list for each
    output such a loop did not set, the value a loop of no iterations collects."""
    from kfp.local.orchestrator import enhanced_dag_orchestrator as orchestrator

    original = orchestrator._run_parallel_for_task
    if getattr(original, "empty_loops_publish_empty_lists", False):
        return

    def run_loop(**kwargs: Any) -> bool:
        failed = original(**kwargs)
        if not failed:
            name, io_store = kwargs["task_name"], kwargs["io_store"]
            spec = kwargs["components"][kwargs["task_spec"].component_ref.name]
            for key in [*spec.output_definitions.artifacts, *spec.output_definitions.parameters]:
                try:
                    io_store.get_task_output(name, key)
                except ValueError:
                    io_store.put_task_output(name, key, [])
        return failed

    run_loop.empty_loops_publish_empty_lists = True
    orchestrator._run_parallel_for_task = run_loop


def run_local(overrides: dict[str, Any], pipeline_root: str) -> Any:
    """The whole DAG through kfp.local's SubprocessRunner in this environment (no containers;
    images, resources and the platform spec's ConfigMap / Secrets are ignored). The data
    defaults are params.yaml's workstation paths, made absolute, not the cluster's s3:// ones.
    There is no pod label here, so the run id the steps read (`KFP_RUN_ID`) is made up and
    inherited, and so is the tracking URI: `MLFLOW_TRACKING_URI`, else ./mlflow.db, named
    explicitly because a step under KFP refuses to guess one (`bert_core.cli.kfp_step`)."""
    import uuid

    from kfp import local

    args = {**P, **overrides}
    for key in DATA:
        if "://" not in str(args[key]):
            args[key] = str((ROOT / args[key]).resolve())
    _kfp_local_empty_loops()
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=pipeline_root)
    os.environ["KFP_RUN_ID"] = f"local-{uuid.uuid4()}"
    os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{Path.cwd() / 'mlflow.db'}")
    return build_pipeline()(**args)


def submit(
    host: str,
    experiment: str,
    run_name: str | None,
    overrides: dict[str, Any],
    spec: Path = SPEC,
) -> str:
    """Upload a compiled spec (default: the committed one) to a KFP endpoint and start a run;
    returns the run id."""
    import kfp

    client = kfp.Client(host=host)
    run = client.create_run_from_pipeline_package(
        str(spec), arguments=overrides, run_name=run_name, experiment_name=experiment
    )
    return run.run_id


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pipelines.bert_pipeline", description=__doc__.split("\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("compile", help="write the pipeline spec (YAML)")
    c.add_argument("--output", type=Path, default=SPEC)
    c.add_argument("--image", help="component image (default: $BERT_IMAGE or the project's)")
    c.add_argument(
        "--train-image", help="default of the `train_image` parameter (default: the image)"
    )
    lo = sub.add_parser("local", help="run the whole DAG here through kfp.local")
    lo.add_argument("--pipeline-root", default=str(ROOT / "runs" / "kfp"))
    lo.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    s = sub.add_parser("submit", help="upload the spec to a KFP endpoint and start a run")
    s.add_argument("--host", required=True, help="KFP API endpoint, e.g. http://localhost:8080")
    s.add_argument("--experiment", default=NAME)
    s.add_argument("--run-name", default=None)
    s.add_argument("--spec", type=Path, default=SPEC, help="compiled spec (default: committed)")
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    if args.command == "compile":
        for var, value in (("BERT_IMAGE", args.image), ("BERT_TRAIN_IMAGE", args.train_image)):
            if value:
                os.environ[var] = value
                sys.modules.pop("components.steps", None)  # read at import
        print(compile_spec(args.output))
    elif args.command == "local":
        run_local(parse_overrides(args.set), args.pipeline_root)
    else:
        overrides = parse_overrides(args.set)
        run_id = submit(args.host, args.experiment, args.run_name, overrides, args.spec)
        print(json.dumps({"run_id": run_id}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
