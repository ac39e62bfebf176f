"""Errors a user can act on, and the atomic-output rule that goes with them.

A step that fails must leave no partial output behind: everything is written under a temporary
sibling of the destination and renamed into place only when complete (`atomic_dir`,
`atomic_file`). A rename within one file system is atomic, so readers see either nothing or the
whole result.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class BertError(Exception):
    """A problem with the user's input or settings; the CLI prints it and exits non-zero."""


class InputError(BertError, ValueError):
    """Bad input data, located by file and (when known) line."""

    def __init__(self, path: str | os.PathLike, message: str, line: int | None = None):
        where = f"{path}:{line}" if line is not None else f"{path}"
        super().__init__(f"{where}: {message}")
        self.path, self.line = str(path), line


@contextmanager
def atomic_dir(dest: str | os.PathLike, overwrite: bool = True) -> Iterator[Path]:
    """Yield a temporary directory that replaces `dest` only if the block succeeds."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    tmp.chmod(0o755)  # mkdtemp makes it 0700; outputs are read by other users (KFP, DVC)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if dest.exists():
        if not overwrite:
            shutil.rmtree(tmp, ignore_errors=True)
            raise BertError(f"{dest} exists")
        old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
        os.replace(dest, old)
        os.replace(tmp, dest)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, dest)


@contextmanager
def atomic_file(dest: str | os.PathLike, mode: str = "w") -> Iterator:
    """Open a temporary file next to `dest`; rename it over `dest` when the block succeeds."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.tmp-", dir=dest.parent)
    os.chmod(tmp, 0o644)  # mkstemp makes it 0600
    try:
        with os.fdopen(fd, mode) as f:
            yield f
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
