"""bf16 numerics: pre-training in bf16 autocast tracks fp32 (#31 point 5).

Three runs of the same pre-training set-up (`bert_core.pretrain.worker.setup`: model, the
paper's optimiser and schedule, our instance stream with its masking) on real instances:

- `fp32`: full precision (tf32 matmuls off), seed S;
- `bf16`: the trainer's precision on GPUs (bf16 autocast, fp32 master weights, the bf16
  residual stream of `bert_core.model.layers`), seed S: the same initial weights, batches and
  dropout draws as `fp32`, so any gap is the arithmetic's;
- `fp32_seed2`: full precision, seed S+1 (other weights, data order and dropout): the gap
  that is noise, to read the bf16 gap against.

The step is the trainer's (`train_step`'s forward, backward, clipping at 1.0, optimizer and
schedule) written out here, because the fp32 side must run without the trainer's autocast.
Prints one JSON line: each run's MLM loss (mean of the last `--window` steps), the bf16 gap
relative to fp32, the seed-to-seed gap, and whether the gap is within `--tolerance`.

    python bench/bf16_numerics.py --instances runs/dvc/instances --preset mini --steps 600
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from bert_core.pretrain.config import PretrainConfig
from bert_core.pretrain.data import prefetch
from bert_core.pretrain.worker import setup


def run(cfg: PretrainConfig, bf16: bool, device: torch.device) -> list[float]:
    """MLM loss at every step of `cfg.steps` steps."""
    t = setup(cfg, device=device)
    batches = prefetch(t.stream)
    params = [p for group in t.optimizer.param_groups for p in group["params"]]
    losses = []
    t.model.train()
    for _ in range(cfg.steps):
        batch = {k: v.to(device, non_blocking=True) for k, v in next(batches).items()}
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            out = t.model(**batch)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        t.optimizer.step()
        t.scheduler.step()
        t.optimizer.zero_grad(set_to_none=True)
        losses.append(out.mlm_loss.detach())
    return torch.stack(losses).float().cpu().tolist()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--instances", required=True)
    p.add_argument("--preset", default="mini")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--learning-rate", type=float, default=5e-4)
    p.add_argument("--window", type=int, default=50, help="steps averaged at the end")
    p.add_argument("--tolerance", type=float, default=0.02, help="relative loss gap allowed")
    p.add_argument("--seed", type=int, default=12345)
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # the fp32 reference is full fp32: tf32 matmuls would already be a reduced precision
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    curves = {}
    with tempfile.TemporaryDirectory(prefix="bench-bf16-") as tmp:
        for name, bf16, seed in [
            ("fp32", False, args.seed),
            ("bf16", True, args.seed),
            ("fp32_seed2", False, args.seed + 1),
        ]:
            cfg = PretrainConfig(
                instances=str(Path(args.instances).resolve()),
                output=tmp,
                preset=args.preset,
                steps=args.steps,
                batch_size=args.batch_size,
                learning_rate=args.learning_rate,
                use_gpu=device.type == "cuda",
                seed=seed,
            )
            curves[name] = run(cfg, bf16, device)
    tail = {k: sum(v[-args.window :]) / args.window for k, v in curves.items()}
    gap = abs(tail["bf16"] - tail["fp32"]) / tail["fp32"]
    noise = abs(tail["fp32_seed2"] - tail["fp32"]) / tail["fp32"]
    step_gap = max(abs(a - b) for a, b in zip(curves["bf16"], curves["fp32"], strict=True))
    out = {
        "bench": "bf16_numerics",
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "preset": args.preset,
        "steps": args.steps,
        "batch_size": args.batch_size,
        "learning_rate": args.learning_rate,
        "first_mlm_loss": round(curves["fp32"][0], 4),
        "mlm_loss_last_window": {k: round(v, 4) for k, v in tail.items()},
        "bf16_gap": round(gap, 5),
        "seed_gap": round(noise, 5),
        "max_step_gap": round(step_gap, 4),
        "tolerance": args.tolerance,
        "within_tolerance": gap <= args.tolerance,
        "curve_every_50": {k: [round(x, 3) for x in v[::50]] for k, v in curves.items()},
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
