"""fp32 against int8, side by side: dev score, size and CPU latency of each model, one run.

For every fine-tuned GLUE classifier given (a `bert finetune` output or model folder: the
teacher now, the distilled students later), the model as it is (fp32) and as `bert quantize`
makes it (int8: `bert_core.model.int8`, written to a temporary folder and read back, as a user
loads it), all through `bert predict`'s predictor (tokenisation included), on the same dev
sentences, `torch.set_num_threads(2)`. Timings run interleaved in rounds (every model once per
round), so drift in the machine's load hits every model alike.

One JSON line per model: dev score (the task's metric, percent), parameters, size on disk (MB),
latency p50 of one sentence (batch 1) and of a batch of 32, throughput at 32; int8 lines add
the ratio to their fp32 model's throughput and whether the targets hold (int8 within 1 point of
fp32 at >= 1.5x its throughput at batch 32). The first model given is the teacher: every later
model's lines add their throughput over the teacher's fp32 and, in fp32, their score's share of
the teacher's and whether the student's targets hold (>= 90 % of its score at >= 3x its
throughput at batch 32).

    python bench/compress.py --data ../shared/data/glue/SST-2 /tmp/q/teacher [student ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from bert_core.compress.quantize import size_mb
from bert_core.finetune.tasks.glue_data import (
    compute_metrics,
    get_task,
    label_ids,
    read_task,
    task_score,
)
from bert_core.model import int8
from bert_core.model.heads import BertForSequenceClassification
from bert_core.model.modeling import num_parameters
from bert_core.serve.mlflow_model import local_model
from bert_core.serve.predictors import Settings, load_predictor, read_config


def dev_frame(data: Path, task) -> tuple[pd.DataFrame, np.ndarray]:
    examples = [e for split in read_task(task, data, "dev").values() for e in split]
    frame = pd.DataFrame({"text": [e.text_a for e in examples]})
    if task.train.layout.text_b is not None:
        frame["text_pair"] = [e.text_b for e in examples]
    return frame, label_ids(task, examples)


def score(predictor, task, frame: pd.DataFrame, labels: np.ndarray) -> float:
    answers = predictor.predict(frame)
    if task.is_regression:
        preds = np.asarray([a["score"] for a in answers])
    else:
        ids = predictor.config.label2id or {}
        preds = np.asarray([int(ids.get(a["label"], a["label"])) for a in answers])
    split = compute_metrics(task, preds, labels)
    return float(task_score(task, split))


def timings(predictor, frame: pd.DataFrame, n1: int, n32: int) -> tuple[list, list]:
    t1, t32 = [], []
    for i in range(n1):
        start = time.perf_counter()
        predictor.predict(frame.iloc[i : i + 1])
        t1.append(time.perf_counter() - start)
    for i in range(n32):
        batch = frame.iloc[i * 32 : (i + 1) * 32]
        start = time.perf_counter()
        predictor.predict(batch)
        t32.append(time.perf_counter() - start)
    return t1, t32


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("models", nargs="+", help="fine-tuned GLUE classifiers (fp32)")
    p.add_argument("--data", required=True, help="the task's data folder (its dev set)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--n1", type=int, default=50, help="single sentences timed per round")
    p.add_argument("--n32", type=int, default=6, help="batches of 32 timed per round")
    args = p.parse_args()
    torch.set_num_threads(2)
    rows, tmp = {}, Path(tempfile.mkdtemp(prefix="bench-compress-"))
    for i, ref in enumerate(args.models):
        with local_model(ref) as (folder, settings):
            config = read_config(folder)
            task = get_task(config["finetuning_task"])
            fp32 = BertForSequenceClassification.from_pretrained(folder)
            int8.save(int8.quantize(fp32), tmp / f"{i}", {"source": str(ref)}, config)
            fp32 = BertForSequenceClassification.from_pretrained(folder)
            settings = Settings.from_dict(settings | {"device": "cpu", "batch_size": 32})
            for kind, path in (("fp32", folder), ("int8", tmp / f"{i}")):
                predictor = load_predictor(path, settings)
                rows[f"{ref} {kind}"] = {
                    "model": str(ref),
                    "precision": kind,
                    "task": task.name,
                    "parameters": num_parameters(fp32),
                    "size_mb": round(size_mb(path), 1),
                    "predictor": predictor,
                    "glue": task,
                    "t1": [],
                    "t32": [],
                }
    frame, labels = dev_frame(Path(args.data), next(iter(rows.values()))["glue"])
    for row in rows.values():
        row["dev_score"] = round(score(row["predictor"], row["glue"], frame, labels), 2)
        timings(row["predictor"], frame, 5, 1)  # warm-up
    shuffled = frame.sample(frac=1.0, random_state=0).reset_index(drop=True)
    for _ in range(args.rounds):
        for row in rows.values():
            t1, t32 = timings(row["predictor"], shuffled, args.n1, args.n32)
            row["t1"] += t1
            row["t32"] += t32
    teacher = rows[f"{args.models[0]} fp32"]
    for key, row in rows.items():
        out = {k: v for k, v in row.items() if k not in ("predictor", "glue", "t1", "t32")}
        out["p50_ms_batch1"] = round(statistics.median(row["t1"]) * 1e3, 2)
        out["p50_ms_batch32"] = round(statistics.median(row["t32"]) * 1e3, 1)
        out["seq_per_s_batch32"] = round(32 / statistics.median(row["t32"]), 1)
        if row["precision"] == "int8":
            base = rows[key.removesuffix("int8") + "fp32"]
            ratio = out["seq_per_s_batch32"] * statistics.median(base["t32"]) / 32
            out["throughput_vs_fp32"] = round(ratio, 2)
            out["latency1_speedup_vs_fp32"] = round(
                statistics.median(base["t1"]) / statistics.median(row["t1"]), 2
            )
            out["score_vs_fp32"] = round(out["dev_score"] - base["dev_score"], 2)
            out["targets_met"] = out["score_vs_fp32"] >= -1.0 and ratio >= 1.5
        if row["model"] != teacher["model"]:
            speed = statistics.median(teacher["t32"]) / statistics.median(row["t32"])
            out["throughput_vs_teacher"] = round(speed, 2)
            if row["precision"] == "fp32":
                share = 100 * out["dev_score"] / teacher["dev_score"]
                out["score_share_of_teacher"] = round(share, 1)
                out["student_targets_met"] = share >= 90 and speed >= 3
        out["threads"] = torch.get_num_threads()
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
