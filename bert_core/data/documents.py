"""Text to sentences to documents: the rules `bert clean` applies to every line it keeps.

Apart from the step (`bert_core.data.corpus`: files, formats, workers, de-duplication,
statistics) because these are the rules a reader checks against the paper's input format: one
sentence a line (blingfire's splitter: NSP needs real sentence boundaries), a document a
chapter (a heading line starts a new one) cut at a paragraph boundary once it reaches
`max_document_chars`, WikiText markup undone, NFC, invisible characters removed.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable, Iterator

HEADING = re.compile(
    r"^(CHAPTER|Chapter|STAVE|BOOK|Book|PART|Part|VOLUME|Volume|ACT|Act|Actus|SCENE|Scene"
    r"|ADVENTURE|LETTER|Letter|PREFACE|Preface)\b"
    r"|^[IVXLC]+\.?$"
)
WIKI_TITLE = re.compile(r"^= [^=].* =$")
WIKI_SECTION = re.compile(r"^(= ){2,}.*( =){2,}$")
WIKI_MARKUP = re.compile(r" @([-,.])@ ")
# Control characters (but not \t \n, handled as whitespace) and zero-width / invisible format
# characters: soft hyphen, ZWSP, ZWNJ, ZWJ, word joiner, BOM.
INVISIBLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u00ad\u200b-\u200f\u2060-\u2064\ufeff]")


def normalize_line(line: str) -> str:
    """NFC, WikiText markup undone, invisible characters removed, whitespace collapsed."""
    line = unicodedata.normalize("NFC", line)
    line = WIKI_MARKUP.sub(r"\1", line)
    line = INVISIBLE.sub("", line)
    return " ".join(line.split())


def split_sentences(paragraph: str) -> list[str]:
    """Sentences of one paragraph (a single line of text) with blingfire."""
    import blingfire

    return [s for s in blingfire.text_to_sentences(paragraph).split("\n") if s.strip()]


def _paragraphs(lines: Iterable[str]) -> Iterator[tuple[bool, str]]:
    """(is_heading, text) for each blank-line separated block, normalised to one line."""
    block: list[str] = []
    for raw in lines:
        line = normalize_line(raw)
        if WIKI_TITLE.match(line):  # a WikiText article title starts a new document
            if block:
                yield False, " ".join(block)
                block = []
            yield True, line.strip("= ")
            continue
        if WIKI_SECTION.match(line):
            line = ""
        if line:
            block.append(line)
        elif block:
            yield len(block) == 1 and _is_heading(block[0]), " ".join(block)
            block = []
    if block:
        yield len(block) == 1 and _is_heading(block[0]), " ".join(block)


def _is_heading(line: str) -> bool:
    if len(line) > 80:
        return False
    letters = [c for c in line if c.isalpha()]
    return bool(HEADING.match(line)) or (bool(letters) and not any(c.islower() for c in letters))


def text_documents(lines: Iterable[str], max_document_chars: int) -> Iterator[list[str]]:
    """Group paragraphs into documents (list of sentences): new one at a heading or when full."""
    doc: list[str] = []
    size = 0
    for is_heading, paragraph in _paragraphs(lines):
        if is_heading:
            if doc:
                yield doc
            doc, size = [], 0
            continue
        for sentence in split_sentences(paragraph):
            doc.append(sentence)
            size += len(sentence)
            if size >= 2 * max_document_chars:  # one huge paragraph: cut mid-paragraph
                yield doc
                doc, size = [], 0
        if size >= max_document_chars:
            yield doc
            doc, size = [], 0
    if doc:
        yield doc


def record_document(text: str) -> list[str]:
    """A JSONL/Parquet record is one document, whatever its length."""
    return [s for _, p in _paragraphs(text.splitlines()) for s in split_sentences(p)]
