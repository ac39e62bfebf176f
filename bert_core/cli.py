"""The `bert` command: one sub-command per pipeline step, and the Kubeflow steps that run them.

Each step module owns its argument parser and exposes `main(argv) -> int`; this file only
dispatches, importing the module lazily so `bert clean` never pays for importing Ray or MLflow.
Errors meant for users (`BertError` and its kinds in `bert_core.errors`) become one line on stderr
and exit code 2 (1 for `errors.Diverged`: a valid input whose training went non-finite); anything
else, a ValueError from torch included, is a bug and keeps its traceback (exit 1).

The top of the library: the Kubeflow components (`components/steps.py`) and the DVC runner
(`pipelines/run_dvc.py`) import this module and nothing else from `bert_core`
(tests/test_architecture.py checks). `kfp_step` runs one `bert` command as a KFP step, nested
under the KFP run's MLflow parent run; the other `kfp_*` functions are the few things a component
does around its command (open / close the parent run, register the pre-trained model, report
metrics), and the `dvc_*` functions the same around `dvc repro`. No module of the library imports
this one, so the imports go one way, down the layers of docs/architecture.md.

Under KFP (`KFP_RUN_ID` set) every `kfp_*` call first checks that `MLFLOW_TRACKING_URI` is set:
without it, `bert_core.tracking` would log to a SQLite file inside the pod, which vanishes with
the pod while the step succeeds. On a cluster the variable comes from the ConfigMap
`bert-pipeline-env`; a pod without it fails at once, naming the ConfigMap.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bert_core.errors import BadValue, BertError, Interrupted, interrupts_raise, refuse_secrets

# What an interrupted step that keeps no checkpoint leaves (every step but pretrain: each writes
# its whole output or nothing, in minutes, and its MLflow run ends KILLED).
NO_CHECKPOINT = "nothing written to --output (this step keeps no checkpoint); run it again"

# command -> (the module whose `main` runs it, imported only then; what it does)
COMMANDS: dict[str, tuple[str, str]] = {
    "clean": ("bert_core.data.corpus", "raw text -> normalised, de-duplicated, split documents"),
    "vocab": (
        "bert_core.data.tokenizer",
        "train a WordPiece vocabulary (vocab.txt, tokenizer.json)",
    ),
    "instances": (
        "bert_core.data.instances",
        "create MLM/NSP pre-training instances (Parquet shards)",
    ),
    "pretrain": ("bert_core.pretrain.command", "pre-train BERT with Ray Train (MLM + NSP)"),
    "finetune": ("bert_core.finetune.command", "fine-tune on one GLUE task"),
    "evaluate": (
        "bert_core.report.evaluate",
        "collect GLUE metrics into one table, plot and MLflow run",
    ),
    "runs": (
        "bert_core.track.runs",
        "compare recent pipeline runs: GLUE scores and settings (MLflow)",
    ),
    "predict": ("bert_core.serve.predict", "answers of a fine-tuned model for a file of inputs"),
    "promote": (
        "bert_core.serve.promote",
        "a better version becomes champion; --full-traffic: it serves all traffic",
    ),
    "embed": (
        "bert_core.serve.embed",
        "per-token or pooled vectors from chosen layers, to Parquet",
    ),
    "serve": (
        "bert_core.serve.server",
        "an HTTP endpoint for a model, with limits (localhost unless told)",
    ),
    "deploy": (
        "bert_core.serve.deploy",
        "a registered model's champion as a KServe InferenceService (canary on change)",
    ),
    "quantize": (
        "bert_core.compress.quantize",
        "a fine-tuned model as a dynamic-int8 CPU model, scored beside it",
    ),
    "distill": (
        "bert_core.compress.distill",
        "a small student trained on a fine-tuned teacher's soft targets (GLUE)",
    ),
}


def _usage() -> str:
    lines = ["usage: bert <command> [options]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "`bert <command> --help` shows a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in {"-h", "--help"}:
        print(_usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"bert: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    try:
        refuse_secrets(_option_values(rest))
    except BertError as e:
        print(f"bert {name}: error: {e}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    try:
        with interrupts_raise():
            return int(module.main(rest) or 0)
    except BertError as e:
        print(f"bert {name}: error: {e}", file=sys.stderr)
        return getattr(e, "exit_code", 2)  # errors.Diverged: 1, a sound input
    except KeyboardInterrupt as e:  # SIGTERM or SIGINT (errors.Interrupted), or a bare Ctrl-C
        stopped = e if isinstance(e, Interrupted) else Interrupted(signal.SIGINT)
        what = stopped.what or NO_CHECKPOINT
        print(
            f"bert {name}: interrupted ({signal.Signals(stopped.signum).name}): {what}",
            file=sys.stderr,
        )
        return stopped.exit_code


def _option_values(argv: list[str]) -> Iterator[tuple[str, str]]:
    """(option, value) for each value in `argv` (`--opt value`, `--opt=value`, positionals)."""
    option = "argument"
    for token in argv:
        if token.startswith("--") and "=" in token:
            yield tuple(token.split("=", 1))
        elif token.startswith("-") and len(token) > 1:
            option = token
        else:
            yield option, token


# Kubeflow: what the components in components/steps.py call.


def require_tracking_server() -> None:
    """Fail when running under KFP (`KFP_RUN_ID` set) without `MLFLOW_TRACKING_URI`: the step's
    runs would go to a SQLite file in its pod and vanish with it, silently."""
    if os.environ.get("KFP_RUN_ID") and not os.environ.get("MLFLOW_TRACKING_URI"):
        raise BertError(
            "running as a Kubeflow step (KFP_RUN_ID is set) without MLFLOW_TRACKING_URI: the "
            "MLflow runs would land in a SQLite file inside this pod and be lost with it. Load "
            "the ConfigMap bert-pipeline-env into the pod (the compiled pipeline does, "
            "kfp.kubernetes.use_config_map_as_env; apply infra/k8s/env in the namespace the "
            "pipeline runs in, docs/cluster.md) or set MLFLOW_TRACKING_URI."
        )


def kfp_step(argv: list[Any], pipeline: str | None = None) -> None:
    """Run one `bert` command as a Kubeflow step, its MLflow run nested under the pipeline's.

    The components in `components/` are this one call: all logic stays in the `bert` commands.
    The KFP run id comes from `KFP_RUN_ID` (the pod's `pipeline/runid` label under Kubeflow, set
    by the local runner under kfp.local); without it the step logs a standalone run.
    """
    from bert_core.track import lineage

    require_tracking_server()
    kfp_run_id = os.environ.get("KFP_RUN_ID", "")  # empty where the pod has no such label
    if kfp_run_id:
        pipeline = pipeline or lineage.PIPELINE_EXPERIMENT
        os.environ["BERT_PARENT_RUN_ID"] = lineage.kfp_parent_run(kfp_run_id, pipeline)
    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:  # argparse reports bad options this way
        code = e.code if isinstance(e.code, int) else 2
    if code:
        raise RuntimeError(f"bert {argv[0]} exited with code {code}")


def _run_settings(settings: dict[str, Any], *lists: list) -> dict[str, Any]:
    """A KFP run's settings with its three task lists, which the tasks take as inputs of their
    own (inside a dict, KFP pastes a list in as broken text)."""
    names = ("finetune.tasks", "finetune.control_tasks", "finetune.token_tasks")
    return {**settings, **dict(zip(names, lists, strict=True))}


def kfp_pipeline_run(settings: dict[str, Any], *lists: list) -> Any:
    """The first task: open this KFP run's MLflow parent run with its settings and task lists
    (`_run_settings`), record the content digest of each data input on it
    (`mlflow.log_input`) and return the digests, the task's outputs (a `lineage.DataDigests`).
    Missing data fails here, before any step starts. lineage is imported in each KFP helper,
    not at the top: `bert clean` never loads it."""
    from bert_core.track import lineage

    require_tracking_server()
    settings = _run_settings(settings, *lists)
    parent = lineage.kfp_pipeline_run(settings)
    inputs = lineage.data_inputs(lineage.parse_settings(settings))
    digests = lineage.data_digests(inputs)
    if parent:
        lineage.log_data_inputs(parent, inputs, digests)
    print(f"MLflow parent run: {parent}; data digests: {dict(digests._asdict())}")
    return digests


def kfp_settings(advanced: dict[str, Any], defaults: str) -> Any:
    """A KFP run's `advanced_settings` over their `defaults` (JSON text: the keys a run may
    set, each value of its type), each value of its default's type; a named tuple in the
    defaults' order, the settings task's outputs. The object comes through protobuf's Struct,
    whose numbers are all doubles: a whole number is an int where the default is one."""
    from collections import namedtuple

    default = json.loads(defaults)
    unknown = sorted(set(advanced) - set(default))
    if unknown:
        raise BadValue(
            f"advanced_settings: no setting {', '.join(unknown)} (the keys: {', '.join(default)})"
        )
    values = {**default, **advanced}
    for key, value in values.items():
        kind = type(default[key])
        if kind is int and isinstance(value, float) and value.is_integer():
            value = int(value)
        elif kind is float and type(value) is int:
            value = float(value)
        if type(value) is not kind:
            raise BadValue(
                f"advanced_settings: {key} = {json.dumps(value)}: expected {kind.__name__}, "
                f"as its default {json.dumps(default[key])}"
            )
        values[key] = value
    print("advanced settings:", json.dumps({k: values[k] for k in advanced}))
    return namedtuple("Settings", default)(**values)


def kfp_finetune_jobs(settings: dict[str, Any], *lists: list) -> list[dict]:
    """The run's fine-tunings (from its `settings` and task `lists`), one list for the
    pipeline's one fan-out (`bert_core.finetune.jobs`), each job with its options and its task
    data's digest; nothing to fine-tune fails here, before any step starts."""
    from bert_core import storage
    from bert_core.finetune.jobs import finetune_jobs
    from bert_core.track import lineage

    settings = lineage.parse_settings(_run_settings(settings, *lists))
    jobs = finetune_jobs(settings, storage.digest)
    print("fine-tunings:", ", ".join(job["name"] for job in jobs))
    return jobs


def kfp_pipeline_end(state: str) -> str | None:
    """The exit handler: close this KFP run's MLflow parent run with its final state."""
    from bert_core.track import lineage

    require_tracking_server()
    return lineage.kfp_pipeline_end(state)


def kfp_register_pretrained(output: str | os.PathLike) -> dict[str, float]:
    """After `bert pretrain --output OUTPUT` ran as a KFP step: its model registered (on its
    FINISHED run, `serve.registry.register_pretrained`: once, found again by the run), here,
    before the fine-tuning fan-out, so the fine-tunings all name the same version rather than
    race to register it; returns the last logged pre-training metrics, for the step's KFP
    Metrics output."""
    from bert_core.serve import registry
    from bert_core.track import lineage

    require_tracking_server()
    output = Path(output)
    registry.register_pretrained(output / "model")
    return lineage.last_pretrain_metrics(output / "pretrain_metrics.csv")


def kfp_metrics(result_file: str | os.PathLike) -> dict[str, float]:
    """A step's KFP Metrics, named and scaled as its MLflow metrics (`evaluate.mlflow_metrics`:
    fractions): from a `bert finetune` output's metrics.json or `bert evaluate`'s
    glue_results.json."""
    from bert_core.report.evaluate import mlflow_metrics

    return mlflow_metrics(json.loads(Path(result_file).read_text()))


# DVC: what pipelines/run_dvc.py (`make run`) calls around `dvc repro`.


def dvc_pipeline_run(params: dict[str, Any], tags: dict[str, str], name: str):
    """The MLflow parent run of one `make run` (a context manager yielding the run), named
    `name` (the DVC command): each stage's `bert` command nests its run under it
    (`BERT_PARENT_RUN_ID`, set while it is open)."""
    from bert_core.track import lineage

    return lineage.start_pipeline_run(params=params, tags=tags, run_name=name)


def dvc_lineage_env() -> dict[str, str]:
    """What a stage needs to nest its run under the open parent run: the parent's id, the
    experiment, the tracking URI (the project's store when none is set)."""
    from bert_core.tracking import tracking_uri

    keys = ("BERT_PARENT_RUN_ID", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_TRACKING_URI")
    env = {k: os.environ[k] for k in keys if os.environ.get(k)}
    env.setdefault("MLFLOW_TRACKING_URI", tracking_uri())
    return env


def dvc_record_lineage(parent_id: str, dvc_lock: Path, output: Path) -> list[str]:
    """After `dvc repro`, on the open parent run: DVC's hashes on the step runs, which stages
    ran, and when pretrain ran the version of `bert-pretrained` it made (registered by the
    first `bert finetune` of its model: `serve.registry.register_pretrained` finds it by the
    run). Returns the stages that ran."""
    import mlflow

    from bert_core.serve import registry
    from bert_core.track import lineage

    lineage.record_dvc_lineage(parent_id, dvc_lock)
    stages = sorted({r.data.tags.get("dvc.stage", "") for r in lineage.child_runs(parent_id)})
    mlflow.set_tag("bert.stages_run", ",".join(s for s in stages if s) or "none (cached)")
    if lineage.child_runs(parent_id, "pretrain"):
        version = registry.register_pretrained(output / "pretrain" / "model")
        if version is not None:
            mlflow.set_tag("bert.registered_model", f"{version.name}/{version.version}")
    return stages


def dvc_log_results(parent_id: str, evaluate_dir: Path) -> dict:
    """The results on the parent run when DVC skipped a cached evaluate stage (one that ran
    published them itself, `tracking.publish_results`): the same names, values and files. Returns
    glue_results.json's content."""
    from bert_core.report.evaluate import mlflow_metrics
    from bert_core.track import lineage
    from bert_core.tracking import publish_results

    results = json.loads((evaluate_dir / "glue_results.json").read_text())
    if not lineage.child_runs(parent_id, "evaluate"):
        publish_results(parent_id, mlflow_metrics(results), evaluate_dir)
    return results


if __name__ == "__main__":
    raise SystemExit(main())


# Experiment sets: what pipelines/experiments.py (`make table7`) needs besides the commands.


def feature_choices() -> tuple[str, ...]:
    """`bert finetune --feature-based`'s choices in the paper's Table 7 order."""
    from bert_core.model.heads import FEATURE_LAYERS

    return FEATURE_LAYERS
