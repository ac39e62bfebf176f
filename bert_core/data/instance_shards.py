"""One input shard of the cleaned corpus -> one Parquet file of pre-training instances.

The unit of work of `bert instances` is one input shard, as Google ran the original (once per
shard): documents are read (BERT's input format: one sentence a line, blank lines between
documents), tokenised, turned into instances `dupe_factor` times
(`bert_core.data.instance_sampling`), masked, shuffled and written. Random-next segments come from
the same shard, and every random stream is seeded by (random_seed, shard index, dupe round,
purpose), so the output is byte-identical whatever the number of worker processes, and a worker
holds one shard (times the dupe factor) at a time, never the corpus.

Tokenisation is the Rust WordPiece (`tokenizers`, through `tokenizer.encode_lines`), the same ids
as the original `FullTokenizer` on the same vocabulary (see tests/data/test_tokenizer.py).

Parquet schema (`SCHEMA`, unpadded, zstd): input_ids list<int32>, token_type_ids list<int8>,
masked_lm_positions list<int32>, masked_lm_ids list<int32>, next_sentence_label int8
(0 = IsNext, 1 = random next).
"""

from __future__ import annotations

import functools
import random
import re
from itertools import chain
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from bert_core.data.instance_config import InstanceConfig
from bert_core.data.instance_sampling import (
    Pair,
    Vocab,
    create_instances_from_document,
    mask_batch,
    mask_whole_words,
)
from bert_core.data.tokenizer import encode_lines, load_tokenizer
from bert_core.errors import utf8_errors

SCHEMA = pa.schema(
    [
        ("input_ids", pa.list_(pa.int32())),
        ("token_type_ids", pa.list_(pa.int8())),
        ("masked_lm_positions", pa.list_(pa.int32())),
        ("masked_lm_ids", pa.list_(pa.int32())),
        ("next_sentence_label", pa.int8()),
    ]
)
BLANK_LINE = re.compile(r"\n[^\S\n]*\n")
# Per-stream tags mixed into the seed, so no two random streams coincide.
DOCS, CHUNKS, MASKS, SHUFFLE, SPLIT = range(5)
# The held-out set's shard index in its seeds (no input shard has it).
HELDOUT = 2**32 - 1
# Parquet metadata: the sequence length the shard was made for (`bert pretrain` checks it
# against the model's positions before it starts).
SEQ_LENGTH_KEY = b"bert.max_seq_length"


def seed_for(random_seed: int, shard: int, *stream: int) -> np.random.SeedSequence:
    return np.random.SeedSequence([random_seed, shard, *stream])


def read_documents(path: Path) -> list[list[str]]:
    """BERT's input format: one sentence a line, blank lines between documents."""
    with utf8_errors(path):
        text = path.read_text(encoding="utf-8")
    docs = ([s for s in map(str.strip, block.split("\n")) if s] for block in BLANK_LINE.split(text))
    return [d for d in docs if d]


def tokenize_documents(
    docs: list[list[str]], tokenizer, cache: dict | None = None
) -> list[list[list[int]]]:
    """Token ids per sentence per document, in batches through the Rust tokenizer."""
    encoded = encode_lines(tokenizer, list(chain.from_iterable(docs)), cache)
    out: list[list[list[int]]] = []
    k = 0
    for doc in docs:
        sentences = encoded[k : k + len(doc)]
        k += len(doc)
        sentences = [s for s in sentences if s]  # as the original: drop lines with no tokens
        if sentences:
            out.append(sentences)
    return out


def _list_array(values: np.ndarray, counts: np.ndarray, type_: pa.DataType) -> pa.Array:
    offsets = np.zeros(len(counts) + 1, dtype=np.int32)
    np.cumsum(counts, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=type_))


def _round_table(
    raw: list[Pair], cfg: InstanceConfig, vocab: Vocab, seeds
) -> tuple[pa.Table, dict]:
    """Mask one dupe round's instances and lay them out as an Arrow table."""
    n, width = len(raw), cfg.max_seq_length
    lengths = np.fromiter((len(pair.tokens) for pair in raw), dtype=np.int64, count=n)
    len_a = np.fromiter((pair.len_a for pair in raw), dtype=np.int64, count=n)
    random_next = np.fromiter((pair.is_random_next for pair in raw), dtype=np.int8, count=n)
    ids = np.zeros((n, width), dtype=np.int32)
    valid = np.arange(width)[None, :] < lengths[:, None]
    ids[valid] = np.fromiter(
        chain.from_iterable(pair.tokens for pair in raw), np.int32, lengths.sum()
    )
    original = ids.copy()
    if cfg.whole_word_mask:
        rng = random.Random(int(seeds.generate_state(1)[0]))
        pos_l, lab_l, dec_l = [], [], []
        count = np.zeros(n, dtype=np.int64)
        for k, pair in enumerate(raw):
            out, pos, lab, dec = mask_whole_words(pair.tokens, cfg, vocab, rng)
            ids[k, : len(out)] = out
            pos_l.extend(pos), lab_l.extend(lab), dec_l.extend(dec)
            count[k] = len(pos)
        pos_flat = np.array(pos_l, dtype=np.int32)
        lab_flat = np.array(lab_l, dtype=np.int32)
        dec_flat = np.array(dec_l, dtype=np.int8)
    else:
        positions, labels, count, decisions = mask_batch(
            ids, lengths, cfg, vocab, np.random.default_rng(seeds)
        )
        taken = np.arange(positions.shape[1])[None, :] < count[:, None]
        pos_flat, lab_flat, dec_flat = positions[taken], labels[taken], decisions[taken]
    token_type = (np.arange(width)[None, :] >= (len_a + 2)[:, None]).astype(np.int8)
    special = (original == vocab.cls_id) | (original == vocab.sep_id)
    table = pa.table(
        [
            _list_array(ids[valid], lengths, pa.int32()),
            _list_array(token_type[valid], lengths, pa.int8()),
            _list_array(pos_flat.astype(np.int32), count, pa.int32()),
            _list_array(lab_flat.astype(np.int32), count, pa.int32()),
            pa.array(random_next, type=pa.int8()),
        ],
        schema=SCHEMA,
    )
    stats = {
        "instances": n,
        "tokens": int(lengths.sum()),
        "non_special_tokens": int((valid & ~special).sum()),
        "masked": int(count.sum()),
        "masked_as_mask": int((dec_flat == 0).sum()),
        "masked_as_random": int((dec_flat == 1).sum()),
        "masked_unchanged": int((dec_flat == 2).sum()),
        "random_next": int(random_next.sum()),
    }
    return table, stats


@functools.lru_cache(maxsize=2)
def _shard_tools(vocab_file: Path, lowercase: bool) -> tuple[Vocab, object, dict]:
    """Vocabulary, tokenizer and piece cache, loaded once per worker process and reused for
    every shard it handles (a pure function of the vocabulary: output does not depend on which
    worker ran which shard)."""
    return Vocab.from_file(vocab_file), load_tokenizer(vocab_file, lowercase), {}


def process_shard(
    shard_index: int,
    path: Path,
    out_path: Path,
    vocab_file: Path,
    cfg: InstanceConfig,
    heldout: tuple[int, ...] = (),
) -> tuple[dict, list[list[str]]]:
    """All instances of one input shard, shuffled, written to one Parquet file.

    The documents numbered in `heldout` (their order in the file, from 0) are left out and
    returned as text, for the held-out set; they are gone before anything is drawn, so the
    training instances are those of a shard that never had them.
    """
    documents = read_documents(path)
    if heldout and heldout[-1] >= len(documents):
        raise RuntimeError(f"{path}: held-out document {heldout[-1]} of {len(documents)}")
    held = [documents[i] for i in heldout]
    if heldout:
        skip = set(heldout)
        documents = [d for i, d in enumerate(documents) if i not in skip]
    stats = write_instances(documents, shard_index, out_path, vocab_file, cfg, cfg.dupe_factor)
    stats["input_bytes"] = path.stat().st_size
    return stats, held


def documents_in_shard(path: Path) -> int:
    """Documents in one input shard, counted as `process_shard` numbers them for `heldout`."""
    return len(read_documents(path))


def write_instances(
    text_documents: list[list[str]],
    shard_index: int,
    out_path: Path,
    vocab_file: Path,
    cfg: InstanceConfig,
    dupe_factor: int,
) -> dict:
    """Tokenise the documents, make their instances `dupe_factor` times, mask, shuffle, write.

    Every random stream is seeded by (random_seed, `shard_index`, purpose[, dupe round]), so
    what a shard gets does not depend on which process made it.
    """
    vocab, tokenizer, cache = _shard_tools(Path(vocab_file), cfg.lowercase)
    all_documents = tokenize_documents(text_documents, tokenizer, cache)
    random.Random(int(seed_for(cfg.random_seed, shard_index, DOCS).generate_state(1)[0])).shuffle(
        all_documents
    )
    tables: list[pa.Table] = []
    stats = dict.fromkeys(("short_target", "targets", "forced_random_next"), 0)
    stats["documents"] = len(all_documents)
    for dupe in range(dupe_factor if all_documents else 0):
        rng = random.Random(
            int(seed_for(cfg.random_seed, shard_index, CHUNKS, dupe).generate_state(1)[0])
        )
        raw: list[Pair] = []
        for document_index in range(len(all_documents)):
            got = create_instances_from_document(all_documents, document_index, cfg, rng, vocab)
            raw.extend(got.pairs)
            stats["forced_random_next"] += got.forced_random_next
            stats["short_target"] += got.short
            stats["targets"] += 1
        if not raw:
            continue
        table, round_stats = _round_table(
            raw, cfg, vocab, seed_for(cfg.random_seed, shard_index, MASKS, dupe)
        )
        tables.append(table)
        for k, v in round_stats.items():
            stats[k] = stats.get(k, 0) + v
    table = pa.concat_tables(tables) if tables else SCHEMA.empty_table()
    perm = np.random.default_rng(seed_for(cfg.random_seed, shard_index, SHUFFLE)).permutation(
        table.num_rows
    )
    table = table.take(perm).replace_schema_metadata({SEQ_LENGTH_KEY: str(cfg.max_seq_length)})
    pq.write_table(table, out_path, compression="zstd")
    return stats
