"""SQuAD's data: the official JSON read and checked into `Example`s, the dev split, the download.

Its own module so that the official scores (`squad_metrics`) and the task (`squad`) both import
the `Example` type from below, and neither imports the other back.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from bert_core import storage
from bert_core.errors import InputError, NotFound, utf8_errors

VERSIONS = {"squad": "1.1", "squad_v2": "2.0"}
OFFICIAL_URL = "https://rajpurkar.github.io/SQuAD-explorer/dataset/"
DEV_EVERY = 5  # without a dev file: articles with index % 5 == 4 are dev


@dataclass
class Example:
    qid: str
    question: str
    context: str
    answers: list[tuple[str, int]]  # (text, answer_start); empty when impossible
    is_impossible: bool = False


# ---------------------------------------------------------------------------------------------
# Reading


KINDS = {str: "text", int: "an integer", list: "a list"}


def _field(path: Path, record: object, key: str, kind: type, where: str):
    """`record[key]` when it is a `kind` (a JSON bool is no int), else one line naming it."""
    value = record.get(key) if isinstance(record, dict) else None
    if not isinstance(value, kind) or isinstance(value, bool):
        got = "nothing" if value is None else type(value).__name__
        raise InputError(path, f"{where}: {key!r} must be {KINDS[kind]}, got {got}")
    return value


def _examples(path: Path, articles: list, version: str) -> list[Example]:
    out: list[Example] = []
    for a, article in enumerate(articles):
        title = article.get("title", a)
        for p, para in enumerate(article["paragraphs"]):
            context = _field(path, para, "context", str, f"article {title!r} paragraph {p}")
            if not context.strip():
                raise InputError(path, f"article {title!r} paragraph {p}: empty context")
            for qa in para["qas"]:
                qid, impossible = str(qa["id"]), bool(qa.get("is_impossible", False))
                if impossible and version != "2.0":
                    raise InputError(path, f"question {qid}: is_impossible needs SQuAD 2.0")
                answers = []
                for ans in _field(path, qa, "answers", list, f"question {qid}"):
                    text = _field(path, ans, "text", str, f"question {qid}'s answer")
                    start = _field(path, ans, "answer_start", int, f"question {qid}'s answer")
                    if context[start : start + len(text)] != text or not text.strip():
                        raise InputError(
                            path,
                            f"question {qid}: answer_start {start} does not point at its answer "
                            f"{text!r} (context has {context[start : start + len(text)]!r})",
                        )
                    answers.append((text, start))
                if not answers and not impossible:
                    raise InputError(path, f"question {qid}: no answers and not is_impossible")
                if answers and impossible:
                    raise InputError(path, f"question {qid}: is_impossible but has answers")
                question = _field(path, qa, "question", str, f"question {qid}")
                if not question.strip():
                    raise InputError(path, f"question {qid}: empty question")
                out.append(Example(qid, question, context, answers, impossible))
    return out


def read_squad(path: str | Path, version: str = "1.1", split: str | None = None) -> list[Example]:
    """Examples of a SQuAD JSON file, checked; `split` ('train'/'dev') takes the deterministic
    by-article split of a file that has no separate dev set."""
    path = Path(path)
    try:
        with utf8_errors(path), open(path, encoding="utf-8") as f:
            articles = json.load(f)["data"]
    except json.JSONDecodeError as e:
        raise InputError(path, f"not valid JSON: {e.msg}", line=e.lineno) from e
    except (KeyError, TypeError) as e:
        raise InputError(path, 'expected {"data": [...], "version": ...}') from e
    if split is not None:
        dev = split == "dev"
        articles = [a for i, a in enumerate(articles) if (i % DEV_EVERY == DEV_EVERY - 1) == dev]
    try:
        examples = _examples(path, articles, version)
    except (KeyError, TypeError) as e:
        raise InputError(path, f"not SQuAD JSON: missing or bad field {e}") from e
    if not examples:
        raise InputError(path, "no questions")
    seen: set[str] = set()
    for ex in examples:
        if ex.qid in seen:
            raise InputError(path, f"question id {ex.qid} given twice")
        seen.add(ex.qid)
    return examples


def find_files(data_dir: str | Path, version: str) -> tuple[Path, Path | None]:
    """(train file, dev file or None when the dev set is split off the train file)."""
    data_dir = Path(data_dir)

    def first(*names: str) -> Path | None:
        return next((data_dir / n for n in names if (data_dir / n).is_file()), None)

    train = first(f"train-v{version}.json", "train.json")
    if train is None:
        raise NotFound(f"{data_dir}: no train-v{version}.json or train.json")
    return train, first(f"dev-v{version}.json", "dev.json")


def download(dest: str | Path, version: str = "1.1", base_url: str = OFFICIAL_URL) -> Path:
    """Fetch the official train/dev files into `dest`; each is parsed before it is kept, so a
    truncated or wrong download leaves nothing behind."""
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for split in ("train", "dev"):
        name = f"{split}-v{version}.json"
        url = base_url.rstrip("/") + "/" + name
        storage.download(url, dest / name, lambda part: read_squad(part, version))
    return dest
