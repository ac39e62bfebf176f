"""CoNLL-2003's data: the files read and checked into `Sentence`s (IOB1 tags turned IOB2), the
split files found, the download, and predictions written back in CoNLL format.

Apart from the task (`ner`) so that each module stays one job: this one knows the file format,
that one the windows, the model and the metrics.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bert_core import storage
from bert_core.errors import InputError, NotFound, utf8_errors

ENTITY_TYPES = ("PER", "ORG", "LOC", "MISC")
LABELS = ("O",) + tuple(f"{p}-{t}" for t in ENTITY_TYPES for p in "BI")
DOCSTART = "-DOCSTART-"
# file names: the commonly distributed copies, then the original shared-task ones
SPLIT_FILES = {
    "train": ("train.txt", "eng.train"),
    "dev": ("valid.txt", "dev.txt", "eng.testa"),
    "test": ("test.txt", "eng.testb"),
}
# the copy the Hugging Face `conll2003` dataset used (train.txt, valid.txt, test.txt; IOB2)
CONLL_URL = "https://data.deepai.org/conll2003.zip"
_TAG = re.compile(r"^(?:O|[BI]-([A-Z]+))$")


@dataclass
class Sentence:
    words: list[str]
    pos: list[str]
    chunk: list[str]
    tags: list[str]  # IOB2
    line: int  # first line in the file, for messages
    doc: int = 0  # document number in the file (-DOCSTART- lines separate documents)
    index: int = 0  # position in the file


# ---------------------------------------------------------------------------------------------
# Reading


def iob1_to_iob2(tags: Sequence[str]) -> list[str]:
    """IOB1 marks B- only between two adjacent entities of one type; IOB2 starts every entity
    with B-. An I-X that follows O or another type starts an entity. IOB2 input is unchanged."""
    out: list[str] = []
    for i, tag in enumerate(tags):
        if tag.startswith("I-"):
            prev = out[i - 1] if i else "O"
            if prev == "O" or prev[2:] != tag[2:]:
                tag = "B-" + tag[2:]
        out.append(tag)
    return out


def read_conll(path: str | Path) -> list[Sentence]:
    """Sentences of a CoNLL-2003 file, tags checked against the four entity types."""
    path = Path(path)
    sentences: list[Sentence] = []
    rows: list[list[str]] = []
    first = doc = 0

    def flush() -> None:
        if rows:
            cols = [list(c) for c in zip(*rows, strict=True)]
            tags = iob1_to_iob2(cols[3])
            sentences.append(Sentence(*cols[:3], tags, first, doc, len(sentences)))
            rows.clear()

    with utf8_errors(path), open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            parts = line.split()
            if not parts:
                flush()
                continue
            if parts[0] == DOCSTART:
                flush()
                doc += 1  # a document: the sentences up to the next -DOCSTART- line
                continue
            if len(parts) != 4:
                raise InputError(
                    path, f"expected 4 columns 'token POS chunk NER', got {len(parts)}", line=n
                )
            m = _TAG.match(parts[3])
            if m is None or (m.group(1) is not None and m.group(1) not in ENTITY_TYPES):
                raise InputError(
                    path, f"unknown NER tag {parts[3]!r} (expected O, B-/I- + {ENTITY_TYPES})", n
                )
            if not rows:
                first = n
            rows.append(parts)
    flush()
    if not sentences:
        raise InputError(path, "no sentences")
    return sentences


def find_split(data_dir: str | Path, split: str, required: bool = True) -> Path | None:
    data_dir = Path(data_dir)
    for name in SPLIT_FILES[split]:
        if (data_dir / name).is_file():
            return data_dir / name
    if not required:
        return None
    raise NotFound(f"{data_dir}: no {split} file (looked for {SPLIT_FILES[split]})")


def download(dest: str | Path, url: str = CONLL_URL) -> Path:
    """Fetch train.txt/valid.txt into `dest` from a .zip or a folder URL. Each file is parsed
    before it is kept, so a truncated or wrong download leaves nothing behind."""
    import io
    import urllib.request
    import zipfile

    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    names = ("train.txt", "valid.txt")
    if not url.endswith(".zip"):
        for name in names:
            storage.download(url.rstrip("/") + "/" + name, dest / name, read_conll)
        return dest
    with urllib.request.urlopen(url, timeout=60) as r:
        archive = zipfile.ZipFile(io.BytesIO(r.read()))
    members = {Path(m).name: m for m in archive.namelist()}
    missing = [n for n in names if n not in members]
    if missing:
        raise InputError(url, f"archive has no {missing}")
    for name in names:
        storage.download(url, dest / name, read_conll, data=archive.read(members[name]))
    return dest


def write_conll(path: Path, sentences: Sequence[Sentence], pred: Sequence[Sequence[str]]) -> None:
    """`token POS chunk gold predicted`, a blank line after each sentence (conlleval's input)."""
    with open(path, "w", encoding="utf-8") as f:
        for s, p in zip(sentences, pred, strict=True):
            for row in zip(s.words, s.pos, s.chunk, s.tags, p, strict=True):
                f.write(" ".join(row) + "\n")
            f.write("\n")
