"""Pre-training's state and measurements: what a rank trains with (`Training`), RNG states,
checkpoints, metric sums, FLOPs.

A checkpoint (`state.pt`) holds everything needed to continue bit for bit: model, optimizer,
scheduler, every rank's RNG states, the step (which is the data position: each rank has consumed
`step * grad_accum * micro_batch` samples) and the metric history; the last one also holds the
final model in the Hugging Face layout (`model/`).
"""

from __future__ import annotations

import csv
import json
import random
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.fs as pafs
import torch

from bert_core.errors import atomic_file
from bert_core.model.modeling import TOKENIZER_FILES
from bert_core.pretrain.config import PretrainConfig
from bert_core.pretrain.data import InstanceStream
from bert_core.storage import filesystem, is_s3, output_dir

CSV_COLUMNS = (
    "step",
    "loss",
    "mlm_loss",
    "nsp_loss",
    "mlm_accuracy",
    "nsp_accuracy",
    "learning_rate",
    "grad_norm",
    "tokens_per_s",
    "sequences_per_s",
    "data_wait_share",
    "mfu",
)
# `heldout_metrics.csv`: the held-out evaluations (`bert_core.pretrain.heldout`), one row each.
HELDOUT_COLUMNS = (
    "step",
    "heldout_mlm_loss",
    "heldout_perplexity",
    "heldout_mlm_accuracy",
    "heldout_nsp_loss",
    "heldout_nsp_accuracy",
    "baseline_mlm_accuracy",
    "baseline_nsp_accuracy",
)
# Dense bf16 peak FLOP/s for MFU; other GPUs: pass --peak-tflops.
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L4": 121.0, "A10G": 125.0}


# ---------------------------------------------------------------- RNG


def rng_state() -> dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


# ---------------------------------------------------------------- collectives


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's `obj` on every rank (one element when not distributed)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t)
    return t.tolist()


# ---------------------------------------------------------------- checkpoints


@dataclass
class Training:
    """What one rank trains with, and where it is."""

    model: torch.nn.Module  # what runs forward: on the device (DDP under Ray), compiled or not
    core: torch.nn.Module  # the BertForPreTraining inside: checkpoints and FLOPs
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    stream: InstanceStream
    step: int = 0
    history: list[dict] = field(default_factory=list)
    heldout: list[dict] = field(default_factory=list)  # held-out evaluations (rank 0)
    # dynamic masking's settings as (value, where from: option, instances or default); {} off
    masking: dict[str, tuple] = field(default_factory=dict)


def save_checkpoint(
    directory: Path, cfg: PretrainConfig, t: Training, rngs: list[dict[str, Any]], *, final: bool
) -> None:
    """`directory/state.pt`: everything to continue `t` (with every rank's RNG states, `rngs`),
    and `directory/model/` when `final`, with the instances' vocab.txt and tokenizer settings
    (casing) beside it."""
    state = {
        "model": t.core.state_dict(),
        "optimizer": t.optimizer.state_dict(),
        "scheduler": t.scheduler.state_dict(),
        "step": t.step,
        "samples_per_rank": t.step * cfg.grad_accum * cfg.micro_batch,
        "rng": rngs,
        "history": t.history,
        "heldout_history": t.heldout,
        "config": asdict(cfg),
    }
    torch.save(state, directory / "state.pt")
    if final:
        save_model(directory / "model", cfg, t.core)


def save_model(directory: Path, cfg: PretrainConfig, model: torch.nn.Module) -> None:
    """`model` as a loadable folder (Hugging Face layout) with the instances' vocab.txt and
    tokenizer settings (casing) beside it: the final model, and each export."""
    with tempfile.TemporaryDirectory(prefix="bert-tokenizer-") as tmp:
        vocab_file: str | Path = cfg.vocab_file
        if is_s3(vocab_file):  # save_pretrained copies local files: the vocabulary's folder
            vocab_file = fetch_tokenizer_files(cfg.instances, Path(tmp) / "tokenizer")
        model.save_pretrained(directory, vocab_file=vocab_file)


def export_model(exports: str, cfg: PretrainConfig, model: torch.nn.Module, step: int) -> None:
    """The model after `step` as `exports/step-N` (rank 0, local or s3://): kept beside
    the checkpoints (which are pruned), copied into OUTPUT/exports when the run ends. A restart
    that passes the step again writes the same folder again (resumed runs are bit for bit)."""
    with output_dir(f"{exports.rstrip('/')}/{export_name(step)}") as tmp:
        save_model(tmp, cfg, model)
        (tmp / EXPORT_RECORD).write_text(json.dumps({"step": step}) + "\n")


EXPORT_RECORD = "pretrain_step.json"  # in an export: the step it was taken after


def export_name(step: int) -> str:
    """`step-N`, unpadded: what a DVC stage names from a params.yaml list of steps."""
    return f"step-{step}"


def fetch_tokenizer_files(instances: str, folder: Path) -> Path:
    """vocab.txt and the tokenizer settings of instances (s3:// or local), copied into `folder`."""
    folder.mkdir()
    for name in TOKENIZER_FILES:
        fs, inner = filesystem(f"{instances.rstrip('/')}/{name}")
        if fs.get_file_info(inner).type == pafs.FileType.File:
            with fs.open_input_stream(inner) as f:
                (folder / name).write_bytes(f.read())
    return folder / "vocab.txt"


def load_state(directory: str | Path) -> dict[str, Any]:
    return torch.load(Path(directory) / "state.pt", map_location="cpu", weights_only=False)


def restore(
    state: dict[str, Any], model, optimizer, scheduler, rank: int, world: int
) -> tuple[int, list[dict], list[dict]]:
    """Load a checkpoint into freshly built objects; returns (step, metric history, held-out
    history).

    This rank's RNG states come back only when the world size is the one that saved them;
    otherwise the per-rank seeds set at start-up stay.
    """
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    if len(state["rng"]) == world:
        set_rng_state(state["rng"][rank])
    return state["step"], state["history"], state.get("heldout_history", [])


def optimizer_state_to(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """A restored optimizer state sits beside the CPU model it was loaded into; follow the model
    to `device`. AdamW's `step` counters stay on the CPU unless the optimizer is fused, whose
    kernel wants them beside the parameters (as `Optimizer.load_state_dict` places them)."""
    if device.type == "cpu":
        return
    fused = any(group.get("fused") for group in optimizer.param_groups)
    for s in optimizer.state.values():
        for k, v in s.items():
            if torch.is_tensor(v) and (k != "step" or fused):
                s[k] = v.to(device)


def write_metrics_csv(
    path: Path, history: list[dict], columns: tuple[str, ...] = CSV_COLUMNS
) -> None:
    """A metric history as CSV for DVC plots, written atomically: `pretrain_metrics.csv`
    (`CSV_COLUMNS`), `heldout_metrics.csv` (`HELDOUT_COLUMNS`)."""
    with atomic_file(path) as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        for row in history:
            writer.writerow({k: ("" if v is None else v) for k, v in row.items()})


# ---------------------------------------------------------------- metrics


def flops_per_token(model: torch.nn.Module, seq_len: float) -> float:
    """Training FLOPs per token: 6 x parameters plus attention (PaLM appendix B)."""
    c = model.config
    n = sum(p.numel() for p in model.parameters())
    return 6 * n + 12 * c.num_hidden_layers * c.hidden_size * seq_len


def peak_flops(cfg: PretrainConfig, device: torch.device) -> float | None:
    if cfg.peak_tflops:
        return cfg.peak_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    tflops = next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    return tflops * 1e12 if tflops else None


class Meter:
    """Sums over a reporting interval; `values` all-reduces them into interval means."""

    KEYS = (
        "loss",
        "mlm_loss",
        "nsp_loss",
        "micro",
        "mlm_correct",
        "mlm_count",
        "nsp_correct",
        "nsp_count",
        "tokens",
        "sequences",
        "padded_tokens",
        "data_wait",
        "grad_norm",
        "steps",
    )

    def __init__(self):
        self.sums: dict[str, Any] = dict.fromkeys(self.KEYS, 0.0)
        self.start = time.perf_counter()

    def add(self, **kw: float | torch.Tensor) -> None:
        """Tensors stay on the device (no GPU sync per step); they are read at report time."""
        for k, v in kw.items():
            self.sums[k] = self.sums[k] + (v.detach().double() if torch.is_tensor(v) else v)

    def values(self, device: torch.device, world_size: int) -> dict[str, float]:
        totals = all_reduce_sum([float(self.sums[k]) for k in self.KEYS], device)
        s = dict(zip(self.KEYS, totals, strict=True))
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        return {
            "loss": s["loss"] / max(s["micro"], 1),
            "mlm_loss": s["mlm_loss"] / max(s["micro"], 1),
            "nsp_loss": s["nsp_loss"] / max(s["micro"], 1),
            "mlm_accuracy": s["mlm_correct"] / max(s["mlm_count"], 1),
            "nsp_accuracy": s["nsp_correct"] / max(s["nsp_count"], 1),
            "grad_norm": s["grad_norm"] / max(s["steps"], 1),
            "tokens_per_s": s["tokens"] / elapsed,
            "sequences_per_s": s["sequences"] / elapsed,
            "data_wait_share": s["data_wait"] / world_size / elapsed,
            "_mean_seq_len": s["padded_tokens"] / max(s["sequences"], 1),
        }
