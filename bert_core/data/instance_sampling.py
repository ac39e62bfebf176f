"""The sampling algorithm of google-research/bert's `create_pretraining_data.py`, ported function
by function: how one document becomes MLM/NSP instances, and how their tokens are masked.

- `create_instances_from_document` (the original's function of that name): `target_seq_length`
  is `max_seq_length - 3`, or with probability `short_seq_prob` a random length in
  [2, max_seq_length - 3], to reduce the pre-training / fine-tuning length mismatch. Sentences
  are accumulated into a chunk until it reaches the target; a random number of them forms
  segment A. With probability 0.5 (always if the chunk is one sentence) segment B is a random
  span of another document (`next_sentence_label` 1) and the unused sentences are put back;
  otherwise B is the rest of the chunk (label 0).
- `truncate_pair_randomly` (the original's `truncate_seq_pair`) trims the longer segment one
  token at a time, from the front or the back at random, until `[CLS] A [SEP] B [SEP]` fits.
- `mask_batch` (the original's `create_masked_lm_predictions`, vectorised with numpy over all
  instances of a dupe round: a random permutation of the candidates per row, argsort of uniform
  keys, and the first `num_to_predict` taken, exactly the original's shuffle-then-take; the
  80/10/10 draws are i.i.d. as in the original) and `mask_whole_words` (whole-word masking, the
  original's per-instance loop and its exact sequence of random calls). Both follow the one
  masking rule of `bert_core.data.masking`.

Python's `random` drives the per-document decisions as in the original; `randint(a, b)` is
computed from one `random()` call (3x faster than `random.randint`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import NamedTuple

import numpy as np

from bert_core.data import masking
from bert_core.data.instance_config import InstanceConfig
from bert_core.data.tokenizer import read_vocab


@dataclass(frozen=True)
class Vocab:
    """What the algorithm needs from vocab.txt: special ids, size, which ids are `##` pieces."""

    size: int
    cls_id: int
    sep_id: int
    mask_id: int
    is_subword: np.ndarray  # bool [size]

    @classmethod
    def from_file(cls, vocab_file: Path) -> Vocab:
        vocab = read_vocab(vocab_file, required=("[UNK]", "[CLS]", "[SEP]", "[MASK]"))
        is_subword = np.zeros(len(vocab), dtype=bool)
        for token, i in vocab.items():
            is_subword[i] = token.startswith("##")
        return cls(len(vocab), vocab["[CLS]"], vocab["[SEP]"], vocab["[MASK]"], is_subword)


def randint(rng: random.Random, a: int, b: int) -> int:
    """Uniform integer in [a, b] like `rng.randint`, from one `random()` call (3x faster)."""
    return a + int(rng.random() * (b - a + 1))


def truncate_pair_randomly(
    tokens_a: list[int], tokens_b: list[int], max_num_tokens: int, rng: random.Random
) -> tuple[list[int], list[int]]:
    """Pre-training's trimming (`create_pretraining_data.truncate_seq_pair`): one token at a time
    from the longer segment (ties: B), from the front or the back by a fair coin; computed in
    closed form rather than token by token.

    Not fine-tuning's rule, which only ever cuts from the end (`run_classifier`'s
    `_truncate_seq_pair`, in `bert_core.finetune.engine`): the random front cuts are a pre-training
    regulariser ("to add more randomness and avoid biases"), while a fine-tuning example must
    keep its beginning.

    Which segment loses each token depends only on the lengths, so the number of tokens cut
    from A and from B is fixed; of the cuts on a segment, the number taken from the front is
    the number of heads in that many fair coin flips, i.e. the popcount of as many random bits.
    """
    overflow = len(tokens_a) + len(tokens_b) - max_num_tokens
    if overflow <= 0:
        return tokens_a, tokens_b
    gap = min(overflow, abs(len(tokens_a) - len(tokens_b)))
    rest = overflow - gap
    cut_a = (gap if len(tokens_a) > len(tokens_b) else 0) + rest // 2
    cut_b = overflow - cut_a
    front_a = rng.getrandbits(cut_a).bit_count() if cut_a else 0
    front_b = rng.getrandbits(cut_b).bit_count() if cut_b else 0
    return (
        tokens_a[front_a : len(tokens_a) - (cut_a - front_a)],
        tokens_b[front_b : len(tokens_b) - (cut_b - front_b)],
    )


class Pair(NamedTuple):
    """One unmasked instance: `[CLS] A [SEP] B [SEP]` as token ids, the length of segment A,
    and NSP's label (B is from another document)."""

    tokens: list[int]
    len_a: int
    is_random_next: bool


class DocumentInstances(NamedTuple):
    """What one document gives: its pairs, whether the short target length was drawn for it,
    and how many pairs were random-next by force (a one-sentence chunk has no actual next
    segment)."""

    pairs: list[Pair]
    short: bool
    forced_random_next: int


def create_instances_from_document(
    all_documents: list[list[list[int]]],
    document_index: int,
    cfg: InstanceConfig,
    rng: random.Random,
    vocab: Vocab,
) -> DocumentInstances:
    """The unmasked instances of one document; line by line the original's loop, kept as one
    function so that it reads against the original (and draws its random numbers in the same
    order)."""
    document = all_documents[document_index]
    lengths = list(map(len, document))
    last = len(document) - 1
    max_num_tokens = cfg.max_seq_length - 3
    target_seq_length = max_num_tokens
    short = rng.random() < cfg.short_seq_prob
    if short:
        target_seq_length = randint(rng, 2, max_num_tokens)

    instances: list[Pair] = []
    forced = 0
    current_chunk: list[list[int]] = []
    current_length = 0
    i = 0
    while i <= last:
        current_chunk.append(document[i])
        current_length += lengths[i]
        if i == last or current_length >= target_seq_length:
            if current_chunk:
                a_end = 1
                if len(current_chunk) >= 2:
                    a_end = randint(rng, 1, len(current_chunk) - 1)
                tokens_a = list(chain.from_iterable(current_chunk[:a_end]))
                tokens_b: list[int] = []
                if len(current_chunk) == 1 or rng.random() < 0.5:
                    is_random_next = True
                    forced += len(current_chunk) == 1
                    target_b_length = target_seq_length - len(tokens_a)
                    for _ in range(10):
                        random_document_index = randint(rng, 0, len(all_documents) - 1)
                        if random_document_index != document_index:
                            break
                    random_document = all_documents[random_document_index]
                    random_start = randint(rng, 0, len(random_document) - 1)
                    for j in range(random_start, len(random_document)):
                        tokens_b.extend(random_document[j])
                        if len(tokens_b) >= target_b_length:
                            break
                    # The unused sentences are "put back" so they don't go to waste.
                    i -= len(current_chunk) - a_end
                else:
                    is_random_next = False
                    tokens_b = list(chain.from_iterable(current_chunk[a_end:]))
                tokens_a, tokens_b = truncate_pair_randomly(tokens_a, tokens_b, max_num_tokens, rng)
                assert tokens_a and tokens_b
                tokens = [vocab.cls_id, *tokens_a, vocab.sep_id, *tokens_b, vocab.sep_id]
                instances.append(Pair(tokens, len(tokens_a), is_random_next))
            current_chunk = []
            current_length = 0
        i += 1
    return DocumentInstances(instances, short, forced)


def mask_batch(
    ids: np.ndarray,
    lengths: np.ndarray,
    cfg: InstanceConfig,
    vocab: Vocab,
    rng: np.random.Generator,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Masked LM predictions for a padded batch `ids` [N, L] (modified in place).

    Returns (positions [N, P], labels [N, P], count [N], decisions [N, P]) with positions
    sorted and only the first `count` of each row valid; decisions `masking.MASK` (0),
    `RANDOM` (1), `KEEP` (2).
    """
    n, width = ids.shape
    cols = np.arange(width)
    valid = cols[None, :] < lengths[:, None]
    cand = valid & masking.candidates(ids, (vocab.cls_id, vocab.sep_id))
    keys = rng.random((n, width))
    keys[~cand] = 2.0
    order = np.argsort(keys, axis=1, kind="stable")  # a random permutation of the candidates
    wanted = masking.num_to_predict(lengths, cfg.masked_lm_prob, cfg.max_predictions_per_seq)
    count = np.minimum(wanted, cand.sum(axis=1))
    p = min(cfg.max_predictions_per_seq, width)
    taken = np.arange(p)[None, :] < count[:, None]
    positions = np.sort(np.where(taken, order[:, :p], width), axis=1)
    rows = np.broadcast_to(np.arange(n)[:, None], positions.shape)
    safe = np.minimum(positions, width - 1)
    labels = ids[rows, safe]
    u, v = rng.random((n, p)), rng.random((n, p))
    random_ids = rng.integers(0, vocab.size, (n, p))
    decisions = cfg.recipe.decide(u, v)
    new = masking.replace(decisions, labels, vocab.mask_id, random_ids)
    ids[rows[taken], positions[taken]] = new[taken]
    return positions, labels, count, decisions


def mask_whole_words(
    tokens: list[int], cfg: InstanceConfig, vocab: Vocab, rng: random.Random
) -> tuple[list[int], list[int], list[int], list[int]]:
    """The original's whole-word masking for one instance (`##` pieces join the word before),
    with its exact sequence of `rng` calls (so the output is the original's for a seed)."""
    recipe = cfg.recipe
    cand = masking.candidates(tokens, (vocab.cls_id, vocab.sep_id))
    cand_indexes: list[list[int]] = []
    for i, token in enumerate(tokens):
        if not cand[i]:
            continue
        if cand_indexes and vocab.is_subword[token]:
            cand_indexes[-1].append(i)
        else:
            cand_indexes.append([i])
    rng.shuffle(cand_indexes)
    output = list(tokens)
    num_to_predict = masking.num_to_predict(
        len(tokens), cfg.masked_lm_prob, cfg.max_predictions_per_seq
    )
    masked: list[tuple[int, int, int]] = []
    covered: set[int] = set()
    for index_set in cand_indexes:
        if len(masked) >= num_to_predict:
            break
        if len(masked) + len(index_set) > num_to_predict:
            continue
        if any(i in covered for i in index_set):
            continue
        for index in index_set:
            covered.add(index)
            u = rng.random()
            # the second draw only when the first did not pick [MASK], as the original's elif
            decision = recipe.decide(u, rng.random() if u >= recipe.mask_prob else 0.0)
            if decision == masking.MASK:
                output[index] = vocab.mask_id
            elif decision == masking.RANDOM:
                output[index] = rng.randint(0, vocab.size - 1)
            masked.append((index, tokens[index], decision))
    masked.sort()
    return output, [m[0] for m in masked], [m[1] for m in masked], [m[2] for m in masked]
