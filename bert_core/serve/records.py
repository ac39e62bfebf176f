"""The files `bert predict` and `bert embed` read and write: rows streamed in chunks, outputs
written atomically.

Why chunks: an input may be larger than memory, so it is read `chunk_size` rows at a time (a
text file line by line, TSV with the csv reader, JSONL line by line, Parquet through
`ParquetFile.iter_batches`), answered and written before the next chunk is read; memory is
bounded by one chunk whatever the file's size. Every row keeps its line number (text formats)
or row number (Parquet), so a bad value is reported as `file:line: ...`.

Inputs, by suffix: `.txt` (one text a line: the column `text`), `.tsv` (a header row names the
columns; no quoting, as GLUE's files), `.jsonl` (one JSON object a line; blank lines skipped),
`.parquet`. `rename` maps the model's column names to the file's (`text` -> `sentence`).
Outputs, by suffix: `.jsonl` (UTF-8, one object a line) or `.parquet` (the schema given).
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bert_core import storage
from bert_core.errors import BadValue, InputError, NotFound, text_lines, utf8_errors

INPUT_FORMATS = {".txt": "text", ".tsv": "tsv", ".jsonl": "jsonl", ".parquet": "parquet"}
OUTPUT_FORMATS = (".jsonl", ".parquet")


def input_format(path: Path) -> str:
    fmt = INPUT_FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise InputError(path, f"unknown input format: use one of {', '.join(INPUT_FORMATS)}")
    if not path.is_file():
        raise NotFound(f"{path}: no such input file")
    return fmt


@dataclass
class Chunk:
    """`frame` holds rows `start`, `start + 1`, ... of the input; `lines[i]` is row i's line in
    the file (None for Parquet, whose rows have no lines)."""

    path: Path
    start: int
    frame: Any  # pandas.DataFrame
    lines: list[int] | None

    def error(self, message: str, row: int | None) -> InputError:
        """An error about row `row` of this chunk (None: the whole input), naming its line."""
        if row is None:
            return InputError(self.path, message)
        if self.lines is None:
            return InputError(self.path, f"row {self.start + row}: {message}")
        return InputError(self.path, message, line=self.lines[row])


def count_rows(path: Path) -> int | None:
    """Rows in the input, for the progress bar: Parquet's metadata, or a count of lines."""
    fmt = input_format(path)
    if fmt == "parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    with open(path, "rb") as f:
        lines = sum(block.count(b"\n") for block in iter(lambda: f.read(1 << 20), b""))
    return max(0, lines - (fmt == "tsv"))  # the header is no row


def read_chunks(
    path: str | Path, chunk_size: int, rename: dict[str, str] | None = None
) -> Iterator[Chunk]:
    """The input's rows, `chunk_size` at a time; `rename`: model column -> file column."""
    import pandas as pd

    path = Path(path)
    fmt = input_format(path)
    if chunk_size < 1:
        raise BadValue(f"--chunk-size must be >= 1, got {chunk_size}")
    to_model = {file: model for model, file in (rename or {}).items()}
    start = 0
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            table = pq.ParquetFile(path)
        except (pa.ArrowException, OSError) as e:
            raise InputError(path, f"not a readable Parquet file ({e})") from None
        for batch in table.iter_batches(batch_size=chunk_size):
            frame = _renamed(path, batch.to_pandas(), to_model, start)
            yield Chunk(path, start, frame, None)
            start += len(frame)
        if start == 0:  # no rows: its columns are still checked
            empty = table.schema_arrow.empty_table().to_pandas()
            yield Chunk(path, 0, _renamed(path, empty, to_model, 0), None)
        return
    rows: list = []
    lines: list[int] = []
    header: list[str] | None = {"text": ["text"], "jsonl": []}.get(fmt)  # TSV: the first row
    for line, row in _rows(path, fmt):
        if header is None:
            header = row
            continue
        if fmt == "tsv" and len(row) != len(header):
            raise InputError(
                path, f"{len(row)} tab-separated fields, the header has {len(header)}", line=line
            )
        rows.append(row)
        lines.append(line)
        if len(rows) == chunk_size:
            yield Chunk(
                path, start, _renamed(path, _frame(rows, header, fmt), to_model, start), lines
            )
            start, rows, lines = start + len(rows), [], []
    if header is None or (start == 0 and not rows and fmt != "tsv"):  # nothing, not even a header
        raise InputError(path, "no rows: the file is empty")
    if rows or start == 0:  # a TSV of a header only still has its columns checked
        frame = _frame(rows, header, fmt) if rows else pd.DataFrame(columns=header)
        yield Chunk(path, start, _renamed(path, frame, to_model, start), lines)


def _renamed(path: Path, frame, to_model: dict[str, str], start: int):
    """`frame` with the file's columns named as the model's (`--column MODEL=FILE`); a FILE
    column not in the input is an error (checked on the first chunk: JSONL rows may vary)."""
    absent = [file for file in to_model if file not in frame.columns]
    if start == 0 and absent:
        have = ", ".join(map(str, frame.columns)) or "none"
        raise InputError(
            path,
            f"--column {to_model[absent[0]]}={absent[0]}: no column "
            f"{absent[0]!r} in the file (got {have})",
        )
    return frame.rename(columns=to_model)


def _rows(path: Path, fmt: str) -> Iterator[tuple[int, Any]]:
    """(line number, row) of a text, TSV or JSONL file."""
    with utf8_errors(path), open(path, encoding="utf-8", newline="" if fmt == "tsv" else None) as f:
        lines = text_lines(f, path)
        if fmt == "tsv":
            reader = csv.reader(lines, delimiter="\t", quoting=csv.QUOTE_NONE)
            try:
                for row in reader:
                    yield reader.line_num, row
            except csv.Error as e:  # a field over csv's limit (131,072 characters)
                raise InputError(path, str(e), line=reader.line_num) from None
            return
        for n, text in enumerate(lines, start=1):
            text = text.rstrip("\n")
            if fmt == "text":
                yield n, [text]
            elif text.strip():
                try:
                    value = json.loads(text)
                except json.JSONDecodeError as e:
                    raise InputError(path, f"not JSON ({e.msg})", line=n) from None
                if not isinstance(value, dict):
                    raise InputError(path, "expected a JSON object", line=n)
                yield n, value


def _frame(rows: list, header: list[str], fmt: str):
    import pandas as pd

    return pd.DataFrame(rows) if fmt == "jsonl" else pd.DataFrame(rows, columns=header)


def arrow_type(t: Any):
    """`Predictor.output_types` notation -> a pyarrow type."""
    import pyarrow as pa

    if isinstance(t, list):
        return pa.list_(arrow_type(t[0]))
    if isinstance(t, dict):
        return pa.struct([(k, arrow_type(v)) for k, v in t.items()])
    return {"string": pa.string(), "double": pa.float64(), "long": pa.int64()}[t]


def output_format(path: str | Path, formats: tuple[str, ...] = OUTPUT_FORMATS) -> str:
    """The output file's suffix, one of `formats`; checked before any work is done."""
    suffix = Path(str(path)).suffix.lower()
    if suffix not in formats:
        raise InputError(path, f"unknown output format: use {' or '.join(formats)}")
    return suffix


@contextmanager
def writer(path: str | Path, schema=None) -> Iterator:
    """`write(rows)` appends dicts (Parquet: or a pyarrow Table) to a .jsonl or .parquet file
    (Parquet: `schema`, a pyarrow schema) that appears only when the block succeeds; local or
    s3:// (`bert_core.storage.output_file`)."""
    suffix = output_format(path)
    with storage.output_file(path, "wb") as f:
        if suffix == ".jsonl":
            yield lambda rows: f.writelines(
                (json.dumps(r, ensure_ascii=False) + "\n").encode("utf-8") for r in rows
            )
            return
        import pyarrow as pa
        import pyarrow.parquet as pq

        with pq.ParquetWriter(f, schema) as out:
            yield lambda rows: out.write_table(
                rows if isinstance(rows, pa.Table) else pa.Table.from_pylist(rows, schema=schema)
            )
