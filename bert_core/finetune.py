"""`bert finetune`: fine-tune a BERT on one task (GLUE, CoNLL-2003 NER, SQuAD), one engine.

The recipe is the paper's (section 4, appendix A.3) and the same for every task: a task head on
the pre-trained encoder, AdamW (no weight decay on biases and LayerNorm, `bert_core.optim`),
linear warm-up over the first 10 % of steps then linear decay to zero, gradient clipping at 1.0,
dynamic padding (a batch is padded only to its longest sequence: most of the speed on a CPU),
bf16 autocast on GPUs. The dev set is scored after every epoch and the best epoch (by the task's
score) is the one kept, written and reported.

This module is the engine: the configuration and the parser generated from it, the tokenizer
(`bert_core.tokenizer`'s), the training loop (`fit`), the length-sorted prediction loop
(`predict_batches`), the model loader (label names into config.json) and the run itself, from
reading the input to metrics.json and MLflow (`finetune`). A task holds only what is its own:
reading its data, featurisation, collate, decoding, metrics and output files: a `FinetuneTask`
subclass in `bert_core.finetune_glue`, `bert_core.ner` or `bert_core.squad`, found by name in
`TASKS` and imported only when run.

Output (atomic: all or nothing): `model/` (HF layout, label names in config.json, the vocab),
`metrics.json` (`task, metrics, score, best_epoch, epochs, config` and the task's counts: all
`bert evaluate` needs) and the task's prediction files.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import sys
import time
import types
import typing
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np
import torch

from bert_core import glue, optim
from bert_core.errors import InputError, atomic_dir

# Every task `bert finetune` runs: exact name -> "module:class" of its `FinetuneTask`, imported
# only when that task runs (the task modules import this one, never the other way round).
# GLUE names are also found forgiving case and dashes (`sst2`, `mnli`), as `glue.get_task`.
TASKS: dict[str, str] = {
    **dict.fromkeys(glue.TASKS, "bert_core.finetune_glue:GlueFinetune"),
    "conll2003": "bert_core.ner:NerFinetune",
    "squad": "bert_core.squad:SquadFinetune",
    "squad_v2": "bert_core.squad:SquadFinetune",
}
MODEL_INPUTS = ("input_ids", "token_type_ids", "attention_mask")  # a batch's non-target keys


def option(default, help: str, *aliases: str):
    """A config field that is also a command-line option (`--field-name`, plus `aliases`)."""
    return field(default=default, metadata={"help": help, "aliases": aliases})


@dataclass
class FinetuneConfig:
    """Fine-tuning hyper-parameters; the defaults are the paper's (section 4.1, appendix A.3).

    Every field is a `bert finetune` option (`--max-seq-length` for `max_seq_length`): a task's
    subclass adds its own fields and may change defaults (SQuAD: lr 5e-5, length 384)."""

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

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.batch_size < 1 or self.max_seq_length < 8:
            raise ValueError("--epochs and --batch-size must be >= 1, --max-seq-length >= 8")


def config_options(parser: argparse.ArgumentParser, config_class: type[FinetuneConfig]) -> None:
    """One option per field of `config_class`: type from the annotation, the default and help
    from the field (a subclass that only changes a default keeps its parent's help)."""
    hints, defaults = typing.get_type_hints(config_class), config_class()
    for f in fields(config_class):
        kind = hints[f.name]
        if typing.get_origin(kind) in (typing.Union, types.UnionType):  # `int | None`: an int
            kind = next(a for a in typing.get_args(kind) if a is not type(None))
        meta = next(
            k.__dataclass_fields__[f.name].metadata
            for k in config_class.__mro__
            if f.name in getattr(k, "__dataclass_fields__", {})
            and k.__dataclass_fields__[f.name].metadata
        )
        parser.add_argument(
            f"--{f.name.replace('_', '-')}", *meta["aliases"], dest=f.name, type=kind,
            default=getattr(defaults, f.name), help=f"{meta['help']} (default: %(default)s)",
        )  # fmt: skip


def config_from_args(args: argparse.Namespace, config_class: type[FinetuneConfig]):
    return config_class(**{f.name: getattr(args, f.name) for f in fields(config_class)})


# ---------------------------------------------------------------------------------------------
# Tasks


class FinetuneTask:
    """One task as the engine sees it; a subclass holds only what is the task's own.

    The engine calls, in order: `prepare` (read, sample and featurise train and dev: every input
    error surfaces here, before any training), `train_batch` per step, `evaluate` per epoch,
    then `write_outputs` and `summary` for the best epoch.
    """

    config_class: type[FinetuneConfig] = FinetuneConfig
    model_class = "BertForSequenceClassification"  # a head class of `bert_core.heads`
    replace_mismatched_head = False  # a checkpoint head of another shape: replaced, not an error
    download_help: str | None = None  # set: `--download` fetches the data when missing

    def __init__(self, name: str):
        self.name = name  # as in metrics.json, MLflow and `bert evaluate`
        self.labels: Sequence[str] | None = None  # label names (config.json); None: no names
        self.num_labels = 2
        self.num_train = 0  # training rows (windows) the batches are drawn from
        self.num_train_examples = 0  # examples (sentences, questions) they come from

    def download(self, data_dir: Path) -> None:
        """Fetch the task's data into `data_dir` when it is not there (`--download`)."""
        raise NotImplementedError

    def prepare(self, data_dir: Path, tokenizer, cfg) -> dict:
        """Read, sample and featurise; returns the counts logged as run parameters."""
        raise NotImplementedError

    def train_batch(self, index: np.ndarray) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def evaluate(self, model, device: torch.device, cfg) -> tuple[dict, float, object]:
        """(dev metrics, score the best epoch is chosen by, predictions)."""
        raise NotImplementedError

    def write_outputs(self, out: Path, model, predictions, device: torch.device, cfg) -> None:
        """The task's prediction files for the best epoch (the model is saved by the engine)."""

    def summary(self, best: dict) -> dict:
        """The task's own metrics.json fields (counts, files, detailed metrics)."""
        return {}


def load_task(name: str) -> FinetuneTask:
    """The task object for `--task`: exact names first, then GLUE's forgiving lookup."""
    if name not in TASKS:
        name = glue.get_task(name).name  # unknown: "unknown GLUE task ..." with the known ones
    module, cls = TASKS[name].split(":")
    return getattr(importlib.import_module(module), cls)(name)


# ---------------------------------------------------------------------------------------------
# Data


def load_tokenizer(model_dir: str | Path):
    """The model folder's tokenizer: `bert_core.tokenizer`'s, on its vocab.txt (casing from
    tokenizer_config.json's `do_lower_case`; lowercase when absent, as uncased BERT)."""
    from bert_core.tokenizer import load_tokenizer as wordpiece

    model_dir = Path(model_dir)
    vocab = model_dir / "vocab.txt"
    if not vocab.is_file():
        raise InputError(model_dir, "no vocab.txt: the model folder must carry its vocabulary")
    lowercase = True
    config = model_dir / "tokenizer_config.json"
    if config.is_file():
        lowercase = bool(json.loads(config.read_text()).get("do_lower_case", True))
    tokenizer = wordpiece(vocab, lowercase)
    missing = [t for t in ("[CLS]", "[SEP]", "[PAD]", "[UNK]") if tokenizer.token_to_id(t) is None]
    if missing:
        raise InputError(vocab, f"special tokens {missing} not in the vocabulary")
    return tokenizer


def sample(examples: list, n: int | None, seed: int) -> list:
    """A seeded random subset of `n` examples in file order (all of them when n is None)."""
    if n is None or n >= len(examples):
        return examples
    if n < 1:
        raise ValueError(f"cannot sample {n} examples")
    keep = np.sort(np.random.default_rng(seed).choice(len(examples), size=n, replace=False))
    return [examples[i] for i in keep]


def train_batches(n: int, batch_size: int, epoch: int, seed: int) -> Iterator[np.ndarray]:
    """Shuffled mini-batches of indices, different and reproducible every epoch."""
    order = np.random.default_rng([seed, epoch]).permutation(n)
    for start in range(0, n, batch_size):
        yield order[start : start + batch_size]


def pad(rows: Sequence[np.ndarray], index: Sequence[int], fill: int = 0) -> torch.Tensor:
    """rows[i] for i in index as one int64 batch, right-padded with `fill` to the longest."""
    out = np.full((len(index), max(len(rows[i]) for i in index)), fill, dtype=np.int64)
    for row, i in enumerate(index):
        out[row, : len(rows[i])] = rows[i]
    return torch.from_numpy(out)


def padding_mask(rows: Sequence[np.ndarray], index: Sequence[int]) -> torch.Tensor:
    """The attention_mask of `pad(rows, index)`: 1 = token, 0 = padding."""
    lengths = torch.tensor([len(rows[i]) for i in index])
    return (torch.arange(int(lengths.max()))[None] < lengths[:, None]).long()


# ---------------------------------------------------------------------------------------------
# Model, optimisation, the loops


def load_model(task: FinetuneTask, model_dir: str | Path):
    """The encoder of any HF-layout BERT folder under the task's head, with the task's label
    names in its config. A head already in the checkpoint is kept when it fits (continuing a
    run); with `task.replace_mismatched_head` one of another shape is replaced by a fresh one
    (e.g. an MNLI model fine-tuned on STS-B), as transformers' `ignore_mismatched_sizes`."""
    from bert_core import heads
    from bert_core import model as bert

    model_dir = Path(model_dir)
    if not (model_dir / bert.CONFIG_NAME).is_file():
        raise FileNotFoundError(f"{model_dir}: no {bert.CONFIG_NAME} (not a BERT model folder)")
    config = bert.BertConfig.from_json_file(
        model_dir / bert.CONFIG_NAME, num_labels=task.num_labels, finetuning_task=task.name,
        id2label=dict(enumerate(task.labels)) if task.labels else None,
    )  # fmt: skip
    model = getattr(heads, task.model_class)(config)
    state = bert.load_state_dict(model_dir)
    if task.replace_mismatched_head:
        own = model.state_dict()
        state = {
            k: v
            for k, v in state.items()
            if not (k.startswith(bert.HEAD_PREFIXES) and k in own and own[k].shape != v.shape)
        }
    model.load_checkpoint_state(state, source=str(model_dir))
    model.vocab_file = model_dir / "vocab.txt"
    return model


def build_optimizer(model: torch.nn.Module, cfg: FinetuneConfig, total_steps: int):
    """(AdamW, linear warm-up/decay schedule) over `total_steps`, as `bert_core.optim` builds
    them for pre-training too."""
    optimizer = optim.adamw(model, cfg.learning_rate, cfg.weight_decay, cfg.adam_epsilon)
    warmup = int(cfg.warmup_proportion * total_steps)
    return optimizer, optim.linear_schedule(optimizer, warmup, total_steps)


@torch.inference_mode()
def predict_batches(
    model, lengths: Sequence[int], make_batch: Callable[[np.ndarray], dict],
    device: torch.device, batch_size: int,
) -> Iterator[tuple[np.ndarray, typing.Any]]:  # fmt: skip
    """The prediction loop of every task: examples in length-sorted batches (least padding),
    yielding (index, model outputs) where `index` holds the batch rows' positions in the input.

    `make_batch(index)` may include targets; only `MODEL_INPUTS` reach the model.
    """
    model.eval()
    order = np.argsort(lengths, kind="stable")
    for start in range(0, len(order), batch_size):
        index = order[start : start + batch_size]
        batch = {k: v.to(device) for k, v in make_batch(index).items() if k in MODEL_INPUTS}
        with optim.autocast(device):
            outputs = model(**batch)
        yield index, outputs


def fit(
    model: torch.nn.Module,
    num_train: int,
    make_batch: Callable[[np.ndarray], dict[str, torch.Tensor]],
    evaluate: Callable[[torch.nn.Module], tuple[dict, float, object]],
    cfg,
    device: torch.device,
    desc: str,
    log_metrics: Callable[..., None] | None = None,
) -> tuple[dict, list[dict], float]:
    """The fine-tuning loop of every task: `cfg.epochs` epochs with the paper's optimizer,
    schedule and clipping, dev scored after each epoch, and the best epoch's weights loaded
    back into `model`.

    `evaluate(model) -> (metrics, score, predictions)`. Returns (best epoch's record with its
    predictions under "preds", all epochs' records, training seconds). Per-epoch metrics go to
    `log_metrics` (`mlflow.log_metrics` in the CLI; None in the benchmarks, which run without
    MLflow). Works for any model whose forward takes the batch and returns `.loss`.
    (Over 60 lines: one loop, read top to bottom, is clearer than pieces.)
    """
    from tqdm import tqdm

    total_steps = math.ceil(num_train / cfg.batch_size) * cfg.epochs
    optimizer, scheduler = build_optimizer(model, cfg, total_steps)
    history: list[dict] = []
    best: dict | None = None
    interactive = sys.stderr.isatty()  # in a log: a line every 30 s
    bar = tqdm(total=total_steps, desc=desc, unit="step", ascii=not interactive,
               mininterval=0.1 if interactive else 30.0)  # fmt: skip
    train_seconds = 0.0  # evaluation is not training time
    for epoch in range(1, cfg.epochs + 1):
        start = time.perf_counter()
        model.train()
        losses = []
        for index in train_batches(num_train, cfg.batch_size, epoch, cfg.seed):
            batch = {k: v.to(device) for k, v in make_batch(index).items()}
            with optim.autocast(device):
                loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            bar.update()
            bar.set_postfix(epoch=epoch, loss=f"{losses[-1]:.4f}", refresh=False)
        train_seconds += time.perf_counter() - start
        metrics, score, preds = evaluate(model)
        record = {
            "epoch": epoch,
            "train_loss": float(np.mean(losses)),
            "metrics": metrics,
            "score": score,
            "train_seconds": train_seconds,
        }
        history.append(record)
        flat = numeric(metrics)
        if log_metrics is not None:
            log_metrics(
                {"train_loss": record["train_loss"], "dev_score": score}
                | {f"dev_{k}": v for k, v in flat.items()},
                step=epoch,
            )
        bar.write(f"epoch {epoch}: train_loss {record['train_loss']:.4f} dev {flat}")
        if best is None or score > best["score"]:
            state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
            best = {**record, "state": state, "preds": preds}
    bar.close()
    model.load_state_dict(best.pop("state"))
    return best, history, train_seconds


def numeric(metrics: dict) -> dict:
    """The plain numbers of a metrics dict (NER's nested per-type table left out)."""
    return {k: v for k, v in metrics.items() if isinstance(v, int | float)}


# ---------------------------------------------------------------------------------------------
# The run


def finetune(
    task: FinetuneTask, data_dir: str | Path, model_dir: str | Path, output: str | Path, cfg,
) -> dict:  # fmt: skip
    """Fine-tune, keep the best epoch, write the output folder; returns metrics.json's content."""
    from bert_core.tracking import start_run

    # Everything that can be wrong with the input fails here, before any training.
    tokenizer = load_tokenizer(model_dir)
    counts = task.prepare(Path(data_dir), tokenizer, cfg)
    device = optim.resolve_device(cfg.device)
    torch.manual_seed(cfg.seed)
    model = load_model(task, model_dir)
    if cfg.max_seq_length > model.config.max_position_embeddings:
        raise ValueError(
            f"max_seq_length {cfg.max_seq_length} exceeds the model's max_position_embeddings "
            f"{model.config.max_position_embeddings}"
        )
    model.to(device)

    params = {"task": task.name, "data": str(data_dir), "model": str(model_dir), **asdict(cfg)}
    params |= counts | {"device": str(device)}
    with start_run(f"finetune-{task.name}", params), atomic_dir(output) as tmp:
        import mlflow

        best, history, train_seconds = fit(
            model, task.num_train, task.train_batch, lambda m: task.evaluate(m, device, cfg),
            cfg, device, f"finetune {task.name}", mlflow.log_metrics,
        )  # fmt: skip
        result = {
            "task": task.name,
            "metrics": numeric(best["metrics"]),
            "score": best["score"],
            "best_epoch": best["epoch"],
            "epochs": history,
            "config": asdict(cfg),
            **task.summary(best),
            "train_seconds": train_seconds,
            "train_examples_per_second": task.num_train_examples * cfg.epochs / train_seconds,
            "model": str(model_dir),
            "data": str(data_dir),
            "device": str(device),
        }
        model.save_pretrained(tmp / "model")  # label names and task in config.json
        task.write_outputs(tmp, model, best["preds"], device, cfg)
        finish(tmp, result)
    return result


def finish(out: Path, result: dict) -> None:
    """The end of every run: metrics.json, and the best epoch's metrics and that file in the
    open MLflow run; the model logged as an MLflow model and registered (`bert_core.registry`)."""
    import mlflow

    (out / "metrics.json").write_text(json.dumps(result, indent=2) + "\n")
    mlflow.log_metrics({"best_epoch": result["best_epoch"], "best_dev_score": result["score"]})
    mlflow.log_metrics({f"best_dev_{k}": v for k, v in result["metrics"].items()})
    mlflow.log_artifact(str(out / "metrics.json"))
    from bert_core.registry import log_finetuned  # the model as an MLflow model, registered

    log_finetuned(out, result)


def build_parser(task: FinetuneTask | None = None) -> argparse.ArgumentParser:
    """`bert finetune`'s options: the run's, the task's config fields, `--download` when the
    task can fetch its data. Without a task: the GLUE (base) options."""
    p = argparse.ArgumentParser(prog="bert finetune", description=__doc__.split("\n")[0])
    tasks = ", ".join(TASKS)
    p.add_argument("--task", required=True, help=f"one of {tasks} (GLUE: any case)")
    p.add_argument("--data", required=True, type=Path, help="the task's data folder")
    p.add_argument("--model", required=True, type=Path, help="HF-layout BERT folder with vocab")
    p.add_argument("--output", required=True, type=Path)
    config_options(p, task.config_class if task is not None else FinetuneConfig)
    if task is not None and task.download_help:
        where = f"first fetch the data into --data when missing ({task.download_help})"
        p.add_argument("--download", action="store_true", help=where)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    peek = argparse.ArgumentParser(add_help=False)
    peek.add_argument("--task")
    name = peek.parse_known_args(argv)[0].task
    task = load_task(name) if name is not None else None
    args = build_parser(task).parse_args(argv)
    cfg = config_from_args(args, task.config_class)
    if getattr(args, "download", False):
        task.download(args.data)
    result = finetune(task, args.data, args.model, args.output, cfg)
    print(json.dumps({"task": result["task"], "metrics": result["metrics"],
                      "best_epoch": result["best_epoch"], "output": str(args.output)}))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
