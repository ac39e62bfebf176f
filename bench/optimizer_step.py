"""Optimizer-step time: the original's `AdamWeightDecay` (`--optimizer bert`, multi-tensor ops)
against torch's fused AdamW (`--optimizer adamw`), on one preset's parameters, same process.

Also checks, on the device, that `AdamWeightDecay` in fp32 follows the original's update rule
computed in fp64 (no bias correction, decoupled decay on matrices only) over a few steps. Prints
one JSON line: {"preset", "device", "bert_ms", "adamw_ms", "ratio", "max_rel_err"}.

    python bench/optimizer_step.py --preset base --steps 50
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from bert_core.model import optim
from bert_core.model.modeling import BertConfig, BertForPreTraining


def original_rule(p, grads, lrs, wd, eps=1e-6, b1=0.9, b2=0.999):
    """google-research/bert's AdamWeightDecayOptimizer, in fp64."""
    p, m, v = p.double(), torch.zeros_like(p, dtype=torch.float64), 0
    for g, lr in zip(grads, lrs, strict=True):
        g = g.double()
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        p = p - lr * (m / (v.sqrt() + eps) + wd * p)
    return p


def check(device: str) -> float:
    """Largest relative error of fp32 AdamWeightDecay against the fp64 rule over 5 steps."""
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256).to(device)
    start = [p.detach().clone() for p in model.parameters()]
    grads = [[torch.randn_like(p) * 1e-2 for p in model.parameters()] for _ in range(5)]
    lrs = [1e-3 * (s + 1) / 5 for s in range(5)]
    opt = optim.adam_weight_decay(model, 1e-3, 0.01)
    for s, gs in enumerate(grads):
        for group in opt.param_groups:
            group["lr"] = lrs[s]
        for p, g in zip(model.parameters(), gs, strict=True):
            p.grad = g
        opt.step()
    worst = 0.0
    for i, p in enumerate(model.parameters()):
        wd = 0.01 if p.dim() >= 2 else 0.0
        want = original_rule(start[i], [gs[i] for gs in grads], lrs, wd)
        worst = max(worst, ((p.double() - want).abs().max() / want.abs().max()).item())
    return worst


def time_step(opt, device: str, steps: int) -> float:
    for _ in range(3):
        opt.step()
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.step()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps * 1000


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="base")
    p.add_argument("--steps", type=int, default=50)
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = BertForPreTraining(BertConfig.from_preset(args.preset)).to(device)
    for q in model.parameters():
        q.grad = torch.randn_like(q) * 1e-3
    ms = {}
    for name in ("bert", "adamw"):
        opt, _ = optim.optimizer_and_schedule(name, model, 1e-4, 0.01, 10, 1000)
        ms[name] = time_step(opt, device, args.steps)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(
        json.dumps(
            {
                "preset": args.preset,
                "device": name,
                "bert_ms": round(ms["bert"], 3),
                "adamw_ms": round(ms["adamw"], 3),
                "ratio": round(ms["bert"] / ms["adamw"], 2),
                "max_rel_err": check(device),
            }
        )
    )


if __name__ == "__main__":
    main()
