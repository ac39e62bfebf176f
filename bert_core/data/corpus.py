"""`bert clean`: raw text -> BERT input format (one sentence a line, blank line between docs).

Why each step exists:
- Project Gutenberg header and licence footer are boilerplate repeated in every book; left in,
  the model would learn the licence by heart. Cut at the START/END markers (both the modern
  `*** START OF THE PROJECT GUTENBERG EBOOK` and the old `*END*THE SMALL PRINT!` styles).
- WikiText-style markup (` @-@ `, ` = = Heading = = `) is undone so the corpus reads like prose.
- NFC, control and zero-width characters removed, whitespace collapsed: the tokenizer then sees
  one spelling per string.
- Sentences are split with blingfire (a compiled finite-state splitter, no model download, ~MB/s
  per core); NSP needs real sentence boundaries, not lines.
- Documents: a book is far too long to be one NSP document (random-next segments would all come
  from a handful of books). A document is a chapter (a heading line starts a new one) cut at a
  paragraph boundary once it reaches `max_document_chars`; JSONL/Parquet records are one document
  each. Short documents (tables of contents, headings, fragments) are dropped, exact duplicates
  removed by hash.
- Invalid UTF-8 bytes are replaced by U+FFFD and counted (stats `invalid_utf8_sequences`, and a
  warning names the first file:line): old Gutenberg files carry stray Latin-1 bytes, and
  rejecting a whole corpus for one accented letter helps nobody. A file that is mostly such
  bytes or control characters (random bytes, a binary file, another encoding) is an error
  naming it (`bert_core.data.text_quality`): it is not text, and would become a vocabulary of junk.

Memory: input files are cleaned in parallel worker processes, one file at a time; the main
process only keeps the 16-byte hashes of documents already written, so memory is bounded by the
largest input file, not the corpus.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import re
import sys
import zlib
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from bert_core import storage
from bert_core.data import workers
from bert_core.data.documents import record_document, text_documents
from bert_core.data.text_quality import JunkMeter
from bert_core.errors import BadValue, InputError, NotFound
from bert_core.options import add_options, config_from_args, option
from bert_core.tracking import start_run

SUFFIXES = (".txt", ".txt.gz", ".jsonl", ".jsonl.gz", ".parquet")

GUTENBERG_START = re.compile(
    r"^\s*(\*{3}\s*START OF (THIS|THE) PROJECT GUTENBERG"
    r"|\*END\*?\s*THE SMALL PRINT)",
    re.IGNORECASE,
)
GUTENBERG_END = re.compile(
    r"^\s*(\*{3}\s*END OF (THIS|THE) PROJECT GUTENBERG"
    r"|End of (the )?Project Gutenberg"
    r"|\*{3}\s*START: FULL LICENSE)",
    re.IGNORECASE,
)
# Lines scanned for a START marker before deciding a text file has no Gutenberg header.
HEADER_SCAN_LINES = 600
# one line of a text or JSON-lines file (a paragraph, a record), read in bounded memory: a 60 MB
# line that a .gz of 174 KB can hold took 1.9 GB to clean; a 15.8 MiB line peaks at 0.7 GB
MAX_LINE_BYTES = 16 << 20


@dataclass(frozen=True)
class CleanConfig:
    """`bert clean`'s settings; each field is an option (`bert_core.options`)."""

    min_document_chars: int = option(
        200, "documents shorter than this (characters) are dropped", within="non-negative"
    )
    max_document_chars: int = option(
        10_000,
        "a text file's document ends at the paragraph that reaches this many characters",
        within="positive",
    )
    num_shards: int = option(8, "output text shards (shard-NNNNN.txt)")
    num_workers: int = option(
        max(1, os.cpu_count() or 1), "worker processes, one input file each", within="positive"
    )


@dataclass
class FileStats:
    """What cleaning one input file did; summed over files into stats.json."""

    files: int = 0
    bytes_in: int = 0
    chars_in: int = 0
    lines_in: int = 0
    boilerplate_lines: int = 0
    invalid_utf8_sequences: int = 0
    invalid_utf8_first: list[str] = field(default_factory=list)
    documents_in: int = 0

    def add(self, other: FileStats) -> None:
        for key, value in asdict(other).items():
            if key == "invalid_utf8_first":
                self.invalid_utf8_first.extend(value)
            else:
                setattr(self, key, getattr(self, key) + value)


def iter_input_files(path: Path) -> list[Path]:
    if not path.exists():
        raise NotFound(f"{path}: no such file or directory")
    if path.is_file():
        if not path.name.endswith(SUFFIXES):
            raise InputError(path, f"unsupported input type (expected one of {SUFFIXES})")
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.name.endswith(SUFFIXES))
    if not files:
        raise InputError(path, f"no input files ({', '.join(SUFFIXES)})")
    return files


def _decode_lines(
    path: Path, stats: FileStats, meter: JunkMeter | None = None
) -> Iterator[tuple[int, str]]:
    """(line number, text) of a text file: any line ending, BOM dropped, bad UTF-8 replaced;
    the junk characters counted in `meter`. A truncated or corrupt .gz is an error naming it."""
    if not path.name.endswith(".gz"):
        yield from _decode_file(path, open, stats, meter)
        return
    try:
        yield from _decode_file(path, gzip.open, stats, meter)
    except (EOFError, OSError, zlib.error) as e:
        raise InputError(path, f"not a readable gzip file ({e})") from None


def _decode_file(path: Path, opener, stats: FileStats, meter: JunkMeter | None):
    with opener(path, "rb") as f:
        for number, raw in enumerate(iter(lambda: f.readline(MAX_LINE_BYTES + 1), b""), start=1):
            if len(raw) > MAX_LINE_BYTES:
                what = f"a line over {MAX_LINE_BYTES >> 20} MiB: one paragraph (or JSON record)"
                raise InputError(path, f"{what} per line is the format", line=number)
            stats.bytes_in += len(raw)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = raw.decode("utf-8", errors="replace")
                bad = text.count("\ufffd") - raw.count("\ufffd".encode())
                stats.invalid_utf8_sequences += bad
                if not stats.invalid_utf8_first:
                    stats.invalid_utf8_first.append(f"{path}:{number}")
            if number == 1:
                text = text.lstrip("\ufeff")
            text = text.rstrip("\r\n")
            if meter is not None:
                meter.add(text, number)
            stats.chars_in += len(text)
            stats.lines_in += 1
            yield number, text


def _strip_gutenberg(lines: Iterable[tuple[int, str]], stats: FileStats) -> Iterator[str]:
    """Drop the Gutenberg header (up to a START marker) and everything from an END marker."""
    header: list[str] = []
    in_header = True
    for number, line in lines:
        if in_header:
            if GUTENBERG_START.match(line):
                stats.boilerplate_lines += len(header) + 1
                header, in_header = [], False
                continue
            if GUTENBERG_END.match(line):
                break
            header.append(line)
            if number < HEADER_SCAN_LINES:
                continue
            in_header = False  # no header marker: the buffered lines are text
            yield from header
            header = []
            continue
        if GUTENBERG_END.match(line):
            stats.boilerplate_lines += 1 + sum(1 for _ in lines)
            return
        yield line
    yield from header


def _parquet_texts(path: Path, stats: FileStats) -> Iterator[str]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    if "text" not in pf.schema_arrow.names:
        raise InputError(path, f"no 'text' column (columns: {pf.schema_arrow.names})")
    stats.bytes_in += path.stat().st_size
    for batch in pf.iter_batches(columns=["text"]):
        for text in batch.column(0).to_pylist():
            if text:
                stats.chars_in += len(text)
                yield text


def _records(path: Path, stats: FileStats) -> Iterator[str]:
    if path.name.endswith(".parquet"):
        import pyarrow as pa

        try:
            yield from _parquet_texts(path, stats)
        except (pa.ArrowException, OSError) as e:
            raise InputError(path, f"not a readable Parquet file ({e})") from None
        return
    for number, line in _decode_lines(path, stats):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(path, f"invalid JSON: {e.msg}", line=number) from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise InputError(path, "a JSONL record needs a string 'text' field", line=number)
        yield record["text"]


def clean_file(path: Path, cfg: CleanConfig) -> tuple[list[list[str]], FileStats]:
    """All documents of one input file (runs in a worker process)."""
    stats = FileStats(files=1)
    if path.name.endswith((".txt", ".txt.gz")):
        meter = JunkMeter(path)
        lines = _strip_gutenberg(_decode_lines(path, stats, meter), stats)
        docs = list(text_documents(lines, cfg.max_document_chars))
        meter.check()
    else:
        docs = [record_document(text) for text in _records(path, stats)]
    docs = [d for d in docs if d]
    stats.documents_in = len(docs)
    return docs, stats


def _clean_file_task(args: tuple[Path, CleanConfig]) -> tuple[list[list[str]], FileStats]:
    return clean_file(*args)


def clean_corpus(input_path: Path, output_dir: Path, cfg: CleanConfig) -> dict:
    """Clean every input file (in parallel) into `cfg.num_shards` text shards plus stats.json."""
    if cfg.num_shards < 1:
        raise BadValue(f"--num-shards must be >= 1, got {cfg.num_shards}")
    if cfg.min_document_chars > cfg.max_document_chars:
        raise BadValue(
            f"--min-document-chars {cfg.min_document_chars} is over "
            f"--max-document-chars {cfg.max_document_chars}: every document would "
            "be dropped"
        )
    files = iter_input_files(Path(input_path))
    total = FileStats()
    dropped: Counter[str] = Counter()
    seen: set[bytes] = set()
    documents = sentences = chars_out = 0
    with storage.output_dir(output_dir) as tmp:
        shards = [
            open(tmp / f"shard-{i:05d}.txt", "w", encoding="utf-8") for i in range(cfg.num_shards)
        ]
        try:
            tasks = [(f, cfg) for f in files]
            if cfg.num_workers > 1 and len(files) > 1:
                pool = workers.pool(min(cfg.num_workers, len(files)), __name__)
                results: Iterable = pool.imap(_clean_file_task, tasks)
            else:
                pool, results = None, map(_clean_file_task, tasks)
            try:
                for docs, stats in results:
                    total.add(stats)
                    for doc in docs:
                        size = sum(len(s) for s in doc)
                        if size < cfg.min_document_chars:
                            dropped["too_short"] += 1
                            continue
                        digest = hashlib.blake2b("\n".join(doc).encode(), digest_size=16).digest()
                        if digest in seen:
                            dropped["duplicate"] += 1
                            continue
                        seen.add(digest)
                        shards[documents % cfg.num_shards].write("\n".join(doc) + "\n\n")
                        documents += 1
                        sentences += len(doc)
                        chars_out += size
            finally:
                if pool is not None:
                    pool.terminate()
        finally:
            for f in shards:
                f.close()
        if documents == 0:
            raise InputError(input_path, "no documents left after cleaning (empty corpus?)")
        stats = {
            "files": [str(f) for f in files],
            "bytes_in": total.bytes_in,
            "chars_in": total.chars_in,
            "lines_in": total.lines_in,
            "documents_in": total.documents_in,
            "documents": documents,
            "sentences": sentences,
            "chars_out": chars_out,
            "dropped": {
                "boilerplate_lines": total.boilerplate_lines,
                "too_short_documents": dropped["too_short"],
                "duplicate_documents": dropped["duplicate"],
            },
            "invalid_utf8_sequences": total.invalid_utf8_sequences,
            "invalid_utf8_first": total.invalid_utf8_first,
            "num_shards": cfg.num_shards,
            "config": asdict(cfg),
        }
        (tmp / "stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    return stats


def build_parser() -> argparse.ArgumentParser:
    """`bert clean`'s options: the input and output, then one per `CleanConfig` field."""
    p = argparse.ArgumentParser(prog="bert clean", description=__doc__.split("\n")[0])
    p.add_argument("--input", required=True, help="file or folder of text, local or s3://")
    p.add_argument("--output", required=True, help="output folder (shards), local or s3://")
    add_options(p, CleanConfig)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = config_from_args(args, CleanConfig)
    storage.check_apart({"--output": args.output}, {"--input": args.input})

    with storage.local_copy(args.input) as source:  # s3:// is downloaded first
        iter_input_files(source)  # a missing or empty input fails before the MLflow run
        with start_run("clean", {"input": str(args.input), **asdict(cfg)}) as run:
            stats = clean_corpus(source, args.output, cfg)
            import mlflow

            mlflow.log_metrics(
                {k: stats[k] for k in ("documents", "sentences", "chars_in", "chars_out")}
                | {f"dropped_{k}": v for k, v in stats["dropped"].items()}
                | {"invalid_utf8_sequences": stats["invalid_utf8_sequences"]},
                run_id=run.info.run_id,
            )
    if stats["invalid_utf8_sequences"]:
        print(
            f"bert clean: warning: {stats['invalid_utf8_sequences']} invalid UTF-8 sequences "
            f"replaced by U+FFFD (first at {stats['invalid_utf8_first'][0]})",
            file=sys.stderr,
        )
    print(
        f"bert clean: {stats['documents']} documents, {stats['sentences']} sentences "
        f"-> {args.output}"
    )
    return 0
