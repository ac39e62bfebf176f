"""`bert clean` on real Gutenberg books and on crafted bad input."""

from __future__ import annotations

import gzip
import json
import unicodedata
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bert_core import cli
from bert_core.data.corpus import CleanConfig, clean_corpus

BOOKS = [
    "a_christmas_carol.txt",  # UTF-8 BOM, CRLF, modern Gutenberg header/footer
    "frankenstein.txt",  # CRLF, footer without the licence marker first
    "gutenberg_nltk/shakespeare-caesar.txt",  # old "SMALL PRINT" header, invalid UTF-8 bytes
    "sample_text.txt",  # already in BERT's format
]


@pytest.fixture(scope="module")
def mlflow_db(tmp_path_factory) -> str:
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


@pytest.fixture(autouse=True)
def _mlflow(mlflow_db, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_db)


def link_books(shared_data: Path, dest: Path) -> Path:
    dest.mkdir()
    for name in BOOKS:
        (dest / Path(name).name).symlink_to(shared_data / "corpus" / name)
    return dest


def documents(out: Path) -> list[list[str]]:
    docs = []
    for shard in sorted(out.glob("shard-*.txt")):
        for block in shard.read_text(encoding="utf-8").split("\n\n"):
            if block.strip():
                docs.append(block.split("\n"))
    return docs


def test_clean_real_books(shared_data, tmp_path, capsys):
    src = link_books(shared_data, tmp_path / "books")
    out = tmp_path / "clean"
    assert cli.main(["clean", "--input", str(src), "--output", str(out), "--num-shards", "3"]) == 0
    assert "invalid UTF-8" in capsys.readouterr().err
    stats = json.loads((out / "stats.json").read_text())
    docs = documents(out)
    text = "\n".join("\n".join(d) for d in docs)
    # boilerplate gone, the book is there
    for marker in ("START OF THIS PROJECT", "END OF THIS PROJECT", "SMALL PRINT", "FULL LICENSE"):
        assert marker not in text.upper()
    assert "Marley was dead, to begin with." in text
    assert "You will rejoice to hear that no disaster has accompanied" in text
    # normalised: no CR, BOM, control or zero-width characters, NFC, no empty sentence
    assert not any(c in text for c in "\r\ufeff\u200b\x00\t")
    assert unicodedata.is_normalized("NFC", text)
    assert all(s.strip() == s and s for d in docs for s in d)
    # documents: many per book, none short, none duplicated, counts match stats
    assert stats["documents"] == len(docs) > 30
    assert stats["sentences"] == sum(len(d) for d in docs)
    assert all(sum(len(s) for s in d) >= CleanConfig().min_document_chars for d in docs)
    assert len({"\n".join(d) for d in docs}) == len(docs)
    assert stats["dropped"]["boilerplate_lines"] > 500
    assert stats["chars_out"] < stats["chars_in"]
    # policy for invalid UTF-8: replaced by U+FFFD and counted, first place named
    assert stats["invalid_utf8_sequences"] >= 1
    assert "shakespeare-caesar.txt:" in stats["invalid_utf8_first"][0]
    assert "\ufffd" in text
    # sentence split: the sample (one sentence a line) keeps its sentences
    assert "This was nearly opposite." in docs[0] + [s for d in docs for s in d]


def test_same_output_whatever_the_workers(shared_data, tmp_path):
    src = link_books(shared_data, tmp_path / "books")
    a = clean_corpus(src, tmp_path / "a", CleanConfig(num_workers=1, num_shards=2))
    b = clean_corpus(src, tmp_path / "b", CleanConfig(num_workers=2, num_shards=2))
    assert a["documents"] == b["documents"]
    for shard in ("shard-00000.txt", "shard-00001.txt"):
        assert (tmp_path / "a" / shard).read_bytes() == (tmp_path / "b" / shard).read_bytes()


def test_markup_normalisation_dedup_and_formats(tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    body = (
        "The Valkyria @-@ series sold 1 @,@ 000 copies at 3 @.@ 5 dollars. "
        "Cafe\u0301 owners were\u200b pleased.\x07 It   rained\u00a0all day."
    )
    records = [
        {"text": " = Title = \n" + body},
        {"text": " = Title = \n" + body.replace("   ", " ")},  # duplicate after cleaning
        {"text": "Too short."},
        {"text": "Second document here. It has two sentences and enough characters " * 3},
    ]
    with gzip.open(src / "a.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write("\n".join(json.dumps(r) for r in records) + "\n")
    pq.write_table(pa.table({"text": ["A parquet document. " * 12]}), src / "b.parquet")
    out = tmp_path / "out"
    stats = clean_corpus(src, out, CleanConfig(min_document_chars=50, num_shards=1))
    docs = documents(out)
    assert docs[0] == [
        "Title",
        "The Valkyria-series sold 1,000 copies at 3.5 dollars.",
        "Café owners were pleased.",
        "It rained all day.",
    ]
    assert stats["dropped"]["duplicate_documents"] == 1
    assert stats["dropped"]["too_short_documents"] == 1
    assert len(docs) == 4 - 2 + 1
    assert docs[-1][0] == "A parquet document."


def test_empty_corpus_is_an_error_without_output(tmp_path, capsys):
    src = tmp_path / "empty"
    src.mkdir()
    (src / "a.txt").write_text("\n\n   \n")
    out = tmp_path / "out"
    assert cli.main(["clean", "--input", str(src), "--output", str(out)]) == 2
    assert "no documents" in capsys.readouterr().err
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["empty"]
    assert cli.main(["clean", "--input", str(tmp_path / "nope"), "--output", str(out)]) == 2


def test_bad_jsonl_names_file_and_line(tmp_path, capsys):
    src = tmp_path / "c.jsonl"
    src.write_text('{"text": "fine"}\n{"text": 3}\n')
    out = tmp_path / "out"
    assert cli.main(["clean", "--input", str(src), "--output", str(out)]) == 2
    assert f"{src}:2" in capsys.readouterr().err
    assert not out.exists()


def test_invalid_utf8_is_replaced_and_counted(tmp_path):
    src = tmp_path / "latin1.txt"
    src.write_bytes(
        ("Good line one. " * 20 + "\n").encode() + "Caf\xe9 au lait. ".encode("latin-1") * 20
    )
    stats = clean_corpus(src, tmp_path / "out", CleanConfig(num_shards=1))
    assert stats["invalid_utf8_sequences"] == 20
    assert stats["invalid_utf8_first"] == [f"{src}:2"]
    assert "Caf\ufffd au lait." in (tmp_path / "out" / "shard-00000.txt").read_text()


def test_a_single_10mb_line(tmp_path):
    src = tmp_path / "big.txt"
    line = " ".join(f"Sentence number {i} of a very long line." for i in range(250_000))
    src.write_text(line)
    assert len(line) > 10_000_000
    stats = clean_corpus(src, tmp_path / "out", CleanConfig(num_shards=2, num_workers=1))
    # every sentence kept, one a line, cut into documents of bounded size
    assert stats["sentences"] >= 249_000  # blingfire may join a few
    assert stats["documents"] == len(documents(tmp_path / "out")) > 400
    assert max(sum(map(len, d)) for d in documents(tmp_path / "out")) <= 20_100
