"""The `bert` command: one sub-command per pipeline step.

Each step module owns its argument parser and exposes `main(argv) -> int`; this file only
dispatches, importing the module lazily so `bert clean` never pays for importing Ray or MLflow.
Errors meant for users (`BertError`, `ValueError`, `FileNotFoundError`) become one line on stderr
and exit code 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import importlib
import sys

from bert_core.errors import BertError

COMMANDS: dict[str, tuple[str, str]] = {
    "clean": ("bert_core.corpus", "raw text -> normalised, de-duplicated, split documents"),
    "vocab": ("bert_core.tokenizer", "train a WordPiece vocabulary (vocab.txt, tokenizer.json)"),
    "instances": ("bert_core.instances", "create MLM/NSP pre-training instances (Parquet shards)"),
    "pretrain": ("bert_core.pretrain", "pre-train BERT with Ray Train (MLM + NSP)"),
    "finetune": ("bert_core.finetune", "fine-tune on one GLUE task"),
    "evaluate": ("bert_core.evaluate", "collect GLUE metrics into one table, plot and MLflow run"),
    "runs": ("bert_core.runs", "compare recent pipeline runs: GLUE scores and settings (MLflow)"),
}


def _usage() -> str:
    lines = ["usage: bert <command> [options]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "`bert <command> --help` shows a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in {"-h", "--help"}:
        print(_usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"bert: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    try:
        return int(module.main(rest) or 0)
    except (BertError, ValueError, FileNotFoundError) as e:
        print(f"bert {name}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
