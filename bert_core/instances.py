"""`bert instances`: MLM/NSP pre-training instances, the algorithm of google-research/bert's
`create_pretraining_data.py`, made fast and parallel without changing what it samples.

The algorithm (per document, `dupe_factor` times with different randomness):
- `target_seq_length` is `max_seq_length - 3`, or with probability `short_seq_prob` a random
  length in [2, max_seq_length - 3], to reduce the pre-training / fine-tuning length mismatch.
- Sentences are accumulated into a chunk until it reaches the target; a random number of them
  forms segment A. With probability 0.5 (always if the chunk is one sentence) segment B is a
  random span of another document (`next_sentence_label` 1) and the unused sentences are put back;
  otherwise B is the rest of the chunk (label 0).
- `truncate_pair_randomly` (the original's `truncate_seq_pair`) trims the longer segment one
  token at a time, from the front or the back at random, until `[CLS] A [SEP] B [SEP]` fits.
- Masking (`bert_core.masking`, the rule's one home): `num_to_predict = min(max_predictions_per_seq,
  max(1, round(len(tokens) * masked_lm_prob)))` positions are drawn among non-`[CLS]`/`[SEP]`
  tokens (whole words with `--whole-word-mask`); each becomes `[MASK]` 80 %, a random vocabulary
  token 10 %, unchanged 10 % (`--masking-recipe 80/10/10`; other shares for the paper's Table 8).

What differs from the original, and why it does not change the distribution:
- Tokenisation is the Rust WordPiece (`tokenizers`, `encode_batch_fast`), same ids as the
  original `FullTokenizer` on the same vocabulary (see tests/test_tokenizer.py).
- Masking is vectorised with numpy over all instances of a shard: a random permutation of the
  candidates per row (argsort of uniform keys) and the first `num_to_predict` taken, exactly the
  original's shuffle-then-take; the 80/10/10 draws are i.i.d., as in the original.
- The unit of work is one input shard (as Google ran the original, once per shard): random-next
  documents come from the same shard, and every random stream is seeded by
  (random_seed, shard index, dupe round), so the output is byte-identical whatever
  `--num-workers` is, and memory is bounded by one shard (times the dupe factor) per worker.

Output, one Parquet file per input shard, unpadded, columns: input_ids list<int32>,
token_type_ids list<int8>, masked_lm_positions list<int32>, masked_lm_ids list<int32>,
next_sentence_label int8 (0 = IsNext, 1 = random next), plus stats.json and a copy of vocab.txt.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import re
import shutil
from dataclasses import asdict, dataclass
from itertools import chain
from multiprocessing import get_all_start_methods, get_context
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from bert_core import masking
from bert_core.errors import InputError, atomic_dir
from bert_core.masking import MaskingRecipe

SCHEMA = pa.schema(
    [
        ("input_ids", pa.list_(pa.int32())),
        ("token_type_ids", pa.list_(pa.int8())),
        ("masked_lm_positions", pa.list_(pa.int32())),
        ("masked_lm_ids", pa.list_(pa.int32())),
        ("next_sentence_label", pa.int8()),
    ]
)
MIN_SEQ_LENGTH = 8
BLANK_LINE = re.compile(r"\n[^\S\n]*\n")
# fork: workers start in milliseconds instead of re-importing numpy/pyarrow/tokenizers.
START_METHOD = "fork" if "fork" in get_all_start_methods() else "spawn"
# Per-stream tags mixed into the seed, so no two random streams coincide.
DOCS, CHUNKS, MASKS, SHUFFLE = range(4)


@dataclass(frozen=True)
class InstanceConfig:
    max_seq_length: int = 128
    max_predictions_per_seq: int = 20
    masked_lm_prob: float = 0.15
    short_seq_prob: float = 0.1
    dupe_factor: int = 10
    random_seed: int = 12345
    whole_word_mask: bool = False
    lowercase: bool = True
    masking_recipe: str = masking.DEFAULT_RECIPE  # [MASK]/random/keep percent, bert_core.masking

    @property
    def recipe(self) -> MaskingRecipe:
        return MaskingRecipe.parse(self.masking_recipe)

    def validate(self) -> None:
        if self.max_seq_length < MIN_SEQ_LENGTH:
            raise ValueError(
                f"--max-seq-length must be >= {MIN_SEQ_LENGTH} ([CLS] A [SEP] B [SEP] needs "
                f"room), got {self.max_seq_length}"
            )
        if self.max_predictions_per_seq < 1:
            raise ValueError("--max-predictions-per-seq must be >= 1")
        if not 0.0 < self.masked_lm_prob < 1.0:
            raise ValueError("--masked-lm-prob must be in (0, 1)")
        if not 0.0 <= self.short_seq_prob <= 1.0:
            raise ValueError("--short-seq-prob must be in [0, 1]")
        if self.dupe_factor < 1:
            raise ValueError("--dupe-factor must be >= 1")
        MaskingRecipe.parse(self.masking_recipe)  # a bad recipe raises ValueError


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
        from bert_core.tokenizer import read_vocab

        vocab = read_vocab(vocab_file, required=("[UNK]", "[CLS]", "[SEP]", "[MASK]"))
        is_subword = np.zeros(len(vocab), dtype=bool)
        for token, i in vocab.items():
            is_subword[i] = token.startswith("##")
        return cls(len(vocab), vocab["[CLS]"], vocab["[SEP]"], vocab["[MASK]"], is_subword)


def seed_for(random_seed: int, shard: int, *stream: int) -> np.random.SeedSequence:
    return np.random.SeedSequence([random_seed, shard, *stream])


def read_documents(path: Path) -> list[list[str]]:
    """BERT's input format: one sentence a line, blank lines between documents."""
    text = path.read_text(encoding="utf-8", errors="replace")
    docs = ([s for s in map(str.strip, block.split("\n")) if s] for block in BLANK_LINE.split(text))
    return [d for d in docs if d]


def tokenize_documents(
    docs: list[list[str]], tokenizer, cache: dict | None = None
) -> list[list[list[int]]]:
    """Token ids per sentence per document, in batches through the Rust tokenizer."""
    from bert_core.tokenizer import encode_lines

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
    `_truncate_seq_pair`, in `bert_core.finetune`): the random front cuts are a pre-training
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


def create_instances_from_document(
    all_documents: list[list[list[int]]],
    document_index: int,
    cfg: InstanceConfig,
    rng: random.Random,
    vocab: Vocab,
) -> tuple[list[tuple[list[int], int, bool]], bool, int]:
    """Unmasked instances (tokens, len(A), is_random_next) of one document; line by line the
    original's loop. Also returns whether the short target length was drawn, and how many
    instances were random-next by force (a one-sentence chunk has no actual next segment)."""
    document = all_documents[document_index]
    lengths = list(map(len, document))
    last = len(document) - 1
    max_num_tokens = cfg.max_seq_length - 3
    target_seq_length = max_num_tokens
    short = rng.random() < cfg.short_seq_prob
    if short:
        target_seq_length = randint(rng, 2, max_num_tokens)

    instances = []
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
                instances.append((tokens, len(tokens_a), is_random_next))
            current_chunk = []
            current_length = 0
        i += 1
    return instances, short, forced


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


def _list_array(values: np.ndarray, counts: np.ndarray, type_: pa.DataType) -> pa.Array:
    offsets = np.zeros(len(counts) + 1, dtype=np.int32)
    np.cumsum(counts, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=type_))


def _round_table(
    raw: list[tuple[list[int], int, bool]], cfg: InstanceConfig, vocab: Vocab, seeds
) -> tuple[pa.Table, dict]:
    """Mask one dupe round's instances and lay them out as an Arrow table."""
    n, width = len(raw), cfg.max_seq_length
    lengths = np.fromiter((len(t) for t, _, _ in raw), dtype=np.int64, count=n)
    len_a = np.fromiter((a for _, a, _ in raw), dtype=np.int64, count=n)
    random_next = np.fromiter((r for _, _, r in raw), dtype=np.int8, count=n)
    ids = np.zeros((n, width), dtype=np.int32)
    valid = np.arange(width)[None, :] < lengths[:, None]
    ids[valid] = np.fromiter(chain.from_iterable(t for t, _, _ in raw), np.int32, lengths.sum())
    original = ids.copy()
    if cfg.whole_word_mask:
        rng = random.Random(int(seeds.generate_state(1)[0]))
        pos_l, lab_l, dec_l = [], [], []
        count = np.zeros(n, dtype=np.int64)
        for k, (tokens, _, _) in enumerate(raw):
            out, pos, lab, dec = mask_whole_words(tokens, cfg, vocab, rng)
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
    from bert_core.tokenizer import load_tokenizer

    return Vocab.from_file(vocab_file), load_tokenizer(vocab_file, lowercase), {}


def process_shard(
    shard_index: int, path: Path, out_path: Path, vocab_file: Path, cfg: InstanceConfig
) -> dict:
    """All instances of one input shard, shuffled, written to one Parquet file."""
    vocab, tokenizer, cache = _shard_tools(Path(vocab_file), cfg.lowercase)
    all_documents = tokenize_documents(read_documents(path), tokenizer, cache)
    random.Random(int(seed_for(cfg.random_seed, shard_index, DOCS).generate_state(1)[0])).shuffle(
        all_documents
    )
    tables, stats = (
        [],
        {
            "documents": len(all_documents),
            "short_target": 0,
            "targets": 0,
            "forced_random_next": 0,
        },
    )
    for dupe in range(cfg.dupe_factor if all_documents else 0):
        rng = random.Random(
            int(seed_for(cfg.random_seed, shard_index, CHUNKS, dupe).generate_state(1)[0])
        )
        raw: list[tuple[list[int], int, bool]] = []
        for document_index in range(len(all_documents)):
            instances, short, forced = create_instances_from_document(
                all_documents, document_index, cfg, rng, vocab
            )
            raw.extend(instances)
            stats["forced_random_next"] += forced
            stats["short_target"] += short
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
    pq.write_table(table.take(perm), out_path, compression="zstd")
    stats["input_bytes"] = path.stat().st_size
    return stats


def _process_shard_task(args: tuple) -> dict:
    return process_shard(*args)


def _worker_init() -> None:
    # One core per process: parallelism comes from processes, so turn off tokenizers' threads.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def input_shards(input_dir: Path) -> list[Path]:
    path = Path(input_dir)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or directory")
    files = [path] if path.is_file() else sorted(path.glob("*.txt"))
    if not files:
        raise InputError(path, "no .txt shards (run `bert clean` first)")
    return files


def count_documents(files: list[Path], at_least: int = 2) -> int:
    """Documents in the input (blank-line separated), counted up to `at_least`."""
    n = 0
    for file in files:
        in_doc = False
        with open(file, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.strip():
                    n += not in_doc
                    in_doc = True
                    if n >= at_least:
                        return n
                else:
                    in_doc = False
    return n


def check_inputs(input_dir: Path, vocab_file: Path, cfg: InstanceConfig) -> list[Path]:
    """Fail before any work (and before opening an MLflow run) on settings or input that
    cannot work: the input shards, with at least two documents for NSP."""
    cfg.validate()
    Vocab.from_file(vocab_file)
    files = input_shards(input_dir)
    if count_documents(files) < 2:
        raise InputError(input_dir, "needs at least 2 documents (NSP draws random next segments)")
    return files


def create_instances(
    input_dir: Path, vocab_file: Path, output_dir: Path, cfg: InstanceConfig, num_workers: int = 1
) -> dict:
    """Instances for every input shard (in parallel), then stats.json and vocab.txt."""
    files = check_inputs(input_dir, vocab_file, cfg)
    _worker_init()
    with atomic_dir(output_dir) as tmp:
        tasks = [
            (k, f, tmp / f"shard-{k:05d}.parquet", Path(vocab_file), cfg)
            for k, f in enumerate(files)
        ]
        if num_workers > 1 and len(tasks) > 1:
            ctx = get_context(START_METHOD)
            with ctx.Pool(min(num_workers, len(tasks)), initializer=_worker_init) as pool:
                results = pool.map(_process_shard_task, tasks, chunksize=1)
        else:
            results = [_process_shard_task(t) for t in tasks]
        total: dict[str, int] = {}
        for r in results:
            for k, v in r.items():
                total[k] = total.get(k, 0) + v
        if not total.get("instances"):
            raise InputError(input_dir, "no instances created (documents too short?)")
        masked = max(total["masked"], 1)
        stats = {
            "instances": total["instances"],
            "documents": total["documents"],
            "input_bytes": total["input_bytes"],
            "mean_length": total["tokens"] / total["instances"],
            "random_next_share": total["random_next"] / total["instances"],
            # The original forces random-next for one-sentence chunks; the coin is fair on the
            # others, which is what this share measures.
            "forced_random_next_share": total["forced_random_next"] / total["instances"],
            "random_next_share_unforced": (total["random_next"] - total["forced_random_next"])
            / max(total["instances"] - total["forced_random_next"], 1),
            "masked_share": total["masked"] / total["non_special_tokens"],
            "mask_token_share": total["masked_as_mask"] / masked,
            "random_token_share": total["masked_as_random"] / masked,
            "unchanged_share": total["masked_unchanged"] / masked,
            "short_target_share": total["short_target"] / max(total["targets"], 1),
            "shards": len(files),
            "config": asdict(cfg),
        }
        (tmp / "stats.json").write_text(json.dumps(stats, indent=2) + "\n")
        shutil.copyfile(vocab_file, tmp / "vocab.txt")
    return stats


def build_parser() -> argparse.ArgumentParser:
    d = InstanceConfig()
    p = argparse.ArgumentParser(prog="bert instances", description=__doc__.split("\n")[0])
    p.add_argument("--input", required=True, type=Path, help="cleaned corpus folder (shards)")
    p.add_argument("--vocab", required=True, type=Path, help="vocab.txt (Google format)")
    p.add_argument("--output", required=True, type=Path, help="output folder")
    p.add_argument("--max-seq-length", type=int, default=d.max_seq_length)
    p.add_argument("--max-predictions-per-seq", type=int, default=d.max_predictions_per_seq)
    p.add_argument("--masked-lm-prob", type=float, default=d.masked_lm_prob)
    p.add_argument("--short-seq-prob", type=float, default=d.short_seq_prob)
    p.add_argument("--dupe-factor", type=int, default=d.dupe_factor)
    p.add_argument("--random-seed", type=int, default=d.random_seed)
    p.add_argument("--whole-word-mask", action="store_true")
    p.add_argument(
        "--masking-recipe",
        default=d.masking_recipe,
        help="shares of predicted tokens shown as [MASK]/random token/unchanged, percent "
        "(default %(default)s, the paper's; Table 8 ablates e.g. 100/0/0)",
    )
    p.add_argument("--cased", action="store_true", help="do not lowercase (cased vocabulary)")
    p.add_argument("--num-workers", type=int, default=max(1, os.cpu_count() or 1))
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = InstanceConfig(
        max_seq_length=args.max_seq_length,
        max_predictions_per_seq=args.max_predictions_per_seq,
        masked_lm_prob=args.masked_lm_prob,
        short_seq_prob=args.short_seq_prob,
        dupe_factor=args.dupe_factor,
        random_seed=args.random_seed,
        whole_word_mask=args.whole_word_mask,
        lowercase=not args.cased,
        masking_recipe=args.masking_recipe,
    )
    check_inputs(args.input, args.vocab, cfg)
    from bert_core.tracking import start_run

    params = {"input": str(args.input), "vocab": str(args.vocab), **asdict(cfg)}
    with start_run("instances", params) as run:
        stats = create_instances(args.input, args.vocab, args.output, cfg, args.num_workers)
        import mlflow

        mlflow.log_metrics(
            {k: v for k, v in stats.items() if isinstance(v, int | float)},
            run_id=run.info.run_id,
        )
    print(
        f"bert instances: {stats['instances']} instances from {stats['documents']} documents "
        f"-> {args.output}"
    )
    return 0
