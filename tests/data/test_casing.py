"""Cased models stay cased: `bert vocab --cased` -> `bert instances` -> the pre-trained model
folder, through tokenizer_config.json (`do_lower_case`), as transformers reads it."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from transformers import BertTokenizerFast

from bert_core import cli
from bert_core.data.tokenizer import read_lowercase, read_vocab
from bert_core.model.modeling import TOKENIZER_FILES
from bert_core.pretrain.config import PretrainConfig
from bert_core.pretrain.state import fetch_tokenizer_files, rng_state, save_checkpoint
from bert_core.pretrain.worker import setup

CITIES = ["Paris", "London", "Berlin", "Madrid", "Vienna", "Rome"]


@pytest.fixture
def corpus(tmp_path, monkeypatch) -> Path:
    """A cleaned corpus (one sentence a line, blank lines between documents) of six documents
    where capitalised city names recur."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.chdir(tmp_path)
    docs = []
    for k, city in enumerate(CITIES):
        other = CITIES[(k + 1) % len(CITIES)]
        docs.append(
            "\n".join(
                f"{city} is a city, and the road from {city} to {other} is {n} miles long."
                for n in range(12)
            )
        )
    folder = tmp_path / "clean"
    folder.mkdir()
    (folder / "shard-00000.txt").write_text("\n\n".join(docs) + "\n")
    return folder


def run(*argv) -> None:
    assert cli.main([str(a) for a in argv]) == 0, argv


def test_cased_vocabulary_instances_and_model(corpus, tmp_path):
    root = tmp_path
    run("vocab", "--input", corpus, "--output", root / "vocab", "--vocab-size", "200", "--cased")
    vocab = read_vocab(root / "vocab" / "vocab.txt")
    assert "Paris" in vocab and read_lowercase(root / "vocab") is False
    # no --cased here: the casing comes from the vocabulary folder
    run(
        "instances",
        "--input",
        corpus,
        "--vocab",
        root / "vocab" / "vocab.txt",
        "--output",
        root / "instances",
        "--max-seq-length",
        "32",
        "--dupe-factor",
        "1",
        "--num-workers",
        "1",
    )
    assert read_lowercase(root / "instances") is False
    table = pq.read_table(root / "instances" / "shard-00000.parquet").to_pydict()
    original = [
        [lab[pos.index(i)] if i in pos else t for i, t in enumerate(ids)]
        for ids, pos, lab in zip(
            table["input_ids"], table["masked_lm_positions"], table["masked_lm_ids"], strict=True
        )
    ]
    assert sum(row.count(vocab["Paris"]) for row in original) > 5  # "Paris" kept its id

    # the final checkpoint's model folder (what `bert pretrain` copies to OUTPUT/model)
    cfg = PretrainConfig(instances=str(root / "instances"), output=str(root / "p"), batch_size=4)
    t = setup(cfg)
    ckpt = root / "ckpt"
    ckpt.mkdir()
    save_checkpoint(ckpt, cfg, t, [rng_state()], final=True)
    model_dir = ckpt / "model"
    settings = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert settings["do_lower_case"] is False and (model_dir / "special_tokens_map.json").exists()
    hf = BertTokenizerFast.from_pretrained(model_dir)
    assert hf.tokenize("Paris and London") == ["Paris", "and", "London"]
    assert hf("Paris")["input_ids"] == [vocab["[CLS]"], vocab["Paris"], vocab["[SEP]"]]
    # instances on s3:// are fetched through the storage filesystem (the same for a local path)
    fetched = fetch_tokenizer_files(str(root / "instances"), root / "fetched")
    assert fetched == root / "fetched" / "vocab.txt"
    assert {p.name for p in fetched.parent.iterdir()} == set(TOKENIZER_FILES)
    assert read_lowercase(fetched.parent) is False


def test_uncased_is_the_default_and_lowercases(corpus, tmp_path):
    run("vocab", "--input", corpus, "--output", tmp_path / "vocab", "--vocab-size", "200")
    vocab = read_vocab(tmp_path / "vocab" / "vocab.txt")
    assert "paris" in vocab and "Paris" not in vocab
    assert read_lowercase(tmp_path / "vocab") is True
    hf = BertTokenizerFast.from_pretrained(tmp_path / "vocab")
    assert hf.tokenize("Paris") == ["paris"]
