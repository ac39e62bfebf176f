"""Errors a user can act on, and the atomic-output rule that goes with them.

A step that fails must leave no partial output behind: everything is written under a temporary
sibling of the destination and renamed into place only when complete (`atomic_dir`,
`atomic_file`). A rename within one file system is atomic, so readers see either nothing or the
whole result. A run killed with SIGKILL cannot clean up after itself; the next run of the same
step removes what it left.

SIGTERM (what Kubernetes and `kill` send) and SIGINT (Ctrl-C) become `Interrupted` in the main
thread (`interrupts_raise`): the same unwinding as an error (staging removed, the MLflow run ended
KILLED), then one line and exit 143 / 130 instead of Python's traceback or SIGTERM's instant death.
"""

from __future__ import annotations

import errno
import glob
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit


class BertError(Exception):
    """A problem with the user's input or settings; the CLI prints it and exits non-zero."""


class InputError(BertError, ValueError):
    """Bad input data, located by file and (when known) line."""

    def __init__(self, path: str | os.PathLike, message: str, line: int | None = None):
        where = f"{path}:{line}" if line is not None else f"{path}"
        super().__init__(f"{where}: {message}")
        self.path, self.line, self.message = str(path), line, message

    def __reduce__(self):
        """Rebuilt from its parts when it crosses a process boundary (a worker pool): the
        default would call `InputError(text)` and fail, hiding the user's error."""
        return type(self), (self.path, self.message, self.line)


def renamed(e: BertError, old: str, new: str) -> None:
    """`e` naming `new` where it named `old`: its message, and an InputError's file and message
    (what it is rebuilt from across processes). For an error about a temporary copy of an input
    (`storage.local_copy`), which should name the input the user gave."""

    def named(part: object) -> object:
        return part.replace(old, new) if isinstance(part, str) else part

    e.args = tuple(named(a) for a in e.args)
    for attribute in ("path", "message"):
        if hasattr(e, attribute):
            setattr(e, attribute, named(getattr(e, attribute)))


class BadValue(BertError, ValueError):
    """A setting or value the command cannot use. Also a ValueError, so a check that catches
    ValueError (a config's own checks, a parser's) still catches it."""


class NotFound(BertError, FileNotFoundError):
    """A file, folder or object the command needs is not there."""


class Diverged(BertError):
    """Training produced a non-finite number (loss or gradient norm): the run failed, not the
    input. The CLI exits 1 (not 2: the input was valid); nothing is written or registered, and
    the MLflow run ends FAILED, so a NaN model never reaches the registry or a table."""

    exit_code = 1


class Interrupted(KeyboardInterrupt):
    """The process got SIGTERM or SIGINT. A KeyboardInterrupt, so everything that unwinds on
    Ctrl-C unwinds on SIGTERM too (`tracking.start_run` ends the run KILLED); `what` says what
    became of the work (a checkpoint, or why there is none)."""

    def __init__(self, signum: int, what: str = ""):
        super().__init__(signal.Signals(signum).name)
        self.signum, self.what = int(signum), what

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # the shell's convention: 143 for SIGTERM, 130 for SIGINT


@contextmanager
def handling_signals(handler: Callable[[int, Any], None]) -> Iterator[None]:
    """While the block runs, `handler` takes SIGTERM and SIGINT; the previous handlers come back
    afterwards. Off the main thread (where Python cannot set a handler) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, previous in old.items():
            signal.signal(s, previous)


def interrupts_raise() -> AbstractContextManager[None]:
    """While the block runs, SIGTERM and SIGINT raise `Interrupted` in the main thread (by
    default SIGTERM ends the process on the spot: no `finally`, no run ended, staging left)."""
    owner = os.getpid()

    def handler(signum: int, frame) -> None:
        if os.getpid() != owner:  # a forked worker (a Pool's: terminate() sends SIGTERM) dies
            signal.signal(signum, signal.SIG_DFL)  # as it would have, not half-way through
            os.kill(os.getpid(), signum)  # holding its queue's lock
            return
        raise Interrupted(signum)

    return handling_signals(handler)


def first_invalid_utf8_line(path: str | os.PathLike) -> int | None:
    """The line of the first byte of `path` that is not UTF-8 (None: the file is valid),
    read in blocks so a large file costs no memory."""
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    lines = 1
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            try:
                decoder.decode(block)
            except UnicodeDecodeError as e:
                # the decoder's position counts from the bytes it still held back
                held = len(e.object) - len(block)
                return lines + block[: max(0, e.start - held)].count(b"\n")
            lines += block.count(b"\n")
    try:
        decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        return lines
    return None


@contextmanager
def utf8_errors(path: str | os.PathLike, name: str | None = None) -> Iterator[None]:
    """Around the reading of a text file: a byte that is not UTF-8 becomes an `InputError`
    naming the file (as `name`, e.g. the s3:// URI it was copied from) and the line it is on,
    instead of a codec message that names neither."""
    try:
        yield
    except UnicodeDecodeError as e:
        line = first_invalid_utf8_line(path)
        raise InputError(name or path, f"not UTF-8 text ({e.reason})", line=line) from None


# The longest line `text_lines` reads: a sentence, a paragraph or a record is far shorter, and a
# longer one (60 MB in a 174 KB .gz) would otherwise be read whole into memory before any check.
MAX_LINE_CHARS = 16 << 20


def text_lines(f, path: str | os.PathLike, limit: int = MAX_LINE_CHARS) -> Iterator[str]:
    """The lines of the open text file `f` (of `path`), each read with at most `limit`
    characters in memory: a longer one is an `InputError` naming the file and the line."""
    for number, line in enumerate(iter(lambda: f.readline(limit + 1), ""), start=1):
        if len(line) > limit:
            raise InputError(
                path,
                f"a line over {limit:,} characters: one sentence, paragraph "
                "or record per line is the format",
                line=number,
            )
        yield line


class OutputSpaceError(BertError):
    """The output could not be written for lack of room: a full disk, a quota, or a file size
    limit (`ulimit -f`). Named after the output the user asked for, not a staging path."""

    def __init__(self, dest: Path, reason: str):
        super().__init__(
            f"cannot write the output {dest}: {reason}; nothing of this run is left there"
        )
        self.dest, self.reason = dest, reason


# errno of a write that failed for lack of room, and how the message says it
NO_ROOM = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EFBIG: "file size limit exceeded (ulimit -f) or file too large",
}


def _no_room(e: BaseException, dest: Path) -> OutputSpaceError | None:
    """The error to raise instead of `e` when `e` is a write that found no room, else None.
    Nested atomic outputs (a model folder inside a step's output) re-raise it under the
    outermost output's name, the one on the command line."""
    if isinstance(e, OutputSpaceError):
        return OutputSpaceError(dest, e.reason)
    if isinstance(e, OSError) and e.errno in NO_ROOM:
        return OutputSpaceError(dest, NO_ROOM[e.errno])
    return None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _sweep_staging(dest: Path) -> None:
    """Remove what killed runs left beside `dest`: `.NAME.tmp-PID-*` staging and `.NAME.old-PID`
    copies whose process is gone. A SIGKILL runs no cleanup handler, so the next run of the
    step is the first chance to tidy up; a live process's staging is left alone."""
    if not dest.parent.is_dir():
        return
    for kind in ("tmp", "old"):
        for stale in dest.parent.glob(f".{glob.escape(dest.name)}.{kind}-*"):
            pid = stale.name[len(f".{dest.name}.{kind}-") :].split("-")[0]
            if pid.isdigit() and not pid_alive(int(pid)):
                if stale.is_dir() and not stale.is_symlink():
                    shutil.rmtree(stale, ignore_errors=True)
                else:
                    stale.unlink(missing_ok=True)


def _staging(dest: Path, is_dir: bool) -> Path:
    """A fresh hidden sibling of `dest`, named after this process so a later run can tell
    whether its owner is still alive; an unwritable folder is reported as `dest`'s problem."""
    _sweep_staging(dest)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        prefix = f".{dest.name}.tmp-{os.getpid()}-"
        if is_dir:
            return Path(tempfile.mkdtemp(prefix=prefix, dir=dest.parent))
        fd, tmp = tempfile.mkstemp(prefix=prefix, dir=dest.parent)
        os.close(fd)
        return Path(tmp)
    except OSError as e:
        blocker = next((p for p in dest.parents if p.exists() and not p.is_dir()), None)
        why = f"{blocker} is a file, not a folder" if blocker else e.strerror or e
        raise BertError(f"cannot write the output {dest}: {why}") from None


def _drop_own_staging(dest: Path) -> None:
    """Remove this process's staging of `dest` (`_staging`'s names hold the pid), the one being
    written and any an interrupt left before its owner knew its name."""
    for path in dest.parent.glob(f"{glob.escape(f'.{dest.name}.tmp-{os.getpid()}-')}*"):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one atomic step (Linux renameat2 RENAME_EXCHANGE); False if the
    platform or file system cannot, and the caller falls back to two renames."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


@contextmanager
def atomic_dir(dest: str | os.PathLike, overwrite: bool = True) -> Iterator[Path]:
    """Yield a temporary directory that replaces `dest` only if the block succeeds.

    An existing `dest` folder is swapped out in one atomic step and then deleted: readers see
    the old output or the new one, never neither, and no hidden copy of the old one stays. A
    `dest` that is a file is an error (it is never moved aside). Staging left by killed runs of
    the same output is removed first. A write that finds no room (full disk, quota, `ulimit -f`)
    becomes an `OutputSpaceError` naming `dest`.
    """
    dest = Path(dest)
    if dest.exists() and not dest.is_dir():
        raise BertError(f"the output {dest} exists and is a file, not a folder")
    if dest.exists() and not overwrite:
        raise BertError(f"{dest} exists")
    try:  # a signal between the staging's creation and the yield leaves nothing either
        tmp = _staging(dest, is_dir=True)
        tmp.chmod(0o755)  # mkdtemp makes it 0700; outputs are read by other users (KFP, DVC)
        yield tmp
    except BaseException as e:
        _drop_own_staging(dest)
        if (room := _no_room(e, dest)) is not None:
            raise room from None
        raise
    if not dest.exists():
        os.replace(tmp, dest)
    elif _exchange(tmp, dest):
        shutil.rmtree(tmp, ignore_errors=True)  # now holds the old output
    else:
        old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
        os.replace(dest, old)
        os.replace(tmp, dest)
        shutil.rmtree(old, ignore_errors=True)


@contextmanager
def atomic_file(dest: str | os.PathLike, mode: str = "w") -> Iterator:
    """Open a temporary file next to `dest`; rename it over `dest` when the block succeeds (a
    write that finds no room: `OutputSpaceError`, as `atomic_dir`)."""
    dest = Path(dest)
    if dest.is_dir():
        raise BertError(f"the output {dest} exists and is a folder, not a file")
    try:  # as `atomic_dir`: an interrupt at any point leaves no staging
        tmp = _staging(dest, is_dir=False)
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600
        with open(tmp, mode) as f:
            yield f
        os.replace(tmp, dest)
    except BaseException as e:
        _drop_own_staging(dest)
        if (room := _no_room(e, dest)) is not None:
            raise room from None
        raise


# ------------------------------------------------------------------ what a message may show


def redacted(uri: str) -> str:
    """`uri` with the password in its user info hidden (`http://user:***@host`): how every
    message and log line shows a tracking or database URI."""
    parts = urlsplit(uri)
    if parts.password is None:
        return uri
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{parts.username}:***@{host}"))


def refuse_secrets(values: Iterable[tuple[str, Any]]) -> None:
    """Fail (BadValue, naming where) on a value that is a URI with a password in its user info
    (`s3://KEY:SECRET@bucket/x`, `postgresql://u:pw@host/db`), looking inside dicts and lists: a
    setting is printed in messages, logged as an MLflow param and shown in process lists, so a
    credential never travels in one. The one exception is MLFLOW_TRACKING_URI, which MLflow's
    clients read as Basic auth: it is read with `credentials` and shown `redacted`."""
    for where, value in values:
        if isinstance(value, dict):
            refuse_secrets((f"{where}.{k}", v) for k, v in value.items())
        elif isinstance(value, list | tuple):
            refuse_secrets((where, v) for v in value)
        elif isinstance(value, str) and _password(value) is not None:
            raise BadValue(
                f"{where}: {redacted(value)} holds a password, and a setting is shown in logs, "
                "MLflow params and process lists: give S3 keys as AWS_ACCESS_KEY_ID / "
                "AWS_SECRET_ACCESS_KEY and MLflow's as MLFLOW_TRACKING_USERNAME / "
                "MLFLOW_TRACKING_PASSWORD (Secrets on a cluster), and the URI without them"
            )


def _password(value: str) -> str | None:
    """The password in `value`'s user info when it is a URI (RFC 3986, as urllib splits it)."""
    try:
        parts = urlsplit(value)
        return parts.password if len(parts.scheme) > 1 and parts.netloc else None
    except ValueError:  # not a URI (an unbalanced '[' in a host, say)
        return None


def credentials(uri: str) -> tuple[str, tuple[str, str] | None]:
    """(`uri` without its user info, (user, password) or None): what goes on the wire and what
    goes into an Authorization header, never into a host name or another process's settings."""
    parts = urlsplit(uri)
    if parts.username is None:
        return uri, None
    bare = urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
    return bare, (unquote(parts.username), unquote(parts.password or ""))
