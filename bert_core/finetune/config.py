"""What defines a `bert finetune` run: `FinetuneConfig`, and the command line made from it.

Every field is an option (`--max-seq-length` for `max_seq_length`) by the rules of
`bert_core.options`, the generator every command shares. A task's subclass adds its own fields
and may change defaults (SQuAD: lr 5e-5, length 384).
"""

from __future__ import annotations

from dataclasses import dataclass

from bert_core.errors import BadValue
from bert_core.options import comma_list, config_from_args, number, option, optional

__all__ = ["FinetuneConfig", "config_from_args", "float_list", "option"]

INITS = ("pretrained", "random")
# The paper's fine-tuning grid (appendix A.3): "5e-5, 4e-5, 3e-5, 2e-5", best on dev.
PAPER_LEARNING_RATES = (5e-5, 4e-5, 3e-5, 2e-5)


def float_list(text: str) -> tuple[float, ...] | None:
    """'5e-5,4e-5' -> (5e-05, 4e-05); 'paper' -> the paper's grid; '' or 'none' -> None (no
    sweep: what a pipeline parameter left empty passes)."""
    if text.strip() == "paper":
        return PAPER_LEARNING_RATES
    return optional(comma_list(number("positive")))(text)


@dataclass
class FinetuneConfig:
    """Fine-tuning hyper-parameters; the defaults are the paper's (section 4.1, appendix A.3)."""

    learning_rate: float = option(2e-5, "peak learning rate", "--lr", within="positive")
    batch_size: int = option(32, "training batch size")
    epochs: int = option(3, "training epochs; the best one (dev score) is kept")
    warmup_proportion: float = option(0.1, "share of the steps spent warming up", within="share")
    max_seq_length: int = option(128, "tokens per input, [CLS] and [SEP] included")
    weight_decay: float = option(
        0.01, "AdamW weight decay (not on biases and LayerNorm)", within="non-negative"
    )
    adam_epsilon: float = option(
        1e-6, "AdamW epsilon (BERT's; transformers' default is 1e-8)", within="positive"
    )
    max_grad_norm: float = option(1.0, "gradient clipping norm", within="positive")
    seed: int = option(
        42, "seed of the sample, the batch order, the head and dropout", within="non-negative"
    )
    max_train_examples: int | None = option(
        None, "a seeded random sample (CI, quick runs)", within="positive"
    )
    max_eval_examples: int | None = option(
        None, "a seeded random sample of the dev set", within="positive"
    )
    eval_batch_size: int = option(128, "prediction batch size", within="positive")
    device: str = option("auto", "auto (cuda > mps > cpu), cpu, cuda, ...")
    init: str = option(
        "pretrained",
        "pretrained: the model folder's weights; random: the same architecture "
        "(its config.json, vocab) from random weights, the control that shows what "
        "pre-training brings",
    )
    lr_sweep: tuple[float, ...] | None = option(
        None,
        "learning rates to try, e.g. 5e-5,4e-5,3e-5,2e-5 ('paper': that grid); each "
        "trial is a nested MLflow run and the best on dev is kept (bert_core.finetune.sweep)",
        type=float_list,
    )
    restarts: int = option(
        1,
        "seeds per learning rate (--seed, --seed+1, ...): the paper's random restarts on "
        "small data sets; the data sample stays --seed's",
    )
    top_bilstm: bool = option(
        False,
        "Table 5's '+ BiLSTM': a randomly initialised BiLSTM between the encoder and the "
        "task's head, trained with it (the paper's aid to a left-to-right model, which lacks "
        "right-hand context); kept in the model's config.json",
    )

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.batch_size < 1 or self.max_seq_length < 8:
            raise BadValue("--epochs and --batch-size must be >= 1, --max-seq-length >= 8")
        if self.init not in INITS:
            raise BadValue(f"--init must be one of {', '.join(INITS)}, not {self.init!r}")
        if self.restarts < 1:
            raise BadValue("--restarts must be >= 1")
        if self.lr_sweep is not None:
            self.lr_sweep = tuple(float(x) for x in self.lr_sweep)
            if not self.lr_sweep or min(self.lr_sweep) <= 0:
                raise BadValue("--lr-sweep needs one or more positive learning rates")

    @property
    def is_sweep(self) -> bool:
        """More than one trial: the run goes through `bert_core.finetune.sweep`."""
        return self.lr_sweep is not None or self.restarts > 1
