"""`s3://` paths: the one way a step reads its inputs and writes its outputs (local or s3://),
data digests, and a pre-flight check of the services a run depends on.

On a cluster the instance shards, Ray checkpoints and MLflow artifacts live in an S3-compatible
object store (MinIO in infra/k8s). Every client finds it the way AWS tools do: the endpoint from
`AWS_ENDPOINT_URL_S3` / `AWS_ENDPOINT_URL` (boto3, pyarrow) or MLflow's `MLFLOW_S3_ENDPOINT_URL`,
credentials from `AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY` (a Kubernetes Secret). Nothing
here takes a credential as an argument, so none can end up in a parameter or a log line.

Every step reads its inputs through `local_copy`, which hands local paths through untouched and
downloads an s3:// object or prefix to a temporary folder, so the step's own code only ever sees
local files, and a missing input reads the same whichever it is (`not_found`). It writes its
output through `output_dir` / `output_file`: the atomic local rule of `bert_core.errors`, or for
an s3:// output a local staging folder uploaded when the step succeeds, so a failed step leaves
nothing at its --output either way. S3 failures other than a missing object (no bucket, an
unreachable endpoint) are one line naming the URI and the endpoint (`s3_errors`).

`digest` is the content identity of an input (local or s3://), cheap enough for the pipeline's
first task to compute on every run: KFP's cache key sees only the URI string, the digest sees
the data behind it.

`preflight` exists because a pre-training run that discovers an unreachable bucket or tracking
server at its first checkpoint has already burnt GPU hours: it checks both in seconds, before
any data is read, and names what is unreachable.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from urllib.parse import urlparse

from bert_core.errors import NO_ROOM, BertError, NotFound, atomic_dir, atomic_file, renamed
from bert_core.tracking import check_tracking, tracking_uri

ENDPOINT_VARS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "MLFLOW_S3_ENDPOINT_URL")


def is_s3(path: str | os.PathLike) -> bool:
    return str(path).startswith("s3://")


def split_s3(uri: str) -> tuple[str, str]:
    """`s3://bucket/a/b` -> ("bucket", "a/b")."""
    parsed = urlparse(str(uri))
    if parsed.scheme != "s3" or not parsed.netloc:
        raise BertError(f"{uri}: not an s3://bucket/key URI")
    return parsed.netloc, parsed.path.lstrip("/")


def s3_endpoint() -> str | None:
    """The S3 endpoint from the environment (None = AWS itself)."""
    return next((os.environ[v] for v in ENDPOINT_VARS if os.environ.get(v)), None)


def s3_client(connect_timeout: float = 60, retries: int = 5):
    """A boto3 S3 client for the configured endpoint (credentials from the environment)."""
    import boto3
    from botocore.config import Config

    config = Config(
        connect_timeout=connect_timeout,
        read_timeout=max(connect_timeout, 60),
        retries={"max_attempts": retries, "mode": "standard"},
    )
    return boto3.client("s3", endpoint_url=s3_endpoint(), config=config)


def filesystem(path: str | os.PathLike):
    """(pyarrow FileSystem, path inside it) for a local path or an s3:// URI; another scheme is
    refused (e.g. minio://, KFP's own artifact store). Pass the pair to pyarrow.parquet /
    pyarrow.dataset, or to Ray Train as `RunConfig(storage_path=..., storage_filesystem=...)`, so
    shards and checkpoints go to the same endpoint as DVC and MLflow even when only
    MLFLOW_S3_ENDPOINT_URL is set."""
    import pyarrow.fs as pafs

    if not is_s3(path):
        if "://" in str(path):
            raise BertError(f"{path}: not a local path or an s3:// URI")
        return pafs.LocalFileSystem(), os.fspath(path)
    bucket, key = split_s3(str(path))
    endpoint = s3_endpoint()
    kwargs = {}
    if endpoint:
        parsed = urlparse(endpoint)
        kwargs = {"endpoint_override": parsed.netloc or endpoint}
        kwargs["scheme"] = parsed.scheme or "https"
    if region := os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION"):
        kwargs["region"] = region
    return pafs.S3FileSystem(**kwargs), f"{bucket}/{key}".rstrip("/")


def is_uri(source: str | os.PathLike) -> bool:
    """A URI (s3://, http://, `models:/...`, `runs:/...`), not a local path."""
    return "://" in str(source) or str(source).startswith(("models:", "runs:"))


def _place(path: str | os.PathLike) -> tuple[str, PurePosixPath] | None:
    """("s3://bucket", key) or ("", the resolved local path, symlinks followed); None for a
    reference that is not a path (`models:/...`, `runs:/...`, http)."""
    text = str(path)
    if is_s3(text):
        bucket, key = split_s3(text)
        return f"s3://{bucket}", PurePosixPath("/", key.strip("/"))
    if is_uri(text):
        return None
    return "", PurePosixPath(Path(text).expanduser().resolve().as_posix())


def check_apart(outputs: dict[str, object], inputs: dict[str, object]) -> None:
    """Refuse an output that is, contains or lies inside an input, naming both options.

    `outputs`, `inputs`: option -> a path, an s3:// URI, a list of them or None. Called before any
    work: an output is written by replacing its whole folder, so one equal to or around an input
    would delete it, and one inside an input would change it."""
    for out_option, output in outputs.items():
        out = _place(output) if output else None
        for in_option, value in inputs.items() if out else ():
            for item in value if isinstance(value, list | tuple) else [value]:
                src = _place(item) if item else None
                if src is None or src[0] != out[0]:
                    continue
                if how := _overlap(out[1], src[1]):
                    raise BertError(
                        f"{out_option} {output} {how} {in_option} {item}: an output never "
                        f"replaces, contains or goes into an input (writing it would delete or "
                        f"change {in_option}); choose another {out_option}"
                    )


def _overlap(output: PurePosixPath, source: PurePosixPath) -> str | None:
    """How `output` overlaps `source`, as `check_apart`'s message says it; None if apart."""
    if output == source:
        return "is the same path as"
    if output in source.parents:
        return "contains"
    return "lies inside" if source in output.parents else None


def not_found(uri: str | os.PathLike) -> NotFound:
    """The one error for a missing input, local or s3://: it names the path as given."""
    return NotFound(f"{uri}: no such file or folder")


@contextmanager
def s3_errors(uri: str | os.PathLike, doing: str = "reading") -> Iterator[None]:
    """An S3 request that failed (endpoint down, connection lost mid-transfer) as one line
    naming the s3:// URI and the endpoint, instead of pyarrow's OSError and traceback.

    What is retried before that: pyarrow's S3 filesystem retries each request (HEAD, LIST, GET,
    PUT of a part) up to 3 attempts (its default AwsStandardS3RetryStrategy), boto3 clients up
    to 5 (`s3_client`). All are safe to retry: reads change nothing, and a PUT of the same key
    with the same bytes only writes it again. The step itself is not retried: run it again once
    the endpoint is back (a download starts over in a fresh temporary folder). A local write
    that found no room, a missing file and a `uri` that is not s3:// keep their OSError."""
    try:
        yield
    except OSError as e:
        local = not is_s3(uri) or isinstance(e, FileNotFoundError)
        if local or e.errno in NO_ROOM:
            raise
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise BertError(
            f"{uri}: {doing} failed at the S3 endpoint {s3_endpoint() or 'AWS S3'} ({reason}); "
            "check that it is up (AWS_ENDPOINT_URL / MLFLOW_S3_ENDPOINT_URL) and run the step "
            "again"
        ) from None


@contextmanager
def local_copy(uri: str | os.PathLike, siblings: tuple[str, ...] = ()) -> Iterator[Path]:
    """A local path holding `uri`'s data for the duration: a local path itself (untouched, not
    copied), an s3:// object or prefix downloaded to a temporary folder under its own name (so a
    file keeps its suffix) and removed afterwards, with the files named in `siblings` found
    beside it (e.g. a vocab.txt's tokenizer_config.json). Missing data raises `not_found`; a
    `BertError` raised while the copy is in use names `uri`, not the copy (gone when read)."""
    if not is_s3(uri):
        if not Path(uri).exists():
            raise not_found(uri)
        yield Path(uri)
        return
    import pyarrow.fs as pafs

    fs, path = filesystem(uri)
    with s3_errors(uri, "reading"):
        kind = fs.get_file_info(path).type
    if kind == pafs.FileType.NotFound:
        raise not_found(uri)
    with tempfile.TemporaryDirectory(prefix="bert-s3-") as tmp:
        dest = Path(tmp) / (PurePosixPath(path).name or "data")
        if kind == pafs.FileType.Directory:
            dest.mkdir()
        local = pafs.LocalFileSystem()
        with s3_errors(uri, "reading"):
            pafs.copy_files(path, str(dest), source_filesystem=fs, destination_filesystem=local)
            for name in siblings:
                near = f"{PurePosixPath(path).parent}/{name}"
                if fs.get_file_info(near).type == pafs.FileType.File:
                    pafs.copy_files(near, str(dest.parent / name), fs, local)
        try:
            yield dest
        except BertError as e:
            renamed(e, str(dest), str(uri))
            raise


@contextmanager
def output_dir(dest: str | os.PathLike) -> Iterator[Path]:
    """The local folder a step writes its output folder into: `errors.atomic_dir`'s staging for
    a local `dest`; for an s3:// `dest` (its bucket checked first) a temporary folder that
    replaces what is under `dest` when the block succeeds. A failed step leaves nothing."""
    if not is_s3(dest):
        with atomic_dir(dest) as tmp:
            yield tmp
        return
    check_bucket(str(dest))
    with tempfile.TemporaryDirectory(prefix="bert-out-") as tmp:
        yield Path(tmp)
        fs, path = filesystem(dest)
        with s3_errors(dest, "replacing the output"):
            fs.delete_dir_contents(path, missing_dir_ok=True)
        copy(tmp, dest)


@contextmanager
def output_file(dest: str | os.PathLike, mode: str = "w") -> Iterator:
    """An open file whose content appears at `dest` (local: `errors.atomic_file`; s3://: uploaded)
    only when the block succeeds."""
    if not is_s3(dest):
        with atomic_file(dest, mode) as f:
            yield f
        return
    check_bucket(str(dest))
    with tempfile.TemporaryDirectory(prefix="bert-out-") as tmp:
        local = Path(tmp) / PurePosixPath(str(dest)).name
        with open(local, mode) as f:
            yield f
        copy(local, dest)


def _md5(path: Path) -> str:
    h = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _entries(uri: str | os.PathLike) -> list[tuple[str, int, str]]:
    """(name, size, md5) of every file of `uri`, named relative to its parent (so the entries
    start with its own name). For S3 the md5 is the listing's ETag: no object is read."""
    if is_s3(uri):
        bucket, key = split_s3(str(uri))
        key = key.rstrip("/")
        parent = key.rpartition("/")[0]
        pages = s3_client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=key)
        out = [
            (o["Key"][len(parent) :].lstrip("/"), o["Size"], o["ETag"].strip('"'))
            for page in pages
            for o in page.get("Contents", [])
            if o["Key"] == key or o["Key"].startswith(f"{key}/")
        ]
    else:
        path = Path(uri)
        files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        out = [(p.relative_to(path.parent).as_posix(), p.stat().st_size, _md5(p)) for p in files]
    if not out:
        raise NotFound(f"{uri}: no such file, folder, object or prefix (or it is empty)")
    return out


def digest(*uris: str | os.PathLike) -> str:
    """The content digest of the data at `uris` (local or s3://; files or folders/prefixes):
    sha256 over each file's name (relative to its uri's parent), size and md5, 32 hex digits
    (MLflow's dataset digests hold 36). One changed byte changes it; so do a renamed or an added
    file. No object is downloaded: S3 gives the md5 as the ETag in its listing, which is why the
    local digest uses md5 too, and why a folder and its upload have the same digest when the
    upload was single-part (an ETag of a multipart upload is not the file's md5). No uris: the
    digest of nothing (an empty task list)."""
    h = hashlib.sha256()
    for uri in uris:
        for name, size, md5 in sorted(_entries(uri)):
            h.update(f"{name}\t{size}\t{md5}\n".encode())
    return h.hexdigest()[:32]


def download(
    url: str, dest: Path, check: Callable[[Path], object], data: bytes | None = None
) -> Path:
    """Fetch `url` (or keep `data`, a member of an archive fetched from it) as `dest`: written to
    a hidden `.part` beside it and read by `check` before the rename, so a truncated or wrong
    download leaves nothing behind and its error names the `.part` file and line."""
    part = dest.with_name(f".{dest.name}.part")
    try:
        if data is None:
            with urllib.request.urlopen(url, timeout=60) as r:
                data = r.read()
        part.write_bytes(data)
        check(part)
        part.replace(dest)
    finally:
        part.unlink(missing_ok=True)
    return dest


def check_bucket(uri: str, timeout: float = 5.0) -> None:
    """The bucket of an s3:// URI must exist and accept these credentials."""
    from botocore.exceptions import BotoCoreError, ClientError

    bucket, _ = split_s3(uri)
    where = s3_endpoint() or "AWS S3"
    try:
        s3_client(connect_timeout=timeout, retries=1).head_bucket(Bucket=bucket)
    except ClientError as e:
        code = e.response.get("Error", {}).get("Code", "?")
        what = {"404": "does not exist", "NoSuchBucket": "does not exist", "403": "access denied"}
        raise BertError(
            f"{uri}: bucket {bucket!r} at {where} {what.get(code, f'failed ({code})')}"
        ) from None
    except BotoCoreError as e:
        raise BertError(
            f"{uri}: S3 endpoint {where} is unreachable ({type(e).__name__}); check "
            "AWS_ENDPOINT_URL / MLFLOW_S3_ENDPOINT_URL and the credentials"
        ) from None


def preflight(
    tracking_uri: str | None, paths: list[str | os.PathLike] = (), timeout: float = 5.0
) -> None:
    """Fail fast, naming the culprit, when the tracking server or a bucket is unreachable."""
    if tracking_uri:
        check_tracking(tracking_uri, timeout)
    for bucket_uri in dict.fromkeys(
        f"s3://{split_s3(str(p))[0]}/" for p in paths if p and is_s3(p)
    ):
        check_bucket(bucket_uri, timeout)


def main(argv: list[str] | None = None) -> int:
    """`python -m bert_core.storage [--tracking-uri URI] PATH...`: the pipeline's first step."""
    parser = argparse.ArgumentParser(prog="python -m bert_core.storage", description=main.__doc__)
    parser.add_argument("paths", nargs="*", help="local or s3:// paths the run will use")
    parser.add_argument("--tracking-uri", default=None, help="default: MLFLOW_TRACKING_URI")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds per check")
    args = parser.parse_args(argv)
    try:
        preflight(args.tracking_uri or tracking_uri(), args.paths, args.timeout)
    except BertError as e:
        print(f"preflight: error: {e}", flush=True, file=sys.stderr)
        return 2
    print("preflight: ok")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


# ------------------------ copies between local and s3:// (`bert pretrain --output s3://`, Ray jobs)


def exists(path: str | os.PathLike) -> bool:
    """A file or folder at this local path or s3:// URI."""
    import pyarrow.fs as pafs

    fs, where = filesystem(path)
    return fs.get_file_info(where).type != pafs.FileType.NotFound


def copy(src: str | os.PathLike, dst: str | os.PathLike) -> int:
    """Copy a file or a folder (recursively) from `src` to `dst`, each a local path or an s3://
    URI, replacing files of the same name; returns the number of files copied.

    One call for every direction (local -> S3 for uploads, S3 -> local for a KFP step's output
    folder) through pyarrow's filesystems, so the endpoint rules are `filesystem`'s."""
    import pyarrow.fs as pafs

    src_fs, src_path = filesystem(src)
    dst_fs, dst_path = filesystem(dst)
    with s3_errors(src, "reading"):
        info = src_fs.get_file_info(src_path)
    if info.type == pafs.FileType.NotFound:
        raise not_found(src)
    folder, files = info.type != pafs.FileType.File, 1
    if folder:
        found = src_fs.get_file_info(pafs.FileSelector(src_path, recursive=True))
        files = sum(f.type == pafs.FileType.File for f in found)
    if not is_s3(dst):  # pyarrow makes a folder's subfolders, not the destination's own
        (Path(dst_path) if folder else Path(dst_path).parent).mkdir(parents=True, exist_ok=True)
    with s3_errors(dst if is_s3(dst) else src, f"copying {src} to {dst}"):
        pafs.copy_files(src_path, dst_path, source_filesystem=src_fs, destination_filesystem=dst_fs)
    return files
