"""`bert runs`: compare recent pipeline runs, their GLUE scores and settings, in one table.

Each pipeline run (`make run`, `dvc repro` through it, or a Kubeflow run) is a parent MLflow run
in the pipeline's experiment; its scores are the ones its `evaluate` step logged. The table is a
pandas DataFrame, newest run first, so it also reads well in a notebook (`runs_table()`). The
scores are MLflow's as they are (`evaluate.mlflow_metrics`: percent, the GLUE table's numbers),
under their MLflow names, so a column here is a column of MLflow's compare view.

Besides the main system's scores (GLUE `eval/score`, `eval/{task}/score`), a run that fine-tuned
other systems (`bert evaluate`'s rows: the random-init control, ablations) shows each one's GLUE
score (`random_init/eval/score`, ...) and the main system's gain over the control
(`gain/eval/score`, in points), so the control and the gain compare across runs too.
"""

from __future__ import annotations

import argparse
from typing import Any

from bert_core.errors import BadValue, redacted
from bert_core.track.lineage import PIPELINE_EXPERIMENT, child_runs
from bert_core.tracking import tracking_uri

# the settings that usually explain a difference in GLUE score
SETTINGS = (
    "model.preset",
    "model.num_layers",
    "model.hidden_size",
    "model.num_heads",
    "pretrain.steps",
    "pretrain.batch_size",
    "pretrain.learning_rate",
    "vocab.vocab_size",
    "instances.max_seq_length",
    "finetune.epochs",
    "finetune.max_train_examples",
    "finetune.control_tasks",
    "finetune.lr_sweep",
    "finetune.restarts",
    "pretrain.objective",
    "finetune.top_bilstm",
    "instances.masking_recipe",
)


GLUE = "eval/score"  # a pipeline run's headline: the GLUE score (`bert_core.metrics`)


def _is_glue(name: str) -> bool:
    """Every system's GLUE score and the gains': `eval/score`, `random_init/eval/score`, ..."""
    return name == GLUE or name.endswith("/" + GLUE)


def _is_task(name: str) -> bool:
    """The main system's task scores: `eval/SST-2/score`."""
    return name.startswith("eval/") and name.endswith("/score") and name != GLUE


def _scores(run: Any) -> dict[str, float]:
    """GLUE and task scores (and gains) of a pipeline run, in percent: its own, else those of
    its newest evaluate step."""
    metrics = run.data.metrics
    if GLUE not in metrics:
        evaluated = child_runs(run.info.run_id, "evaluate")
        metrics = evaluated[0].data.metrics if evaluated else {}
    return {k: v for k, v in metrics.items() if _is_glue(k) or _is_task(k)}


def runs_table(experiment: str = PIPELINE_EXPERIMENT, limit: int = 10):
    """A DataFrame of the newest `limit` pipeline runs: when, how, settings and GLUE scores
    (percent)."""
    import pandas as pd
    from mlflow import MlflowClient

    uri = tracking_uri(existing=True)  # never creates a store: reading from none is a mistake
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise BadValue(f"no MLflow experiment {experiment!r} at {redacted(uri)}")
    runs = client.search_runs(
        [exp.experiment_id],
        filter_string="tags.`bert.step` = 'pipeline'",
        order_by=["attributes.start_time DESC"],
        max_results=limit,
    )
    rows = []
    for run in runs:
        tags, params = run.data.tags, run.data.params
        row = {
            "run": run.info.run_id[:8],
            "started": pd.to_datetime(run.info.start_time, unit="ms").strftime("%Y-%m-%d %H:%M"),
            "status": run.info.status,
            "runner": tags.get("bert.runner", "kfp" if "kfp.run_id" in tags else ""),
            "commit": tags.get("mlflow.source.git.commit", "")[:8],
        }
        row.update({k: params.get(k, "") for k in SETTINGS if k in params})
        row.update(_scores(run))
        rows.append(row)
    frame = pd.DataFrame(rows)
    glue = sorted(
        (c for c in frame.columns if _is_glue(c)),
        key=lambda c: (c != GLUE, c.startswith("gain/"), c),
    )
    scores = sorted(c for c in frame.columns if _is_task(c))
    ordered = [c for c in frame.columns if c not in scores and c not in glue]
    ordered += glue + scores
    return frame[ordered] if rows else frame


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bert runs", description=__doc__.split("\n")[0])
    p.add_argument("--experiment", default=PIPELINE_EXPERIMENT)
    p.add_argument("--limit", type=int, default=10, help="newest N pipeline runs")
    return p


def main(argv: list[str] | None = None) -> int:
    import pandas as pd

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.limit < 1:
        parser.error(f"--limit must be >= 1, got {args.limit}")
    frame = runs_table(args.experiment, args.limit)
    if frame.empty:
        print(f"no pipeline runs in {args.experiment!r} yet: `make run` starts one")
        return 0
    with pd.option_context("display.width", 200, "display.max_columns", None):
        print(frame.round(2).to_string(index=False))
    return 0
