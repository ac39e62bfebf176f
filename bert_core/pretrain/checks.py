"""What `bert pretrain`'s driver checks before Ray starts, in seconds.

Inside Ray every mistake in the input surfaces late and loud: a worker's traceback, Ray Train's
restarts (`max_failures`), half a minute and a few hundred lines of log, and a `ray/` folder left
behind. So the driver reads what it can cheaply and refuses bad input with one line naming the
file: the vocabulary (and that it is the `--init-model`'s own, token for token), the init model,
and every shard's schema, sequence length and id ranges. The ranges come from the Parquet footers'
column statistics (min/max per row group, which pyarrow writes by default), so a terabyte of
shards is checked without reading its data; a row group without statistics is read.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from bert_core.data.tokenizer import read_vocab
from bert_core.errors import BertError, InputError
from bert_core.model.config import BertConfig
from bert_core.model.modeling import CONFIG_NAME, BertForPreTraining
from bert_core.pretrain.config import PretrainConfig
from bert_core.pretrain.data import dynamic_masking
from bert_core.pretrain.shards import (
    COLUMNS,
    LABEL_COLUMN,
    check_seq_length,
    list_row_groups,
    read_instances_config,
    shards,
)
from bert_core.storage import exists, is_s3


def check_inputs(cfg: PretrainConfig, init_model: str | None) -> int:
    """The instances (local or s3://), their vocabulary, the --init-model (`init_model`: its
    local folder) and the shards; returns the vocabulary's size."""
    list_row_groups(cfg.instances)
    vocab = read_vocab(cfg.vocab_file)
    if init_model:
        config_file = Path(init_model) / CONFIG_NAME
        if not config_file.is_file():
            raise InputError(config_file, "not found (--init-model must be a model folder)")
        config = BertForPreTraining.from_pretrained(init_model).config
        if len(vocab) > config.vocab_size:
            raise InputError(
                config_file,
                f"vocab_size {config.vocab_size}, but the instances' vocabulary "
                f"{cfg.vocab_file} has {len(vocab)} tokens",
            )
        check_same_vocab(cfg.vocab_file, vocab, Path(init_model) / "vocab.txt")
        model = f"--init-model {cfg.init_model}"
    else:
        config, model = BertConfig(**cfg.shape()), f"the {cfg.preset} preset"
    check_seq_length(cfg.instances, config.max_position_embeddings, model)
    limits = {
        "input_ids": len(vocab),
        "masked_lm_ids": len(vocab),
        "token_type_ids": config.type_vocab_size,
        "masked_lm_positions": config.max_position_embeddings,
        LABEL_COLUMN: 2,
    }
    for folder in (cfg.instances, cfg.heldout):
        if folder == cfg.instances or exists(folder):
            check_shards(folder, limits)
    if cfg.dynamic_masking:  # its special tokens and settings (stats.json's), before a worker
        dynamic_masking(vocab, cfg.instances, cfg.masking_options())
    else:
        read_instances_config(cfg.instances)  # stats.json: the workers read it
    return len(vocab)


def check_same_vocab(vocab_file: str, vocab: dict[str, int], init_vocab: Path) -> None:
    """The instances' ids are the --init-model's: the same tokens in the same order. Another
    vocabulary of the same size passes every size check and silently makes every id mean
    another word."""
    if not init_vocab.is_file():
        raise InputError(
            init_vocab.parent,
            "no vocab.txt: --init-model must carry its vocabulary, to check that the instances "
            "were made with it",
        )
    theirs = list(read_vocab(init_vocab, required=()))
    ours = list(vocab)
    if ours == theirs:
        return
    line = next(
        (i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b),
        min(len(ours), len(theirs)),
    )
    here = repr(ours[line]) if line < len(ours) else "nothing"
    there = repr(theirs[line]) if line < len(theirs) else "nothing"
    raise InputError(
        vocab_file,
        f"not --init-model's vocabulary ({init_vocab} has {there} at line {line + 1}, this "
        f"file {here}): the ids would mean other words; make the instances with "
        f"`bert instances --vocab {init_vocab}`",
        line=line + 1,
    )


def check_shards(instances_dir: str, limits: dict[str, int]) -> None:
    """Every shard: each column a list of integers (the label an integer), each value in
    [0, limit) (`limits`: column -> exclusive upper bound)."""
    for shard, meta in shards(instances_dir):
        schema = meta.schema_arrow
        for name in (*COLUMNS, LABEL_COLUMN):
            kind = schema.field(name).type
            inner = kind.value_type if pa.types.is_list(kind) else None
            ok = (
                pa.types.is_integer(kind)
                if name == LABEL_COLUMN
                else (inner is not None and pa.types.is_integer(inner))
            )
            if not ok:
                want = "integers" if name == LABEL_COLUMN else "lists of integers"
                raise InputError(shard, f"column {name} holds {kind}, expected {want}")
        for name, limit in limits.items():
            low, high = _min_max(meta, name)
            if low is not None and (low < 0 or high >= limit):
                bad = low if low < 0 else high
                raise InputError(
                    shard,
                    f"column {name} holds {bad}, outside [0, {limit - 1}] ({_why(name, limit)})",
                )


def _why(name: str, limit: int) -> str:
    return {
        "input_ids": f"the vocabulary has {limit} tokens",
        "masked_lm_ids": f"the vocabulary has {limit} tokens",
        "token_type_ids": f"the model has {limit} segment types",
        "masked_lm_positions": f"the model has {limit} positions",
        LABEL_COLUMN: "0 = next sentence, 1 = random",
    }[name]


def _min_max(meta: pq.ParquetFile, name: str) -> tuple[int | None, int | None]:
    """(min, max) of a column's values over the shard, from the footer's statistics where every
    row group has them, else from the data."""
    md = meta.metadata
    leaf = next(j for j in range(md.num_columns) if md.schema.column(j).path.split(".")[0] == name)
    lows, highs = [], []
    for i in range(md.num_row_groups):
        if not md.row_group(i).num_rows:
            continue
        stats = md.row_group(i).column(leaf).statistics
        if stats is not None and stats.has_min_max:
            lows.append(stats.min)
            highs.append(stats.max)
            continue
        values = meta.read_row_group(i, columns=[name]).column(0)
        if pa.types.is_list(values.type):
            values = pc.list_flatten(values)
        if len(values):
            lows.append(pc.min(values).as_py())
            highs.append(pc.max(values).as_py())
    return (min(lows), max(highs)) if lows else (None, None)


def check_output(output: str) -> None:
    """A local --output must be a folder this user can create or write (an s3:// one is checked
    by `preflight`): found before Ray starts, not when the first checkpoint is saved."""
    if is_s3(output):
        return
    path = Path(output)
    if path.exists() and not path.is_dir():
        raise BertError(f"--output {output} exists and is a file, not a folder")
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK):
        raise BertError(f"--output {output}: cannot write there ({existing} is not writable)")


def check_ray_address(timeout: float = 5.0) -> None:
    """RAY_ADDRESS as host:port (a running cluster's GCS, what `ray start --head` prints) must
    accept a connection: `ray.init` would otherwise retry for half a minute and end in a
    traceback. "auto", "local", ray:// (Ray Client) and a dashboard URL (a Ray job,
    `ray_jobs`) are Ray's to resolve."""
    address = os.environ.get("RAY_ADDRESS", "")
    host, _, port = address.rpartition(":")
    if "://" in address or not host or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as e:
        raise BertError(
            f"RAY_ADDRESS={address}: no Ray cluster answers there ({e}); start one "
            "(`ray start --head`) or unset RAY_ADDRESS to train on a private local Ray"
        ) from None
