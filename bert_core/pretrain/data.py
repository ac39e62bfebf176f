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

import fnmatch
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import torch

from bert_core.data import masking
from bert_core.data.masking import MaskingRecipe
from bert_core.errors import InputError
from bert_core.storage import filesystem

COLUMNS = ("input_ids", "token_type_ids", "masked_lm_positions", "masked_lm_ids")
LABEL_COLUMN = "next_sentence_label"
# The Parquet metadata key `bert instances` writes its --max-seq-length under (as the columns,
# the shards' format is `bert_core.data.instance_shards`'; not imported, to keep the steps apart).
SEQ_LENGTH_KEY = b"bert.max_seq_length"


@dataclass(frozen=True)
class RowGroup:
    """One Parquet row group: the unit that ranks share out."""

    path: str
    index: int
    num_rows: int


@dataclass(frozen=True)
class MaskingConfig:
    """RoBERTa-style dynamic masking, with BERT's replacement rule (80/10/10 by default)."""

    vocab_size: int
    mask_id: int
    special_ids: tuple[int, ...]
    masked_lm_prob: float = 0.15
    max_predictions_per_seq: int = 20
    recipe: MaskingRecipe = MaskingRecipe()


def _join(base: str | Path, name: str) -> str:
    return f"{str(base).rstrip('/')}/{name}"


def open_parquet(path: str) -> pq.ParquetFile:
    """A Parquet file from a local path or an s3:// URI (endpoint as in bert_core.storage)."""
    fs, inner = filesystem(path)
    return pq.ParquetFile(fs.open_input_file(inner))


def shards(instances_dir: str | Path) -> Iterator[tuple[str, pq.ParquetFile]]:
    """(path, opened file) of every `shard-*.parquet`, each checked to be a readable Parquet
    file with the expected columns (only footers are read)."""
    fs, base = filesystem(instances_dir)
    infos = fs.get_file_info(pafs.FileSelector(base, allow_not_found=True))
    names = sorted(i.base_name for i in infos if fnmatch.fnmatch(i.base_name, "shard-*.parquet"))
    if not names:
        raise InputError(instances_dir, "no shard-*.parquet files (run `bert instances` first)")
    for shard in (_join(instances_dir, n) for n in names):
        try:
            meta = open_parquet(shard)
        except Exception as e:  # pyarrow raises several types for a corrupt footer
            raise InputError(shard, f"not a readable Parquet file ({e})") from e
        missing = set(COLUMNS + (LABEL_COLUMN,)) - set(meta.schema_arrow.names)
        if missing:
            raise InputError(shard, f"missing columns {sorted(missing)}")
        yield shard, meta


def list_row_groups(instances_dir: str | Path) -> list[RowGroup]:
    """All row groups of `shard-*.parquet`, after checking each shard has the expected columns."""
    groups = []
    for shard, meta in shards(instances_dir):
        groups += [
            RowGroup(shard, i, meta.metadata.row_group(i).num_rows)
            for i in range(meta.num_row_groups)
            if meta.metadata.row_group(i).num_rows
        ]
    if not groups:
        raise InputError(instances_dir, "the shards hold no instances")
    return groups


def seq_length(shard: pq.ParquetFile) -> int:
    """The longest sequence a shard may hold: the --max-seq-length `bert instances` keeps in
    the file's metadata (`SEQ_LENGTH_KEY`); for shards made otherwise, the longest sequence of
    its first row group."""
    import pyarrow.compute as pc

    meta = shard.schema_arrow.metadata or {}
    if SEQ_LENGTH_KEY in meta:
        return int(meta[SEQ_LENGTH_KEY])
    if not shard.num_row_groups:
        return 0
    ids = shard.read_row_group(0, columns=["input_ids"]).column(0)
    return int(pc.max(pc.list_value_length(ids)).as_py() or 0)


def check_seq_length(instances_dir: str | Path, max_positions: int, model: str) -> None:
    """Every shard's sequences fit the model's positions; checked before Ray starts, since a
    longer sequence fails only in a worker's first forward pass, as a traceback."""
    for shard, meta in shards(instances_dir):
        length = seq_length(meta)
        if length > max_positions:
            raise InputError(
                shard,
                f"sequences of up to {length} tokens, more than max_position_embeddings "
                f"{max_positions} of {model}: make the instances with --max-seq-length "
                f"{max_positions} or less",
            )


def read_instances_config(instances_dir: str | Path) -> dict:
    """The settings `bert instances` made the shards with (stats.json's `config`: masking
    recipe, sequence length, dupe factor, held-out share...); {} for shards without one. A
    stats.json that is not JSON is an error naming it and the line (the driver reads it first,
    `bert_core.pretrain.checks`, so a worker never meets it)."""
    import json

    path = _join(instances_dir, "stats.json")
    fs, inner = filesystem(path)
    if fs.get_file_info(inner).type != pafs.FileType.File:
        return {}
    with fs.open_input_stream(inner) as f:
        text = f.read().decode("utf-8", errors="replace")
    try:
        return dict(json.loads(text).get("config", {}))
    except json.JSONDecodeError as e:
        raise InputError(path, f"not valid JSON ({e.msg})", line=e.lineno) from None


def dynamic_masking(
    vocab: dict[str, int], instances_dir: str | Path, given: dict[str, Any]
) -> tuple[MaskingConfig, dict[str, tuple]]:
    """Dynamic masking for this vocabulary, and its settings as (value, where from): each option
    `given` (not None), else the instances' own (stats.json's config: what `bert instances`
    masked them with), else MaskingConfig's. Why the instances': 512-token ones are made for ~76
    predictions a sequence, and a 128-token default of 20 would predict 3.9 % of their tokens,
    not 15 %, silently. Values from stats.json are checked as the options are."""
    made, settings = read_instances_config(instances_dir), {}
    for name, default in (("masked_lm_prob", MaskingConfig.masked_lm_prob),
                          ("max_predictions_per_seq", MaskingConfig.max_predictions_per_seq),
                          ("masking_recipe", masking.DEFAULT_RECIPE)):  # fmt: skip
        if given.get(name) is not None:
            settings[name] = (given[name], "option")
        else:
            settings[name] = (made[name], "instances") if name in made else (default, "default")
    (prob, _), (most, _), (recipe, _) = settings.values()
    if not (isinstance(prob, float) and 0 < prob < 1 and isinstance(most, int) and most >= 1):
        raise InputError(
            _join(instances_dir, "stats.json"),
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


class InstanceStream:
    """Endless, deterministic stream of padded batches for one rank.

    `start_sample` is the data position: how many samples this rank consumed before (resume).
    """

    def __init__(
        self,
        groups: list[RowGroup],
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        start_sample: int = 0,
        masking: MaskingConfig | None = None,
        pad_id: int = 0,
        next_token: bool = False,
    ):
        self.groups, self.batch_size = groups, batch_size
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.start_sample, self.masking, self.pad_id = start_sample, masking, pad_id
        self.next_token = next_token

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
                table = _read_group(self.groups[g])
                for r in rows[skip:]:
                    yield _instance(table, r)
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


def _read_group(group: RowGroup) -> list:
    """One row group as (offsets, values) per list column plus the label array."""
    table = open_parquet(group.path).read_row_group(group.index, columns=[*COLUMNS, LABEL_COLUMN])
    out = []
    for name in COLUMNS:
        arr = table.column(name).combine_chunks()
        out.append((arr.offsets.to_numpy(), arr.values.to_numpy()))
    out.append(table.column(LABEL_COLUMN).to_numpy())
    return out


def _instance(table: list, r: int) -> tuple[np.ndarray, ...]:
    """Row `r` of a `_read_group` table: ids, types, positions, labels, next-sentence label."""
    return tuple(_row(col, r) for col in table[:4]) + (table[4][r],)


def _row(col: tuple[np.ndarray, np.ndarray], r: int) -> np.ndarray:
    offsets, values = col
    return values[offsets[r] : offsets[r + 1]]


def read_rows(groups: list[RowGroup], limit: int) -> list[tuple[np.ndarray, ...]]:
    """The first `limit` rows of `groups` in stored order (as `collate` takes them): a fixed
    set, for evaluation."""
    rows: list[tuple[np.ndarray, ...]] = []
    for group in groups:
        table = _read_group(group)
        take = min(group.num_rows, limit - len(rows))
        rows += [_instance(table, r) for r in range(take)]
        if len(rows) >= limit:
            break
    return rows


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
