"""What defines a `bert pretrain` run: the `PretrainConfig` dataclass, and the CLI made from it.

One set of defaults: every field is the option `--field-name`, by the rules of
`bert_core.options` (the generator every command shares), with the field's default and help,
so the command line, the MLflow parameters (`asdict(cfg)`) and Python callers (tests,
bench/pretrain.py) cannot drift apart.
"""

from __future__ import annotations

import argparse
from dataclasses import MISSING, dataclass
from typing import Any

from bert_core.data.masking import DEFAULT_RECIPE, MaskingRecipe
from bert_core.errors import BertError
from bert_core.options import add_options, config_from_args, option

# The paper's objective (masked LM + next sentence) and Table 5's ablations: "No NSP" (mlm),
# the left-to-right LM "LTR & No NSP" (ltr: causal attention, next-token prediction) and LTR
# with NSP, which the paper does not train.
OBJECTIVES = ("mlm+nsp", "mlm", "ltr", "ltr+nsp")
# `bert_core.model.optim.OPTIMIZERS`: the original's optimiser and schedule, or transformers'
OPTIMIZERS = ("bert", "adamw")


# What a run writes into OUTPUT beside `model/`: the metric histories and the exports along the
# way; copied out of an s3:// staging folder (`command`) and out of a Ray job's own output
# (`ray_jobs.fetch_outputs`) by this one list.
OUTPUT_FILES = ("pretrain_metrics.csv", "heldout_metrics.csv", "exports")


@dataclass
class PretrainConfig:
    """Everything that defines a pre-training run (logged to MLflow as parameters)."""

    instances: str = option(MISSING, "folder of shard-*.parquet and vocab.txt (or s3://)")
    output: str = option(MISSING, "run folder: model/, pretrain_metrics.csv")
    preset: str = option(
        "tiny",
        "model size: tiny/mini/small/medium/base/large (L/H/A: "
        "2/128/2, 4/256/4, 4/512/8, 8/512/8, 12/768/12, 24/1024/16)",
    )
    num_layers: int = option(0, "Transformer layers L; 0: the preset's")
    hidden_size: int = option(0, "hidden size H; 0: the preset's")
    num_heads: int = option(0, "attention heads A (must divide H); 0: the preset's")
    intermediate_size: int = option(0, "feed-forward size; 0: 4H, the paper's")
    steps: int = option(1000, "optimizer steps in the whole run")
    batch_size: int = option(
        256, "global batch: sequences per optimizer step, all workers and accumulation together"
    )
    num_workers: int = option(1, "Ray Train workers")
    use_gpu: bool = option(False, "one GPU per worker, bf16 autocast")
    cpus_per_worker: int = option(1, "CPUs (and torch threads) per worker")
    grad_accum: int = option(1, "gradient accumulation steps")
    learning_rate: float = option(1e-4, "peak learning rate", within="positive")
    warmup_steps: int | None = option(None, "linear warm-up steps (default: 1% of --steps)")
    weight_decay: float = option(
        0.01, "AdamW weight decay (not on LayerNorm weights and biases)", within="non-negative"
    )
    adam_betas: tuple[float, float] = option(
        (0.9, 0.999), "AdamW betas", metavar=("B1", "B2"), within="share"
    )
    adam_eps: float = option(1e-6, "AdamW epsilon", within="positive")
    optimizer: str = option(
        "bert",
        "bert: the original's Adam without bias correction and its schedule (linear decay from "
        "step 0, 1 - t/T; the warm-up replaces it while warming up); adamw: torch's AdamW and "
        "transformers' schedule (decay after the warm-up, (T - t)/(T - w)). docs/fidelity.md",
        choices=OPTIMIZERS,
    )
    max_grad_norm: float = option(1.0, "gradient clipping (global norm)", within="positive")
    dropout: float | None = option(
        None, "override the preset's dropout (hidden and attention)", within="share"
    )
    dynamic_masking: bool = option(False, "re-mask on every read (RoBERTa)")
    # dynamic masking: each default is the instances' own (`pretrain.data.dynamic_masking`)
    masked_lm_prob: float | None = option(
        None,
        "dynamic masking: share of the tokens predicted (default: the instances' own, "
        "from their stats.json)",
        within="share",
    )
    max_predictions_per_seq: int | None = option(
        None, "dynamic masking: predictions per sequence, at most (default: the instances' own)"
    )
    masking_recipe: str | None = option(
        None,
        "dynamic masking: predictions shown as [MASK]/random/unchanged, percent (default: "
        f"the instances' own, else {DEFAULT_RECIPE})",
    )
    objective: str = option(
        "mlm+nsp",
        "training loss: mlm+nsp (the paper's); mlm (its 'No NSP' ablation, Table 5: the NSP "
        "head and pooler are frozen; NSP accuracy is still reported); ltr (Table 5's 'LTR & No "
        "NSP': causal attention, each token predicts the next, the model stays left-to-right "
        "when fine-tuned; the mlm_* metrics then hold the next-token loss); ltr+nsp",
        choices=OBJECTIVES,
    )
    eval_every: int | None = option(
        None,
        "held-out evaluation every this many steps, and at the start and end "
        "(default: --log-every, so the held-out curve has a point wherever the training one does)",
    )
    eval_sequences: int = option(1024, "held-out sequences evaluated, at most (the first ones)")
    init_model: str | None = option(None, "start from this model (phase two)")
    compile: bool = option(False, "torch.compile the model")
    seed: int = option(12345, "seed of the initial weights, data order and dropout")
    log_every: int = option(50, "metrics (MLflow, CSV, progress bar) every this many steps")
    checkpoint_every: int = option(500, "Ray checkpoint every this many steps (and at the end)")
    keep_checkpoints: int = option(3, "Ray checkpoints kept")
    export_every: int = option(
        0,
        "also a loadable model every this many steps, OUTPUT/exports/step-N (Hugging Face "
        "layout; kept, unlike checkpoints): fine-tune from each for the paper's Figure 2; 0: none",
    )
    export_steps: tuple[int, ...] = option((), "and at these steps (comma list)")
    max_failures: int = option(3, "worker restarts before giving up")
    storage_path: str | None = option(None, "Ray checkpoints (default OUTPUT/ray; s3:// allowed)")
    run_name: str = option("pretrain", "Ray run name: the same storage path and name resume")
    stop_after: int | None = option(None, "stop after this step, with a checkpoint (resumable)")
    peak_tflops: float | None = option(
        None, "GPU peak TFLOP/s for MFU (known GPUs: looked up)", within="positive"
    )
    inject_failure_at: int | None = option(None, argparse.SUPPRESS)  # tests: raise once here

    def __post_init__(self):
        self.adam_betas = tuple(float(b) for b in self.adam_betas)  # argparse gives a list
        self.export_steps = tuple(int(s) for s in self.export_steps)  # JSON (Ray) gives a list

    def shape(self) -> dict[str, int]:
        """The model's size fields: --preset's, each shape option given in its place."""
        from bert_core.model.config import shape

        return shape(
            self.preset, self.num_layers, self.hidden_size, self.num_heads, self.intermediate_size
        )

    def exports_at(self, step: int) -> bool:
        """Is a model exported after this step (--export-every, --export-steps)?"""
        return bool(self.export_every and step % self.export_every == 0) or (
            step in self.export_steps
        )

    @property
    def left_to_right(self) -> bool:
        """A left-to-right LM (Table 5's LTR): causal attention, next-token labels."""
        return self.objective.startswith("ltr")

    @property
    def with_nsp(self) -> bool:
        """Is next sentence prediction in the loss?"""
        return self.objective.endswith("+nsp")

    @property
    def micro_batch(self) -> int:
        return self.batch_size // (self.num_workers * self.grad_accum)

    @property
    def warmup(self) -> int:
        """Warm-up steps: --warmup-steps, else 1% of the steps (the paper's 10k of 1M)."""
        return self.warmup_steps if self.warmup_steps is not None else max(1, self.steps // 100)

    @property
    def eval_interval(self) -> int:
        """Steps between held-out evaluations: --eval-every, else --log-every (MLflow's held-out
        curve then has a point at every logged step, not only at checkpoints)."""
        return self.eval_every or self.log_every

    @property
    def heldout(self) -> str:
        """The held-out instances (`bert instances` writes them beside the training shards)."""
        return f"{self.instances.rstrip('/')}/heldout"

    def masking_options(self) -> dict[str, Any]:
        """Dynamic masking's options as given (None: the instances' own applies)."""
        names = ("masked_lm_prob", "max_predictions_per_seq", "masking_recipe")
        return {name: getattr(self, name) for name in names}

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
        if [s for s in self.export_steps if not 1 <= s <= self.steps]:
            raise BertError(f"--export-steps must be within 1..--steps ({self.steps})")
        if self.export_every < 0:
            raise BertError("--export-every must be >= 1, or 0 for none")
        for name in (
            "log_every",
            "checkpoint_every",
            "eval_every",
            "eval_sequences",
            "max_predictions_per_seq",
            "keep_checkpoints",
            "cpus_per_worker",
            "stop_after",
        ):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise BertError(f"--{name.replace('_', '-')} must be >= 1")
        for name in ("warmup_steps", "max_failures", "seed"):  # 0: none, none, a seed
            value = getattr(self, name)
            if value is not None and value < 0:
                raise BertError(f"--{name.replace('_', '-')} must be >= 0")
        from bert_core.model.config import PRESETS, BertConfig

        if self.preset not in PRESETS:
            raise BertError(f"--preset must be one of {', '.join(PRESETS)}, not {self.preset!r}")
        sizes = {
            "--num-layers": self.num_layers,
            "--hidden-size": self.hidden_size,
            "--num-heads": self.num_heads,
            "--intermediate-size": self.intermediate_size,
        }
        if min(sizes.values()) < 0:
            raise BertError(f"{', '.join(sizes)} must be >= 1, or 0 for the preset's")
        given = [name for name, value in sizes.items() if value]
        if given and self.init_model:
            raise BertError(
                f"{', '.join(given)}: --init-model {self.init_model} has its own "
                "shape (its config.json); leave them 0"
            )
        try:
            BertConfig(**self.shape())
        except ValueError as e:  # heads that do not divide the hidden size
            raise BertError(f"--hidden-size / --num-heads: {e}") from None
        if self.objective not in OBJECTIVES:
            raise BertError(f"--objective must be one of {', '.join(OBJECTIVES)}")
        if self.left_to_right and self.dynamic_masking:
            raise BertError(
                f"--dynamic-masking masks for the masked LM; --objective {self.objective} "
                "predicts the next token of the unmasked text"
            )
        if self.optimizer not in OPTIMIZERS:
            raise BertError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}")
        if self.masking_recipe is not None:
            MaskingRecipe.parse(self.masking_recipe)  # a bad recipe raises ValueError


def build_parser() -> argparse.ArgumentParser:
    """`bert pretrain`'s options: one per `PretrainConfig` field."""
    p = argparse.ArgumentParser(
        prog="bert pretrain", description="Pre-train BERT (MLM + NSP) with Ray Train."
    )
    add_options(p, PretrainConfig)
    return p


def parse_args(argv: list[str] | None = None) -> PretrainConfig:
    return config_from_args(build_parser().parse_args(argv), PretrainConfig)
