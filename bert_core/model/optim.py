"""What pre-training and fine-tuning share about optimisation: one home for each rule.

BERT trains with the same recipe in both phases (section A.2 and `optimization.py` of the
original): Adam with decoupled weight decay on the weight matrices only (LayerNorm weights and
biases, the 1-D parameters, are not decayed), a learning rate that warms up linearly and then
decays linearly to zero, and gradient clipping at 1.0. Two versions of that recipe live here:

- `bert`: the original's, exactly: `AdamWeightDecay` (its `AdamWeightDecayOptimizer`: Adam
  *without* bias correction) and `warmup_polynomial_decay` (`polynomial_decay` from step 0,
  1 - t/T, the linear warm-up replacing it while warming up). Pre-training's default.
- `adamw`: transformers' habit: `torch.optim.AdamW` (bias correction) and `warmup_linear_decay`
  (decay over the steps after the warm-up, (T - t)/(T - w)). Fine-tuning uses it, as
  transformers' `run_glue.py` and the results it is compared with (docs/glue.md).

docs/fidelity.md says which rule runs where, and why. On GPUs the activations run in bf16 (the
paper's TPUs did the same); bf16 needs no loss scaling, so there is no GradScaler anywhere.
"""

from __future__ import annotations

import contextlib

import torch

from bert_core.errors import BadValue


def resolve_device(name: str = "auto") -> torch.device:
    """`auto` picks cuda, then mps, then cpu; any other name is taken as it is, and refused
    (naming --device) when torch does not know it or this machine does not have it."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("mps" if torch.backends.mps.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise BadValue(f"--device {name!r}: use auto, cpu, cuda, cuda:N or mps") from None
    here = {"cuda": torch.cuda.is_available, "mps": torch.backends.mps.is_available}
    if device.type in here and not here[device.type]():
        raise BadValue(f"--device {name}: this machine has no {device.type} device; use auto")
    return device


def autocast(device: torch.device):
    """bf16 autocast on GPUs that support it; full precision elsewhere (CPU, old GPUs)."""
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay on matrices only: the 1-D parameters are LayerNorm weights and biases."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def adamw(
    model: torch.nn.Module,
    learning_rate: float,
    weight_decay: float,
    eps: float = 1e-6,
    betas: tuple[float, float] = (0.9, 0.999),
) -> torch.optim.AdamW:
    """torch's AdamW, bias-corrected (eps 1e-6 as the original; transformers' default is 1e-8).

    The fused kernel updates all parameters in one pass: ~8x faster than the default on a CPU,
    where a 30k-token embedding makes the optimizer step a large part of a small model's step.
    """
    groups = param_groups(model, weight_decay)
    device = next(model.parameters()).device
    fused = device.type in {"cpu", "cuda", "mps"}
    return torch.optim.AdamW(groups, lr=learning_rate, betas=tuple(betas), eps=eps, fused=fused)


class AdamWeightDecay(torch.optim.Optimizer):
    """The original BERT's optimiser (`AdamWeightDecayOptimizer` in google-research/bert's
    optimization.py), for every parameter with a gradient:

        m = b1 m + (1 - b1) g        v = b2 v + (1 - b2) g^2
        p = p - lr (m / (sqrt(v) + eps) + weight_decay p)

    Adam *without* bias correction (the moments are used as they are), so for a steady
    gradient step t is (1 - b1^t) / sqrt(1 - b2^t) times Adam's: 3.2x
    at step 1, 6.5x at step 10, 1.26x at step 1000; the original's long warm-up hides that.
    The decay uses the parameter before the step and is scaled by lr, as torch's AdamW;
    `param_groups` leaves LayerNorm and biases undecayed (the original excludes them by name).
    Multi-tensor (`torch._foreach_*`) ops, as the rule reads (docs/fidelity.md: speed)."""

    def __init__(
        self,
        params,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
    ):
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            for p in params:
                if not self.state[p]:  # the original's slots start at zero
                    self.state[p]["exp_avg"] = torch.zeros_like(p)
                    self.state[p]["exp_avg_sq"] = torch.zeros_like(p)
            grads = [p.grad for p in params]
            m = [self.state[p]["exp_avg"] for p in params]
            v = [self.state[p]["exp_avg_sq"] for p in params]
            (b1, b2), lr = group["betas"], group["lr"]
            torch._foreach_mul_(m, b1)
            torch._foreach_add_(m, grads, alpha=1 - b1)
            torch._foreach_mul_(v, b2)
            torch._foreach_addcmul_(v, grads, grads, value=1 - b2)
            denom = torch._foreach_sqrt(v)
            torch._foreach_add_(denom, group["eps"])
            if group["weight_decay"]:  # p - lr wd p, with p before the step
                torch._foreach_mul_(params, 1 - lr * group["weight_decay"])
            torch._foreach_addcdiv_(params, m, denom, value=-lr)
        return loss


def adam_weight_decay(
    model: torch.nn.Module,
    learning_rate: float,
    weight_decay: float,
    eps: float = 1e-6,
    betas: tuple[float, float] = (0.9, 0.999),
) -> AdamWeightDecay:
    """The original's optimiser over `model`, no decay on LayerNorm and biases."""
    groups = param_groups(model, weight_decay)
    return AdamWeightDecay(groups, lr=learning_rate, betas=tuple(betas), eps=eps)


def warmup_polynomial_decay(warmup_steps: int, total_steps: int):
    """lr multiplier at `step`, the original's (`create_optimizer` in optimization.py):
    `polynomial_decay(power=1.0)` from step 0, 1 - step / total_steps (0 from total_steps on),
    and while step < warmup_steps the warm-up step / warmup_steps instead. So the first step
    runs at lr 0, the peak lr is never reached (1 - w/T at step w), and mid-run the lr is
    below `warmup_linear_decay`'s: 0.5 against ~0.505 at T/2 with a 1 % warm-up."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return step / warmup_steps
        return max(0.0, 1.0 - step / max(1, total_steps))

    return factor


def warmup_linear_decay(warmup_steps: int, total_steps: int):
    """lr multiplier at `step`: step / warmup_steps while warming up, then linear decay to 0
    over the remaining steps, (total_steps - step) / (total_steps - warmup_steps).

    The rule of transformers' `get_linear_schedule_with_warmup` (the first step also runs at
    lr 0); the original decays from step 0 instead (`warmup_polynomial_decay`).
    """

    def factor(step: int) -> float:
        if step < warmup_steps:
            return step / max(1, warmup_steps)
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))

    return factor


def linear_schedule(
    optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """transformers' warm-up and decay (`warmup_linear_decay`)."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_linear_decay(warmup_steps, total_steps)
    )


def bert_schedule(
    optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """The original's warm-up and decay (`warmup_polynomial_decay`)."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_polynomial_decay(warmup_steps, total_steps)
    )


# --optimizer of `bert pretrain`: name -> (optimiser, schedule)
OPTIMIZERS = {
    "bert": (adam_weight_decay, bert_schedule),
    "adamw": (adamw, linear_schedule),
}


def optimizer_and_schedule(
    name: str,
    model: torch.nn.Module,
    learning_rate: float,
    weight_decay: float,
    warmup_steps: int,
    total_steps: int,
    eps: float = 1e-6,
    betas: tuple[float, float] = (0.9, 0.999),
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """`OPTIMIZERS[name]`'s optimiser over `model` and its schedule."""
    if name not in OPTIMIZERS:
        raise BadValue(f"optimizer {name!r}: use one of {', '.join(OPTIMIZERS)}")
    make, schedule = OPTIMIZERS[name]
    optimizer = make(model, learning_rate, weight_decay, eps=eps, betas=betas)
    return optimizer, schedule(optimizer, warmup_steps, total_steps)
