"""The BERT DAG as a Kubeflow Pipelines v2 pipeline: compile it, run it locally, or submit it.

    clean -> vocab -> instances -> pretrain -> finetune (ParallelFor over GLUE tasks) -> evaluate
                                             -> finetune (ParallelFor over token tasks) -^

The token-level tasks (`finetune_token_tasks`: conll2003, squad) reuse the finetune component;
the list is empty by default, so that loop runs nothing unless asked for. Before `clean`, one
uncached task (`pipeline-run`) opens the run's MLflow parent run with its settings, and an exit
handler (`pipeline-end`) closes it with the run's final state; the steps read the KFP run id
from the environment, so it never enters their cache keys (see `step`).

Every pipeline parameter's default comes from params.yaml (the file `dvc repro` reads too), so
the KFP UI, DVC and `make run` start from the same settings. A parameter is `section_key`; its
step's component takes it as `key`, so each params.yaml section is the keyword arguments of its
step (`section`), and the training sub-pipeline takes the parameters under their own names.

    python -m pipelines.bert_pipeline compile [--image IMAGE]     # writes bert_pipeline.yaml
    python -m pipelines.bert_pipeline local [--set KEY=VALUE ...]  # whole DAG via kfp.local
    python -m pipelines.bert_pipeline submit --host URL [--experiment E] [--run-name R] [--set ..]

Pre-training and fine-tuning run on GPUs when `use_gpu` is true: KFP resources are fixed per
task at compile time, so the pipeline holds the training part twice (a GPU and a CPU variant)
and a `dsl.If`/`dsl.Else` on `use_gpu` picks one at run time.
"""

import argparse
import inspect
import json
import os
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
SPEC = Path(__file__).with_name("bert_pipeline.yaml")
NAME = "bert-pipeline"
DESCRIPTION = "BERT: corpus -> WordPiece -> MLM/NSP -> pre-train -> GLUE (+ NER, SQuAD)"


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


P = load_params()

# The pipeline parameters the training half takes (a sub-pipeline declares its own inputs; they
# keep the pipeline's names): the fine-tuning data folders and the model, pretrain and finetune
# sections. Not `pretrain_use_gpu`: it picks the branch.
TRAINING = tuple(
    k
    for k in P
    if k in ("data_glue", "data_token")
    or (k.startswith(("model_", "pretrain_", "finetune_")) and k != "pretrain_use_gpu")
)


def section(settings: Mapping[str, Any], name: str, leave_out: Iterable[str] = ()) -> dict:
    """One params.yaml section of the pipeline parameters as its step's component inputs: the
    parameter `section_key` is the component's `key` (params.yaml mirrors the `bert` options)."""
    prefix = f"{name}_"
    keys = {k: k.removeprefix(prefix) for k in settings if k.startswith(prefix)}
    return {key: settings[k] for k, key in keys.items() if key not in set(leave_out)}


@dataclass(frozen=True)
class FineTuning:
    """One fine-tuning fan-out: the tasks it loops over, the folder holding their data (one
    sub-folder per task), the finetune component's other inputs, and its names in the KFP UI."""

    tasks: Any
    data_dir: Any
    inputs: dict[str, Any]
    loop: str
    display: str


def fine_tunings(s: Mapping[str, Any]) -> list[FineTuning]:
    """GLUE (`finetune.*`) and the token-level tasks (`finetune.token_*`; batch size and learning
    rate are the GLUE ones), in this order: evaluate's `results`, then its `token_results`."""
    finetune = section(s, "finetune", leave_out=["tasks"])
    glue = {k: v for k, v in finetune.items() if not k.startswith("token_")}
    token = {**glue, **section(s, "finetune_token", leave_out=["tasks"])}
    return [
        FineTuning(s["finetune_tasks"], s["data_glue"], glue, "glue-tasks", "finetune"),
        FineTuning(
            s["finetune_token_tasks"], s["data_token"], token, "token-tasks", "finetune-token"
        ),
    ]


def _kfp():
    # imported lazily: `load_params` and `--help` work without KFP installed
    from kfp import dsl

    from components import steps

    return dsl, steps


# The pod label that carries the KFP run id (set by the KFP backend on every step's pod).
RUN_ID_FIELD = "metadata.labels['pipeline/runid']"


def step(task, name: str, cpu: str, memory: str, gpu: bool = False):
    """A task's display name and resources, and its KFP run id as `KFP_RUN_ID` read from the pod
    label through the Kubernetes downward API. Passed as an input, the run id would enter every
    step's cache key and no later run could reuse a step; an environment variable does not, so
    caching works across runs and each step still nests its MLflow run under its pipeline run."""
    from kfp import kubernetes

    task.set_display_name(name).set_cpu_request(cpu).set_memory_request(memory)
    if gpu:
        task.set_accelerator_type("nvidia.com/gpu").set_accelerator_limit(1)
    return kubernetes.use_field_path_as_env(task, env_name="KFP_RUN_ID", field_path=RUN_ID_FIELD)


def build_pipeline():
    """The pipeline function: the DAG of the module docstring, its defaults from params.yaml.

    Its parameters are what a user sets for a run (KFP UI, `--set`): one per params.yaml key,
    `section_key`. The body is `dag`; the two training sub-pipelines are compiled before the
    pipeline itself (KFP compiles a pipeline when it is decorated, and none inside another)."""
    dsl, steps = _kfp()
    branches: dict[bool, Any] = {}  # use_gpu -> the training half; filled before compiling

    def bert_pipeline(
        data_corpus: str = P["data_corpus"],
        data_glue: str = P["data_glue"],
        data_token: str = P["data_token"],
        vocab_vocab_size: int = P["vocab_vocab_size"],
        instances_max_seq_length: int = P["instances_max_seq_length"],
        instances_max_predictions_per_seq: int = P["instances_max_predictions_per_seq"],
        instances_masked_lm_prob: float = P["instances_masked_lm_prob"],
        instances_dupe_factor: int = P["instances_dupe_factor"],
        instances_random_seed: int = P["instances_random_seed"],
        model_preset: str = P["model_preset"],
        pretrain_steps: int = P["pretrain_steps"],
        pretrain_batch_size: int = P["pretrain_batch_size"],
        pretrain_num_workers: int = P["pretrain_num_workers"],
        pretrain_learning_rate: float = P["pretrain_learning_rate"],
        pretrain_use_gpu: bool = P["pretrain_use_gpu"],
        finetune_tasks: list = P["finetune_tasks"],
        finetune_epochs: int = P["finetune_epochs"],
        finetune_batch_size: int = P["finetune_batch_size"],
        finetune_learning_rate: float = P["finetune_learning_rate"],
        finetune_max_seq_length: int = P["finetune_max_seq_length"],
        finetune_max_train_examples: int = P["finetune_max_train_examples"],
        finetune_token_tasks: list = P["finetune_token_tasks"],
        finetune_token_epochs: int = P["finetune_token_epochs"],
        finetune_token_max_seq_length: int = P["finetune_token_max_seq_length"],
        finetune_token_max_train_examples: int = P["finetune_token_max_train_examples"],
        finetune_token_max_eval_examples: int = P["finetune_token_max_eval_examples"],
    ):
        settings = {k: v for k, v in locals().items() if k in P}  # the parameters, by name
        dag(dsl, steps, branches, settings)

    for gpu in (True, False):
        branches[gpu] = train_and_evaluate(dsl, steps, gpu, inspect.signature(bert_pipeline))
    return dsl.pipeline(name=NAME, description=DESCRIPTION)(bert_pipeline)


def dag(dsl, steps, branches: dict[bool, Any], s: dict[str, Any]) -> None:
    """The pipeline's body: the MLflow bracket around clean -> vocab -> instances and the
    training half on the branch `pretrain_use_gpu` picks. `s`: the pipeline parameters."""
    # the exit handler closes the MLflow parent run, whatever becomes of the steps
    end = step(steps.pipeline_end(), "pipeline-end", cpu="1", memory="1G")
    with dsl.ExitHandler(end.set_caching_options(False), name="bert"):
        start = step(steps.pipeline_run(**parent_run(s)), "pipeline-run", cpu="1", memory="1G")
        start.set_caching_options(False)
        cl = step(steps.clean(corpus=s["data_corpus"]), "clean", cpu="2", memory="4G").after(start)
        vo = steps.vocab(cleaned=cl.outputs["cleaned"], **section(s, "vocab"))
        step(vo, "vocab", cpu="2", memory="4G")
        ins = steps.instances(
            cleaned=cl.outputs["cleaned"],
            wordpiece=vo.outputs["wordpiece"],
            **section(s, "instances"),
        )
        step(ins, "instances", cpu="2", memory="8G")
        training = {"shards": ins.outputs["shards"], **{k: s[k] for k in TRAINING}}
        with dsl.If(s["pretrain_use_gpu"] == True, name="use-gpu"):  # noqa: E712 - a KFP condition
            branches[True](**training).set_display_name("train-and-evaluate (GPU)")
        with dsl.Else(name="cpu-only"):
            branches[False](**training).set_display_name("train-and-evaluate (CPU)")


def parent_run(s: Mapping[str, Any]) -> dict[str, Any]:
    """pipeline-run's inputs: every parameter, `section_key` -> `section.key` as DVC's parent run
    logs them; the two lists as inputs of their own (inside a dict KFP breaks them)."""
    lists = {"tasks": s["finetune_tasks"], "token_tasks": s["finetune_token_tasks"]}
    settings = {k.replace("_", ".", 1): v for k, v in s.items()}
    del settings["finetune.tasks"], settings["finetune.token_tasks"]
    return {"settings": settings, **lists}


def train_and_evaluate(dsl, steps, gpu: bool, pipeline: inspect.Signature):
    """The training half as a sub-pipeline: pretrain, each fine-tuning fan-out, evaluate. One
    per value of `use_gpu` (KFP fixes a task's resources at compile time). It takes the instance
    shards and the pipeline parameters in TRAINING, named and typed as `pipeline` has them."""
    from kfp.dsl import Dataset, Input, Markdown

    def graph(shards, *values) -> Markdown:
        s = dict(zip(TRAINING, values, strict=True))
        pretrain = {"preset": s["model_preset"], **section(s, "pretrain")}
        pre = steps.pretrain(shards=shards, use_gpu=gpu, **pretrain)
        step(pre, "pretrain", cpu="4", memory="16G", gpu=gpu)
        results, token_results = [
            finetune_loop(dsl, steps, pre.outputs["pretrained"], f, gpu) for f in fine_tunings(s)
        ]
        ev = steps.evaluate(results=results, token_results=token_results)
        step(ev, "evaluate", cpu="1", memory="2G")
        return ev.outputs["table"]

    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    inputs = [inspect.Parameter("shards", kind, annotation=Input[Dataset])]
    inputs += [pipeline.parameters[k].replace(default=inspect.Parameter.empty) for k in TRAINING]
    graph.__signature__ = inspect.Signature(inputs, return_annotation=Markdown)
    return dsl.pipeline(name=f"train-and-evaluate-{'gpu' if gpu else 'cpu'}")(graph)


def finetune_loop(dsl, steps, pretrained, fine_tuning: FineTuning, gpu: bool):
    """One `dsl.ParallelFor` of the finetune component; returns its collected models."""
    f = fine_tuning
    with dsl.ParallelFor(f.tasks, name=f.loop) as task:
        ft = steps.finetune(
            pretrained=pretrained, data_dir=f.data_dir, task=task, use_gpu=gpu, **f.inputs
        )
        step(ft, f.display, cpu="2", memory="8G", gpu=gpu)
    return dsl.Collected(ft.outputs["finetuned"])


def compile_spec(path: Path = SPEC) -> Path:
    from kfp import compiler

    compiler.Compiler().compile(build_pipeline(), str(path))
    return path


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """`--set finetune_tasks='["SST-2"]' --set pretrain_steps=50`: values parsed as YAML."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or key not in P:
            raise SystemExit(f"--set {pair!r}: expected KEY=VALUE with KEY one of {sorted(P)}")
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
    resource settings are ignored). Relative data paths are made absolute first. There is no
    pod label here, so the run id the steps read (`KFP_RUN_ID`) is made up and inherited."""
    import uuid

    from kfp import local

    args = {**P, **overrides}
    for key in ("data_corpus", "data_glue", "data_token"):
        if "://" not in str(args[key]):
            args[key] = str((ROOT / args[key]).resolve())
    _kfp_local_empty_loops()
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=pipeline_root)
    os.environ["KFP_RUN_ID"] = f"local-{uuid.uuid4()}"
    return build_pipeline()(**args)


def submit(host: str, experiment: str, run_name: str | None, overrides: dict[str, Any]) -> str:
    """Upload the committed spec to a KFP endpoint and start a run; returns the run id."""
    import kfp

    client = kfp.Client(host=host)
    run = client.create_run_from_pipeline_package(
        str(SPEC), arguments=overrides, run_name=run_name, experiment_name=experiment
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
    lo = sub.add_parser("local", help="run the whole DAG here through kfp.local")
    lo.add_argument("--pipeline-root", default=str(ROOT / "runs" / "kfp"))
    lo.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    s = sub.add_parser("submit", help="upload the spec to a KFP endpoint and start a run")
    s.add_argument("--host", required=True, help="KFP API endpoint, e.g. http://localhost:8080")
    s.add_argument("--experiment", default=NAME)
    s.add_argument("--run-name", default=None)
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    if args.command == "compile":
        if args.image:
            os.environ["BERT_IMAGE"] = args.image
            sys.modules.pop("components.steps", None)
        print(compile_spec(args.output))
    elif args.command == "local":
        run_local(parse_overrides(args.set), args.pipeline_root)
    else:
        print(
            json.dumps(
                {
                    "run_id": submit(
                        args.host, args.experiment, args.run_name, parse_overrides(args.set)
                    )
                }
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
