"""What defines a `bert pretrain` run: the `PretrainConfig` dataclass, and the CLI made from it.

One set of defaults: every field is the option `--field-name`, typed by its annotation, with the
field's default and the help in its `metadata`, so the command line, the MLflow parameters
(`asdict(cfg)`) and Python callers (tests, bench/pretrain.py) cannot drift apart. Booleans are
`store_true` flags, tuples take as many values as they have items, `X | None` takes an X.
"""

from __future__ import annotations

import argparse
import types
import typing
from dataclasses import MISSING, Field, dataclass, field, fields

from bert_core.data.masking import DEFAULT_RECIPE, MaskingRecipe
from bert_core.errors import BertError

# The paper's objective (masked LM + next sentence) and its "No NSP" ablation (Table 5).
OBJECTIVES = ("mlm+nsp", "mlm")


def _opt(default: typing.Any, help: str, **argparse_kw: typing.Any) -> typing.Any:
    return field(default=default, metadata={"help": help, **argparse_kw})


@dataclass
class PretrainConfig:
    """Everything that defines a pre-training run (logged to MLflow as parameters)."""

    instances: str = field(metadata={"help": "folder of shard-*.parquet and vocab.txt (or s3://)"})
    output: str = field(metadata={"help": "run folder: model/, pretrain_metrics.csv"})
    preset: str = _opt("tiny", "model size: tiny/mini/small/medium/base/large")
    steps: int = _opt(1000, "optimizer steps in the whole run")
    batch_size: int = _opt(
        256, "global batch: sequences per optimizer step, all workers and accumulation together"
    )
    num_workers: int = _opt(1, "Ray Train workers")
    use_gpu: bool = _opt(False, "one GPU per worker, bf16 autocast")
    cpus_per_worker: int = _opt(1, "CPUs (and torch threads) per worker")
    grad_accum: int = _opt(1, "gradient accumulation steps")
    learning_rate: float = _opt(1e-4, "peak learning rate")
    warmup_steps: int | None = _opt(None, "linear warm-up steps (default: 1% of --steps)")
    weight_decay: float = _opt(0.01, "AdamW weight decay (not on LayerNorm weights and biases)")
    adam_betas: tuple[float, float] = _opt((0.9, 0.999), "AdamW betas", metavar=("B1", "B2"))
    adam_eps: float = _opt(1e-6, "AdamW epsilon")
    max_grad_norm: float = _opt(1.0, "gradient clipping (global norm)")
    dropout: float | None = _opt(None, "override the preset's dropout (hidden and attention)")
    dynamic_masking: bool = _opt(False, "re-mask on every read (RoBERTa)")
    masked_lm_prob: float = _opt(0.15, "dynamic masking: share of the tokens predicted")
    max_predictions_per_seq: int = _opt(20, "dynamic masking: predictions per sequence, at most")
    masking_recipe: str = _opt(
        DEFAULT_RECIPE, "dynamic masking: predictions shown as [MASK]/random/unchanged, percent"
    )
    objective: str = _opt(
        "mlm+nsp",
        "training loss: mlm+nsp (the paper's) or mlm (its 'No NSP' ablation, Table 5: the NSP "
        "head and pooler are frozen; NSP accuracy is still reported)",
        choices=OBJECTIVES,
    )
    eval_every: int | None = _opt(
        None,
        "held-out evaluation every this many steps, and at the start and end "
        "(default: --checkpoint-every)",
    )
    eval_sequences: int = _opt(1024, "held-out sequences evaluated, at most (the first ones)")
    init_model: str | None = _opt(None, "start from this model (phase two)")
    compile: bool = _opt(False, "torch.compile the model")
    seed: int = _opt(12345, "seed of the initial weights, data order and dropout")
    log_every: int = _opt(50, "metrics (MLflow, CSV, progress bar) every this many steps")
    checkpoint_every: int = _opt(500, "Ray checkpoint every this many steps (and at the end)")
    keep_checkpoints: int = _opt(3, "Ray checkpoints kept")
    max_failures: int = _opt(3, "worker restarts before giving up")
    storage_path: str | None = _opt(None, "Ray checkpoints (default OUTPUT/ray; s3:// allowed)")
    run_name: str = _opt("pretrain", "Ray run name: the same storage path and name resume")
    stop_after: int | None = _opt(None, "stop after this step, with a checkpoint (resumable)")
    peak_tflops: float | None = _opt(None, "GPU peak TFLOP/s for MFU (known GPUs: looked up)")
    inject_failure_at: int | None = _opt(None, argparse.SUPPRESS)  # tests: raise once here

    def __post_init__(self):
        self.adam_betas = tuple(float(b) for b in self.adam_betas)  # argparse gives a list

    @property
    def micro_batch(self) -> int:
        return self.batch_size // (self.num_workers * self.grad_accum)

    @property
    def warmup(self) -> int:
        """Warm-up steps: --warmup-steps, else 1% of the steps (the paper's 10k of 1M)."""
        return self.warmup_steps if self.warmup_steps is not None else max(1, self.steps // 100)

    @property
    def eval_interval(self) -> int:
        """Steps between held-out evaluations: --eval-every, else --checkpoint-every."""
        return self.eval_every or self.checkpoint_every

    @property
    def heldout(self) -> str:
        """The held-out instances (`bert instances` writes them beside the training shards)."""
        return f"{self.instances.rstrip('/')}/heldout"

    @property
    def vocab_file(self) -> str:
        """The instances' vocab.txt (`bert instances` copies it there; local or s3://)."""
        return f"{self.instances.rstrip('/')}/vocab.txt"

    def validate(self) -> None:
        if self.steps < 1 or self.batch_size < 1 or self.num_workers < 1 or self.grad_accum < 1:
            raise BertError("--steps, --batch-size, --num-workers, --grad-accum must be >= 1")
        if self.batch_size % (self.num_workers * self.grad_accum):
            raise BertError(
                f"--batch-size {self.batch_size} is not divisible by --num-workers x "
                f"--grad-accum = {self.num_workers * self.grad_accum}"
            )
        for name in ("log_every", "checkpoint_every", "eval_every", "eval_sequences"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise BertError(f"--{name.replace('_', '-')} must be >= 1")
        from bert_core.model.config import PRESETS

        if self.preset not in PRESETS:
            raise BertError(f"--preset must be one of {', '.join(PRESETS)}, not {self.preset!r}")
        if self.objective not in OBJECTIVES:
            raise BertError(f"--objective must be one of {', '.join(OBJECTIVES)}")
        MaskingRecipe.parse(self.masking_recipe)  # a bad recipe raises ValueError


def build_parser() -> argparse.ArgumentParser:
    """`bert pretrain`'s options: one per `PretrainConfig` field."""
    p = argparse.ArgumentParser(
        prog="bert pretrain", description="Pre-train BERT (MLM + NSP) with Ray Train."
    )
    hints = typing.get_type_hints(PretrainConfig)
    for f in fields(PretrainConfig):
        p.add_argument(f"--{f.name.replace('_', '-')}", **_argument(f, hints[f.name]))
    return p


def _argument(f: Field, hint: typing.Any) -> dict[str, typing.Any]:
    """argparse keywords for one field: type from the annotation, default and help from it."""
    help_ = f.metadata["help"]
    extra = {k: v for k, v in f.metadata.items() if k != "help"}  # e.g. metavar
    if f.default is MISSING:
        return {"required": True, "type": hint, "help": help_, **extra}
    if typing.get_origin(hint) in (typing.Union, types.UnionType):  # X | None
        (hint,) = [a for a in typing.get_args(hint) if a is not type(None)]
    if help_ is not argparse.SUPPRESS:
        help_ = help_.replace("%", "%%")  # argparse formats help with %
        if f.default is not None and hint is not bool:
            help_ += " (default: %(default)s)"
    if hint is bool:
        if f.default is not False:
            raise TypeError(f"{f.name}: a flag must default to False")
        return {"action": "store_true", "help": help_, **extra}
    if typing.get_origin(hint) is tuple:
        (item,) = set(typing.get_args(hint))  # one item type: `type=` converts each value
        n = len(typing.get_args(hint))
        return {"type": item, "nargs": n, "default": f.default, "help": help_, **extra}
    return {"type": hint, "default": f.default, "help": help_, **extra}


def parse_args(argv: list[str] | None = None) -> PretrainConfig:
    args = build_parser().parse_args(argv)
    return PretrainConfig(**{f.name: getattr(args, f.name) for f in fields(PretrainConfig)})
