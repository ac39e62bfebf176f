"""The instance shards as files: find every `shard-*.parquet` of an instances folder (local or
s3://), check its columns and sequence length from the footers alone, list its row groups (the
unit ranks share out), read a row group's columns, and read the settings `bert instances` made
them with (stats.json). What a batch is made of them is `bert_core.pretrain.data`'s.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.fs as pafs
import pyarrow.parquet as pq

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


def join(base: str | Path, name: str) -> str:
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
    for shard in (join(instances_dir, n) for n in names):
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


def longest_sequence(instances_dir: str | Path) -> int:
    """The longest sequence any shard of `instances_dir` may hold (`seq_length`'s, over all)."""
    return max(seq_length(meta) for _, meta in shards(instances_dir))


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

    path = join(instances_dir, "stats.json")
    fs, inner = filesystem(path)
    if fs.get_file_info(inner).type != pafs.FileType.File:
        return {}
    with fs.open_input_stream(inner) as f:
        text = f.read().decode("utf-8", errors="replace")
    try:
        return dict(json.loads(text).get("config", {}))
    except json.JSONDecodeError as e:
        raise InputError(path, f"not valid JSON ({e.msg})", line=e.lineno) from None


def read_group(group: RowGroup) -> list:
    """One row group as (offsets, values) per list column plus the label array."""
    table = open_parquet(group.path).read_row_group(group.index, columns=[*COLUMNS, LABEL_COLUMN])
    out = []
    for name in COLUMNS:
        arr = table.column(name).combine_chunks()
        out.append((arr.offsets.to_numpy(), arr.values.to_numpy()))
    out.append(table.column(LABEL_COLUMN).to_numpy())
    return out


def instance(table: list, r: int) -> tuple[np.ndarray, ...]:
    """Row `r` of a `read_group` table: ids, types, positions, labels, next-sentence label."""
    return tuple(_row(col, r) for col in table[:4]) + (table[4][r],)


def _row(col: tuple[np.ndarray, np.ndarray], r: int) -> np.ndarray:
    offsets, values = col
    return values[offsets[r] : offsets[r + 1]]


def read_rows(groups: list[RowGroup], limit: int) -> list[tuple[np.ndarray, ...]]:
    """The first `limit` rows of `groups` in stored order (as `collate` takes them): a fixed
    set, for evaluation."""
    rows: list[tuple[np.ndarray, ...]] = []
    for group in groups:
        table = read_group(group)
        take = min(group.num_rows, limit - len(rows))
        rows += [instance(table, r) for r in range(take)]
        if len(rows) >= limit:
            break
    return rows
