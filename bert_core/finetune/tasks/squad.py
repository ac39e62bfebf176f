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

Scores are the official evaluate-v1.1.py / evaluate-v2.0.py ones
(`bert_core.finetune.tasks.squad_metrics`), as fractions; for SQuAD 2.0 also with the null threshold
tuned on dev as the v2 script's best-threshold search does (`best_exact`, `best_f1` and their
`*_thresh`), beside the untuned `exact_match`/`f1` (at `--null-score-diff-threshold`), which choose
the best epoch.

Input: a folder with the official SQuAD JSON (`train-v1.1.json`/`dev-v1.1.json`,
`train-v2.0.json`/`dev-v2.0.json`, or `train.json`/`dev.json`). Without a dev file the train
file is split by article, deterministically: every fifth article (index % 5 == 4) is dev, so no
paragraph is in both. Output (atomic): `model/`, `metrics.json`, `predictions.json` (official
format: question id -> answer text) and, for SQuAD 2.0, `null_odds.json`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from bert_core.errors import BadValue, InputError
from bert_core.finetune.engine import (
    Epoch,
    FinetuneConfig,
    FinetuneTask,
    option,
    pad,
    padding_mask,
    predict_batches,
    sample,
)
from bert_core.finetune.tasks.squad_data import (  # noqa: F401 (re-exported: the task's data)
    DEV_EVERY,
    OFFICIAL_URL,
    VERSIONS,
    Example,
    download,
    find_files,
    read_squad,
)
from bert_core.finetune.tasks.squad_metrics import (  # noqa: F401 (the official scores, re-exported)
    apply_threshold,
    best_thresholds,
    exact_match,
    f1_v1,
    f1_v2,
    normalize_answer,
    squad_metrics,
)
from bert_core.metrics import percent


@dataclass
class SquadConfig(FinetuneConfig):
    """FinetuneConfig with the paper's SQuAD settings and run_squad.py's windowing/decoding."""

    learning_rate: float = 5e-5
    max_seq_length: int = 384
    doc_stride: int = option(128, "tokens the window start advances by in a long context")
    max_query_length: int = option(64, "question tokens at most (longer: an error)")
    n_best_size: int = option(20, "best starts and ends of each window considered")
    max_answer_length: int = option(30, "answer tokens at most")
    null_score_diff_threshold: float = option(0.0, "SQuAD 2.0: null answer margin")
    eval_batch_size: int = 64

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.doc_stride < 1 or self.max_query_length < 1 or self.max_answer_length < 1:
            raise BadValue("--doc-stride, --max-query-length, --max-answer-length must be >= 1")


@dataclass
class SquadV2Config(SquadConfig):
    """SQuAD 2.0's own settings in the paper (section 4.3): 2 epochs at batch size 48 (v1.1:
    3 epochs at 32, the defaults above); learning rate 5e-5 for both."""

    epochs: int = 2
    batch_size: int = 48


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
    examples: Sequence[Example],
    tokenizer,
    cfg: SquadConfig,
    source: str | Path = "<input>",
    train: bool = False,
) -> Features:
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
                source,
                f"question {ex.qid}: {len(q.ids)} tokens, more than max_query_length "
                f"{cfg.max_query_length}",
            )
        doc_ids, doc_offsets = by_context[ex.context]
        if len(doc_ids) == 0:
            raise InputError(source, f"question {ex.qid}: context has no tokens")
        max_tokens = cfg.max_seq_length - len(q.ids) - 3
        if max_tokens < 1:
            raise BadValue(f"max_seq_length {cfg.max_seq_length} leaves no room for context")
        answer = None
        if train and ex.answers:
            text, char_start = ex.answers[0]
            answer = answer_tokens(doc_offsets, char_start, char_start + len(text))
        spans = doc_spans(len(doc_ids), max_tokens, cfg.doc_stride)
        prefix = len(q.ids) + 2
        owner = max_context_window(len(doc_ids), spans)
        first_window = len(f.max_context)
        for s, n in spans:
            window = [cls_id, *q.ids, sep_id, *doc_ids[s : s + n], sep_id]
            f.input_ids.append(np.asarray(window, dtype=np.int64))
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


def predict_logits(model, f: Features, device, batch_size: int) -> list[tuple[np.ndarray, ...]]:
    """(start_logits, end_logits) of every window, unpadded, in input order."""
    out: list = [None] * len(f)
    lengths = [len(x) for x in f.input_ids]
    for index, o in predict_batches(model, lengths, lambda i: collate(f, i), device, batch_size):
        s, e = o.start_logits.float().cpu().numpy(), o.end_logits.float().cpu().numpy()
        for row, i in enumerate(index):
            n = len(f.input_ids[i])
            out[i] = (s[row, :n], e[row, :n])
    return out


def best_span(
    sl: np.ndarray, el: np.ndarray, offsets: np.ndarray, max_context: np.ndarray, cfg: SquadConfig
) -> tuple[float, int, int] | None:
    """The best answer span of one window: (start + end logit, start, end) over the n-best
    starts and ends that lie in the context, start in its max-context part, end >= start and
    at most max_answer_length tokens long (`run_squad.py`'s rules); None when no span is valid.
    The one search of the training-time `decode` and the served predictor."""
    k = min(cfg.n_best_size, len(sl))
    S, E = np.meshgrid(np.argsort(-sl)[:k], np.argsort(-el)[:k], indexing="ij")
    in_context = offsets[:, 0] >= 0
    valid = (
        in_context[S]
        & in_context[E]
        & max_context[S]
        & (E >= S)
        & (E - S + 1 <= cfg.max_answer_length)
    )
    if not valid.any():
        return None
    score = np.where(valid, sl[S] + el[E], -np.inf)
    j = np.unravel_index(int(score.argmax()), score.shape)
    return float(score[j]), int(S[j]), int(E[j])


def decode(
    examples: Sequence[Example],
    f: Features,
    logits: Sequence[tuple[np.ndarray, np.ndarray]],
    cfg: SquadConfig,
    version_2: bool,
) -> tuple[dict[str, str], dict[str, float]]:
    """Best answer text per question id, and (SQuAD 2.0) null score minus best span score."""
    best: dict[int, tuple[float, str]] = {}
    null: dict[int, float] = {}
    for w, (sl, el) in enumerate(logits):
        i = int(f.example_index[w])
        null[i] = min(null.get(i, np.inf), float(sl[0] + el[0]))
        span = best_span(sl, el, f.offsets[w], f.max_context[w], cfg)
        if span is None:
            continue
        score, s, e = span
        if i not in best or score > best[i][0]:
            ctx = examples[i].context
            best[i] = (score, ctx[f.offsets[w][s, 0] : f.offsets[w][e, 1]])
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
# The task


class SquadFinetune(FinetuneTask):
    """SQuAD 1.1 / 2.0 for the engine: windows over the context, span decoding, official EM/F1."""

    config_class = SquadConfig
    model_class = "BertForQuestionAnswering"  # start and end logits: no label names
    download_help = OFFICIAL_URL
    score_metric = "f1"

    def __init__(self, name: str):
        super().__init__(name)
        self.version = VERSIONS[name]
        if self.version == "2.0":
            self.config_class = SquadV2Config

    def download(self, data_dir: Path) -> None:
        if not (Path(data_dir) / f"train-v{self.version}.json").is_file():
            download(data_dir, self.version)

    def prepare(self, data_dir: Path, tokenizer, cfg: SquadConfig) -> dict:
        version = self.version
        train_path, dev_path = find_files(data_dir, version)
        if dev_path is None:
            train_ex = read_squad(train_path, version, split="train")
            dev_ex = read_squad(train_path, version, split="dev")
            dev_source = f"{train_path} (articles with index % {DEV_EVERY} == {DEV_EVERY - 1})"
        else:
            train_ex, dev_ex = read_squad(train_path, version), read_squad(dev_path, version)
            dev_source = str(dev_path)
        self.files = {"train": str(train_path), "dev": dev_source}
        train_ex = sample(train_ex, cfg.max_train_examples, cfg.seed)
        self.dev_examples = sample(dev_ex, cfg.max_eval_examples, cfg.seed)
        tokenizer.no_truncation()  # windows, not truncation
        self.train = featurize(train_ex, tokenizer, cfg, train_path, train=True)
        self.dev = featurize(self.dev_examples, tokenizer, cfg, dev_path or train_path)
        self.num_train, self.num_train_examples = len(self.train), len(train_ex)
        return {"num_train_examples": len(train_ex), "num_train_windows": len(self.train)}

    def train_batch(self, index):
        return collate(self.train, index)

    def evaluate(self, model, device, cfg: SquadConfig):
        logits = predict_logits(model, self.dev, device, cfg.eval_batch_size)
        if self.version == "1.1":
            preds, null_odds = decode(self.dev_examples, self.dev, logits, cfg, False)
            metrics = squad_metrics(self.dev_examples, preds, self.version)
            return metrics, percent("f1", metrics["f1"]), (preds, null_odds)
        # 2.0: the best spans and their null odds, then the answers at the set threshold
        no_null = replace(cfg, null_score_diff_threshold=math.inf)
        spans, null_odds = decode(self.dev_examples, self.dev, logits, no_null, True)
        preds = apply_threshold(spans, null_odds, cfg.null_score_diff_threshold)
        metrics = squad_metrics(self.dev_examples, preds, self.version)
        metrics |= best_thresholds(self.dev_examples, spans, null_odds)
        return metrics, percent("f1", metrics["f1"]), (preds, null_odds)

    def baseline(self) -> tuple[float, str]:
        """No answer to any question: 0 on 1.1; on 2.0 the share of unanswerable questions."""
        metrics = squad_metrics(self.dev_examples, {}, self.version)
        return percent("f1", metrics["f1"]), "no answer to any question"

    def summary(self, best: Epoch) -> dict:
        return {
            "squad_version": self.version,
            "num_train_examples": self.num_train_examples,
            "num_dev_examples": len(self.dev_examples),
            "num_train_windows": self.num_train,
            "files": self.files,
        }

    def write_outputs(self, out: Path, model, predictions, device, cfg) -> None:
        """predictions.json (official format: id -> answer) and, for 2.0, null_odds.json."""
        preds, null_odds = predictions
        (out / "predictions.json").write_text(json.dumps(preds, indent=2) + "\n")
        if self.version == "2.0":
            (out / "null_odds.json").write_text(json.dumps(null_odds, indent=2) + "\n")
