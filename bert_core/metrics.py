"""One metric language: the names and the scale of every score a run logs to MLflow or Kubeflow.

Why: users compare runs in MLflow's compare view, which lines runs up by metric name. When each
task logged its headline under its own name (`best_dev_accuracy` for SST-2, `best_dev_spearman`
for STS-B) the grid was mostly empty, and a GLUE score of 0.378 in MLflow beside 37.8 in the
table read as two numbers. So, everywhere:

- **Scale**: the table's, percent (the paper's), for every fraction and correlation (`percent`);
  other numbers (losses, epochs, SQuAD 2.0's null-score thresholds) as they are. The files keep
  their own contract: metrics.json holds fractions (`bert evaluate` range-checks them as such),
  and a task's `score` is percent there too.
- **Names, by role**: `eval/score`, a run's headline (a fine-tuning run: its task's score; a
  pipeline or `bert evaluate` run: the GLUE score), and `eval/<metric>` the kept model's named
  dev metrics; per epoch (MLflow step = epoch) `dev/score`, `dev/<metric>` and `train/loss`;
  `test/<metric>` where a task has a test set. A run that reports several tasks puts each under
  `eval/<task>/...`, and other systems (the random-init control, ablations) and the gain over the
  control under a prefix: `random_init/eval/score`, `gain/eval/SST-2/score`
  (`bert_core.report.evaluate.mlflow_metrics`).
"""

from __future__ import annotations

from collections.abc import Mapping

# a metric's kind is the last part of its name (exact_match -> match, test_f1 -> f1)
FRACTIONS = ("accuracy", "f1", "precision", "recall", "exact", "match")
CORRELATIONS = ("mcc", "pearson", "spearman")
HEADLINE = "score"


def kind(name: str) -> str:
    """`f1` for `strict_f1` or `test_f1`: what the number measures, whatever the prefix."""
    return name.rsplit("_", 1)[-1]


def is_ratio(name: str) -> bool:
    """A fraction in [0, 1] or a correlation in [-1, 1] in metrics.json: percent in MLflow."""
    return kind(name) in FRACTIONS or kind(name) in CORRELATIONS


def percent(name: str, value: float) -> float:
    """`value` of metric `name` on the table's scale: x 100 for a ratio, as it is otherwise."""
    return 100.0 * float(value) if is_ratio(name) else float(value)


def named(metrics: Mapping[str, object], role: str) -> dict[str, float]:
    """`{role}/{name}` on the table's scale for each number in `metrics` (nested tables, such as
    NER's per-type scores, and strings left out): `named({"accuracy": 0.9}, "eval")` is
    `{"eval/accuracy": 90.0}`."""
    return {
        f"{role}/{name}": percent(name, value)
        for name, value in metrics.items()
        if isinstance(value, int | float) and not isinstance(value, bool)
    }


def task_run(score: float, metrics: Mapping[str, object], role: str = "eval") -> dict[str, float]:
    """A fine-tuning run's metrics for one evaluation: `{role}/score` (the task's score, already
    percent) and its named metrics (`named`)."""
    return {f"{role}/{HEADLINE}": float(score), **named(metrics, role)}
