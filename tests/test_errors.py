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


SECRET = "wJalrXUtnFEMI-sekrit"


def test_a_password_in_a_uri_setting_is_refused_before_anything_and_never_shown(
    tmp_path, monkeypatch, capsys
):
    """A URI with a password in its user info, as a `bert` option (`--opt value`, `--opt=value`,
    a positional) or a pipeline setting (DVC's params, a KFP run's settings, nested in a dict or
    a list), is refused naming where, its password shown as ***, before any MLflow store, run or
    param exists. URIs with no password (a user alone, models:/NAME@ALIAS, hf:ORG/NAME@REV) pass."""
    from bert_core import cli
    from bert_core.errors import BadValue, refuse_secrets
    from bert_core.track import lineage

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    uri = f"s3://AKIAEXAMPLE:{SECRET}@bert/data"
    for argv, where in (
        (["clean", "--input", uri, "--output", "out"], "--input"),
        (["clean", "--input", "x.txt", f"--output={uri}"], "--output"),
        (["evaluate", uri], "argument"),
    ):
        assert cli.main(argv) == 2
        out, err = capsys.readouterr()
        assert (
            err
            == f"bert {argv[0]}: error: {where}: {uri.replace(SECRET, '***')} holds a "
            + (err.split(" holds a ", 1)[1])
        )
        assert SECRET not in out + err and err.count("\n") == 1
    with pytest.raises(BadValue, match=r"^data\.corpus: s3://AKIAEXAMPLE:\*\*\*@") as e:
        with lineage.start_pipeline_run(params={"data": {"corpus": uri}}):
            pass
    assert SECRET not in str(e.value)
    monkeypatch.setenv("KFP_RUN_ID", "run-1")
    db = f"postgresql+psycopg2://mlflow:{SECRET}@postgres:5432/mlflow"
    with pytest.raises(BadValue, match=r"^finetune_tasks: postgresql\+psycopg2://mlflow:\*\*\*@"):
        lineage.kfp_pipeline_run({"finetune_tasks": ["SST-2", db]})
    assert list(tmp_path.iterdir()) == []  # no store, no output: refused before anything
    refuse_secrets(
        [
            ("a", "s3://bucket/key"),
            ("b", "http://user@host:5000"),
            ("c", "models:/bert-sst2@champion"),
            ("d", "hf:org/name@" + "0" * 40),
            ("e", "http://[bad"),
            ("f", "C:/data/x"),
        ]
    )
