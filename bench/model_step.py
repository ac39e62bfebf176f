"""Train-step throughput: our BertForPreTraining against transformers', same process and inputs.

One step = forward + backward + AdamW on a batch of `--batch-size` sequences of `--seq-len`
tokens with 15 % of positions masked (capped at max_predictions_per_seq, as in the paper's data).
The two models run interleaved in rounds, so drift in machine load hits both alike. Prints one
JSON line: {"preset", "ours_tokens_per_s", "hf_tokens_per_s", "ratio", "device", ...}; on CUDA
also MFU = 6 * parameters * tokens/s over the device's dense bf16 peak.

    python bench/model_step.py --preset mini --seq-len 128 --batch-size 32 --steps 20

`--profile` adds a second JSON line: where our step's GPU time goes (matrix products, attention,
the rest: elementwise, LayerNorm, dropout, optimizer), the top kernels with their shares.
Measured on an H100 (#31): docs/pretrain.md "Throughput to expect per GPU".
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import transformers

from bert_core.model.modeling import BertConfig, BertForPreTraining, num_parameters

PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def make_batch(config: BertConfig, batch_size: int, seq_len: int, device: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    n_pred = min(20 if seq_len <= 128 else 80, max(1, round(0.15 * seq_len)))
    ids = torch.randint(1000, config.vocab_size, (batch_size, seq_len), generator=g)
    ids[:, 0] = 101
    types = torch.zeros_like(ids)
    types[:, seq_len // 2 :] = 1
    positions = torch.stack(
        [torch.randperm(seq_len - 1, generator=g)[:n_pred].sort().values + 1 for _ in ids]
    )
    labels = torch.gather(ids, 1, positions)
    full_labels = torch.full_like(ids, -100).scatter_(1, positions, labels)
    nsp = torch.randint(0, 2, (batch_size,), generator=g)
    mask = torch.ones_like(ids)
    to = lambda t: t.to(device)  # noqa: E731
    ours = dict(
        input_ids=to(ids),
        token_type_ids=to(types),
        attention_mask=to(mask),
        masked_lm_positions=to(positions),
        masked_lm_labels=to(labels),
        next_sentence_label=to(nsp),
    )
    hf = dict(
        input_ids=to(ids),
        token_type_ids=to(types),
        attention_mask=to(mask),
        labels=to(full_labels),
        next_sentence_label=to(nsp),
    )
    return ours, hf


def make_step(model, batch, device: str):
    # the same optimiser for both models: fused on CUDA, the field's default there
    opt = torch.optim.AdamW(
        model.parameters(), lr=1e-4, weight_decay=0.01, fused=device == "cuda" or None
    )
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else None

    def step() -> float:
        if amp is not None:
            with amp:
                loss = model(**batch).loss
        else:
            loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def timed(step, n: int, device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        loss = step()
    loss.item()  # wait for the last step
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t


def kernel_kind(name: str) -> str:
    n = name.lower()
    if any(k in n for k in ("gemm", "cutlass", "xmma", "nvjet", "matmul")):
        return "matmul"
    if any(k in n for k in ("fmha", "flash", "attention", "attn")):
        return "attention"
    return "other"


def profile(step, steps: int = 5) -> dict:
    """GPU time of `steps` steps by kernel: the share of each kind and the top 12 kernels."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    times = {}
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)
        if us > 0:
            times[e.key] = times.get(e.key, 0.0) + us
    total = sum(times.values()) or 1.0
    kinds: dict[str, float] = {}
    for name, us in times.items():
        kinds[kernel_kind(name)] = kinds.get(kernel_kind(name), 0.0) + us / total
    top = sorted(times.items(), key=lambda kv: -kv[1])[:12]
    return {
        "gpu_ms_per_step": round(total / steps / 1000, 3),
        "share": {k: round(v, 3) for k, v in sorted(kinds.items())},
        "top": [[name[:90], round(us / total, 4)] for name, us in top],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="mini")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=20, help="timed steps per model per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--compile", action="store_true", help="torch.compile both models")
    p.add_argument(
        "--compile-mode",
        default=None,
        help="torch.compile mode for both models, e.g. max-autotune-no-cudagraphs (Triton GEMMs\n"
        "with the bias/GELU/residual epilogues fused in, chosen by timing; implies --compile)",
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--profile", action="store_true", help="also our step's GPU time by kernel")
    args = p.parse_args()
    device = args.device
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    torch.manual_seed(0)
    config = BertConfig.from_preset(args.preset)
    ours = BertForPreTraining(config).to(device).train()
    hf_config = transformers.BertConfig(**config.to_dict(), attn_implementation="sdpa")
    hf = transformers.BertForPreTraining(hf_config).to(device).train()
    hf.load_state_dict(ours.state_dict(), strict=False)  # same starting weights
    args.compile = args.compile or args.compile_mode is not None
    if args.compile:
        ours, hf = (torch.compile(m, mode=args.compile_mode) for m in (ours, hf))
    ours_batch, hf_batch = make_batch(config, args.batch_size, args.seq_len, device)
    steps = {
        "ours": make_step(ours, ours_batch, device),
        "hf": make_step(hf, hf_batch, device),
    }
    for step in steps.values():
        timed(step, args.warmup, device)
    seconds = {name: 0.0 for name in steps}
    for _ in range(args.rounds):
        for name, step in steps.items():
            seconds[name] += timed(step, args.steps, device)
    tokens = args.rounds * args.steps * args.batch_size * args.seq_len
    ours_tps, hf_tps = tokens / seconds["ours"], tokens / seconds["hf"]
    result = {
        "bench": "model_step",
        "preset": args.preset,
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
        "compile": args.compile,
        "compile_mode": args.compile_mode,
        "ours_tokens_per_s": round(ours_tps, 1),
        "hf_tokens_per_s": round(hf_tps, 1),
        "ratio": round(ours_tps / hf_tps, 3),
        "device": torch.cuda.get_device_name()
        if device == "cuda"
        else f"cpu x{torch.get_num_threads()}",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    if device == "cuda":
        peak = next((v for k, v in PEAK_BF16_FLOPS.items() if k in result["device"]), None)
        n = num_parameters(ours if not args.compile else ours._orig_mod)
        result["parameters"] = n
        if peak:
            result["ours_mfu"] = round(6 * n * ours_tps / peak, 4)
            result["hf_mfu"] = round(6 * n * hf_tps / peak, 4)
    print(json.dumps(result), flush=True)
    if args.profile and device == "cuda":
        print(
            json.dumps(
                {
                    "bench": "model_step_profile",
                    "preset": args.preset,
                    "seq_len": args.seq_len,
                    **profile(steps["ours"]),
                }
            )
        )


if __name__ == "__main__":
    main()
