"""`bert finetune`: fine-tune a BERT on one GLUE task, as in section 4.1 of the paper.

The recipe is the paper's (and `run_classifier.py`'s): a linear classifier on the pooled [CLS]
vector, inputs packed `[CLS] A [SEP] B [SEP]` with the longer sentence truncated first, AdamW
(no weight decay on biases and LayerNorm), linear warm-up over the first 10 % of steps then
linear decay to zero, gradient clipping at 1.0; lr 2e-5, batch 32, 3 epochs, max length 128.
Batches are padded only to their longest sequence (dynamic padding): GLUE sentences are short,
so this is most of the speed on a CPU. The dev set is scored after every epoch and the best
epoch (by the task's GLUE score) is the one kept, written and reported.

Output (atomic: all or nothing): `model/` (HF layout, with the vocab), `metrics.json` (task name
and best-epoch dev metrics: all `bert evaluate` needs), `dev_predictions.tsv`, and when the task
folder has GLUE test files, `submission/<Task>.tsv` in the GLUE server's `index<TAB>prediction`
format.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from bert_core.errors import InputError, atomic_dir
from bert_core.glue import (
    Example,
    GlueTask,
    compute_metrics,
    get_task,
    label_ids,
    prediction_names,
    read_task,
    task_metrics,
    task_score,
)


@dataclass
class FinetuneConfig:
    """Fine-tuning hyper-parameters; the defaults are the paper's (section 4.1, appendix A.3)."""

    learning_rate: float = 2e-5
    batch_size: int = 32
    epochs: int = 3
    warmup_proportion: float = 0.1
    max_seq_length: int = 128
    weight_decay: float = 0.01
    adam_epsilon: float = 1e-6  # BERT's optimizer; transformers' default is 1e-8
    max_grad_norm: float = 1.0
    seed: int = 42
    max_train_examples: int | None = None  # a seeded random sample (CI, quick runs)
    max_eval_examples: int | None = None
    eval_batch_size: int = 128
    device: str = "auto"


# ---------------------------------------------------------------------------------------------
# Data


def load_tokenizer(model_dir: str | Path):
    """BERT's WordPiece tokenizer from the model folder's vocab.txt (casing from its config)."""
    from tokenizers import BertWordPieceTokenizer

    model_dir = Path(model_dir)
    vocab = model_dir / "vocab.txt"
    if not vocab.is_file():
        raise InputError(model_dir, "no vocab.txt: the model folder must carry its vocabulary")
    lowercase = True  # uncased BERT, unless the folder says otherwise
    config = model_dir / "tokenizer_config.json"
    if config.is_file():
        lowercase = bool(json.loads(config.read_text()).get("do_lower_case", True))
    tokens = set(vocab.read_text(encoding="utf-8").splitlines())
    missing = [t for t in ("[CLS]", "[SEP]", "[PAD]", "[UNK]") if t not in tokens]
    if missing:
        raise InputError(vocab, f"special tokens {missing} not in the vocabulary")
    return BertWordPieceTokenizer(str(vocab), lowercase=lowercase)


def truncate_seq_pair(tokens_a: list, tokens_b: list, max_length: int) -> None:
    """Drop tokens from the end of the longer sequence, one at a time (`run_classifier.py`).

    Why not keep a fixed share of each: a short sentence keeps all of its tokens, which carry
    more information each than the tail of a long one.
    """
    while len(tokens_a) + len(tokens_b) > max_length:
        (tokens_a if len(tokens_a) > len(tokens_b) else tokens_b).pop()


@dataclass
class Features:
    """Tokenised examples (unpadded) and their targets."""

    input_ids: list[np.ndarray]
    token_type_ids: list[np.ndarray]
    labels: np.ndarray | None

    def __len__(self) -> int:
        return len(self.input_ids)


def featurize(
    task: GlueTask, examples: Sequence[Example], tokenizer, max_seq_length: int
) -> Features:
    """`[CLS] A [SEP]` or `[CLS] A [SEP] B [SEP]` ids (segment 0 up to the first [SEP], then 1),
    at most `max_seq_length` long, the longer sentence truncated first."""
    cls, sep = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    a_enc = tokenizer.encode_batch([e.text_a for e in examples], add_special_tokens=False)
    pairs = [e.text_b for e in examples if e.text_b is not None]
    b_enc = iter(tokenizer.encode_batch(pairs, add_special_tokens=False))
    input_ids, token_type_ids = [], []
    for ex, a in zip(examples, a_enc, strict=True):
        a_ids = list(a.ids)
        if ex.text_b is None:
            del a_ids[max_seq_length - 2 :]
            ids, types = [cls, *a_ids, sep], [0] * (len(a_ids) + 2)
        else:
            b_ids = list(next(b_enc).ids)
            truncate_seq_pair(a_ids, b_ids, max_seq_length - 3)
            ids = [cls, *a_ids, sep, *b_ids, sep]
            types = [0] * (len(a_ids) + 2) + [1] * (len(b_ids) + 1)
        input_ids.append(np.asarray(ids, dtype=np.int64))
        token_type_ids.append(np.asarray(types, dtype=np.int64))
    labelled = bool(examples) and examples[0].label is not None
    return Features(input_ids, token_type_ids, label_ids(task, examples) if labelled else None)


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


def collate(features: Features, index: Sequence[int], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """One batch padded to its longest sequence; attention_mask 1 = token, 0 = padding."""
    batch = {
        "input_ids": pad(features.input_ids, index, pad_id),
        "token_type_ids": pad(features.token_type_ids, index),
        "attention_mask": padding_mask(features.input_ids, index),
    }
    if features.labels is not None:
        batch["labels"] = torch.from_numpy(features.labels[list(index)])
    return batch


def sample(examples: list[Example], n: int | None, seed: int) -> list[Example]:
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


# ---------------------------------------------------------------------------------------------
# Optimisation


def build_optimizer(model: torch.nn.Module, cfg: FinetuneConfig, total_steps: int):
    """AdamW with no decay on biases and LayerNorm weights (the 1-D parameters), linear warm-up
    then linear decay to zero (transformers' `get_linear_schedule_with_warmup`)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    # The fused kernel updates all parameters in one pass: ~8x faster than the default on a
    # CPU, where a 30k-token embedding makes the optimizer step a large part of a small model's.
    fused = params[0].device.type in {"cpu", "cuda", "mps"}
    optimizer = torch.optim.AdamW(groups, lr=cfg.learning_rate, eps=cfg.adam_epsilon, fused=fused)
    warmup = int(cfg.warmup_proportion * total_steps)

    def schedule(step: int) -> float:
        if step < warmup:
            return step / max(1, warmup)
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def load_model(model_dir: str | Path, num_labels: int):
    """The encoder of any HF-layout BERT folder under a classifier of `num_labels` outputs.

    A classifier already in the checkpoint is kept when its shape fits (continuing a run) and
    replaced by a fresh one when it does not (e.g. an MNLI model fine-tuned on STS-B), as
    transformers' `ignore_mismatched_sizes` does for the head only.
    """
    from bert_core.model import (
        CONFIG_NAME,
        BertConfig,
        BertForSequenceClassification,
        load_state_dict,
    )

    model_dir = Path(model_dir)
    if not (model_dir / CONFIG_NAME).is_file():
        raise FileNotFoundError(f"{model_dir}: no {CONFIG_NAME} (not a BERT model folder)")
    config = BertConfig.from_json_file(model_dir / CONFIG_NAME, num_labels=num_labels)
    model = BertForSequenceClassification(config)
    own = model.state_dict()
    state = {
        k: v
        for k, v in load_state_dict(model_dir).items()
        if not k.startswith("classifier.") or (k in own and own[k].shape == v.shape)
    }
    model.load_checkpoint_state(state, source=str(model_dir))
    model.vocab_file = model_dir / "vocab.txt"
    return model


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("mps" if torch.backends.mps.is_available() else "cpu")
    return torch.device(name)


def _autocast(device: torch.device):
    """bf16 on GPUs that have it (no loss scaling needed), full precision elsewhere."""
    enabled = device.type == "cuda" and torch.cuda.is_bf16_supported()
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)


@torch.inference_mode()
def predict(model, features: Features, device: torch.device, batch_size: int) -> np.ndarray:
    """Logits for every example, computed in length-sorted batches (less padding)."""
    model.eval()
    order = np.argsort([len(x) for x in features.input_ids], kind="stable")
    out = np.zeros((len(features), model.config.num_labels), dtype=np.float32)
    for start in range(0, len(order), batch_size):
        index = order[start : start + batch_size]
        batch = collate(features, index)
        batch.pop("labels", None)
        with _autocast(device):
            logits = model(**{k: v.to(device) for k, v in batch.items()}).logits
        out[index] = logits.float().cpu().numpy()
    return out


def to_predictions(task: GlueTask, logits: np.ndarray) -> np.ndarray:
    return logits[:, 0] if task.is_regression else logits.argmax(-1)


def evaluate_dev(task, model, dev: dict[str, Features], device, batch_size):
    """(task metrics, per-split predictions) on every dev split."""
    preds = {s: to_predictions(task, predict(model, f, device, batch_size)) for s, f in dev.items()}
    per_split = {s: compute_metrics(task, preds[s], dev[s].labels) for s in dev}
    return task_metrics(task, per_split), preds


# ---------------------------------------------------------------------------------------------
# The step


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
    """The fine-tuning loop of every task (GLUE, NER, SQuAD): `cfg.epochs` epochs with the
    paper's optimizer, schedule and clipping, dev scored after each epoch, and the best epoch's
    weights loaded back into `model`.

    `evaluate(model) -> (metrics, score, predictions)`. Returns (best epoch's record with its
    predictions, all epochs' records, training seconds). Per-epoch metrics go to `log_metrics`
    (`mlflow.log_metrics` in the CLI; None in the benchmarks, which run without MLflow). Works
    for any model whose forward takes the batch and returns `.loss` (transformers' too).
    """
    from tqdm import tqdm

    total_steps = math.ceil(num_train / cfg.batch_size) * cfg.epochs
    optimizer, scheduler = build_optimizer(model, cfg, total_steps)
    history: list[dict] = []
    best: dict | None = None
    interactive = sys.stderr.isatty()  # in a log: a line every 30 s, as finetune's bar
    bar = tqdm(total=total_steps, desc=desc, unit="step", ascii=not interactive,
               mininterval=0.1 if interactive else 30.0)  # fmt: skip
    train_seconds = 0.0  # evaluation is not training time
    for epoch in range(1, cfg.epochs + 1):
        start = time.perf_counter()
        model.train()
        losses = []
        for index in train_batches(num_train, cfg.batch_size, epoch, cfg.seed):
            batch = {k: v.to(device) for k, v in make_batch(index).items()}
            with _autocast(device):
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
        flat = {k: v for k, v in metrics.items() if isinstance(v, int | float)}
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


def train(
    task: GlueTask,
    model: torch.nn.Module,
    train_set: Features,
    dev: dict[str, Features],
    cfg: FinetuneConfig,
    device: torch.device,
    log_metrics: Callable[..., None] | None = None,
) -> tuple[dict, list[dict], float]:
    """`fit` on a GLUE task: (best epoch with its dev predictions, history, training seconds)."""

    def evaluate(m: torch.nn.Module) -> tuple[dict, float, dict[str, np.ndarray]]:
        metrics, preds = evaluate_dev(task, m, dev, device, cfg.eval_batch_size)
        return metrics, task_score(task, metrics), preds

    return fit(
        model, len(train_set), lambda index: collate(train_set, index), evaluate, cfg, device,
        f"finetune {task.name}", log_metrics,
    )  # fmt: skip


def finetune(
    task_name: str, data_dir: str | Path, model_dir: str | Path, output: str | Path,
    cfg: FinetuneConfig,
) -> dict:  # fmt: skip
    """Fine-tune, keep the best epoch, write the output folder; returns metrics.json's content."""
    from bert_core.tracking import start_run

    task = get_task(task_name)
    # Everything that can be wrong with the input fails here, before any training.
    tokenizer = load_tokenizer(model_dir)
    train_ex = sample(read_task(task, data_dir, "train")["train"], cfg.max_train_examples, cfg.seed)
    dev_ex = {
        s: sample(ex, cfg.max_eval_examples, cfg.seed)
        for s, ex in read_task(task, data_dir, "dev").items()
    }
    test_ex = read_task(task, data_dir, "test")
    train_set = featurize(task, train_ex, tokenizer, cfg.max_seq_length)
    dev = {s: featurize(task, ex, tokenizer, cfg.max_seq_length) for s, ex in dev_ex.items()}

    device = resolve_device(cfg.device)
    torch.manual_seed(cfg.seed)
    model = load_model(model_dir, task.num_labels)
    if cfg.max_seq_length > model.config.max_position_embeddings:
        raise ValueError(
            f"max_seq_length {cfg.max_seq_length} exceeds the model's max_position_embeddings "
            f"{model.config.max_position_embeddings}"
        )
    model.to(device)

    params = {"task": task.name, "data": str(data_dir), "model": str(model_dir), **asdict(cfg)}
    params |= {"num_train_examples": len(train_set), "device": str(device)}
    with start_run(f"finetune-{task.name}", params), atomic_dir(output) as tmp:
        import mlflow

        best, history, train_seconds = train(
            task, model, train_set, dev, cfg, device, mlflow.log_metrics
        )
        result = {
            "task": task.name,
            "metrics": best["metrics"],
            "score": best["score"],
            "best_epoch": best["epoch"],
            "epochs": history,
            "num_train_examples": len(train_set),
            "num_dev_examples": {s: len(f) for s, f in dev.items()},
            "train_seconds": train_seconds,
            "train_examples_per_second": len(train_set) * cfg.epochs / train_seconds,
            "config": asdict(cfg),
            "model": str(model_dir),
            "data": str(data_dir),
            "device": str(device),
        }
        _write_outputs(tmp, task, model, dev_ex, best["preds"], test_ex, tokenizer, cfg, device)
        (tmp / "metrics.json").write_text(json.dumps(result, indent=2) + "\n")
        mlflow.log_metrics({"best_epoch": best["epoch"], "best_dev_score": best["score"]})
        mlflow.log_metrics({f"best_dev_{k}": v for k, v in best["metrics"].items()})
        mlflow.log_artifact(str(tmp / "metrics.json"))
    return result


def _write_outputs(tmp: Path, task, model, dev_ex, dev_preds, test_ex, tokenizer, cfg, device):
    """model/, dev_predictions.tsv and, with test files, the GLUE submission files."""
    model.save_pretrained(tmp / "model")
    config_path = tmp / "model" / "config.json"
    config = json.loads(config_path.read_text())
    if not task.is_regression:  # label names, so the saved classifier reads on its own
        config["id2label"] = dict(enumerate(task.labels))
        config["label2id"] = {name: i for i, name in enumerate(task.labels)}
    config["finetuning_task"] = task.name
    config_path.write_text(json.dumps(config, indent=2) + "\n")

    with open(tmp / "dev_predictions.tsv", "w", encoding="utf-8") as f:
        f.write("split\tguid\tlabel\tprediction\n")
        for split, examples in dev_ex.items():
            names = prediction_names(task, dev_preds[split])
            for ex, pred in zip(examples, names, strict=True):
                f.write(f"{split}\t{ex.guid}\t{ex.label}\t{pred}\n")

    for split in task.test:
        if split.name not in test_ex:
            continue
        examples = test_ex[split.name]
        feats = featurize(task, examples, tokenizer, cfg.max_seq_length)
        logits = predict(model, feats, device, cfg.eval_batch_size)
        names = prediction_names(task, to_predictions(task, logits))
        (tmp / "submission").mkdir(exist_ok=True)
        with open(tmp / "submission" / split.submission, "w", encoding="utf-8") as f:
            f.write("index\tprediction\n")
            f.writelines(f"{ex.index}\t{p}\n" for ex, p in zip(examples, names, strict=True))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bert finetune", description=__doc__.split("\n")[0])
    p.add_argument(
        "--task", required=True,
        help="GLUE task (CoLA, SST-2, MRPC, STS-B, QQP, ...), or conll2003, squad, squad_v2",
    )  # fmt: skip
    p.add_argument("--data", required=True, type=Path, help="the task's data folder")
    p.add_argument("--model", required=True, type=Path, help="HF-layout BERT folder with vocab")
    p.add_argument("--output", required=True, type=Path)
    d = FinetuneConfig()
    p.add_argument("--learning-rate", "--lr", type=float, default=d.learning_rate)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--epochs", type=int, default=d.epochs)
    p.add_argument("--warmup-proportion", type=float, default=d.warmup_proportion)
    p.add_argument("--max-seq-length", type=int, default=d.max_seq_length)
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--max-grad-norm", type=float, default=d.max_grad_norm)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--max-train-examples", type=int, default=None)
    p.add_argument("--max-eval-examples", type=int, default=None)
    p.add_argument("--eval-batch-size", type=int, default=d.eval_batch_size)
    p.add_argument("--device", default=d.device, help="auto (cuda > mps > cpu), cpu, cuda, ...")
    return p


# Token-level tasks: one `bert finetune` for all fine-tuning (same options, outputs, MLflow
# runs), their data, model head and metrics in their own modules.
TOKEN_TASKS = {
    "conll2003": "bert_core.ner",
    "squad": "bert_core.squad",
    "squad_v2": "bert_core.squad",
}


def main(argv: list[str] | None = None) -> int:
    import importlib

    peek = argparse.ArgumentParser(add_help=False)
    peek.add_argument("--task")
    known, _ = peek.parse_known_args(sys.argv[1:] if argv is None else argv)
    if known.task in TOKEN_TASKS:  # exact names, as in metrics.json and `bert evaluate`
        return importlib.import_module(TOKEN_TASKS[known.task]).main(argv)
    args = build_parser().parse_args(argv)
    cfg = FinetuneConfig(
        learning_rate=args.learning_rate,
        batch_size=args.batch_size,
        epochs=args.epochs,
        warmup_proportion=args.warmup_proportion,
        max_seq_length=args.max_seq_length,
        weight_decay=args.weight_decay,
        max_grad_norm=args.max_grad_norm,
        seed=args.seed,
        max_train_examples=args.max_train_examples,
        max_eval_examples=args.max_eval_examples,
        eval_batch_size=args.eval_batch_size,
        device=args.device,
    )
    if cfg.epochs < 1 or cfg.batch_size < 1 or cfg.max_seq_length < 8:
        raise ValueError("--epochs and --batch-size must be >= 1, --max-seq-length >= 8")
    result = finetune(args.task, args.data, args.model, args.output, cfg)
    print(json.dumps({"task": result["task"], "metrics": result["metrics"],
                      "best_epoch": result["best_epoch"], "output": str(args.output)}))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
