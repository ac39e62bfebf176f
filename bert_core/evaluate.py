"""`bert evaluate`: collect fine-tuning results into one GLUE table, a plot and an MLflow run.

Each `--results` folder is one `bert finetune` output; its `metrics.json` names the task and holds
the dev metrics of the best epoch, so nothing else is needed. Task scores and the GLUE score are
recomputed here from the metrics with the leaderboard's rule (`bert_core.glue`), never trusted
from the input. The table is laid out like BERT's Table 1 (tasks in the paper's order, the
paper's metric per task, MNLI as matched/mismatched) with the GLUE score added; when fewer than
nine tasks are given, the score is the mean over those present and is marked partial.

Token-level results (`bert finetune --task conll2003|squad|squad_v2`) get their own rows, laid
out like the paper's Tables 2 and 3 (SQuAD v1.1 / v2.0: EM and F1) and its CoNLL-2003 table (F1);
they are reported beside GLUE, never averaged into the GLUE score.

Scales: metrics are fractions everywhere (metrics.json, glue_results.json, MLflow); the task and
GLUE scores are percent in glue_results.json and the table (the paper's scale) and fractions in
MLflow, where `mlflow_metrics` names and scales every number the same way for every caller.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from bert_core.errors import InputError, atomic_dir
from bert_core.glue import TASKS, get_task, glue_score, task_score

# BERT's Table 1 column order, with WNLI (left out of the paper's table) at the end.
TABLE_ORDER = ["MNLI", "QQP", "QNLI", "SST-2", "CoLA", "STS-B", "MRPC", "RTE", "WNLI"]
# Token-level tasks (names as bert_core.ner / bert_core.squad write them): title, table columns.
TOKEN_TASKS = {
    "squad": ("SQuAD v1.1 (Table 2 layout)", {"exact_match": "Dev EM", "f1": "Dev F1"}),
    "squad_v2": ("SQuAD v2.0 (Table 3 layout)", {"exact_match": "Dev EM", "f1": "Dev F1"}),
    "conll2003": ("CoNLL-2003 NER", {"f1": "Dev F1"}),
}


def load_result(folder: str | Path) -> tuple[str, dict[str, float]]:
    """(task name, metrics) from one fine-tuning output folder, validated."""
    path = Path(folder) / "metrics.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found (is {folder} a `bert finetune` output?)")
    try:
        data = json.loads(path.read_text())
        metrics = {str(k): float(v) for k, v in data["metrics"].items()}
        if data["task"] in TOKEN_TASKS:
            return _token_result(path, data["task"], metrics)
        task = get_task(str(data["task"]))
    except json.JSONDecodeError as e:
        raise InputError(path, f"not valid JSON: {e.msg}", line=e.lineno) from e
    except (KeyError, TypeError, AttributeError) as e:
        raise InputError(path, "expected {'task': NAME, 'metrics': {NAME: number}}") from e
    except ValueError as e:
        raise InputError(path, str(e)) from e
    missing = [m for m in task.metric_names() if not math.isfinite(metrics.get(m, math.nan))]
    if missing:
        raise InputError(path, f"{task.name}: missing or non-finite metrics {missing}")
    return task.name, metrics


def _token_result(path: Path, name: str, metrics: dict[str, float]):
    missing = [m for m in TOKEN_TASKS[name][1] if not math.isfinite(metrics.get(m, math.nan))]
    if missing:
        raise InputError(path, f"{name}: missing or non-finite metrics {missing}")
    return name, metrics


def collect(folders: list[str | Path]) -> dict:
    """glue_results.json's content: per-task metrics and scores, and the GLUE score."""
    tasks: dict[str, dict] = {}
    token: dict[str, dict] = {}
    for folder in folders:
        name, metrics = load_result(folder)
        seen = tasks.get(name) or token.get(name)
        if seen:
            raise InputError(
                Path(folder) / "metrics.json", f"{name} given twice (also {seen['source']})"
            )
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


def mlflow_metrics(results: dict) -> dict[str, float]:
    """Results as MLflow metrics, at one scale: fractions, as metrics.json holds them.

    `results` is `collect`'s (glue_results.json's content) or one `bert finetune` output's
    metrics.json. Names: `{task}.{metric}` for every task's dev metrics, `{task}.score` for a
    GLUE task's score and `glue_score`; the scores, in percent in glue_results.json (the table's
    scale), are divided by 100. Every place results reach MLflow (`bert evaluate`'s run, the DVC
    pipeline's parent run, the Kubeflow components' Metrics) logs this, so runs compare as-is.
    """
    if "task" in results:  # one metrics.json: the task's metrics (its `score` is not GLUE's)
        return {f"{results['task']}.{k}": float(v) for k, v in results["metrics"].items()}
    out = {}
    if results["glue_score"] is not None:  # None when only token-level tasks ran
        out["glue_score"] = results["glue_score"] / 100
    for name, r in {**results["tasks"], **results.get("token_tasks", {})}.items():
        out.update({f"{name}.{k}": float(v) for k, v in r["metrics"].items()})
        if "score" in r:  # GLUE tasks; token-level ones report their metrics only
            out[f"{name}.score"] = r["score"] / 100
    return out


def _pct(x: float) -> str:
    return f"{100 * x:.1f}"


def _paper_cell(name: str, metrics: dict[str, float]) -> str:
    if name == "MNLI":
        return f"{_pct(metrics['matched_accuracy'])}/{_pct(metrics['mismatched_accuracy'])}"
    return _pct(metrics[TASKS[name].paper_metric])


def token_tables(results: dict, system: str) -> str:
    """One small table per token-level task, in the paper's layout (dev columns only)."""
    parts = []
    for name, r in results.get("token_tasks", {}).items():
        title, columns = TOKEN_TASKS[name]
        cells = [_pct(r["metrics"][m]) for m in columns]
        parts.append(
            f"**{title}**\n\n| System | " + " | ".join(columns.values()) + " |\n"
            + "|---" * (len(columns) + 1) + "|\n"
            + f"| {system} | " + " | ".join(cells) + " |\n"
        )  # fmt: skip
    return "\n".join(parts)


def markdown_table(results: dict, system: str) -> str:
    """Table 1 layout (the paper's metric per task) plus every metric and each task's score;
    then the token-level tasks' tables."""
    tokens = token_tables(results, system)
    if not results["tasks"]:
        return tokens
    tasks = results["tasks"]
    heads = ["MNLI-(m/mm)" if t == "MNLI" else t for t in TABLE_ORDER]
    cells = [_paper_cell(t, tasks[t]["metrics"]) if t in tasks else "-" for t in TABLE_ORDER]
    partial = "" if results["complete"] else f" ({results['num_tasks']}/9 tasks)"
    lines = [
        "| System | " + " | ".join(heads) + " | GLUE score |",
        "|---" * (len(heads) + 2) + "|",
        f"| {system} | " + " | ".join(cells) + f" | {results['glue_score']:.1f}{partial} |",
        "",
        "Dev-set metrics in percent. Table 1's metric per task: F1 for QQP and MRPC, Spearman "
        "for STS-B, Matthews correlation for CoLA, accuracy for the others. GLUE score: mean of "
        "the task scores, a task's score being the mean of its metrics.",
        "",
        "| Task | Metrics | Task score |",
        "|---|---|---|",
    ]
    for name, r in tasks.items():
        ms = ", ".join(f"{k} {_pct(v)}" for k, v in r["metrics"].items())
        lines.append(f"| {name} | {ms} | {r['score']:.1f} |")
    return "\n".join(lines) + "\n" + ("\n" + tokens if tokens else "")


def plot_scores(results: dict, path: Path, system: str) -> None:
    """Bar chart of task scores with the GLUE score as a line (for the run's report); token-level
    tasks' F1 as bars of another colour."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["tasks"])
    scores = [results["tasks"][t]["score"] for t in names]
    token = results.get("token_tasks", {})
    fig, ax = plt.subplots(figsize=(1.0 + 0.9 * (len(names) + len(token)), 4))
    bars = ax.bar(names, scores, color="#4c72b0")
    ax.bar_label(bars, fmt="%.1f", fontsize=8)
    if token:
        f1 = [100 * r["metrics"]["f1"] for r in token.values()]
        ax.bar_label(
            ax.bar([f"{t} F1" for t in token], f1, color="#55a868"), fmt="%.1f", fontsize=8
        )
        scores += f1
    if results["glue_score"] is not None:
        ax.axhline(results["glue_score"], color="#c44e52", linestyle="--")
        ax.text(
            len(names) - 0.5,
            results["glue_score"],
            f"GLUE {results['glue_score']:.1f}",
            color="#c44e52",
            ha="right",
            va="bottom",
        )
    ax.set_ylim(min(0.0, *scores) - 5, 100)
    ax.set_ylabel("task score (dev, %)")
    ax.set_title(f"{system}: {'dev' if token else 'GLUE dev'} scores")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def evaluate(folders: list[str | Path], output: str | Path, system: str = "BERT (ours)") -> dict:
    results = collect(folders)
    with atomic_dir(output) as tmp:
        (tmp / "glue_results.json").write_text(json.dumps(results, indent=2) + "\n")
        (tmp / "glue_table.md").write_text(markdown_table(results, system))
        plot_scores(results, tmp / "glue_scores.png", system)
    return results


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bert evaluate", description=__doc__.split("\n")[0])
    p.add_argument("--results", nargs="+", required=True, help="`bert finetune` output folders")
    p.add_argument("--output", required=True, help="folder for glue_results.json, table, plot")
    p.add_argument("--system", default="BERT (ours)", help="row name in the table")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from bert_core.tracking import start_run

    results = evaluate(args.results, args.output, args.system)
    with start_run("evaluate", {"results": args.results, "system": args.system}):
        import mlflow

        mlflow.log_metrics(mlflow_metrics(results))
        mlflow.log_artifacts(str(args.output), artifact_path="glue")
    print(Path(args.output) / "glue_table.md")
    print(markdown_table(results, args.system).split("\n\n")[0])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
