"""The atomic-output rule: all or nothing at the destination, nothing hidden left beside it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from bert_core.errors import BertError, atomic_dir, atomic_file


def siblings(dest: Path) -> list[str]:
    return sorted(p.name for p in dest.parent.iterdir() if p.name != dest.name)


def test_atomic_dir_replaces_an_old_output_and_keeps_no_copy(tmp_path):
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "old.txt").write_text("old")
    with atomic_dir(dest) as tmp:
        (tmp / "new.txt").write_text("new")
    assert sorted(p.name for p in dest.iterdir()) == ["new.txt"]
    assert siblings(dest) == []


def test_atomic_dir_failure_keeps_the_old_output_and_no_staging(tmp_path):
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "old.txt").write_text("old")
    with pytest.raises(RuntimeError), atomic_dir(dest) as tmp:
        (tmp / "half.txt").write_text("partial")
        raise RuntimeError("step failed")
    assert (dest / "old.txt").read_text() == "old"
    assert not (dest / "half.txt").exists()
    assert siblings(dest) == []


def test_output_that_is_a_file_is_an_error_and_is_left_alone(tmp_path):
    dest = tmp_path / "out"
    dest.write_text("precious")
    with pytest.raises(BertError, match="is a file"), atomic_dir(dest):
        pass
    assert dest.read_text() == "precious"
    assert siblings(dest) == []
    folder = tmp_path / "folder"
    folder.mkdir()
    with pytest.raises(BertError, match="is a folder"), atomic_file(folder):
        pass


def test_unwritable_output_names_the_output_not_a_temp_path(tmp_path):
    if os.geteuid() == 0:
        blocker = tmp_path / "not-a-folder"  # root ignores permissions: a file as parent
        blocker.write_text("x")
        dest = blocker / "out"
    else:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        dest = locked / "out"
    with pytest.raises(BertError) as e, atomic_dir(dest):
        pass
    assert str(dest) in str(e.value) and ".tmp-" not in str(e.value)


KILLED_STEP = textwrap.dedent(
    """
    import os, signal, sys
    from pathlib import Path
    from bert_core.errors import atomic_dir, atomic_file
    dest = Path(sys.argv[1])
    with atomic_dir(dest) as tmp:
        (tmp / "half.txt").write_text("partial")
        with atomic_file(dest.parent / "metrics.csv") as f:
            f.write("half a row")
            os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_staging_of_a_killed_run_is_removed_by_the_next_run(tmp_path):
    dest = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.run([sys.executable, "-c", KILLED_STEP, str(dest)], env=env)
    assert proc.returncode == -signal.SIGKILL
    left = siblings(dest)
    assert any(n.startswith(".out.tmp-") for n in left)  # SIGKILL ran no cleanup
    assert any(n.startswith(".metrics.csv.tmp-") for n in left)
    with atomic_dir(dest) as tmp:
        (tmp / "done.txt").write_text("whole")
    with atomic_file(tmp_path / "metrics.csv") as f:
        f.write("step,loss\n")
    assert siblings(dest) == ["metrics.csv"]
    assert sorted(p.name for p in dest.iterdir()) == ["done.txt"]


def test_staging_of_a_live_run_is_left_alone(tmp_path):
    dest = tmp_path / "out"
    live = tmp_path / f".out.tmp-{os.getpid()}-abc"
    live.mkdir()
    with atomic_dir(dest):
        pass
    assert live.is_dir()


def test_only_our_errors_are_one_line_anything_else_is_a_bug_with_its_traceback(
    monkeypatch, capsys
):
    """`bert` turns its own errors (BertError and its kinds) into one line, exit 2; a ValueError
    from elsewhere (torch's, when labels and logits disagree) is a bug in our code: it keeps its
    traceback (exit 1 from the interpreter), never read as the user's mistake."""
    from bert_core import cli
    from bert_core.errors import BadValue, NotFound
    from bert_core.report import evaluate

    def raising(error: Exception):
        def main(argv):
            raise error

        return main

    for error in (BadValue("--epochs must be >= 1"), NotFound("x: no such file or folder")):
        monkeypatch.setattr(evaluate, "main", raising(error))
        assert cli.main(["evaluate"]) == 2
        assert capsys.readouterr().err == f"bert evaluate: error: {error}\n"
    bug = ValueError("Expected input batch_size (4) to match target batch_size (3).")
    monkeypatch.setattr(evaluate, "main", raising(bug))
    with pytest.raises(ValueError, match="batch_size"):
        cli.main(["evaluate"])
    monkeypatch.setattr(evaluate, "main", raising(FileNotFoundError("/tmp/x.lock")))
    with pytest.raises(FileNotFoundError):
        cli.main(["evaluate"])
