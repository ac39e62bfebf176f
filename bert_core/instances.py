"""`bert instances`: MLM/NSP pre-training instances, the algorithm of google-research/bert's
`create_pretraining_data.py`, made fast and parallel without changing what it samples.

Three modules, one job each:
- this one, the step: its settings (`InstanceConfig`), input checks, the pool of worker
  processes over the input shards, `stats.json`, the command line;
- `bert_core.instance_shards`: one input shard -> one Parquet file (reading, tokenisation,
  seeding, layout);
- `bert_core.instance_sampling`: the original's algorithm itself (instances from a document,
  random truncation, masking by the rule of `bert_core.masking`).

Every random stream is seeded by (random_seed, shard index, dupe round, purpose), so the output
is byte-identical whatever `--num-workers` is. Output: one Parquet file per input shard
(`instance_shards.SCHEMA`), stats.json and a copy of vocab.txt.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from dataclasses import asdict, dataclass
from multiprocessing import get_all_start_methods, get_context
from pathlib import Path

from bert_core import masking
from bert_core.errors import InputError, atomic_dir
from bert_core.instance_sampling import Vocab
from bert_core.instance_shards import SCHEMA, process_shard
from bert_core.masking import MaskingRecipe

__all__ = ["SCHEMA", "InstanceConfig", "create_instances", "main"]

MIN_SEQ_LENGTH = 8
# fork: workers start in milliseconds instead of re-importing numpy/pyarrow/tokenizers.
START_METHOD = "fork" if "fork" in get_all_start_methods() else "spawn"


@dataclass(frozen=True)
class InstanceConfig:
    max_seq_length: int = 128
    max_predictions_per_seq: int = 20
    masked_lm_prob: float = 0.15
    short_seq_prob: float = 0.1
    dupe_factor: int = 10
    random_seed: int = 12345
    whole_word_mask: bool = False
    lowercase: bool = True
    masking_recipe: str = masking.DEFAULT_RECIPE  # [MASK]/random/keep percent, bert_core.masking

    @property
    def recipe(self) -> MaskingRecipe:
        return MaskingRecipe.parse(self.masking_recipe)

    def validate(self) -> None:
        if self.max_seq_length < MIN_SEQ_LENGTH:
            raise ValueError(
                f"--max-seq-length must be >= {MIN_SEQ_LENGTH} ([CLS] A [SEP] B [SEP] needs "
                f"room), got {self.max_seq_length}"
            )
        if self.max_predictions_per_seq < 1:
            raise ValueError("--max-predictions-per-seq must be >= 1")
        if not 0.0 < self.masked_lm_prob < 1.0:
            raise ValueError("--masked-lm-prob must be in (0, 1)")
        if not 0.0 <= self.short_seq_prob <= 1.0:
            raise ValueError("--short-seq-prob must be in [0, 1]")
        if self.dupe_factor < 1:
            raise ValueError("--dupe-factor must be >= 1")
        MaskingRecipe.parse(self.masking_recipe)  # a bad recipe raises ValueError


def _process_shard_task(args: tuple) -> dict:
    return process_shard(*args)


def _worker_init() -> None:
    # One core per process: parallelism comes from processes, so turn off tokenizers' threads.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def input_shards(input_dir: Path) -> list[Path]:
    path = Path(input_dir)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or directory")
    files = [path] if path.is_file() else sorted(path.glob("*.txt"))
    if not files:
        raise InputError(path, "no .txt shards (run `bert clean` first)")
    return files


def count_documents(files: list[Path], at_least: int = 2) -> int:
    """Documents in the input (blank-line separated), counted up to `at_least`."""
    n = 0
    for file in files:
        in_doc = False
        with open(file, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.strip():
                    n += not in_doc
                    in_doc = True
                    if n >= at_least:
                        return n
                else:
                    in_doc = False
    return n


def check_inputs(input_dir: Path, vocab_file: Path, cfg: InstanceConfig) -> list[Path]:
    """Fail before any work (and before opening an MLflow run) on settings or input that
    cannot work: the input shards, with at least two documents for NSP."""
    cfg.validate()
    Vocab.from_file(vocab_file)
    files = input_shards(input_dir)
    if count_documents(files) < 2:
        raise InputError(input_dir, "needs at least 2 documents (NSP draws random next segments)")
    return files


def create_instances(
    input_dir: Path, vocab_file: Path, output_dir: Path, cfg: InstanceConfig, num_workers: int = 1
) -> dict:
    """Instances for every input shard (in parallel), then stats.json and vocab.txt."""
    files = check_inputs(input_dir, vocab_file, cfg)
    _worker_init()
    with atomic_dir(output_dir) as tmp:
        tasks = [
            (k, f, tmp / f"shard-{k:05d}.parquet", Path(vocab_file), cfg)
            for k, f in enumerate(files)
        ]
        if num_workers > 1 and len(tasks) > 1:
            ctx = get_context(START_METHOD)
            with ctx.Pool(min(num_workers, len(tasks)), initializer=_worker_init) as pool:
                results = pool.map(_process_shard_task, tasks, chunksize=1)
        else:
            results = [_process_shard_task(t) for t in tasks]
        total: dict[str, int] = {}
        for r in results:
            for k, v in r.items():
                total[k] = total.get(k, 0) + v
        if not total.get("instances"):
            raise InputError(input_dir, "no instances created (documents too short?)")
        masked = max(total["masked"], 1)
        stats = {
            "instances": total["instances"],
            "documents": total["documents"],
            "input_bytes": total["input_bytes"],
            "mean_length": total["tokens"] / total["instances"],
            "random_next_share": total["random_next"] / total["instances"],
            # The original forces random-next for one-sentence chunks; the coin is fair on the
            # others, which is what this share measures.
            "forced_random_next_share": total["forced_random_next"] / total["instances"],
            "random_next_share_unforced": (total["random_next"] - total["forced_random_next"])
            / max(total["instances"] - total["forced_random_next"], 1),
            "masked_share": total["masked"] / total["non_special_tokens"],
            "mask_token_share": total["masked_as_mask"] / masked,
            "random_token_share": total["masked_as_random"] / masked,
            "unchanged_share": total["masked_unchanged"] / masked,
            "short_target_share": total["short_target"] / max(total["targets"], 1),
            "shards": len(files),
            "config": asdict(cfg),
        }
        (tmp / "stats.json").write_text(json.dumps(stats, indent=2) + "\n")
        shutil.copyfile(vocab_file, tmp / "vocab.txt")
    return stats


def build_parser() -> argparse.ArgumentParser:
    d = InstanceConfig()
    p = argparse.ArgumentParser(prog="bert instances", description=__doc__.split("\n")[0])
    p.add_argument("--input", required=True, type=Path, help="cleaned corpus folder (shards)")
    p.add_argument("--vocab", required=True, type=Path, help="vocab.txt (Google format)")
    p.add_argument("--output", required=True, type=Path, help="output folder")
    p.add_argument("--max-seq-length", type=int, default=d.max_seq_length)
    p.add_argument("--max-predictions-per-seq", type=int, default=d.max_predictions_per_seq)
    p.add_argument("--masked-lm-prob", type=float, default=d.masked_lm_prob)
    p.add_argument("--short-seq-prob", type=float, default=d.short_seq_prob)
    p.add_argument("--dupe-factor", type=int, default=d.dupe_factor)
    p.add_argument("--random-seed", type=int, default=d.random_seed)
    p.add_argument("--whole-word-mask", action="store_true")
    p.add_argument(
        "--masking-recipe",
        default=d.masking_recipe,
        help="shares of predicted tokens shown as [MASK]/random token/unchanged, percent "
        "(default %(default)s, the paper's; Table 8 ablates e.g. 100/0/0)",
    )
    p.add_argument("--cased", action="store_true", help="do not lowercase (cased vocabulary)")
    p.add_argument("--num-workers", type=int, default=max(1, os.cpu_count() or 1))
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = InstanceConfig(
        max_seq_length=args.max_seq_length,
        max_predictions_per_seq=args.max_predictions_per_seq,
        masked_lm_prob=args.masked_lm_prob,
        short_seq_prob=args.short_seq_prob,
        dupe_factor=args.dupe_factor,
        random_seed=args.random_seed,
        whole_word_mask=args.whole_word_mask,
        lowercase=not args.cased,
        masking_recipe=args.masking_recipe,
    )
    check_inputs(args.input, args.vocab, cfg)
    from bert_core.tracking import start_run

    params = {"input": str(args.input), "vocab": str(args.vocab), **asdict(cfg)}
    with start_run("instances", params) as run:
        stats = create_instances(args.input, args.vocab, args.output, cfg, args.num_workers)
        import mlflow

        mlflow.log_metrics(
            {k: v for k, v in stats.items() if isinstance(v, int | float)},
            run_id=run.info.run_id,
        )
    print(
        f"bert instances: {stats['instances']} instances from {stats['documents']} documents "
        f"-> {args.output}"
    )
    return 0
