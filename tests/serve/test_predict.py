"""`bert predict`: every input format, any chunking, JSONL or Parquet out, the same answers;
bounded chunks; a bad row names its file and line and leaves no output."""

from __future__ import annotations

import json

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bert_core import cli
from bert_core.serve import predict, records
from bert_core.serve.predictors import load_predictor
from tests.serving_helpers import build

SENTENCES = [
    "it 's a charming and often affecting journey . ",
    "unflinchingly bleak and desperate",
    "allows us to hope that nolan is poised to embark a major career as a commercial yet "
    "inventive filmmaker .",
    "the acting , costumes , music , cinematography and sound are all astounding given the "
    "production 's austere locales .",
    "it 's slow -- very , very slow .",
    "a sometimes tedious film .",
    "ok",
]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def env(tmp_path_factory, minilm_dir):
    root = tmp_path_factory.mktemp("predict")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
        mp.delenv("BERT_PARENT_RUN_ID", raising=False)
        mp.chdir(root)
        folders = {k: build(k, minilm_dir, root / k) for k in ("classification", "ner")}
        yield root, folders


def read_output(path):
    if path.suffix == ".parquet":
        return pq.read_table(path).to_pylist()
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def write_inputs(root):
    """The same sentences as .txt, .tsv (GLUE's columns), .jsonl (with ids) and .parquet."""
    files = {"txt": root / "in.txt", "tsv": root / "in.tsv", "jsonl": root / "in.jsonl"}
    files["txt"].write_text("".join(s + "\n" for s in SENTENCES), encoding="utf-8")
    rows = "".join(f"{s}\t{i % 2}\n" for i, s in enumerate(SENTENCES))
    files["tsv"].write_text("sentence\tlabel\n" + rows, encoding="utf-8")
    jsonl = [json.dumps({"id": f"q{i}", "text": s}) for i, s in enumerate(SENTENCES)]
    files["jsonl"].write_text("\n".join(jsonl) + "\n\n", encoding="utf-8")  # a blank line too
    files["parquet"] = root / "in.parquet"
    pq.write_table(pa.table({"text": SENTENCES}), files["parquet"], row_group_size=3)
    return files


@pytest.mark.slow
def test_every_format_any_chunking_same_answers(env, capsys):
    root, folders = env
    model = str(folders["classification"])
    want = load_predictor(model).predict(pd.DataFrame({"text": SENTENCES}))
    files = write_inputs(root)
    runs = [
        ("txt", 2, ".jsonl"),
        ("tsv", 3, ".parquet"),
        ("jsonl", 100, ".jsonl"),
        ("parquet", 2, ".parquet"),
    ]
    for fmt, chunk, suffix in runs:
        out = root / f"out-{fmt}{suffix}"
        argv = ["predict", "--model", model, "--input", str(files[fmt]), "--output", str(out)]
        argv += ["--chunk-size", str(chunk), "--batch-size", "2"]
        assert cli.main(argv + (["--column", "text=sentence"] if fmt == "tsv" else [])) == 0
        printed = capsys.readouterr()
        summary = json.loads(printed.out.strip().splitlines()[-1])
        assert summary["rows"] == len(SENTENCES) and summary["kind"] == "classification"
        assert "predict:" not in printed.err  # stderr is no terminal: no progress bar
        got = read_output(out)
        assert [r["row"] for r in got] == list(range(len(SENTENCES)))
        assert [r.get("id") for r in got] == (
            [f"q{i}" for i in range(7)] if fmt == "jsonl" else [None] * 7
        )
        for g, w in zip(got, want, strict=True):
            assert g["label"] == w["label"]
            assert g["probabilities"] == pytest.approx(w["probabilities"], abs=1e-6)


def test_input_is_read_in_bounded_chunks(env, monkeypatch):
    root, folders = env
    predictor = load_predictor(folders["classification"])
    seen = []
    answer = predictor.predict
    monkeypatch.setattr(
        predictor, "predict", lambda frame: seen.append(len(frame)) or answer(frame)
    )
    path = root / "many.txt"
    path.write_text("".join(f"sentence number {i}\n" for i in range(23)))
    assert predict.predict_file(predictor, path, root / "many.jsonl", chunk_size=5) == 23
    assert seen == [5, 5, 5, 5, 3]
    assert records.count_rows(path) == 23


def test_entities_to_parquet_with_nested_schema(env):
    root, folders = env
    predictor = load_predictor(folders["ner"])
    path = root / "ner.jsonl"
    texts = ["EU rejects German call to boycott British lamb .", "Peter Blackburn"]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    predict.predict_file(predictor, path, root / "ner.parquet")
    table = pq.read_table(root / "ner.parquet")
    assert table.schema.field("entities").type == pa.list_(
        records.arrow_type(type(predictor).output_types({})["entities"][0])
    )
    assert table.to_pylist() == [
        {"row": i, **a} for i, a in enumerate(predictor.predict(pd.DataFrame({"text": texts})))
    ]


@pytest.mark.slow
def test_bad_rows_name_file_and_line_and_leave_no_output(env, capsys):
    root, folders = env
    model = str(folders["classification"])
    bad = root / "bad.tsv"
    bad.write_text("sentence\tlabel\ngood\t1\nfine\t0\n \t1\n", encoding="utf-8")
    cases = [
        (bad, ["--column", "text=sentence"], f"{bad}:4: 'text' is empty"),
        (
            bad,
            [],
            f"{bad}: missing column 'text': this classification model (fine-tuned on SST-2) "
            "reads the columns text (got sentence, label); `--column MODEL=FILE`",
        ),
        (bad, ["--column", "text=sentence", "--max-chars", "3"], f"{bad}:2: 'text' has 4"),
    ]
    broken = root / "broken.jsonl"
    broken.write_text('{"text": "a"}\n{"text": \n')
    cases.append((broken, [], f"{broken}:2: not JSON"))
    ragged = root / "ragged.tsv"
    ragged.write_text("text\tlabel\na\t1\nb\n")
    cases.append((ragged, [], f"{ragged}:3: 1 tab-separated fields, the header has 2"))
    pq.write_table(pa.table({"text": ["a", "b", None]}), root / "bad.parquet", row_group_size=2)
    cases.append((root / "bad.parquet", [], "bad.parquet: row 2: 'text' is missing"))
    for path, extra, message in cases:
        out = root / "never.jsonl"
        argv = ["predict", "--model", model, "--input", str(path), "--output", str(out)]
        assert cli.main(argv + ["--chunk-size", "1"] + extra) == 2
        assert message in capsys.readouterr().err
        assert not out.exists() and not list(root.glob(".never.jsonl*"))
    with pytest.raises(ValueError, match="MODEL_COLUMN=FILE_COLUMN"):
        predict.parse_columns(["text"])
    argv = ["predict", "--model", "models:/bert-nope@champion", "--input", str(bad)]
    assert cli.main([*argv, "--output", str(root / "never.jsonl")]) == 2
    assert "models:/bert-nope@champion: Registered Model with name=bert-nope not found" in (
        capsys.readouterr().err
    )
