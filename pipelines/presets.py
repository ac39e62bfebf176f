"""The paper's ablations as Kubeflow parameter presets: one pipeline run per row of a table.

`python -m pipelines.bert_pipeline submit --host URL --preset table5` starts one run per row
of Table 5, each with the form's defaults (the cluster's first run, `pipelines/cluster.py`), the
paper's BERT-Base settings over them (`cluster.PAPER`: the tables are of BERT-Base runs), the
row's parameters, and every `--set` on top (`--preset paper`: that BERT-Base run alone); all
in the KFP experiment named as the preset, each run named as its row. Every run's MLflow parent
run carries its settings, so `bert runs` lists the rows side by side, and `bert evaluate
--results RUN/glue/* --system ROW ...` makes the paper's table of them (rows of Tables 5, 6 and
8 by these names get the paper's numbers beside ours, `bert_core.report.tables.PAPER_TABLES`;
`make table5|6|8` names its rows the same way).

Table 7 is no preset: the pipeline fine-tunes, it does not train feature-based taggers
(`make table7` does, docs/experiments.md).
"""

from __future__ import annotations

from typing import Any

from pipelines.cluster import PAPER

# Table 6's grid (L, H, A), in the paper's order
TABLE6 = ((3, 768, 12), (6, 768, 3), (6, 768, 12), (12, 768, 12), (12, 1024, 16), (24, 1024, 16))
# Table 8's rows as `--masking-recipe MASK/RANDOM/KEEP` (the paper's columns are MASK, SAME, RND)
TABLE8 = ("80/10/10", "100/0/0", "80/20/0", "80/0/20", "0/80/20", "0/100/0")


def size_row(layers: int, hidden: int, heads: int) -> str:
    """A Table 6 row's name: "L=12 H=768 A=12"."""
    return f"L={layers} H={hidden} A={heads}"


def masking_row(recipe: str) -> str:
    """A Table 8 row's name: "masking 80/10/10"."""
    return f"masking {recipe}"


PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "paper": {"BERT-Base": {}},
    "table5": {
        "BERT (MLM & NSP)": {"pretrain_objective": "mlm+nsp"},
        "No NSP": {"pretrain_objective": "mlm"},
        "LTR & No NSP": {"pretrain_objective": "ltr"},
        "+ BiLSTM": {"pretrain_objective": "ltr", "finetune_top_bilstm": True},
    },
    "table6": {
        size_row(L, H, A): {"model_num_layers": L, "model_hidden_size": H, "model_num_heads": A}
        for L, H, A in TABLE6
    },
    "table8": {masking_row(r): {"instances_masking_recipe": r} for r in TABLE8},
    # one run whose pre-training exports a model every 100k steps of its phase one (the paper's
    # run: 900k steps at 128 tokens, then its phase two);
    # `make figure2 ARGS="--pretrain FOLDER"` fine-tunes from each export (docs/experiments.md)
    "figure2": {"exports": {"pretrain_export_every": 100_000}},
}


def runs(preset: str | None, overrides: dict[str, Any]) -> list[tuple[str | None, dict]]:
    """(run name, arguments) of each run to start: the preset's rows, `overrides` (`--set`) on
    top of each; without a preset, one unnamed run of `overrides`."""
    if preset is None:
        return [(None, overrides)]
    if preset not in PRESETS:
        raise SystemExit(f"--preset {preset!r}: one of {', '.join(PRESETS)}")
    return [(row, {**PAPER, **values, **overrides}) for row, values in PRESETS[preset].items()]
