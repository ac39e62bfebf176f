"""`bert instances`: MLM/NSP pre-training instances, the algorithm of google-research/bert's
`create_pretraining_data.py`, made fast and parallel without changing what it samples.

Four modules, one job each:
- this one, the step: input checks, the pool of worker processes over the input shards,
  `stats.json`, the command line;
- `bert_core.data.instance_config`: its settings (`InstanceConfig`), read by all four;
- `bert_core.data.instance_shards`: one input shard -> one Parquet file (reading, tokenisation,
  seeding, layout);
- `bert_core.data.instance_sampling`: the original's algorithm itself (instances from a document,
  random truncation, masking by the rule of `bert_core.data.masking`).

Every random stream is seeded by (random_seed, shard index, dupe round, purpose), so the output
is byte-identical whatever `--num-workers` is. Output: one Parquet file per input shard
(`instance_shards.SCHEMA`), stats.json and a copy of vocab.txt.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

from bert_core import hub, storage
from bert_core.data import workers
from bert_core.data.instance_config import InstanceConfig
from bert_core.data.instance_sampling import Vocab
from bert_core.data.instance_shards import (
    HELDOUT,
    SCHEMA,
    SPLIT,
    documents_in_shard,
    process_shard,
    seed_for,
    write_instances,
)
from bert_core.data.tokenizer import (
    TOKENIZER_CONFIG,
    checkpoint_of,
    read_lowercase,
    text_shards,
    write_tokenizer_settings,
)
from bert_core.errors import InputError, text_lines, utf8_errors
from bert_core.options import add_options, config_from_args, number
from bert_core.tracking import start_run

__all__ = ["SCHEMA", "InstanceConfig", "create_instances", "main"]

HELDOUT_DIR = "heldout"  # beside the training shards; `list_row_groups` does not look inside


def _process_shard_task(args: tuple) -> tuple[dict, list[list[str]]]:
    return process_shard(*args)


def _worker_init() -> None:
    # One core per process: parallelism comes from processes, so turn off tokenizers' threads.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def count_documents(files: list[Path], at_least: int = 2) -> int:
    """Documents in the input (blank-line separated), counted up to `at_least`; every line is
    read (`text_lines`), so a line too long to hold is refused here, before any work."""
    n = 0
    for file in files:
        in_doc = False
        with utf8_errors(file), open(file, encoding="utf-8") as f:
            for line in text_lines(f, file):
                if line.strip():
                    n += not in_doc
                    in_doc = True
                else:
                    in_doc = False
    return min(n, at_least)


def check_inputs(input_dir: Path, vocab_file: Path, cfg: InstanceConfig) -> list[Path]:
    """Fail before any work (and before opening an MLflow run) on settings or input that
    cannot work: the input shards, with at least two documents for NSP."""
    cfg.validate()
    Vocab.from_file(vocab_file)
    lowercase = read_lowercase(Path(vocab_file).parent)
    if lowercase is not None and lowercase != cfg.lowercase:
        raise InputError(
            Path(vocab_file).parent / TOKENIZER_CONFIG,
            f"the vocabulary is {'un' if lowercase else ''}cased (do_lower_case {lowercase}) but "
            f"{'--cased was' if lowercase else 'lower-casing is'} asked",
        )
    files = text_shards(input_dir)
    if count_documents(files) < 2:
        raise InputError(input_dir, "needs at least 2 documents (NSP draws random next segments)")
    return files


@contextmanager
def _mapper(num_workers: int, tasks: int) -> Iterator[Callable]:
    """`map` over worker processes (one core each), or in this process for one worker or task."""
    if num_workers > 1 and tasks > 1:
        with workers.pool(min(num_workers, tasks), __name__, _worker_init) as pool:
            yield functools.partial(pool.map, chunksize=1)
    else:
        yield lambda f, items: [f(x) for x in items]


def split_heldout(files: list[Path], cfg: InstanceConfig, map_: Callable) -> dict[int, tuple]:
    """Which whole documents are held out: input shard number -> document numbers in it.

    A seeded draw without replacement over all documents of the corpus (`map_` counts them, a
    shard per task), so the same seed holds out the same documents whatever the workers.
    """
    if not cfg.holds_out:
        return {}
    counts = map_(documents_in_shard, files)
    total = sum(counts)
    rng = np.random.default_rng(seed_for(cfg.random_seed, HELDOUT, SPLIT))
    chosen = np.sort(rng.choice(total, size=cfg.heldout_count(total), replace=False))
    starts = np.cumsum([0, *counts])
    out: dict[int, list[int]] = {}
    for g in chosen.tolist():
        k = int(np.searchsorted(starts, g, side="right")) - 1
        out.setdefault(k, []).append(g - int(starts[k]))
    return {k: tuple(v) for k, v in out.items()}


def write_heldout(
    documents: list[list[str]], names: list[str], out_dir: Path, vocab_file: Path, cfg
) -> dict:
    """The held-out documents' instances in `out_dir/shard-00000.parquet` (one dupe round: the
    masks are fixed, each document is seen once) and `documents.tsv` naming them; their stats."""
    if not documents:
        return {"documents": 0, "instances": 0}
    out_dir.mkdir()
    raw = write_instances(
        documents, HELDOUT, out_dir / "shard-00000.parquet", vocab_file, cfg, dupe_factor=1
    )
    if not raw.get("instances"):
        shutil.rmtree(out_dir)
        return {"documents": raw["documents"], "instances": 0}
    (out_dir / "documents.tsv").write_text("".join(f"{n}\n" for n in ["shard\tdocument", *names]))
    return {"path": out_dir.name, "dupe_factor": 1, **_summary(raw)}


def _summary(total: dict[str, int]) -> dict:
    """stats.json's figures from the summed counts of some shards."""
    n, masked = total["instances"], max(total["masked"], 1)
    return {
        "instances": n,
        "documents": total["documents"],
        "mean_length": total["tokens"] / n,
        "random_next_share": total["random_next"] / n,
        # The original forces random-next for one-sentence chunks; the coin is fair on the
        # others, which is what this share measures.
        "forced_random_next_share": total["forced_random_next"] / n,
        "random_next_share_unforced": (total["random_next"] - total["forced_random_next"])
        / max(n - total["forced_random_next"], 1),
        "masked_share": total["masked"] / total["non_special_tokens"],
        "mask_token_share": total["masked_as_mask"] / masked,
        "random_token_share": total["masked_as_random"] / masked,
        "unchanged_share": total["masked_unchanged"] / masked,
        "short_target_share": total["short_target"] / max(total["targets"], 1),
    }


def create_instances(
    input_dir: Path, vocab_file: Path, output_dir: Path, cfg: InstanceConfig, num_workers: int = 1
) -> dict:
    """Instances for every input shard (in parallel), the held-out set (`heldout/`), stats.json
    and vocab.txt."""
    files = check_inputs(input_dir, vocab_file, cfg)
    _worker_init()
    with storage.output_dir(output_dir) as tmp, _mapper(num_workers, len(files)) as map_:
        heldout = split_heldout(files, cfg, map_)
        tasks = [
            (k, f, tmp / f"shard-{k:05d}.parquet", Path(vocab_file), cfg, heldout.get(k, ()))
            for k, f in enumerate(files)
        ]
        results = map_(_process_shard_task, tasks)
        total: dict[str, int] = {}
        for r, _ in results:
            for k, v in r.items():
                total[k] = total.get(k, 0) + v
        if not total.get("instances"):
            raise InputError(input_dir, "no instances created (documents too short?)")
        names = [f"{files[k].name}\t{n}" for k in sorted(heldout) for n in heldout[k]]
        held = [d for _, docs in results for d in docs]
        stats = {
            **_summary(total),
            "input_bytes": total["input_bytes"],
            "shards": len(files),
            "heldout": write_heldout(held, names, tmp / HELDOUT_DIR, vocab_file, cfg),
            "config": asdict(cfg),
        }
        (tmp / "stats.json").write_text(json.dumps(stats, indent=2) + "\n")
        shutil.copyfile(vocab_file, tmp / "vocab.txt")
        write_tokenizer_settings(tmp, cfg.lowercase)
    return stats


def run_name(start: str | None, max_seq_length: int) -> str:
    """The MLflow run's name: the sequence length, and the checkpoint its vocabulary is from,
    so that one pipeline run's instances are told apart in the runs list (phase one's and
    phase two's at 512 tokens; ours and a public start's); the step tag stays `instances`."""
    about = f"{start}, {max_seq_length} tokens" if start else f"{max_seq_length} tokens"
    return f"instances ({about})"


def build_parser() -> argparse.ArgumentParser:
    """`bert instances`' options: the inputs and output, one per `InstanceConfig` field, and the
    worker count (which cannot change the output, so it is not a setting)."""
    p = argparse.ArgumentParser(prog="bert instances", description=__doc__.split("\n")[0])
    p.add_argument("--input", required=True, help="cleaned corpus folder (shards), or s3://")
    p.add_argument("--vocab", required=True, help="vocab.txt (Google format), or s3://")
    p.add_argument("--output", required=True, help="output folder, local or s3://")
    add_options(p, InstanceConfig)
    workers = max(1, os.cpu_count() or 1)
    p.add_argument("--num-workers", type=number("positive", int), default=workers)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = config_from_args(args, InstanceConfig)
    cfg.validate()  # the settings, before any input is downloaded
    inputs = {"--input": args.input, "--vocab": args.vocab}
    storage.check_apart({"--output": args.output}, hub.folders(inputs))
    start = hub.identity(args.vocab) if hub.is_named(args.vocab) else None
    if start:  # a public checkpoint's vocabulary (and casing)
        args.vocab = str(hub.resolve(args.vocab) / "vocab.txt")

    with (
        storage.local_copy(args.input) as corpus,
        storage.local_copy(args.vocab, siblings=(TOKENIZER_CONFIG, "stats.json")) as vocab,
    ):
        start = start or checkpoint_of(vocab)
        lowercase = read_lowercase(vocab.parent)  # the vocabulary's own setting, if it has one
        if lowercase is not None and cfg.lowercase:  # --cased with an uncased one: checked
            cfg = replace(cfg, lowercase=lowercase)
        check_inputs(corpus, vocab, cfg)
        params = {"input": str(args.input), "vocab": str(args.vocab), **asdict(cfg)}
        with start_run("instances", params, name=run_name(start, cfg.max_seq_length)) as run:
            stats = create_instances(corpus, vocab, args.output, cfg, args.num_workers)
            import mlflow

            numbers = {**stats, **{f"heldout_{k}": v for k, v in stats["heldout"].items()}}
            mlflow.log_metrics(
                {k: v for k, v in numbers.items() if isinstance(v, int | float)},
                run_id=run.info.run_id,
            )
    print(
        f"bert instances: {stats['instances']} instances from {stats['documents']} documents, "
        f"{stats['heldout']['instances']} held out from {stats['heldout']['documents']} "
        f"-> {args.output}"
    )
    return 0
