"""Pre-training batches from instance shards: a rank-aware, resumable Parquet reader.

Why not Ray Data: every worker needs only a few MB/s of token ids, and on a small node the
streaming executor's extra processes cost more CPU than the reading itself. Instead each worker
reads its own Parquet row groups with pyarrow, in an order that is a pure function of
(seed, epoch, rank). The data position is therefore one number, the count of samples a rank has
consumed, and resuming is skipping that many samples using only the row-group sizes in the
Parquet footers (no data is read to skip).

Sharding: the row groups of all shards are the unit of work. Each epoch they are shuffled with
the same seed on every rank and dealt round-robin, so ranks read disjoint data. When there are
fewer row groups than ranks every rank reads every row group and keeps rows `rank::world_size`.
Rows inside a row group are shuffled too (`create_pretraining_data` already shuffled globally).

Dynamic masking (RoBERTa): with `masking` set, every sequence gets fresh masked positions each
time it is read, so unmasked shards (empty `masked_lm_positions`) can be used and masked shards
are re-masked from their original tokens, by the rule of `bert_core.data.masking`.

Next-token labels (`next_token`, Table 5's left-to-right LM): the stored masking is undone and
every token but the last predicts the one after it, in the same positions/labels layout, so the
model, the training step and the held-out evaluation read both objectives alike.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bert_core.data import masking
from bert_core.data.instance_config import InstanceConfig
from bert_core.data.masking import MaskingRecipe
from bert_core.errors import InputError
from bert_core.pretrain.shards import RowGroup, instance, join, read_group, read_instances_config


@dataclass(frozen=True)
class MaskingConfig:
    """RoBERTa-style dynamic masking, with BERT's replacement rule (80/10/10 by default); the
    defaults are `bert instances`' (one home: the paper's 15 %, 20 predictions a sequence)."""

    vocab_size: int
    mask_id: int
    special_ids: tuple[int, ...]
    masked_lm_prob: float = InstanceConfig.masked_lm_prob
    max_predictions_per_seq: int = InstanceConfig.max_predictions_per_seq
    recipe: MaskingRecipe = MaskingRecipe()


def dynamic_masking(
    vocab: dict[str, int], instances_dir: str | Path, given: dict[str, Any]
) -> tuple[MaskingConfig, dict[str, tuple]]:
    """Dynamic masking for this vocabulary, and its settings as (value, where from): each option
    `given` (not None), else the instances' own (stats.json's config: what `bert instances`
    masked them with), else MaskingConfig's. Why the instances': 512-token ones are made for ~76
    predictions a sequence, and a 128-token default of 20 would predict 3.9 % of their tokens,
    not 15 %, silently. Values from stats.json are checked as the options are."""
    made, settings = read_instances_config(instances_dir), {}
    for name, default in (
        ("masked_lm_prob", MaskingConfig.masked_lm_prob),
        ("max_predictions_per_seq", MaskingConfig.max_predictions_per_seq),
        ("masking_recipe", masking.DEFAULT_RECIPE),
    ):
        if given.get(name) is not None:
            settings[name] = (given[name], "option")
        else:
            settings[name] = (made[name], "instances") if name in made else (default, "default")
    (prob, _), (most, _), (recipe, _) = settings.values()
    if not (isinstance(prob, float) and 0 < prob < 1 and isinstance(most, int) and most >= 1):
        raise InputError(
            join(instances_dir, "stats.json"),
            f"masked_lm_prob {prob!r}, max_predictions_per_seq {most!r}: not usable; give the "
            "options --masked-lm-prob and --max-predictions-per-seq",
        )
    kw = {"masked_lm_prob": prob, "max_predictions_per_seq": most}
    return masking_config_from_vocab(vocab, recipe, **kw), settings


def masking_config_from_vocab(
    vocab: dict[str, int], recipe: MaskingRecipe | str = masking.DEFAULT_RECIPE, **kw
) -> MaskingConfig:
    """Dynamic masking for this vocabulary; `recipe` as `--masking-recipe` ("80/10/10")."""
    missing = [t for t in ("[MASK]", "[CLS]", "[SEP]", "[PAD]") if t not in vocab]
    if missing:
        raise InputError("vocab.txt", f"missing special tokens {missing}")
    specials = tuple(vocab[t] for t in ("[CLS]", "[SEP]", "[PAD]"))
    return MaskingConfig(
        len(vocab), vocab["[MASK]"], specials, recipe=MaskingRecipe.parse(recipe), **kw
    )


@dataclass
class InstanceStream:
    """Endless, deterministic stream of padded batches for one rank."""

    groups: list[RowGroup]
    batch_size: int
    rank: int = 0
    world_size: int = 1
    seed: int = 0
    start_sample: int = 0  # the data position: samples this rank consumed before (resume)
    masking: MaskingConfig | None = None  # dynamic masking's settings; None: the instances'
    pad_id: int = 0
    next_token: bool = False  # left-to-right: labels are the next token (Table 5's LTR)

    def _epoch_plan(self, epoch: int) -> list[tuple[int, np.ndarray]]:
        """(row-group number, row order) for this rank in one epoch; no data read."""
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self.groups))
        deal = len(self.groups) >= self.world_size
        mine = order[self.rank :: self.world_size] if deal else order
        plan = []
        for g in mine:
            rows = np.random.default_rng([self.seed, epoch, g]).permutation(self.groups[g].num_rows)
            plan.append((int(g), rows if deal else rows[self.rank :: self.world_size]))
        return plan

    def _rows(self) -> Iterator[tuple[np.ndarray, ...]]:
        skip, epoch = self.start_sample, 0
        while True:
            plan = self._epoch_plan(epoch)
            per_epoch = sum(len(rows) for _, rows in plan)
            if per_epoch == 0:
                raise InputError(self.groups[0].path, f"rank {self.rank} has no rows to read")
            if skip >= per_epoch:  # whole epochs are skipped without reading anything
                skip, epoch = skip - per_epoch, epoch + 1
                continue
            for g, rows in plan:
                if skip >= len(rows):
                    skip -= len(rows)
                    continue
                table = read_group(self.groups[g])
                for r in rows[skip:]:
                    yield instance(table, r)
                skip = 0
            epoch += 1

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        batch, n = [], self.start_sample // self.batch_size
        for row in self._rows():
            batch.append(row)
            if len(batch) == self.batch_size:
                rng = np.random.default_rng([self.seed, self.rank, n, 7])
                yield collate(batch, self.pad_id, self.masking, rng, self.next_token)
                batch, n = [], n + 1


def dynamic_mask(
    ids: np.ndarray, cfg: MaskingConfig, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mask one sequence as BERT does (`bert_core.data.masking`): choose ~masked_lm_prob of the
    non-special tokens, show each as [MASK], a random token or itself by `cfg.recipe` (80/10/10).
    Returns (input_ids, positions, labels)."""
    candidates = np.flatnonzero(masking.candidates(ids, cfg.special_ids))
    n = masking.num_to_predict(len(ids), cfg.masked_lm_prob, cfg.max_predictions_per_seq)
    positions = np.sort(rng.choice(candidates, size=min(n, len(candidates)), replace=False))
    labels = ids[positions].copy()
    size = len(positions)
    decisions = cfg.recipe.decide(rng.random(size), rng.random(size))
    random_ids = rng.integers(0, cfg.vocab_size, size=size)
    ids = ids.copy()
    ids[positions] = masking.replace(decisions, labels, cfg.mask_id, random_ids)
    return ids, positions, labels


def collate(
    rows: list[tuple[np.ndarray, ...]],
    pad_id: int = 0,
    masking: MaskingConfig | None = None,
    rng: np.random.Generator | None = None,
    next_token: bool = False,
) -> dict[str, torch.Tensor]:
    """Pad a batch to its longest sequence (and longest prediction list) as the model expects:
    positions padded with 0, labels with -100 (ignored), attention_mask 1 on real tokens.
    `next_token`: the unmasked text, each position but the last labelled with the next token."""
    seqs = []
    for ids, types, positions, labels, nsp in rows:
        if next_token or masking is not None:
            ids = ids.astype(np.int64)
            ids[positions] = labels  # undo the stored masking: the original text
            if next_token:
                positions, labels = np.arange(len(ids) - 1), ids[1:]
            else:  # mask afresh
                ids, positions, labels = dynamic_mask(ids, masking, rng)
        elif len(positions) == 0:
            raise InputError("instances", "a sequence has no masked positions: use dynamic masking")
        seqs.append((ids, types, positions, labels, nsp))
    b = len(seqs)
    length = max(len(s[0]) for s in seqs)
    preds = max(len(s[2]) for s in seqs)
    input_ids = torch.full((b, length), pad_id, dtype=torch.long)
    token_type_ids = torch.zeros((b, length), dtype=torch.long)
    attention_mask = torch.zeros((b, length), dtype=torch.long)
    positions = torch.zeros((b, preds), dtype=torch.long)
    labels = torch.full((b, preds), -100, dtype=torch.long)
    for i, (ids, types, pos, lab, _) in enumerate(seqs):
        input_ids[i, : len(ids)] = torch.from_numpy(np.asarray(ids, dtype=np.int64))
        token_type_ids[i, : len(types)] = torch.from_numpy(np.asarray(types, dtype=np.int64))
        attention_mask[i, : len(ids)] = 1
        positions[i, : len(pos)] = torch.from_numpy(np.asarray(pos, dtype=np.int64))
        labels[i, : len(lab)] = torch.from_numpy(np.asarray(lab, dtype=np.int64))
    nsp = torch.tensor([int(s[4]) for s in seqs], dtype=torch.long)
    return {
        "input_ids": input_ids,
        "token_type_ids": token_type_ids,
        "attention_mask": attention_mask,
        "masked_lm_positions": positions,
        "masked_lm_labels": labels,
        "next_sentence_label": nsp,
    }


def prefetch(iterable, depth: int = 4) -> Iterator:
    """Produce items in a background thread so reading and padding overlap the training step
    (pyarrow and numpy release the GIL). Order is unchanged, so determinism is kept."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    done = object()
    stop = threading.Event()

    def produce():
        try:
            for item in iterable:
                while not stop.is_set():
                    try:
                        q.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            q.put(done)
        except BaseException as e:  # hand the error to the consumer
            q.put(e)

    thread = threading.Thread(target=produce, daemon=True, name="bert-prefetch")
    thread.start()
    try:
        while True:
            item = q.get()
            if item is done:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
