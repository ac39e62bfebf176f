"""The fine-tuning engine: one recipe for every task (GLUE, CoNLL-2003, SQuAD, SWAG).

The recipe is the paper's (section 4, appendix A.3): a task head on the pre-trained encoder,
AdamW (no weight decay on biases and LayerNorm, `bert_core.model.optim`), linear warm-up over
the first 10 % of steps then linear decay to zero, gradient clipping at 1.0, dynamic padding (a
batch is padded only to its longest sequence: most of the speed on a CPU), bf16 autocast on
GPUs. The dev set is scored after every epoch and the best epoch (by the task's score) is the
one kept.

Here: what a task is to the engine (`FinetuneTask`), the model folder's tokenizer, batching and
padding (`train_batches`, `pad`, `padding_mask`), the model loader (label names into
config.json; `--init random` for the control), the training loop (`fit`), the length-sorted
prediction loop (`predict_batches`) and one training run (`train`). A task holds only what is
its own (reading its data, featurisation, collate, decoding, metrics and output files): a
`FinetuneTask` subclass in `bert_core.finetune.tasks`, which imports this module, never the
other way round. The step around it (reading the input, MLflow, metrics.json, registering the
model, the command line) is `bert_core.finetune.command`; the configuration
`bert_core.finetune.config`; the paper's learning-rate sweep `bert_core.finetune.sweep`.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bert_core.data.tokenizer import load_tokenizer as wordpiece
from bert_core.data.tokenizer import read_lowercase, read_vocab
from bert_core.errors import BadValue, Diverged, InputError, NotFound
from bert_core.finetune.config import FinetuneConfig, option  # noqa: F401 (re-exported)
from bert_core.metrics import task_run
from bert_core.model import heads, optim, weights
from bert_core.model import modeling as bert
from bert_core.model.config import CONFIG_NAME

MODEL_INPUTS = ("input_ids", "token_type_ids", "attention_mask")  # a batch's non-target keys


# ---------------------------------------------------------------------------------------------
# Tasks


class FinetuneTask:
    """One task as the engine sees it; a subclass holds only what is the task's own.

    The engine calls, in order: `prepare` (read, sample and featurise train and dev: every input
    error surfaces here, before any training), `train_batch` per step, `evaluate` per epoch,
    then `evaluate_test`, `write_outputs` and `summary` for the best epoch.
    """

    config_class: type[FinetuneConfig] = FinetuneConfig
    model_class = "BertForSequenceClassification"  # a head class of `bert_core.model.heads`
    replace_mismatched_head = False  # a checkpoint head of another shape: replaced, not an error
    download_help: str | None = None  # set: `--download` fetches the data when missing
    score_metric = "score"  # the dev metric `evaluate`'s score is (the registry names it)

    def __init__(self, name: str):
        self.name = name  # as in metrics.json, MLflow and `bert evaluate`
        self.labels: Sequence[str] | None = None  # label names (config.json); None: no names
        self.num_labels = 2
        # config.json's `problem_type`, as transformers names it (`regression` for STS-B,
        # `single_label_classification`); None: a head that has none (tokens, spans, choices)
        self.problem_type: str | None = None
        self.num_train = 0  # training rows (windows) the batches are drawn from
        self.num_train_examples = 0  # examples (sentences, questions) they come from

    def head(self, cfg) -> tuple[str, dict]:
        """(a class of `bert_core.model.heads`, config.json fields it reads beyond the labels)
        for the settings `cfg`: the task's class; Table 5's BiLSTM under it on --top-bilstm."""
        return self.model_class, {"top_bilstm": True} if cfg.top_bilstm else {}

    def download(self, data_dir: Path) -> None:
        """Fetch the task's data into `data_dir` when it is not there (`--download`)."""
        raise NotImplementedError

    def prepare(self, data_dir: Path, tokenizer, cfg) -> dict:
        """Read, sample and featurise; returns the counts logged as run parameters."""
        raise NotImplementedError

    def train_batch(self, index: np.ndarray) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def evaluate(self, model, device: torch.device, cfg) -> tuple[dict, float, object]:
        """(dev metrics, score the best epoch is chosen by, predictions). The score is in percent
        (the results table's scale, `bert_core.metrics`) for every task; metrics are fractions."""
        raise NotImplementedError

    def evaluate_test(self, model, device: torch.device, cfg) -> dict | None:
        """The kept model's metrics on a labelled test split when the data have one (CoNLL's
        test.txt; GLUE's and SWAG's are unlabelled), else None; never used to choose."""

    def write_outputs(self, out: Path, model, predictions, device: torch.device, cfg) -> None:
        """The task's prediction files for the best epoch (the model is saved by the engine)."""

    def summary(self, best: Epoch) -> dict:
        """The task's own metrics.json fields (counts, files, detailed metrics)."""
        return {}

    def baseline(self) -> tuple[float, str]:
        """(score, rule) of the best answer that ignores its input, on the dev set `evaluate`
        scores, in the score's percent: what a model must beat to be worth serving (the
        registry's champion rule). Here: no answer at all (no entity), which scores 0."""
        return 0.0, "no answer"


def majority(labels: np.ndarray) -> int:
    """The most frequent of the training `labels` (the lowest on a tie)."""
    values, counts = np.unique(labels, return_counts=True)
    return int(values[counts.argmax()])


# ---------------------------------------------------------------------------------------------
# Data


def load_tokenizer(model_dir: str | Path):
    """The model folder's tokenizer: `bert_core.data.tokenizer`'s, on its vocab.txt (casing from
    tokenizer_config.json's `do_lower_case`; lowercase when absent, as uncased BERT)."""
    model_dir = Path(model_dir)
    vocab = model_dir / "vocab.txt"
    if not vocab.is_file():
        raise InputError(model_dir, "no vocab.txt: the model folder must carry its vocabulary")
    lowercase = read_lowercase(model_dir)
    tokenizer = wordpiece(vocab, True if lowercase is None else lowercase)
    missing = [t for t in ("[CLS]", "[SEP]", "[PAD]", "[UNK]") if tokenizer.token_to_id(t) is None]
    if missing:
        raise InputError(vocab, f"special tokens {missing} not in the vocabulary")
    return tokenizer


def sample(examples: list, n: int | None, seed: int) -> list:
    """A seeded random subset of `n` examples in file order (all of them when n is None)."""
    if n is None or n >= len(examples):
        return examples
    if n < 1:
        raise BadValue(f"cannot sample {n} examples")
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


def model_config(task: FinetuneTask, model_dir: Path, cfg):
    """The folder's BertConfig with the task's label names and the fields its head reads for
    `cfg` (`FinetuneTask.head`); checks that `cfg.max_seq_length` fits its positions (read
    before any training, so a bad folder fails first)."""
    if not (model_dir / CONFIG_NAME).is_file():
        raise NotFound(f"{model_dir}: no {CONFIG_NAME} (not a BERT model folder)")
    # label2id too: given id2label alone, the folder's own label2id (a pre-trained model's
    # LABEL_0, LABEL_1) would be kept beside the task's names, the two disagreeing
    names = list(task.labels or ())
    config = bert.BertConfig.from_json_file(
        model_dir / CONFIG_NAME,
        num_labels=task.num_labels,
        finetuning_task=task.name,
        id2label=dict(enumerate(names)) or None,
        label2id={n: i for i, n in enumerate(names)} or None,
        **task.head(cfg)[1],
    )
    vocab = model_dir / "vocab.txt"
    if vocab.is_file() and (size := len(read_vocab(vocab))) > config.vocab_size:
        raise InputError(  # its ids past the embedding table: another model's vocabulary
            vocab,
            f"{size} tokens, more than the model's vocab_size {config.vocab_size} "
            f"({model_dir / CONFIG_NAME}): the vocabulary of another model",
        )
    if cfg.max_seq_length > config.max_position_embeddings:
        raise BadValue(
            f"max_seq_length {cfg.max_seq_length} exceeds the model's max_position_embeddings "
            f"{config.max_position_embeddings}"
        )
    return config


def load_model(task: FinetuneTask, model_dir: str | Path, cfg=None):
    """The encoder of any HF-layout BERT folder under the task's head for the settings `cfg`
    (None: the task's defaults; `FinetuneTask.head`), the task's label names in its config. A
    head already in the checkpoint is kept when it fits (continuing a run); with
    `task.replace_mismatched_head` one of another shape is replaced by a fresh one (e.g. an
    MNLI model fine-tuned on STS-B), as transformers' `ignore_mismatched_sizes`.

    `cfg.init == "random"`: the same architecture (the folder's config.json) with every weight
    freshly initialised from torch's current seed, none read from the checkpoint: the control
    run that shows what pre-training brings (the vocabulary is still the folder's)."""
    model_dir, cfg = Path(model_dir), cfg or task.config_class()
    head = getattr(heads, task.head(cfg)[0])
    model = head(model_config(task, model_dir, cfg), init_weights=cfg.init == "random")
    model.vocab_file = model_dir / "vocab.txt"
    if cfg.init == "random":
        return model
    state = weights.read(model_dir)
    if task.replace_mismatched_head:
        own = model.state_dict()
        state = {
            k: v
            for k, v in state.items()
            if not (k.startswith(bert.HEAD_PREFIXES) and k in own and own[k].shape != v.shape)
        }
    # the task's head (and Table 5's BiLSTM under it) is new on purpose: no warning for it
    created = ("classifier", "qa_outputs", "bilstm")
    model.load_checkpoint_state(state, str(model_dir), created=created)
    return model


def save_model(task: FinetuneTask, model, path: Path) -> None:
    """`model.save_pretrained(path)` (label names and task in config.json), then the task's
    `problem_type` and `num_labels` in config.json as transformers writes them, so the folder
    says what its head is (STS-B: a regression) to us and to transformers alike. `BertConfig`
    has no `problem_type` field (it reads past unknown keys), hence the addition here."""
    model.save_pretrained(path)
    if task.problem_type is None:
        return
    file = Path(path) / CONFIG_NAME
    config = json.loads(file.read_text(encoding="utf-8"))
    config |= {"problem_type": task.problem_type, "num_labels": task.num_labels}
    file.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def build_optimizer(model: torch.nn.Module, cfg: FinetuneConfig, total_steps: int):
    """(AdamW, linear warm-up/decay schedule) over `total_steps`, by `bert_core.model.optim`."""
    optimizer = optim.adamw(model, cfg.learning_rate, cfg.weight_decay, cfg.adam_epsilon)
    warmup = int(cfg.warmup_proportion * total_steps)
    return optimizer, optim.linear_schedule(optimizer, warmup, total_steps)


@torch.inference_mode()
def predict_batches(
    model,
    lengths: Sequence[int],
    make_batch: Callable[[np.ndarray], dict],
    device: torch.device,
    batch_size: int,
) -> Iterator[tuple[np.ndarray, Any]]:
    """The prediction loop of every task: examples in length-sorted batches (least padding),
    yielding (index, model outputs) where `index` holds the batch rows' positions in the input.
    `make_batch(index)` may include targets; only `MODEL_INPUTS` reach the model."""
    model.eval()
    order = np.argsort(lengths, kind="stable")
    for start in range(0, len(order), batch_size):
        index = order[start : start + batch_size]
        batch = {k: v.to(device) for k, v in make_batch(index).items() if k in MODEL_INPUTS}
        with optim.autocast(device):
            outputs = model(**batch)
        yield index, outputs


@dataclass
class Epoch:
    """One epoch of `fit`: metrics.json's `epochs` rows and MLflow's per-epoch metrics."""

    epoch: int
    train_loss: float  # the epoch's mean
    metrics: dict  # dev, the task's own (`evaluate`)
    score: float  # dev, the task's one number
    train_seconds: float  # training so far, evaluation not counted


@dataclass
class Fitted:
    """What a fine-tuning ends with, beside its model (which holds the best epoch's weights)."""

    best: Epoch
    predictions: Any  # the best epoch's dev predictions, for the task's `write_outputs`
    history: list[Epoch]
    train_seconds: float


def fit(
    model: torch.nn.Module,
    num_train: int,
    make_batch: Callable[[np.ndarray], dict[str, torch.Tensor]],
    evaluate: Callable[[torch.nn.Module], tuple[dict, float, Any]],
    cfg,
    device: torch.device,
    desc: str,
    log_metrics: Callable[..., None] | None = None,
) -> Fitted:
    """The fine-tuning loop of every task: `cfg.epochs` epochs with the paper's optimizer,
    schedule and clipping, dev scored after each epoch, and the best epoch's weights loaded
    back into `model`.

    `evaluate(model) -> (metrics, score, predictions)`. Per-epoch metrics go to `log_metrics`
    (`mlflow.log_metrics` in the CLI; None in the benchmarks, which run without MLflow). Works
    for any model whose forward takes the batch and returns `.loss`.
    (Over 60 lines: one loop, read top to bottom, is clearer than pieces.)
    """
    from tqdm import tqdm

    total_steps = math.ceil(num_train / cfg.batch_size) * cfg.epochs
    optimizer, scheduler = build_optimizer(model, cfg, total_steps)
    history: list[Epoch] = []
    best: Epoch | None = None
    best_state: dict[str, torch.Tensor] = {}  # its weights, on the CPU
    best_predictions: Any = None
    # disable=None: a bar on a terminal only; in a log (a KFP pod, CI) the epoch lines below
    bar = tqdm(total=total_steps, desc=desc, unit="step", disable=None)
    train_seconds = 0.0  # evaluation is not training time
    step = 0
    for epoch in range(1, cfg.epochs + 1):
        start = time.perf_counter()
        model.train()
        losses = []
        for index in train_batches(num_train, cfg.batch_size, epoch, cfg.seed):
            batch = {k: v.to(device) for k, v in make_batch(index).items()}
            with optim.autocast(device):
                loss = model(**batch).loss
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
            # one sync a step either way (the loss is read for the bar): a non-finite loss or
            # gradient norm stops the run before the optimizer writes NaN into every weight
            value, norm, step = loss.item(), norm.item(), step + 1
            if not (math.isfinite(value) and math.isfinite(norm)):
                raise Diverged(
                    f"{desc}: training diverged at epoch {epoch}, step {step}: loss "
                    f"{value}, gradient norm {norm} at learning rate {cfg.learning_rate:g}; "
                    "lower --learning-rate (or --lr-sweep)"
                )
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(value)
            bar.update()
            bar.set_postfix(epoch=epoch, loss=f"{losses[-1]:.4f}", refresh=False)
        train_seconds += time.perf_counter() - start
        metrics, score, preds = evaluate(model)
        record = Epoch(epoch, float(np.mean(losses)), metrics, score, train_seconds)
        history.append(record)
        if log_metrics is not None:
            log_metrics(epoch_metrics(record), step=epoch)
        bar.write(f"epoch {epoch}: train_loss {record.train_loss:.4f} dev {numeric(metrics)}")
        if best is None or score > best.score:
            best, best_predictions = record, preds
            best_state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
    bar.close()
    model.load_state_dict(best_state)
    return Fitted(best, best_predictions, history, train_seconds)


def epoch_metrics(record: Epoch) -> dict[str, float]:
    """One epoch's MLflow metrics (step = epoch), in the one metric language
    (`bert_core.metrics`): `train/loss`, `dev/score`, `dev/<metric>` in percent."""
    return {"train/loss": record.train_loss, **task_run(record.score, record.metrics, "dev")}


def numeric(metrics: dict) -> dict:
    """The plain numbers of a metrics dict (NER's nested per-type table left out)."""
    return {k: v for k, v in metrics.items() if isinstance(v, int | float)}


# ---------------------------------------------------------------------------------------------
# The run


def train(
    task: FinetuneTask,
    model_dir: str | Path,
    cfg,
    device: torch.device,
    log_metrics: Callable[..., None] | None = None,
) -> tuple[torch.nn.Module, Fitted]:
    """One training run on the prepared task: the model (seeded with `cfg.seed`, from the
    folder's weights or random ones by `cfg.init`) fitted with `cfg`, the best epoch loaded.
    The whole step, or one trial of a sweep (`bert_core.finetune.sweep`)."""
    torch.manual_seed(cfg.seed)
    model = load_model(task, model_dir, cfg).to(device)
    trial = f" lr {cfg.learning_rate:g} seed {cfg.seed}" if cfg.is_sweep else ""
    desc = f"finetune {task.name}{trial}"
    evaluate = lambda m: task.evaluate(m, device, cfg)  # noqa: E731
    fitted = fit(model, task.num_train, task.train_batch, evaluate, cfg, device, desc, log_metrics)
    return model, fitted
