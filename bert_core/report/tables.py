"""`bert evaluate`'s report: the Markdown tables and the plot of `collect_systems`' results.

One row per system, as the paper's tables have one row per model: Table 1's layout for GLUE
(the paper's metric per task, MNLI matched/mismatched, the GLUE score added), then the other
tasks' tables (SQuAD, CoNLL-2003, SWAG). With a control (random init) each other system gets a
gain row under the rows: the difference in points, per task and in GLUE score. Numbers are
percent here (metrics are fractions in the results).
"""

from __future__ import annotations

import re
from pathlib import Path

from bert_core.finetune.tasks.glue_data import TASKS

# BERT's Table 1 column order, with WNLI (left out of the paper's table) at the end.
TABLE_ORDER = ["MNLI", "QQP", "QNLI", "SST-2", "CoLA", "STS-B", "MRPC", "RTE", "WNLI"]
# Other tasks (names as their task modules write them): title, table columns (metric -> header).
# The first column is required; the others are shown when some system has them (SQuAD 2.0's
# tuned threshold, seqeval's strict F1, CoNLL's test split). `test_*` come from metrics.json's
# `test_metrics`.
TOKEN_TASKS = {
    "squad": ("SQuAD v1.1 (Table 2 layout)", {"exact_match": "Dev EM", "f1": "Dev F1"}),
    "squad_v2": (
        "SQuAD v2.0 (Table 3 layout)",
        {
            "exact_match": "Dev EM",
            "f1": "Dev F1",
            "best_exact": "Dev EM (tuned null threshold)",
            "best_f1": "Dev F1 (tuned null threshold)",
        },
    ),
    "conll2003": (
        "CoNLL-2003 NER",
        {
            "f1": "Dev F1",
            "strict_f1": "Dev F1 (seqeval strict)",
            "test_f1": "Test F1",
            "test_strict_f1": "Test F1 (seqeval strict)",
        },
    ),
    "swag": ("SWAG (Table 4 layout)", {"accuracy": "Dev Acc"}),
}
REQUIRED = {"squad": ("exact_match", "f1"), "squad_v2": ("exact_match", "f1")}
# A feature-based tagger's row (`evaluate.system_of`): "feature-based (CHOICE)".
FEATURE_ROW = re.compile(r"feature-based \((.+)\)")


def feature_row(choice: str) -> str:
    return f"feature-based ({choice})"


# The paper's Table 7 (CoNLL-2003 dev F1, BERT-Base): each feature-based row and fine-tuning,
# shown beside ours when a feature-based row is in the table.
PAPER_TABLE7 = {
    "embeddings": 91.0,
    "second-to-last": 95.6,
    "last": 94.9,
    "weighted-sum-last4": 95.9,
    "concat-last4": 96.1,
    "weighted-sum-all": 95.5,
    "fine-tuning": 96.4,
}
# The paper's ablation tables (dev sets, BERT-Base-scale pre-training): each row by the name of
# the system `make table5` / `table6` / `table8` gives it, and the columns as (header, task,
# metric). A table of ours / the paper's is added for each whose rows are in the report.
PAPER_TABLES = {
    "Table 5": (
        (
            ("MNLI-m (Acc)", "MNLI", "matched_accuracy"),
            ("QNLI (Acc)", "QNLI", "accuracy"),
            ("MRPC (Acc)", "MRPC", "accuracy"),
            ("SST-2 (Acc)", "SST-2", "accuracy"),
            ("SQuAD (F1)", "squad", "f1"),
        ),
        {
            "BERT (MLM & NSP)": (84.4, 88.4, 86.7, 92.7, 88.5),
            "No NSP": (83.9, 84.9, 86.5, 92.6, 87.9),
            "LTR & No NSP": (82.1, 84.3, 77.5, 92.1, 77.8),
            "+ BiLSTM": (82.1, 84.1, 75.7, 91.6, 84.9),
        },
    ),
    "Table 6": (
        (
            ("MNLI-m (Acc)", "MNLI", "matched_accuracy"),
            ("MRPC (Acc)", "MRPC", "accuracy"),
            ("SST-2 (Acc)", "SST-2", "accuracy"),
        ),
        {
            "L=3 H=768 A=12": (77.9, 79.8, 88.4),
            "L=6 H=768 A=3": (80.6, 82.2, 90.7),
            "L=6 H=768 A=12": (81.9, 84.8, 91.3),
            "L=12 H=768 A=12": (84.4, 86.7, 92.9),
            "L=12 H=1024 A=16": (85.7, 86.9, 93.3),
            "L=24 H=1024 A=16": (86.6, 87.8, 93.7),
        },
    ),
    # recipes as `--masking-recipe MASK/RANDOM/KEEP` (the paper's columns: MASK, SAME, RND);
    # its feature-based NER column is no row of ours
    "Table 8": (
        (("MNLI-m (Acc)", "MNLI", "matched_accuracy"), ("NER fine-tuned (F1)", "conll2003", "f1")),
        {
            "masking 80/10/10": (84.2, 95.4),
            "masking 100/0/0": (84.3, 94.9),
            "masking 80/20/0": (84.1, 95.2),
            "masking 80/0/20": (84.4, 95.2),
            "masking 0/80/20": (83.7, 94.8),
            "masking 0/100/0": (83.6, 94.9),
        },
    ),
}
NOTE = (
    "Dev-set metrics in percent. Table 1's metric per task: F1 for QQP and MRPC, Spearman "
    "for STS-B, Matthews correlation for CoLA, accuracy for the others. GLUE score: mean of "
    "the task scores, a task's score being the mean of its metrics. A gain row is a system "
    "minus the control (random init), in points of the same cells; its GLUE score is the mean "
    "task-score difference over the tasks both have."
)


def systems(results: dict) -> dict[str, dict]:
    """{name: that system's results}, the single system's when there is one."""
    return results.get("systems") or {results.get("system", "BERT (ours)"): results}


def slug(system: str) -> str:
    """A system's name as an MLflow metric prefix or a file name: 'random init' -> 'random_init'."""
    return re.sub(r"[^0-9a-z]+", "_", system.lower()).strip("_") or "system"


def _pct(x: float) -> str:
    return f"{100 * x:.1f}"


def _signed(points: float) -> str:
    return f"{points:+.1f}"


def _paper_cell(name: str, metrics: dict[str, float]) -> str:
    if name == "MNLI":
        return f"{_pct(metrics['matched_accuracy'])}/{_pct(metrics['mismatched_accuracy'])}"
    return _pct(metrics[TASKS[name].paper_metric])


def _gain_cell(name: str, mine: dict, control: dict) -> str:
    """A task's gain in the paper's metric (MNLI: matched/mismatched)."""
    keys = ["matched_accuracy", "mismatched_accuracy"] if name == "MNLI" else None
    keys = keys or [TASKS[name].paper_metric]
    return "/".join(_signed(100 * (mine["metrics"][k] - control["metrics"][k])) for k in keys)


def gain_rows(results: dict, cell, glue_cell) -> list[str]:
    """`| name gain over control | ... |` for every system with a gain."""
    rows = []
    for name, r in systems(results).items():
        g = r.get("gain")
        if g:
            control = systems(results)[g["over"]]
            rows.append(f"| {name} gain over {g['over']} | " + cell(r, control) + glue_cell(g))
    return rows


def glue_table(results: dict) -> list[str]:
    """Table 1: a row per system, the gain rows, the note, then every metric per task."""
    heads = ["MNLI-(m/mm)" if t == "MNLI" else t for t in TABLE_ORDER]
    lines = ["| System | " + " | ".join(heads) + " | GLUE score |", "|---" * (len(heads) + 2) + "|"]
    for name, r in systems(results).items():
        if not r["tasks"]:
            continue
        tasks = r["tasks"]
        cells = [_paper_cell(t, tasks[t]["metrics"]) if t in tasks else "-" for t in TABLE_ORDER]
        partial = "" if r["complete"] else f" ({r['num_tasks']}/9 tasks)"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {r['glue_score']:.1f}{partial} |")

    def cell(mine: dict, control: dict) -> str:
        both = lambda t: t in mine["tasks"] and t in control["tasks"]  # noqa: E731
        return " | ".join(
            _gain_cell(t, mine["tasks"][t], control["tasks"][t]) if both(t) else "-"
            for t in TABLE_ORDER
        )

    def glue_cell(g: dict) -> str:
        return f" | {_signed(g['glue_score'])} |" if g["glue_score"] is not None else " | - |"

    lines += gain_rows(results, cell, glue_cell)
    lines += ["", NOTE, ""]
    several = len(systems(results)) > 1
    lines += (
        ["| System | Task | Metrics | Task score |", "|---|---|---|---|"]
        if several
        else ["| Task | Metrics | Task score |", "|---|---|---|"]
    )
    for name, r in systems(results).items():
        for task, t in r["tasks"].items():
            ms = ", ".join(f"{k} {_pct(v)}" for k, v in t["metrics"].items())
            lines.append(
                (f"| {name} " if several else "") + f"| {task} | {ms} | {t['score']:.1f} |"
            )
    return lines


def token_tables(results: dict) -> str:
    """One small table per other task, in the paper's layout (dev columns; test when present),
    a row per system and the gain rows."""
    parts = []
    for task, (title, columns) in TOKEN_TASKS.items():
        rows = {
            n: r["token_tasks"][task]
            for n, r in systems(results).items()
            if task in r.get("token_tasks", {})
        }
        if not rows:
            continue
        shown = [m for m in columns if any(m in r["metrics"] for r in rows.values())]
        paper = task == "conll2003" and any(FEATURE_ROW.fullmatch(n) for n in rows)
        heads = [columns[m] for m in shown] + (["Paper Dev F1 (BERT-Base, Table 7)"] * paper)
        lines = [
            f"**{title}**",
            "",
            "| System | " + " | ".join(heads) + " |",
            "|---" * (len(heads) + 1) + "|",
        ]
        for name, r in rows.items():
            cells = [_pct(r["metrics"][m]) if m in r["metrics"] else "-" for m in shown]
            if paper:
                cells.append(_table7_cell(name, systems(results)[name].get("init")))
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        for name, r in systems(results).items():
            g = (r.get("gain") or {}).get("token_tasks", {}).get(task)
            if g:
                cells = [_signed(g[m]) if m in g else "-" for m in shown]
                lines.append(
                    f"| {name} gain over {r['gain']['over']} | " + " | ".join(cells) + " |"
                )
        parts.append("\n".join(lines) + "\n")
    return "\n".join(parts)


def _table7_cell(name: str, init: str | None) -> str:
    """The paper's number for a row of Table 7: its feature choice, or fine-tuning for a row
    fine-tuned from pre-trained weights; none for the random-init control."""
    if row := FEATURE_ROW.fullmatch(name):
        paper = PAPER_TABLE7.get(row.group(1))  # a --system so named may be no Table 7 choice
        return "-" if paper is None else f"{paper:.1f}"
    return "-" if init == "random" else f"{PAPER_TABLE7['fine-tuning']:.1f} (fine-tuning)"


def paper_tables(results: dict) -> str:
    """Each of `PAPER_TABLES` whose rows are systems here, in its layout: ours / the paper's."""
    parts = []
    for title, (columns, paper) in PAPER_TABLES.items():
        rows = {name: r for name, r in systems(results).items() if name in paper}
        if not rows:
            continue
        lines = [
            f"**{title} layout: ours / the paper's (BERT-Base scale)**",
            "",
            "| System | " + " | ".join(head for head, _, _ in columns) + " |",
            "|---" * (len(columns) + 1) + "|",
        ]
        for name, r in rows.items():
            cells = []
            for (_, task, metric), number in zip(columns, paper[name], strict=True):
                result = r["tasks"].get(task) or r.get("token_tasks", {}).get(task) or {}
                ours = result.get("metrics", {}).get(metric)
                cells.append(f"{'-' if ours is None else _pct(ours)} / {number:.1f}")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        parts.append("\n".join(lines) + "\n")
    return "\n".join(parts)


def markdown_table(results: dict) -> str:
    """Table 1 layout (the paper's metric per task) with a row per system and the gains, plus
    every metric and each task's score; then the other tasks' tables, and the layouts of the
    paper's ablation tables whose rows are there."""
    tokens = "\n".join(part for part in (token_tables(results), paper_tables(results)) if part)
    if not any(r["tasks"] for r in systems(results).values()):
        return tokens
    return "\n".join(glue_table(results)) + "\n" + ("\n" + tokens if tokens else "")


def _main_metric(task: str) -> str:
    return next(iter(TOKEN_TASKS[task][1]))


STEP_SYSTEM = re.compile(r"step (\d+)")  # a Figure 2 sweep's rows: the model after N steps


def plot_steps(results: dict, path: Path) -> None:
    """The paper's Figure 2: each task's dev score against the pre-training steps of the model
    it was fine-tuned from, when every system is named `step N` (`make figure2`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    every = systems(results)
    steps = {name: int(STEP_SYSTEM.fullmatch(name).group(1)) for name in every}
    order = sorted(every, key=steps.get)
    tasks = [t for t in TABLE_ORDER if any(t in r["tasks"] for r in every.values())]
    fig, ax = plt.subplots(figsize=(6, 4))
    for k, task in enumerate(tasks):
        points = [
            (steps[n], every[n]["tasks"][task]["score"]) for n in order if task in every[n]["tasks"]
        ]
        ax.plot(*zip(*points, strict=True), marker="o", color=f"C{k}", label=task)
    ax.set_xlabel("pre-training steps")
    ax.set_ylabel("task score (dev, %)")
    ax.set_title("dev score against pre-training steps (Figure 2 layout)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_scores(results: dict, path: Path) -> None:
    """Grouped bars: each system's task scores (GLUE) and other tasks' main metric, its GLUE
    score as a dashed line of its colour. Systems that are all `step N` (a Figure 2 sweep)
    are drawn as lines against the steps instead (`plot_steps`)."""
    every = systems(results)
    if len(every) > 1 and all(STEP_SYSTEM.fullmatch(n) for n in every):
        return plot_steps(results, path)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [t for t in TABLE_ORDER if any(t in r["tasks"] for r in every.values())]
    token = [t for t in TOKEN_TASKS if any(t in r.get("token_tasks", {}) for r in every.values())]
    labels = names + [f"{t} {_main_metric(t)}" for t in token]
    width = 0.8 / len(every)
    fig, ax = plt.subplots(figsize=(1.5 + 0.9 * len(labels) * max(1, len(every) / 2), 4))
    values = [0.0]
    for k, (name, r) in enumerate(every.items()):
        ys = [r["tasks"][t]["score"] if t in r["tasks"] else float("nan") for t in names]
        ys += [
            100
            * r.get("token_tasks", {})
            .get(t, {})
            .get("metrics", {})
            .get(_main_metric(t), float("nan"))
            for t in token
        ]
        xs = [i + (k - (len(every) - 1) / 2) * width for i in range(len(labels))]
        glue = f" (GLUE {r['glue_score']:.1f})" if r["glue_score"] is not None else ""
        bars = ax.bar(xs, ys, width, label=name + glue, color=f"C{k}")
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
        values += [y for y in ys if y == y]
        if r["glue_score"] is not None:  # a dashed line; its value in the legend or beside it
            ax.axhline(r["glue_score"], color=f"C{k}", linestyle="--", linewidth=1)
            if len(every) == 1:
                ax.text(
                    len(names) - 0.5,
                    r["glue_score"],
                    f"GLUE {r['glue_score']:.1f}",
                    color=f"C{k}",
                    ha="right",
                    va="bottom",
                    fontsize=8,
                )
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylim(min(values) - 5, 100)
    ax.set_ylabel("task score (dev, %)")
    ax.set_title(" vs ".join(every) + ": dev scores")
    if len(every) > 1:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
