"""The CoNLL shared tasks' official scorer, `conlleval` (Tjong Kim Sang), in Python.

The paper's CoNLL-2003 F1 is conlleval's, and so is `bert finetune --task conll2003`'s headline
(epoch choice, tables, MLflow, registry). It differs from seqeval's strict IOB2 mode (the second
metric, `strict_f1`) on ill-formed predictions, because conlleval reads
chunks tolerantly, tag by tag, the same rules for IOB1 and IOB2:

- a chunk starts at B-X, at I-X after O, and at any tag whose type differs from the previous
  tag's type (so `O I-PER` is a PER chunk, and `B-PER I-LOC` two chunks, PER and LOC);
- a chunk ends before B, before O, and before a tag of another type;
- a predicted chunk is correct when it starts and ends where a gold chunk does, with its type.

seqeval strict (IOB2) instead drops an entity that does not start with B-, so conlleval's F1 is
the same or higher. Sentence boundaries end every chunk (the script's blank line is an O).
Precision, recall and F1 are over chunks (micro), plus per type; accuracy is over tokens. This
follows the perl script's `endOfChunk`/`startOfChunk` and its counting loop (IOBES tags and the
bracket tags `[`/`]` included), not a re-derivation.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence


def split_tag(tag: str) -> tuple[str, str]:
    """'B-PER' -> ('B', 'PER'); 'O' -> ('O', '')."""
    prefix, _, kind = tag.partition("-")
    return (prefix, kind) if _ else (tag, "")


def end_of_chunk(prev_tag: str, tag: str, prev_type: str, type_: str) -> bool:
    """Did a chunk end between the previous word and this one (`endOfChunk`)?"""
    if (prev_tag, tag) in {
        ("B", "B"),
        ("B", "O"),
        ("I", "B"),
        ("I", "O"),
        ("E", "E"),
        ("E", "I"),
        ("E", "O"),
    }:
        return True
    if prev_tag not in ("O", ".") and prev_type != type_:
        return True
    return prev_tag in ("]", "[")


def start_of_chunk(prev_tag: str, tag: str, prev_type: str, type_: str) -> bool:
    """Did a chunk start at this word (`startOfChunk`)?"""
    if (prev_tag, tag) in {
        ("B", "B"),
        ("I", "B"),
        ("O", "B"),
        ("O", "I"),
        ("E", "E"),
        ("E", "I"),
        ("O", "E"),
    }:
        return True
    if tag not in ("O", ".") and prev_type != type_:
        return True
    return tag in ("[", "]")


def _prf(correct: int, guessed: int, gold: int) -> dict[str, float]:
    p = correct / guessed if guessed else 0.0
    r = correct / gold if gold else 0.0
    return {"precision": p, "recall": r, "f1": 2 * p * r / (p + r) if p + r else 0.0}


def conlleval(gold: Sequence[Sequence[str]], pred: Sequence[Sequence[str]]) -> dict:
    """conlleval's scores of `pred` against `gold` (lists of sentences of tags), as fractions:
    precision, recall, f1 (chunks, micro), accuracy (tokens), and `per_type` with chunk counts."""
    correct_chunks, found_gold, found_guessed = Counter(), Counter(), Counter()
    correct_tags = tokens = 0
    for gold_sentence, pred_sentence in zip(gold, pred, strict=True):
        if len(gold_sentence) != len(pred_sentence):
            raise ValueError("gold and predicted sentences differ in length")
        # each sentence is followed by the script's boundary line: tags O, O
        last_c, last_ct, last_g, last_gt = "O", "", "O", ""
        in_correct = False
        for c_tag, g_tag in [*zip(gold_sentence, pred_sentence, strict=True), ("O", "O")]:
            c, ct = split_tag(c_tag)
            g, gt = split_tag(g_tag)
            end_c, end_g = (
                end_of_chunk(last_c, c, last_ct, ct),
                end_of_chunk(last_g, g, last_gt, gt),
            )
            start_c, start_g = (
                start_of_chunk(last_c, c, last_ct, ct),
                start_of_chunk(last_g, g, last_gt, gt),
            )
            if in_correct:
                if end_c and end_g and last_gt == last_ct:
                    in_correct = False
                    correct_chunks[last_ct] += 1
                elif end_c != end_g or gt != ct:
                    in_correct = False
            if start_c and start_g and gt == ct:
                in_correct = True
            found_gold[ct] += start_c
            found_guessed[gt] += start_g
            last_c, last_ct, last_g, last_gt = c, ct, g, gt
        tokens += len(gold_sentence)
        correct_tags += sum(a == b for a, b in zip(gold_sentence, pred_sentence, strict=True))
    types = sorted(
        t for t in set(found_gold) | set(found_guessed) if found_gold[t] or found_guessed[t]
    )
    total = sum(correct_chunks.values()), sum(found_guessed.values()), sum(found_gold.values())
    return {
        **_prf(*total),
        "accuracy": correct_tags / tokens if tokens else 0.0,
        "chunks": {"correct": total[0], "found": total[1], "gold": total[2]},
        "per_type": {
            t: _prf(correct_chunks[t], found_guessed[t], found_gold[t])
            | {"support": found_gold[t], "found": found_guessed[t]}
            for t in types
        },
    }
