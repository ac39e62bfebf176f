"""`bert evaluate`: collect fine-tuning results into one table (a row per system), a plot and an
MLflow run.

Each `--results` folder is one `bert finetune` output; its `metrics.json` names the task and holds
the dev metrics of the best epoch, so nothing else is needed. Task scores and the GLUE score are
recomputed here from the metrics with the leaderboard's rule (`bert_core.finetune.tasks.glue_data`),
never trusted from the input. The table is laid out like BERT's Table 1 (tasks in the paper's order,
the paper's metric per task, MNLI as matched/mismatched) with the GLUE score added; when fewer than
nine tasks are given, the score is the mean over those present and is marked partial.

Systems: the rows of the table, as the paper compares BERT with its baselines and ablations. A
folder's system is the `--system` given with its `--results` group, else what its metrics.json
says it started from (`system_of`): "BERT (ours)" for our pre-training from scratch, "public
checkpoint + continued pre-training" for `bert pretrain --init-model` on a public checkpoint,
"public checkpoint" for one fine-tuned as it is, "random init" for `bert finetune --init random`
(the control). So `--results ours/* control/*` alone gives the two rows; `--results A/*
--system "BERT (ours)" --results B/* --system "no NSP"` names them. The control is the system
whose results are all random-init; every other system gets a gain row over it: per task the
difference in score, and the difference in GLUE score over the tasks both have ("did
pre-training help?", the paper's claim). The first other system is the main one: its results
keep the top-level names in glue_results.json and MLflow, so single-system callers see no change.

Other tasks (`bert finetune --task conll2003|squad|squad_v2|swag`) get their own tables, laid
out like the paper's Tables 2 to 4 and its CoNLL-2003 table; they are reported beside GLUE,
never averaged into the GLUE score.

Scales: metrics are fractions in the files (metrics.json, glue_results.json); the task and GLUE
scores and the gains are percent there and in the table (the paper's scale). In MLflow and
Kubeflow every score is percent, the table's numbers, named by `mlflow_metrics` in the one metric
language (`bert_core.metrics`) for every caller. The tables and the plot are
`bert_core.report.tables`.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from pathlib import Path

from bert_core import storage
from bert_core.errors import InputError, NotFound, utf8_errors
from bert_core.finetune.tasks.glue_data import TASKS, get_task, glue_score, task_score
from bert_core.metrics import CORRELATIONS, HEADLINE, is_ratio, kind, named, task_run
from bert_core.report.scores import write_scores
from bert_core.report.tables import (  # noqa: F401 (TABLE_ORDER: re-exported)
    REQUIRED,
    TABLE_ORDER,
    TOKEN_TASKS,
    feature_row,
    markdown_table,
    plot_scores,
    slug,
)
from bert_core.tracking import publish_results, start_run

SYSTEM_OF_INIT = {"pretrained": "BERT (ours)", "random": "random init"}
CONTROL_INIT = "random"
# a pre-trained start that is not ours from scratch (metrics.json's `start_from`)
CONTINUED = "public checkpoint + continued pre-training"
PUBLIC = "public checkpoint"
ROWS = (SYSTEM_OF_INIT["pretrained"], CONTINUED, PUBLIC, SYSTEM_OF_INIT["random"])  # unnamed


def _metrics_file(folder: str | Path) -> str:
    """A fine-tuning output's metrics.json, named as the folder was (local or s3://)."""
    return f"{str(folder).rstrip('/')}/metrics.json"


def _read(folder: str | Path) -> tuple[str, dict]:
    """(where, content) of a fine-tuning output's metrics.json, local or s3://."""
    uri = _metrics_file(folder)
    try:
        with storage.local_copy(uri) as path, utf8_errors(path, name=uri):
            data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict):
            raise InputError(uri, "expected a JSON object {'task': NAME, 'metrics': {...}}")
        return uri, data
    except FileNotFoundError as e:
        if str(folder).rstrip("/").endswith(".json"):  # the file, not its folder
            raise InputError(
                folder,
                "--results takes the `bert finetune` output folder that "
                "holds metrics.json, not the file",
            ) from None
        raise NotFound(f"{e} (is {folder} a `bert finetune` output?)") from None
    except json.JSONDecodeError as e:
        raise InputError(uri, f"not valid JSON: {e.msg}", line=e.lineno) from None


def load_result(folder: str | Path) -> tuple[str, dict[str, float]]:
    """(task name, metrics) from one fine-tuning output folder, validated."""
    path, data = _read(folder)
    try:
        metrics = _numbers(path, data["metrics"])
        if data["task"] in TOKEN_TASKS:
            test = _numbers(path, data.get("test_metrics", {}), "test_")
            return _token_result(path, data["task"], metrics | test)
        task = get_task(str(data["task"]))
    except (KeyError, TypeError, AttributeError) as e:
        raise InputError(path, "expected {'task': NAME, 'metrics': {NAME: number}}") from e
    except InputError:
        raise
    except ValueError as e:
        raise InputError(path, str(e)) from e
    missing = [m for m in task.metric_names() if not math.isfinite(metrics.get(m, math.nan))]
    if missing:
        raise InputError(path, f"{task.name}: missing or non-finite metrics {missing}")
    _check_ranges(path, task.name, metrics)
    return task.name, metrics


def _token_result(path: Path, name: str, metrics: dict[str, float]):
    required = REQUIRED.get(name, tuple(TOKEN_TASKS[name][1])[:1])
    missing = [m for m in required if not math.isfinite(metrics.get(m, math.nan))]
    if missing:
        raise InputError(path, f"{name}: missing or non-finite metrics {missing}")
    _check_ranges(path, name, metrics)
    return name, metrics


def _numbers(path: str, values: dict, prefix: str = "") -> dict[str, float]:
    """A metrics section as {name: float}; a value that is no number names its metric."""
    out = {}
    for name, value in values.items():
        try:
            if isinstance(value, bool):
                raise TypeError
            out[f"{prefix}{name}"] = float(value)
        except (TypeError, ValueError):
            raise InputError(path, f"metric {prefix}{name}: {value!r} is not a number") from None
    return out


# the last word of a metric's name -> its range; metrics.json holds fractions (module doc)


def _check_ranges(path: str, task: str, metrics: dict[str, float]) -> None:
    """Every metric a finite number, a fraction in [0, 1] (a correlation in [-1, 1]): one in
    percent, or a broken run's, would be averaged into the scores as it is. Others (SQuAD 2.0's
    `*_thresh`: null-score odds) need only be finite."""
    for name, value in metrics.items():
        low = -1.0 if kind(name) in CORRELATIONS else 0.0
        if not math.isfinite(value):
            raise InputError(path, f"{task}: metric {name} is {value}, not a finite number")
        if is_ratio(name) and not low <= value <= 1:
            hint = " (metrics.json holds fractions, not percent)" if value > 1 else ""
            raise InputError(path, f"{task}: {name} {value:g} is outside [{low:g}, 1]{hint}")


def init_of(data: dict) -> str:
    """How the fine-tuned model started (`bert finetune --init`): metrics.json's `init`, or
    `config.init`; "pretrained" for results written before the option existed."""
    init = data.get("init") or (data.get("config") or {}).get("init") or "pretrained"
    return str(init)


def system_of(data: dict, init: str) -> str:
    """The row of an unnamed result (metrics.json's content `data`): "random init" for the
    control; for a pre-trained start, what the weights were (`start_from`, `bert finetune`'s
    `pretraining`): ours from scratch ("BERT (ours)", also results written before the field
    existed), a public checkpoint pre-trained further on the user's corpus, or one fine-tuned as
    it is. A feature-based tagger (`bert finetune --feature-based`) is its own row, one per
    Table 7 choice: "feature-based (concat-last4)"."""
    choice = (data.get("config") or {}).get("feature_based", "none")
    if choice != "none":
        return feature_row(choice)  # ranked after ROWS, by name
    if init != "pretrained":
        return SYSTEM_OF_INIT[init]
    if data.get("start_from", "random init") == "random init":
        return SYSTEM_OF_INIT[init]
    return CONTINUED if data.get("continued_pretraining") else PUBLIC


def collect(folders: Sequence[str | Path]) -> dict:
    """One system's results: per-task metrics and scores, and the GLUE score."""
    tasks: dict[str, dict] = {}
    token: dict[str, dict] = {}
    for folder in folders:
        name, metrics = load_result(folder)
        seen = tasks.get(name) or token.get(name)
        if seen:
            raise InputError(_metrics_file(folder), f"{name} given twice (also {seen['source']})")
        if name in TOKEN_TASKS:
            token[name] = {"metrics": metrics, "source": str(folder)}
            continue
        score = task_score(TASKS[name], metrics)
        tasks[name] = {"metrics": metrics, "score": score, "source": str(folder)}
    ordered = {t: tasks[t] for t in TABLE_ORDER if t in tasks}
    results = {
        "tasks": ordered,
        # None when only token-level results were given: there is no GLUE score to report
        "glue_score": glue_score({t: r["score"] for t, r in ordered.items()}) if ordered else None,
        "num_tasks": len(ordered),
        "complete": len(ordered) == len(TASKS),
        "rule": "mean over tasks of the task score; a task's score is the mean of its metrics "
        "(MRPC, QQP: F1/accuracy; STS-B: Pearson/Spearman; MNLI: matched/mismatched accuracy)",
    }
    if token:
        results["token_tasks"] = {t: token[t] for t in TOKEN_TASKS if t in token}
    return results


Group = tuple[str | None, Sequence[str | Path]]  # (--system or None, its --results folders)


def group_systems(groups: Sequence[Group]) -> dict[str, dict]:
    """{system: {"folders", "init"}}: named ones in the order given, then the unnamed folders'
    (`system_of`) in the order of ROWS, whatever order a shell's glob gave the folders in (the
    first is the main system). A named group must be of one init: a control mixed into a
    system is an error."""
    systems: dict[str, dict] = {}
    for name, folders in groups:
        data = {str(f): _read(f)[1] for f in folders}  # each metrics.json read once here
        inits = {f: init_of(d) for f, d in data.items()}
        if name is not None and len(set(inits.values())) > 1:
            raise InputError(
                folders[0],
                f"--system {name!r} mixes --init {sorted(set(inits.values()))} "
                "results: give each its own --results/--system pair, or no --system",
            )
        for folder, init in inits.items():
            if init not in SYSTEM_OF_INIT:
                raise InputError(_metrics_file(folder), f"unknown init {init!r}")
            system = name or system_of(data[folder], init)
            entry = systems.setdefault(system, {"folders": [], "init": init})
            entry["folders"].append(folder)
            if entry["init"] != init:
                raise InputError(folder, f"system {name!r} mixes pretrained and random init")
    named = {name for name, _ in groups}
    rank = {
        name: (0, 0, "")
        if name in named
        else (1, *((ROWS.index(name), "") if name in ROWS else (len(ROWS), name)))
        for name in systems
    }
    return dict(sorted(systems.items(), key=lambda kv: rank[kv[0]]))  # stable: named as given


def gain(system: dict, control: dict, over: str) -> dict:
    """`system` minus `control`, in points: per GLUE task score, the GLUE score over the tasks
    both have, and per other task's metric."""
    common = [t for t in system["tasks"] if t in control["tasks"]]
    tasks = {t: system["tasks"][t]["score"] - control["tasks"][t]["score"] for t in common}
    token = {}
    for t, r in system.get("token_tasks", {}).items():
        other = control.get("token_tasks", {}).get(t)
        if other:
            shared = [m for m in TOKEN_TASKS[t][1] if m in r["metrics"] and m in other["metrics"]]
            token[t] = {m: 100 * (r["metrics"][m] - other["metrics"][m]) for m in shared}
    return {
        "over": over,
        "glue_score": sum(tasks.values()) / len(tasks) if tasks else None,
        "tasks": tasks,
        **({"token_tasks": token} if token else {}),
        "rule": "points; GLUE score: the mean of the task-score differences over the tasks "
        "both systems have",
    }


def collect_systems(groups: Sequence[Group]) -> dict:
    """glue_results.json's content: the main system's results at the top level (as `collect`
    gives them), and with several systems every one under `systems`, the control's name and
    each other system's `gain` over it (the main one's also at the top level)."""
    systems = group_systems(groups)
    per = {name: collect(s["folders"]) for name, s in systems.items()}
    control = next((n for n, s in systems.items() if s["init"] == CONTROL_INIT), None)
    main = next((n for n in per if n != control), control)
    results = {**per[main], "system": main}
    if len(per) > 1:
        results["systems"] = {n: {**r, "init": systems[n]["init"]} for n, r in per.items()}
        results["control"] = control
        if control is not None:
            for name in per:
                if name != control:
                    results["systems"][name]["gain"] = gain(per[name], per[control], control)
            results["gain"] = results["systems"][main].get("gain")
    return results


def _system_metrics(results: dict, prefix: str = "") -> dict[str, float]:
    out = {}
    if results["glue_score"] is not None:  # None when only token-level tasks ran
        out[f"{prefix}eval/{HEADLINE}"] = results["glue_score"]
    for name, r in {**results["tasks"], **results.get("token_tasks", {})}.items():
        out |= named(r["metrics"], f"{prefix}eval/{name}")
        if "score" in r:  # GLUE tasks; token-level ones report their metrics only
            out[f"{prefix}eval/{name}/{HEADLINE}"] = r["score"]
    return out


def mlflow_metrics(results: dict) -> dict[str, float]:
    """Results as MLflow (and Kubeflow) metrics in the one metric language (`bert_core.metrics`):
    every score in percent, the table's numbers.

    `results` is `collect_systems`'s (glue_results.json's content) or one `bert finetune`
    output's metrics.json (its run's `eval/score` and `eval/<metric>`). Names for a table: the
    main system's GLUE score `eval/score`, each task's `eval/{task}/score` and
    `eval/{task}/{metric}`; every other system's the same under its `slug`
    (`random_init/eval/score`, `random_init/eval/SST-2/score`, ...); the main system's gain over
    the control as `gain/eval/score`, `gain/eval/{task}/score` and `gain/eval/{task}/{metric}`
    (other tasks), another system's as `{slug}/gain/eval/score`. Every place results reach
    MLflow (`bert evaluate`'s run, the DVC pipeline's parent run, the Kubeflow components'
    Metrics) logs this, so runs compare as-is.
    """
    if "task" in results:  # one metrics.json: a fine-tuning run's own names
        score = results.get(HEADLINE)
        return named(results["metrics"], "eval") | ({} if score is None else task_run(score, {}))
    out = _system_metrics(results)
    main = results.get("system")
    for name, r in results.get("systems", {}).items():
        if name != main:
            out |= _system_metrics(r, f"{slug(name)}/")
        if r.get("gain"):
            prefix = "gain/" if name == main else f"{slug(name)}/gain/"
            out |= _gain_metrics(r["gain"], prefix)
    return out


def _gain_metrics(g: dict, prefix: str) -> dict[str, float]:
    """A gain section (points, already percent) under `prefix`."""
    out = {f"{prefix}eval/{t}/{HEADLINE}": v for t, v in g["tasks"].items()}
    for t, ms in g.get("token_tasks", {}).items():
        out |= {f"{prefix}eval/{t}/{m}": v for m, v in ms.items()}
    if g["glue_score"] is not None:
        out[f"{prefix}eval/{HEADLINE}"] = g["glue_score"]
    return out


def evaluate(
    results: Sequence[str | Path] | Sequence[Group], output: str | Path, system: str | None = None
) -> dict:
    """Collect, write glue_results.json, glue_table.md and glue_scores.png into `output`.
    `results`: folders (one group, named `system` or by init), or (system, folders) groups."""
    groups = results if results and isinstance(results[0], tuple) else [(system, results)]
    collected = collect_systems(groups)
    with storage.output_dir(output) as tmp:
        (tmp / "glue_results.json").write_text(json.dumps(collected, indent=2) + "\n")
        (tmp / "glue_table.md").write_text(markdown_table(collected))
        plot_scores(collected, tmp / "glue_scores.png")
        write_scores(collected, tmp, lambda folder: _read(folder)[1])  # flat: for DVC
    return collected


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bert evaluate", description=__doc__.split("\n")[0])
    p.add_argument(
        "--results",
        nargs="+",
        action="append",
        required=True,
        help="`bert finetune` output folders; repeat for several systems (one row each)",
    )
    p.add_argument(
        "--system",
        action="append",
        help="row name of the matching --results (default: by each result's init: "
        f"{SYSTEM_OF_INIT['pretrained']!r}, or {SYSTEM_OF_INIT['random']!r} for the control)",
    )
    p.add_argument(
        "--output", required=True, help="folder for glue_results.json, table, plot (or s3://)"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    names = args.system or [None] * len(args.results)
    if len(names) != len(args.results):
        parser.error("give one --system per --results, or none (systems named by init)")
    storage.check_apart({"--output": args.output}, {"--results": sum(args.results, [])})

    groups = list(zip(names, args.results, strict=True))
    results = evaluate(groups, args.output)
    folders = [f for group in args.results for f in group]
    systems = list(results.get("systems", [results["system"]]))
    with start_run("evaluate", {"results": folders, "system": ", ".join(systems)}) as run:
        import mlflow

        metrics = mlflow_metrics(results)
        mlflow.log_metrics(metrics)
        with storage.local_copy(args.output) as written:  # an s3:// output: fetched back
            mlflow.log_artifacts(str(written), artifact_path="glue")
            parent = run.data.tags.get("mlflow.parentRunId")
            if parent:  # a pipeline's evaluate: its results on the pipeline's run too
                publish_results(parent, metrics, written)
    print(f"{args.output.rstrip('/')}/glue_table.md")
    print(markdown_table(results).split("\n\n")[0])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
