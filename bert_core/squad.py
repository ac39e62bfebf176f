"""`bert finetune --task squad|squad_v2`: extractive question answering (paper, section 4.2/4.3).

As Google's `run_squad.py`: question and context packed `[CLS] question [SEP] context [SEP]`;
a context longer than the window is cut into overlapping windows (`max_seq_length` 384, the
window start advancing by `doc_stride` 128 tokens, the question at most `max_query_length` 64
tokens: longer is an error, not a silent cut); each context token is scored only in the window
where it has the most context on both sides. Gold character offsets become token positions
through the fast tokenizer's offset mapping, and predicted spans go back to the exact context
text the same way. Decoding takes the `n_best_size` best starts and ends of every window,
keeps valid spans up to `max_answer_length` tokens and picks the best start+end logit; for
SQuAD 2.0 the null answer ([CLS] start and end) wins when its score beats the best span's by
more than `null_score_diff_threshold`.

Scores are the official evaluate-v1.1.py / evaluate-v2.0.py ones (answer normalisation:
lower-case, no punctuation, no articles, single spaces; max over the gold answers), reported as
fractions (x 100 for the official scale).

Input: a folder with the official SQuAD JSON (`train-v1.1.json`/`dev-v1.1.json`,
`train-v2.0.json`/`dev-v2.0.json`, or `train.json`/`dev.json`). Without a dev file the train
file is split by article, deterministically: every fifth article (index % 5 == 4) is dev, so no
paragraph is in both. Output (atomic): `model/`, `metrics.json`, `predictions.json` (official
format: question id -> answer text) and, for SQuAD 2.0, `null_odds.json`.
"""

from __future__ import annotations

import argparse
import json
import re
import string
import urllib.request
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from bert_core.errors import InputError, atomic_dir
from bert_core.finetune import FinetuneConfig, pad, padding_mask

VERSIONS = {"squad": "1.1", "squad_v2": "2.0"}
OFFICIAL_URL = "https://rajpurkar.github.io/SQuAD-explorer/dataset/"
DEV_EVERY = 5  # without a dev file: articles with index % 5 == 4 are dev


@dataclass
class SquadConfig(FinetuneConfig):
    """FinetuneConfig with the paper's SQuAD settings and run_squad.py's windowing/decoding."""

    learning_rate: float = 5e-5
    max_seq_length: int = 384
    doc_stride: int = 128
    max_query_length: int = 64
    n_best_size: int = 20
    max_answer_length: int = 30
    null_score_diff_threshold: float = 0.0
    eval_batch_size: int = 64


@dataclass
class Example:
    qid: str
    question: str
    context: str
    answers: list[tuple[str, int]]  # (text, answer_start); empty when impossible
    is_impossible: bool = False


# ---------------------------------------------------------------------------------------------
# Reading


def _examples(path: Path, articles: list, version: str) -> list[Example]:
    out: list[Example] = []
    for a, article in enumerate(articles):
        title = article.get("title", a)
        for p, para in enumerate(article["paragraphs"]):
            context = para["context"]
            if not context.strip():
                raise InputError(path, f"article {title!r} paragraph {p}: empty context")
            for qa in para["qas"]:
                qid, impossible = str(qa["id"]), bool(qa.get("is_impossible", False))
                if impossible and version != "2.0":
                    raise InputError(path, f"question {qid}: is_impossible needs SQuAD 2.0")
                answers = []
                for ans in qa["answers"]:
                    text, start = ans["text"], int(ans["answer_start"])
                    if context[start : start + len(text)] != text or not text.strip():
                        raise InputError(
                            path,
                            f"question {qid}: answer_start {start} does not point at its answer "
                            f"{text!r} (context has {context[start : start + len(text)]!r})",
                        )
                    answers.append((text, start))
                if not answers and not impossible:
                    raise InputError(path, f"question {qid}: no answers and not is_impossible")
                if answers and impossible:
                    raise InputError(path, f"question {qid}: is_impossible but has answers")
                if not qa["question"].strip():
                    raise InputError(path, f"question {qid}: empty question")
                out.append(Example(qid, qa["question"], context, answers, impossible))
    return out


def read_squad(path: str | Path, version: str = "1.1", split: str | None = None) -> list[Example]:
    """Examples of a SQuAD JSON file, checked; `split` ('train'/'dev') takes the deterministic
    by-article split of a file that has no separate dev set."""
    path = Path(path)
    try:
        with open(path, encoding="utf-8") as f:
            articles = json.load(f)["data"]
    except json.JSONDecodeError as e:
        raise InputError(path, f"not valid JSON: {e.msg}", line=e.lineno) from e
    except (KeyError, TypeError) as e:
        raise InputError(path, 'expected {"data": [...], "version": ...}') from e
    if split is not None:
        dev = split == "dev"
        articles = [a for i, a in enumerate(articles) if (i % DEV_EVERY == DEV_EVERY - 1) == dev]
    try:
        examples = _examples(path, articles, version)
    except (KeyError, TypeError) as e:
        raise InputError(path, f"not SQuAD JSON: missing or bad field {e}") from e
    if not examples:
        raise InputError(path, "no questions")
    seen: set[str] = set()
    for ex in examples:
        if ex.qid in seen:
            raise InputError(path, f"question id {ex.qid} given twice")
        seen.add(ex.qid)
    return examples


def find_files(data_dir: str | Path, version: str) -> tuple[Path, Path | None]:
    """(train file, dev file or None when the dev set is split off the train file)."""
    data_dir = Path(data_dir)

    def first(*names: str) -> Path | None:
        return next((data_dir / n for n in names if (data_dir / n).is_file()), None)

    train = first(f"train-v{version}.json", "train.json")
    if train is None:
        raise FileNotFoundError(f"{data_dir}: no train-v{version}.json or train.json")
    return train, first(f"dev-v{version}.json", "dev.json")


def download(dest: str | Path, version: str = "1.1", base_url: str = OFFICIAL_URL) -> Path:
    """Fetch the official train/dev files into `dest`; each is parsed before it is kept, so a
    truncated or wrong download leaves nothing behind."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for split in ("train", "dev"):
        name = f"{split}-v{version}.json"
        part = dest / f".{name}.part"
        try:
            with urllib.request.urlopen(base_url.rstrip("/") + "/" + name, timeout=60) as r:
                part.write_bytes(r.read())
            read_squad(part, version)
            part.replace(dest / name)
        finally:
            part.unlink(missing_ok=True)
    return dest


# ---------------------------------------------------------------------------------------------
# Features: windows over the context


@dataclass
class Features:
    input_ids: list[np.ndarray]
    token_type_ids: list[np.ndarray]
    example_index: np.ndarray  # [F] which example each window belongs to
    offsets: list[np.ndarray]  # [L, 2] character span in the context; -1 outside the context
    max_context: list[np.ndarray]  # [L] bool: this window is the token's best-centred one
    start_positions: np.ndarray  # [F]; 0 ([CLS]) when the answer is not in the window
    end_positions: np.ndarray

    def __len__(self) -> int:
        return len(self.input_ids)


def answer_tokens(offsets: np.ndarray, char_start: int, char_end: int) -> tuple[int, int]:
    """First and last token overlapping [char_start, char_end) in a context's offset mapping."""
    start = int(np.searchsorted(offsets[:, 1], char_start, side="right"))
    end = int(np.searchsorted(offsets[:, 0], char_end, side="left")) - 1
    return start, end


def doc_spans(n: int, max_tokens: int, stride: int) -> list[tuple[int, int]]:
    """run_squad.py's sliding windows: (start, length), the start advancing by `stride`."""
    spans, start = [], 0
    while True:
        length = min(n - start, max_tokens)
        spans.append((start, length))
        if start + length >= n:
            return spans
        start += min(length, stride)


def max_context_window(n: int, spans: list[tuple[int, int]]) -> np.ndarray:
    """For each context token, the window where it has the most context (run_squad.py's
    `_check_is_max_context`: min of left and right context + 0.01 * window length; the first
    such window on ties). Only there is it allowed to start a predicted answer."""
    j = np.arange(n)
    scores = np.full((len(spans), n), -np.inf)
    for w, (s, length) in enumerate(spans):
        inside = (j >= s) & (j < s + length)
        scores[w, inside] = np.minimum(j - s, s + length - 1 - j)[inside] + 0.01 * length
    return scores.argmax(0)


def featurize(
    examples: Sequence[Example], tokenizer, cfg: SquadConfig, source: str | Path = "<input>",
    train: bool = False,
) -> Features:  # fmt: skip
    cls_id, sep_id = tokenizer.token_to_id("[CLS]"), tokenizer.token_to_id("[SEP]")
    questions = tokenizer.encode_batch([e.question for e in examples], add_special_tokens=False)
    contexts = sorted({e.context for e in examples})
    encs = tokenizer.encode_batch(contexts, add_special_tokens=False)
    by_context = {
        c: (np.asarray(e.ids, dtype=np.int64), np.asarray(e.offsets, dtype=np.int64).reshape(-1, 2))
        for c, e in zip(contexts, encs, strict=True)
    }
    f = Features([], [], [], [], [], [], [])
    example_index, starts, ends = [], [], []
    for i, (ex, q) in enumerate(zip(examples, questions, strict=True)):
        if len(q.ids) > cfg.max_query_length:
            raise InputError(
                source, f"question {ex.qid}: {len(q.ids)} tokens, more than max_query_length "
                f"{cfg.max_query_length}",
            )  # fmt: skip
        doc_ids, doc_offsets = by_context[ex.context]
        if len(doc_ids) == 0:
            raise InputError(source, f"question {ex.qid}: context has no tokens")
        max_tokens = cfg.max_seq_length - len(q.ids) - 3
        if max_tokens < 1:
            raise ValueError(f"max_seq_length {cfg.max_seq_length} leaves no room for context")
        answer = None
        if train and ex.answers:
            text, char_start = ex.answers[0]
            answer = answer_tokens(doc_offsets, char_start, char_start + len(text))
        spans = doc_spans(len(doc_ids), max_tokens, cfg.doc_stride)
        prefix = len(q.ids) + 2
        owner = max_context_window(len(doc_ids), spans)
        first_window = len(f.max_context)
        for s, n in spans:
            f.input_ids.append(
                np.concatenate([[cls_id], q.ids, [sep_id], doc_ids[s : s + n], [sep_id]]).astype(
                    np.int64
                )
            )  # noqa: E501
            f.token_type_ids.append(np.r_[np.zeros(prefix, np.int64), np.ones(n + 1, np.int64)])
            offsets = np.full((prefix + n + 1, 2), -1, dtype=np.int64)
            offsets[prefix : prefix + n] = doc_offsets[s : s + n]
            f.offsets.append(offsets)
            best = np.zeros(prefix + n + 1, dtype=bool)
            best[prefix : prefix + n] = owner[s : s + n] == len(f.max_context) - first_window
            f.max_context.append(best)
            example_index.append(i)
            if answer is not None and s <= answer[0] and answer[1] < s + n:
                starts.append(prefix + answer[0] - s)
                ends.append(prefix + answer[1] - s)
            else:
                starts.append(0)
                ends.append(0)
    f.example_index = np.asarray(example_index, dtype=np.int64)
    f.start_positions = np.asarray(starts, dtype=np.int64)
    f.end_positions = np.asarray(ends, dtype=np.int64)
    return f


def collate(f: Features, index: Sequence[int], pad_id: int = 0) -> dict[str, torch.Tensor]:
    index = list(index)
    return {
        "input_ids": pad(f.input_ids, index, pad_id),
        "token_type_ids": pad(f.token_type_ids, index),
        "attention_mask": padding_mask(f.input_ids, index),
        "start_positions": torch.from_numpy(f.start_positions[index]),
        "end_positions": torch.from_numpy(f.end_positions[index]),
    }


@torch.inference_mode()
def predict_logits(model, f: Features, device, batch_size: int) -> list[tuple[np.ndarray, ...]]:
    """(start_logits, end_logits) of every window, unpadded."""
    from bert_core.finetune import _autocast

    model.eval()
    out: list = [None] * len(f)
    order = np.argsort([len(x) for x in f.input_ids], kind="stable")
    for b in range(0, len(order), batch_size):
        index = order[b : b + batch_size]
        batch = collate(f, index)
        del batch["start_positions"], batch["end_positions"]
        with _autocast(device):
            o = model(**{k: v.to(device) for k, v in batch.items()})
        s, e = o.start_logits.float().cpu().numpy(), o.end_logits.float().cpu().numpy()
        for row, i in enumerate(index):
            n = len(f.input_ids[i])
            out[i] = (s[row, :n], e[row, :n])
    return out


def decode(
    examples: Sequence[Example], f: Features, logits: Sequence[tuple[np.ndarray, np.ndarray]],
    cfg: SquadConfig, version_2: bool,
) -> tuple[dict[str, str], dict[str, float]]:  # fmt: skip
    """Best answer text per question id, and (SQuAD 2.0) null score minus best span score."""
    best: dict[int, tuple[float, str]] = {}
    null: dict[int, float] = {}
    for w, (sl, el) in enumerate(logits):
        i = int(f.example_index[w])
        null[i] = min(null.get(i, np.inf), float(sl[0] + el[0]))
        k = min(cfg.n_best_size, len(sl))
        S, E = np.meshgrid(np.argsort(-sl)[:k], np.argsort(-el)[:k], indexing="ij")
        in_context = f.offsets[w][:, 0] >= 0
        valid = (
            in_context[S] & in_context[E] & f.max_context[w][S]
            & (E >= S) & (E - S + 1 <= cfg.max_answer_length)
        )  # fmt: skip
        if not valid.any():
            continue
        score = np.where(valid, sl[S] + el[E], -np.inf)
        j = np.unravel_index(int(score.argmax()), score.shape)
        s, e = int(S[j]), int(E[j])
        if i not in best or score[j] > best[i][0]:
            ctx = examples[i].context
            best[i] = (float(score[j]), ctx[f.offsets[w][s, 0] : f.offsets[w][e, 1]])
    preds, null_odds = {}, {}
    for i, ex in enumerate(examples):
        score, text = best.get(i, (-np.inf, ""))
        if version_2:
            null_odds[ex.qid] = null[i] - score if np.isfinite(score) else float("inf")
            if null_odds[ex.qid] > cfg.null_score_diff_threshold:
                text = ""
        preds[ex.qid] = text
    return preds, null_odds


# ---------------------------------------------------------------------------------------------
# Official metrics (evaluate-v1.1.py, evaluate-v2.0.py)


def normalize_answer(s: str) -> str:
    """Lower text and remove punctuation, articles and extra whitespace (both scripts)."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s, flags=re.UNICODE)
    return " ".join(s.split())


def f1_v1(prediction: str, ground_truth: str) -> float:
    pred, gold = normalize_answer(prediction).split(), normalize_answer(ground_truth).split()
    same = sum((Counter(pred) & Counter(gold)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(gold)
    return 2 * precision * recall / (precision + recall)


def f1_v2(prediction: str, ground_truth: str) -> float:
    """v2.0: an empty answer (no-answer) scores 1 only against an empty answer."""
    pred, gold = normalize_answer(prediction).split(), normalize_answer(ground_truth).split()
    if not pred or not gold:
        return float(pred == gold)
    return f1_v1(prediction, ground_truth)


def exact_match(prediction: str, ground_truth: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(ground_truth))


def squad_metrics(
    examples: Sequence[Example], predictions: dict[str, str], version: str = "1.1"
) -> dict[str, float]:
    """Exact match and F1 (max over gold answers, mean over questions); for 2.0 also split into
    questions with and without an answer, as evaluate-v2.0.py reports."""
    v2 = version == "2.0"
    em, f1, has = [], [], []
    for ex in examples:
        gold = [t for t, _ in ex.answers]
        if v2:
            gold = [t for t in gold if normalize_answer(t)] or [""]
        pred = predictions.get(ex.qid, "")
        em.append(max(exact_match(pred, g) for g in gold))
        f1.append(max((f1_v2 if v2 else f1_v1)(pred, g) for g in gold))
        has.append(bool(ex.answers))
    em_, f1_, has_ = np.asarray(em), np.asarray(f1), np.asarray(has)
    out = {"exact_match": float(em_.mean()), "f1": float(f1_.mean())}
    if v2:
        for name, sel in (("has_ans", has_), ("no_ans", ~has_)):
            if sel.any():
                out[f"{name}_exact_match"] = float(em_[sel].mean())
                out[f"{name}_f1"] = float(f1_[sel].mean())
    return out


# ---------------------------------------------------------------------------------------------
# The step


def finetune(
    task: str, data_dir: str | Path, model_dir: str | Path, output: str | Path, cfg: SquadConfig
) -> dict:
    from bert_core.finetune import fit, load_tokenizer, resolve_device, sample
    from bert_core.model import BertForQuestionAnswering
    from bert_core.ner import result_record, save_model
    from bert_core.tracking import start_run

    version = VERSIONS[task]
    train_path, dev_path = find_files(data_dir, version)
    if dev_path is None:
        train_ex = read_squad(train_path, version, split="train")
        dev_ex = read_squad(train_path, version, split="dev")
        dev_source = f"{train_path} (articles with index % {DEV_EVERY} == {DEV_EVERY - 1})"
    else:
        train_ex, dev_ex = read_squad(train_path, version), read_squad(dev_path, version)
        dev_source = str(dev_path)
    train_ex = sample(train_ex, cfg.max_train_examples, cfg.seed)
    dev_ex = sample(dev_ex, cfg.max_eval_examples, cfg.seed)
    tokenizer = load_tokenizer(model_dir)
    tokenizer.no_truncation()  # windows, not truncation
    train = featurize(train_ex, tokenizer, cfg, train_path, train=True)
    dev = featurize(dev_ex, tokenizer, cfg, dev_path or train_path)

    device = resolve_device(cfg.device)
    torch.manual_seed(cfg.seed)
    model = BertForQuestionAnswering.from_pretrained(model_dir, num_labels=2)
    if cfg.max_seq_length > model.config.max_position_embeddings:
        raise ValueError(
            f"max_seq_length {cfg.max_seq_length} exceeds the model's max_position_embeddings "
            f"{model.config.max_position_embeddings}"
        )
    model.to(device)

    def evaluate(m):
        logits = predict_logits(m, dev, device, cfg.eval_batch_size)
        preds, null_odds = decode(dev_ex, dev, logits, cfg, version == "2.0")
        metrics = squad_metrics(dev_ex, preds, version)
        return metrics, metrics["f1"], (preds, null_odds)

    params = {"task": task, "data": str(data_dir), "model": str(model_dir), **asdict(cfg)}
    params |= {"num_train_examples": len(train_ex), "num_train_windows": len(train)}
    with start_run(f"finetune-{task}", params | {"device": str(device)}), atomic_dir(output) as tmp:
        import mlflow

        best, history, train_seconds = fit(
            model, len(train), lambda i: collate(train, i), evaluate, cfg, device,
            f"finetune {task}", mlflow.log_metrics,
        )  # fmt: skip
        preds, null_odds = best["preds"]
        result = result_record(
            task, best, history, cfg,
            squad_version=version,
            num_train_examples=len(train_ex),
            num_dev_examples=len(dev_ex),
            num_train_windows=len(train),
            train_seconds=train_seconds,
            train_examples_per_second=len(train_ex) * cfg.epochs / train_seconds,
            files={"train": str(train_path), "dev": dev_source},
            model=str(model_dir),
            device=str(device),
        )  # fmt: skip
        save_model(model, tmp / "model", task, None)
        (tmp / "predictions.json").write_text(json.dumps(preds, indent=2) + "\n")
        if version == "2.0":
            (tmp / "null_odds.json").write_text(json.dumps(null_odds, indent=2) + "\n")
        (tmp / "metrics.json").write_text(json.dumps(result, indent=2) + "\n")
        mlflow.log_metrics({"best_epoch": best["epoch"], "best_dev_score": best["score"]})
        mlflow.log_metrics({f"best_dev_{k}": v for k, v in result["metrics"].items()})
        mlflow.log_artifact(str(tmp / "metrics.json"))
    return result


def build_parser() -> argparse.ArgumentParser:
    """finetune's options with the paper's SQuAD defaults, plus windowing and decoding."""
    from bert_core.finetune import build_parser as finetune_parser

    p = finetune_parser()
    d = SquadConfig()
    p.set_defaults(learning_rate=d.learning_rate, max_seq_length=d.max_seq_length,
                   eval_batch_size=d.eval_batch_size)  # fmt: skip
    p.add_argument("--doc-stride", type=int, default=d.doc_stride)
    p.add_argument("--max-query-length", type=int, default=d.max_query_length)
    p.add_argument("--n-best-size", type=int, default=d.n_best_size)
    p.add_argument("--max-answer-length", type=int, default=d.max_answer_length)
    p.add_argument("--null-score-diff-threshold", type=float, default=d.null_score_diff_threshold)
    p.add_argument(
        "--download", action="store_true",
        help=f"first fetch the official files into --data when missing ({OFFICIAL_URL})",
    )  # fmt: skip
    return p


def main(argv: list[str] | None = None) -> int:
    """`bert finetune --task squad|squad_v2 ...`."""
    from bert_core.ner import config_from_args

    args = build_parser().parse_args(argv)
    task = args.task.lower()
    if task not in VERSIONS:
        raise ValueError(f"bert_core.squad handles --task {'|'.join(VERSIONS)}, not {args.task!r}")
    cfg = config_from_args(args, SquadConfig)
    if cfg.doc_stride < 1 or cfg.max_query_length < 1 or cfg.max_answer_length < 1:
        raise ValueError("--doc-stride, --max-query-length, --max-answer-length must be >= 1")
    if args.download and not (Path(args.data) / f"train-v{VERSIONS[task]}.json").is_file():
        download(args.data, VERSIONS[task])
    result = finetune(task, args.data, args.model, args.output, cfg)
    print(json.dumps({"task": task, "metrics": result["metrics"],
                      "best_epoch": result["best_epoch"], "output": str(args.output)}))  # fmt: skip
    return 0
