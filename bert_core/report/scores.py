"""`bert evaluate`'s flat files: the table's numbers only, a row per system and task, for tools
that show a file as a row and its keys as columns (`dvc metrics show`, `dvc plots show`).

Why apart from glue_results.json: that file is the full record (systems nested, strings such as
`rule` and `source`), and a task's metrics.json also holds its fine-tuning config; read as DVC
metrics they gave a row of about a hundred columns per file. Settings stay in params.yaml and the
MLflow runs; these files hold numbers on the table's scale (percent, as glue_table.md prints
them) and nothing else:

- `scores/<system>/<task>.json`: `score` (the task score: GLUE's rule, or the first column of the
  task's own table for the others), the task's metrics (its table's columns), `best_epoch`, and
  `gain`, points over the control (systems that have one). `scores/<system>/GLUE.json`: the GLUE
  `score`, how many `tasks` it averages, its `gain`. `<system>` is the system's `slug`
  (`bert_ours`, `random_init`).
- `task_scores.csv` (task, system, score): every system's task scores and GLUE score, the bars
  of "pre-trained vs random init".
- `dev_curves.csv` (task, system, epoch, score): the task score on dev after each epoch of the
  kept run (metrics.json's `epochs`).

Long tables (a row per task and system) rather than a column per system: any set of systems
and tasks fits one file, so dvc.yaml names its plots' columns once, whatever `finetune.tasks`
and `finetune.control_tasks` hold.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable, Iterator
from pathlib import Path

from bert_core.finetune.tasks.glue_data import TASKS, task_score
from bert_core.metrics import HEADLINE, percent
from bert_core.report.tables import TOKEN_TASKS, slug, systems

GLUE_ROW = "GLUE"  # the file and task name of a system's GLUE score (no task is named so)


def columns(task: str) -> list[str]:
    """The metrics a task's row holds: a GLUE task's own (one or two), another task's table
    columns (`bert_core.report.tables.TOKEN_TASKS`)."""
    return TASKS[task].metric_names() if task in TASKS else list(TOKEN_TASKS[task][1])


def headline(task: str, metrics: dict[str, float]) -> float:
    """The task's score in percent, as the table and the plot give it: GLUE's rule for a GLUE
    task, the first table column (e.g. SQuAD's EM, CoNLL's F1) for the others. KeyError when
    `metrics` lacks what it needs."""
    if task in TASKS:
        try:
            return task_score(TASKS[task], metrics)
        except ValueError as e:  # a metric missing
            raise KeyError(str(e)) from None
    first = columns(task)[0]
    return percent(first, metrics[first])


def entries(results: dict) -> Iterator[tuple[str, str, dict]]:
    """(system, task, its collected entry) for every task of every system, GLUE first."""
    for name, r in systems(results).items():
        for task, entry in {**r["tasks"], **r.get("token_tasks", {})}.items():
            yield name, task, entry


def task_row(task: str, entry: dict, run: dict, control: dict | None) -> dict[str, float]:
    """One row of `scores/`: the score, the metrics (percent), best_epoch, the gain over the
    control's entry for the same task (when there is one)."""
    score = headline(task, entry["metrics"])
    row = {HEADLINE: score}
    row |= {m: percent(m, entry["metrics"][m]) for m in columns(task) if m in entry["metrics"]}
    if isinstance(run.get("best_epoch"), int):
        row["best_epoch"] = run["best_epoch"]
    if control is not None:
        row["gain"] = score - headline(task, control["metrics"])
    return row


def glue_row(r: dict) -> dict[str, float] | None:
    """A system's GLUE row (None when it has no GLUE task): score, tasks averaged, gain."""
    if r["glue_score"] is None:
        return None
    row = {HEADLINE: r["glue_score"], "tasks": r["num_tasks"]}
    gain = (r.get("gain") or {}).get("glue_score")
    return row | ({"gain": gain} if gain is not None else {})


def rows(results: dict, runs: dict[str, dict]) -> dict[str, dict[str, float]]:
    """{`scores/<system>/<task>.json`: its row} for every system and task, and each system's
    GLUE row. `runs`: each entry's `source` -> its metrics.json."""
    every = systems(results)
    out = {}
    for name, task, entry in entries(results):
        over = (every[name].get("gain") or {}).get("over")
        theirs = every[over] if over else {}
        control = {**theirs.get("tasks", {}), **theirs.get("token_tasks", {})}.get(task)
        run = runs[entry["source"]]
        out[f"scores/{slug(name)}/{task}.json"] = task_row(task, entry, run, control)
    for name, r in every.items():
        glue = glue_row(r)
        if glue is not None:
            out[f"scores/{slug(name)}/{GLUE_ROW}.json"] = glue
    return out


def task_scores(results: dict) -> list[dict]:
    """`task_scores.csv`'s rows: each system's task scores, then its GLUE score."""
    out = [
        {"task": task, "system": name, "score": headline(task, entry["metrics"])}
        for name, task, entry in entries(results)
    ]
    for name, r in systems(results).items():
        if r["glue_score"] is not None:
            out.append({"task": GLUE_ROW, "system": name, "score": r["glue_score"]})
    return out


def dev_curves(results: dict, runs: dict[str, dict]) -> list[dict]:
    """`dev_curves.csv`'s rows: the task score after each epoch of every system's kept run (an
    epoch whose metrics lack one the score needs is left out)."""
    out = []
    for name, task, entry in entries(results):
        for epoch in runs[entry["source"]].get("epochs") or []:
            try:
                score = headline(task, epoch["metrics"])
            except (KeyError, TypeError):
                continue
            out.append({"task": task, "system": name, "epoch": epoch["epoch"], "score": score})
    return out


def _write_csv(path: Path, fields: list[str], records: list[dict]) -> None:
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(records)


def write_scores(results: dict, out: Path, read: Callable[[str], dict]) -> None:
    """Write `scores/`, `task_scores.csv` and `dev_curves.csv` into `out` (module doc).
    `results`: `collect_systems`'s; `read`: a result folder -> its metrics.json (the best epoch
    and the per-epoch history, which glue_results.json does not keep)."""
    runs = {entry["source"]: read(entry["source"]) for _, _, entry in entries(results)}
    for name, row in rows(results, runs).items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(json.dumps(row, indent=2) + "\n")
    _write_csv(out / "task_scores.csv", ["task", "system", "score"], task_scores(results))
    curves = dev_curves(results, runs)
    _write_csv(out / "dev_curves.csv", ["task", "system", "epoch", "score"], curves)
