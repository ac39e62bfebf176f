"""The official SQuAD scores (evaluate-v1.1.py, evaluate-v2.0.py), and v2.0's best threshold.

Exact match and F1 after the scripts' answer normalisation (lower-case, no punctuation, no
articles, single spaces), the max over a question's gold answers, the mean over questions; as
fractions (x 100 for the official scale). For SQuAD 2.0 an empty answer means "no answer".

SQuAD 2.0 also has the null-score threshold tuned on dev, as `find_best_thresh` of the official
v2 script does with `--na-prob-file` (`best_thresholds`): questions sorted by their null odds
(null score minus the best span's score, `null_odds.json`), the threshold that maximises EM
(or F1) when every question with odds up to it is answered with its best span and every other
one left unanswered. The paper: "We predict a non-null answer when s_hat > s_null + tau, where
the threshold tau is selected on the dev set to maximize F1." The tuned score is reported beside
the untuned one (the configured `--null-score-diff-threshold`), never instead of it.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Sequence

import numpy as np

from bert_core.finetune.tasks.squad_data import Example


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


def apply_threshold(spans: dict[str, str], null_odds: dict[str, float], threshold: float):
    """The answers at one threshold: no answer ("") where the null odds exceed it."""
    return {q: "" if null_odds[q] > threshold else text for q, text in spans.items()}


def best_thresholds(
    examples: Sequence[Example], spans: dict[str, str], null_odds: dict[str, float]
):
    """`find_best_thresh` of evaluate-v2.0.py for EM and F1: `best_exact`, `best_exact_thresh`,
    `best_f1`, `best_f1_thresh` (scores as fractions).

    `spans` are the best non-null answers, `null_odds` the null score minus the best span's.
    Starting from "nothing answered" (every no-answer question right), questions are answered
    in increasing null odds; the best running score and the odds where it was reached win
    (ties: the lowest threshold, as the script's strict `>`)."""
    has_answer = {ex.qid: bool(ex.answers) for ex in examples}
    out = {}
    for name, score in (("exact", exact_match), ("f1", f1_v2)):
        raw = {}
        for ex in examples:
            gold = [t for t, _ in ex.answers if normalize_answer(t)] or [""]
            raw[ex.qid] = max(score(spans.get(ex.qid, ""), g) for g in gold)
        current = best = sum(not h for h in has_answer.values())
        best_thresh = 0.0
        for qid in sorted(null_odds, key=lambda q: null_odds[q]):
            if qid not in raw:
                continue
            if has_answer[qid]:
                current += raw[qid]
            elif spans.get(qid):
                current -= 1
            if current > best:
                best, best_thresh = current, null_odds[qid]
        out[f"best_{name}"] = best / len(raw)
        out[f"best_{name}_thresh"] = float(best_thresh)
    return out
