"""What defines a `bert finetune` run: `FinetuneConfig`, and the command line made from it.

Every field is an option (`--max-seq-length` for `max_seq_length`), typed by its annotation,
with its default and help in the field, so the command line, the MLflow parameters
(`asdict(cfg)`), metrics.json's `config` and Python callers (tests, bench/) cannot drift apart.
A task's subclass adds its own fields and may change defaults (SQuAD: lr 5e-5, length 384).
Booleans are `store_true` flags; `X | None` takes an X; a tuple of floats is a comma list.
"""

from __future__ import annotations

import argparse
import types
import typing
from dataclasses import dataclass, field, fields

INITS = ("pretrained", "random")
# The paper's fine-tuning grid (appendix A.3): "5e-5, 4e-5, 3e-5, 2e-5", best on dev.
PAPER_LEARNING_RATES = (5e-5, 4e-5, 3e-5, 2e-5)


def option(default, help: str, *aliases: str):
    """A config field that is also a command-line option (`--field-name`, plus `aliases`)."""
    return field(default=default, metadata={"help": help, "aliases": aliases})


def float_list(text: str) -> tuple[float, ...] | None:
    """'5e-5,4e-5' -> (5e-05, 4e-05); 'paper' -> the paper's grid; '' or 'none' -> None (no
    sweep: what a pipeline parameter left empty passes)."""
    if text.strip().lower() in ("", "none"):
        return None
    if text.strip() == "paper":
        return PAPER_LEARNING_RATES
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        message = f"expected numbers separated by commas: {text!r}"
        raise argparse.ArgumentTypeError(message) from None


def optional_int(text: str) -> int | None:
    """'2000' -> 2000; '' or 'none' -> None: `-S finetune.max_train_examples=none` in DVC asks
    for the whole training set, as leaving the option out does."""
    if text.strip().lower() in ("", "none"):
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'none': {text!r}") from None


@dataclass
class FinetuneConfig:
    """Fine-tuning hyper-parameters; the defaults are the paper's (section 4.1, appendix A.3)."""

    learning_rate: float = option(2e-5, "peak learning rate", "--lr")
    batch_size: int = option(32, "training batch size")
    epochs: int = option(3, "training epochs; the best one (dev score) is kept")
    warmup_proportion: float = option(0.1, "share of the steps spent warming up")
    max_seq_length: int = option(128, "tokens per input, [CLS] and [SEP] included")
    weight_decay: float = option(0.01, "AdamW weight decay (not on biases and LayerNorm)")
    adam_epsilon: float = option(1e-6, "AdamW epsilon (BERT's; transformers' default is 1e-8)")
    max_grad_norm: float = option(1.0, "gradient clipping norm")
    seed: int = option(42, "seed of the sample, the batch order, the head and dropout")
    max_train_examples: int | None = option(None, "a seeded random sample (CI, quick runs)")
    max_eval_examples: int | None = option(None, "a seeded random sample of the dev set")
    eval_batch_size: int = option(128, "prediction batch size")
    device: str = option("auto", "auto (cuda > mps > cpu), cpu, cuda, ...")
    init: str = option(
        "pretrained", "pretrained: the model folder's weights; random: the same architecture "
        "(its config.json, vocab) from random weights, the control that shows what "
        "pre-training brings",
    )  # fmt: skip
    lr_sweep: tuple[float, ...] | None = option(
        None, "learning rates to try, e.g. 5e-5,4e-5,3e-5,2e-5 ('paper': that grid); each "
        "trial is a nested MLflow run and the best on dev is kept (bert_core.finetune.sweep)",
    )  # fmt: skip
    restarts: int = option(
        1, "seeds per learning rate (--seed, --seed+1, ...): the paper's random restarts on "
        "small data sets; the data sample stays --seed's",
    )  # fmt: skip

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.batch_size < 1 or self.max_seq_length < 8:
            raise ValueError("--epochs and --batch-size must be >= 1, --max-seq-length >= 8")
        if self.init not in INITS:
            raise ValueError(f"--init must be one of {', '.join(INITS)}, not {self.init!r}")
        if self.restarts < 1:
            raise ValueError("--restarts must be >= 1")
        if self.lr_sweep is not None:
            self.lr_sweep = tuple(float(x) for x in self.lr_sweep)
            if not self.lr_sweep or min(self.lr_sweep) <= 0:
                raise ValueError("--lr-sweep needs one or more positive learning rates")

    @property
    def is_sweep(self) -> bool:
        """More than one trial: the run goes through `bert_core.finetune.sweep`."""
        return self.lr_sweep is not None or self.restarts > 1


def _metadata(config_class: type, name: str) -> typing.Mapping:
    """The field's help/aliases: a subclass that only changes a default keeps its parent's."""
    return next(
        k.__dataclass_fields__[name].metadata
        for k in config_class.__mro__
        if name in getattr(k, "__dataclass_fields__", {}) and k.__dataclass_fields__[name].metadata
    )


def config_options(parser: argparse.ArgumentParser, config_class: type[FinetuneConfig]) -> None:
    """One option per field of `config_class`: type from the annotation, the default and help
    from the field."""
    hints, defaults = typing.get_type_hints(config_class), config_class()
    for f in fields(config_class):
        kind = hints[f.name]
        if typing.get_origin(kind) in (typing.Union, types.UnionType):  # `int | None`
            kind = next(a for a in typing.get_args(kind) if a is not type(None))
            kind = optional_int if kind is int else kind
        meta = _metadata(config_class, f.name)
        default = getattr(defaults, f.name)
        names = (f"--{f.name.replace('_', '-')}", *meta["aliases"])
        kw: dict = {"dest": f.name, "default": default, "help": meta["help"].replace("%", "%%")}
        if kind is bool:
            kw["action"] = "store_true"
        else:
            kw["type"] = float_list if typing.get_origin(kind) is tuple else kind
            kw["help"] += " (default: %(default)s)"
        parser.add_argument(*names, **kw)


def config_from_args(args: argparse.Namespace, config_class: type[FinetuneConfig]):
    return config_class(**{f.name: getattr(args, f.name) for f in fields(config_class)})
