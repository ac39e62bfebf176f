"""docs/reliability.md's table of bad inputs, kept by the test that runs them.

Every row of `tests/test_bad_inputs.py` renders as one table row: its id (what the user did), the
kind of mistake, what is expected (exit code and a fragment of the message) and what was observed
(the exit code and the command's own first line, `bert ...: error: ...`, paths and ports made
neutral). The test of
each row checks that the doc holds exactly its row, so a changed message or a new row fails until
the doc is regenerated:

    BERT_WRITE_RELIABILITY=1 .venv/bin/python -m pytest tests/test_bad_inputs.py

which writes the table between the markers below (the rows in the catalogue's order). README.md
quotes the number of rows; tests/test_docs.py holds it to the catalogue.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "reliability.md"
BEGIN, END = "<!-- bad-inputs:begin -->", "<!-- bad-inputs:end -->"
HEADER = "| id (the mistake) | kind | expected | observed |\n|---|---|---|---|\n"
WRITE = os.environ.get("BERT_WRITE_RELIABILITY") == "1"


def observed(code: int, err: str, places: dict[str, Path | str]) -> str:
    """The exit code and the command's first line (not a library's log line before it), `places`
    (folder -> its name in the doc) replaced, ports and pytest's temporary folders made neutral."""
    lines = [line for line in err.strip().splitlines() if line.strip()]
    ours = [line for line in lines if line.startswith("bert")]  # not a library's log lines
    line = ours[0] if ours else (lines[-1] if lines else "")
    for path, name in sorted(places.items(), key=lambda kv: -len(str(kv[0]))):
        line = line.replace(str(path), name)
    # pytest's base temp, with an xdist worker's folder (popen-gwN) when `make test` runs two
    line = re.sub(r"/tmp/pytest-of-[^/]+/pytest-\d+/(?:popen-gw\d+/)?[^/\s'\"]+", "TMP", line)
    line = re.sub(r"(127\.0\.0\.1|localhost):\d+", r"\1:PORT", line)
    return f"exit {code}: {line}"


def row(case_id: str, kind: str, code: int, message: str, seen: str) -> str:
    cells = [f"`{case_id}`", kind, f"exit {code}: {message}", seen]
    return "| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells) + " |"


def doc_rows() -> dict[str, str]:
    """id -> its row, as the doc has them now."""
    text = DOC.read_text(encoding="utf-8")
    if BEGIN not in text:
        return {}
    table = text.split(BEGIN, 1)[1].split(END, 1)[0]
    found = re.findall(r"^\| `([^`]+)` \|.*$", table, flags=re.M)
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    return dict(zip(found, rows, strict=True))


def write(rows: list[str]) -> None:
    """Replace the table between the markers with `rows`."""
    text = DOC.read_text(encoding="utf-8")
    before, rest = text.split(BEGIN, 1)
    after = rest.split(END, 1)[1]
    DOC.write_text(f"{before}{BEGIN}\n{HEADER}" + "\n".join(rows) + f"\n{END}{after}", "utf-8")
