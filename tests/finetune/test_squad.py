"""SQuAD span QA: official metrics, offset mapping, windows, decoding, bad input, download, CLI."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from bert_core import cli
from bert_core.finetune.engine import load_tokenizer
from bert_core.finetune.tasks.squad import (
    Example,
    SquadConfig,
    SquadFinetune,
    answer_tokens,
    apply_threshold,
    best_thresholds,
    decode,
    doc_spans,
    download,
    exact_match,
    f1_v1,
    featurize,
    normalize_answer,
    read_squad,
    squad_metrics,
)
from bert_core.model.modeling import BertConfig, BertForPreTraining

torch.set_num_threads(1)  # as the other fine-tuning tests: CI's cores are shared


@pytest.fixture(scope="module")
def tokenizer(minilm_dir: Path):
    tok = load_tokenizer(minilm_dir)
    tok.no_truncation()
    return tok


def test_official_normalisation_and_scores() -> None:
    assert normalize_answer("The  Eiffel-Tower!") == "eiffeltower"
    assert normalize_answer("an apple, a pear and THE fig.") == "apple pear and fig"
    assert exact_match("the Eiffel Tower.", "Eiffel Tower") == 1.0
    # pred tokens {in, paris, france}, gold {paris}: P = 1/3, R = 1 -> F1 = 0.5
    assert f1_v1("in Paris, France", "Paris") == pytest.approx(0.5)
    # articles vanish before counting: {denver, broncos} vs {denver, broncos, team}
    assert f1_v1("The Denver Broncos", "Denver Broncos team") == pytest.approx(0.8)
    assert f1_v1("Broncos", "Panthers") == 0.0
    examples = [
        Example("q1", "?", "c", [("Denver Broncos", 0), ("the Broncos", 0), ("Broncos", 0)]),
        Example("q2", "?", "c", [("1990s", 0)]),
        Example("q3", "?", "c", [("Saint Bernadette Soubirous", 0)]),
    ]
    preds = {"q1": "Broncos", "q2": "the 1990s", "q3": "Bernadette"}
    m = squad_metrics(examples, preds)
    # q1: exact against 'Broncos' (several golds: max); q2: article dropped -> exact;
    # q3: P = 1, R = 1/3 -> F1 = 0.5
    assert m["exact_match"] == pytest.approx(2 / 3)
    assert m["f1"] == pytest.approx((1 + 1 + 0.5) / 3)


def test_v2_scores_no_answer_questions() -> None:
    examples = [
        Example("a", "?", "c", [("Paris", 0)]),
        Example("b", "?", "c", [], is_impossible=True),
        Example("c", "?", "c", [], is_impossible=True),
    ]
    m = squad_metrics(examples, {"a": "", "b": "", "c": "Paris"}, version="2.0")
    assert m["exact_match"] == pytest.approx(1 / 3) and m["f1"] == pytest.approx(1 / 3)
    assert m["has_ans_f1"] == 0.0 and m["no_ans_exact_match"] == 0.5
    # the baseline a champion must beat: no answer at all, 2/3 here on 2.0, always 0 on 1.1
    for name, share in (("squad_v2", 200 / 3), ("squad", 0.0)):
        task = SquadFinetune(name)
        task.dev_examples = examples if name == "squad_v2" else examples[:1]
        assert task.baseline() == (pytest.approx(share), "no answer to any question")


def test_offsets_round_trip_every_gold_answer(shared_data: Path, tokenizer) -> None:
    """Char offsets -> token span -> char offsets gives back the exact gold answer text, except
    where an answer ends inside a WordPiece token ('7' of '1817'): there the span is the
    smallest run of whole tokens that covers it, as in run_squad.py."""
    examples = read_squad(shared_data / "squad" / "train.json")
    assert len(examples) == 11877
    contexts = sorted({e.context for e in examples})
    encs = dict(
        zip(contexts, tokenizer.encode_batch(contexts, add_special_tokens=False), strict=True)
    )
    inside_token = []
    for ex in examples:
        ((text, start),) = ex.answers
        end = start + len(text)
        offsets = np.asarray(encs[ex.context].offsets).reshape(-1, 2)
        s, e = answer_tokens(offsets, start, end)
        got = ex.context[offsets[s, 0] : offsets[e, 1]]
        on_boundaries = start in offsets[:, 0] and end in offsets[:, 1]
        if on_boundaries:
            assert got == text, (ex.qid, text, got)
        else:
            assert offsets[s, 0] <= start and end <= offsets[e, 1] and text in got
            inside_token.append(ex.qid)
    assert len(inside_token) < 0.01 * len(examples), len(inside_token)  # 86 of 11,877 here


def test_windows_cover_long_contexts_and_keep_answers(shared_data: Path, tokenizer) -> None:
    assert doc_spans(10, 4, 2) == [(0, 4), (2, 4), (4, 4), (6, 4)]
    assert doc_spans(3, 4, 2) == [(0, 3)]
    examples = read_squad(shared_data / "squad" / "train.json")[:300]
    cfg = SquadConfig(max_seq_length=96, doc_stride=32)
    f = featurize(examples, tokenizer, cfg, train=True)
    assert len(f) > len(examples) and max(len(x) for x in f.input_ids) <= 96
    found = set()
    for w in range(len(f)):
        ex = examples[f.example_index[w]]
        # every context token is the max-context token of exactly one window of its example
        if f.start_positions[w]:
            s, e = f.start_positions[w], f.end_positions[w]
            assert ex.context[f.offsets[w][s, 0] : f.offsets[w][e, 1]] == ex.answers[0][0]
            found.add(int(f.example_index[w]))
    assert len(found) == len(examples)  # every answer lies whole in some window
    for i in range(len(examples)):
        n_ctx = sum(int(f.max_context[w].sum()) for w in np.flatnonzero(f.example_index == i))
        ids = tokenizer.encode(examples[i].context, add_special_tokens=False).ids
        assert n_ctx == len(ids)


def test_decode_picks_best_valid_span_and_null() -> None:
    ex = Example("q", "who?", "Marie Curie won.", [("Marie Curie", 0)])
    offsets = np.array(
        [[-1, -1], [-1, -1], [-1, -1], [0, 5], [6, 11], [12, 15], [15, 16], [-1, -1]]
    )
    from bert_core.finetune.tasks.squad import Features

    f = Features(
        [np.zeros(8, np.int64)],
        [],
        np.array([0]),
        [offsets],
        [offsets[:, 0] >= 0],
        np.zeros(1),
        np.zeros(1),
    )
    sl = np.array([1.0, 9, 0, 5, 0, 0, 0, 0])  # the best start (9) is in the question: invalid
    el = np.array([1.0, 0, 0, 0, 4, 9, 0, 0])  # end 5 beats end 4 but 5 -> "won" is after start 3
    cfg = SquadConfig()
    preds, _ = decode([ex], f, [(sl, el)], cfg, version_2=False)
    assert preds == {"q": "Marie Curie won"}  # 5 + 9 = 14 beats 5 + 4
    cfg.max_answer_length = 2
    preds, _ = decode([ex], f, [(sl, el)], cfg, version_2=False)
    assert preds == {"q": "Marie Curie"}
    # SQuAD 2.0: the null score (1 + 1 = 2) against the best span (5 + 4 = 9)
    preds, odds = decode([ex], f, [(sl, el)], cfg, version_2=True)
    assert preds == {"q": "Marie Curie"} and odds["q"] == pytest.approx(2 - 9)
    sl[0] = el[0] = 6.0
    preds, odds = decode([ex], f, [(sl, el)], cfg, version_2=True)
    assert preds == {"q": ""} and odds["q"] == pytest.approx(12 - 9)


def _squad_file(path: Path, context: str, question: str, text: str, start: int) -> Path:
    qa = {"answers": [{"answer_start": start, "text": text}], "question": question, "id": "x1"}
    data = {
        "data": [{"title": "T", "paragraphs": [{"context": context, "qas": [qa]}]}],
        "version": "1.1",
    }
    path.mkdir(parents=True, exist_ok=True)
    (path / "train.json").write_text(json.dumps(data))
    (path / "dev.json").write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(
    "context, question, text, start, message",
    [
        ("Paris is in France.", "Where?", "France", 3, "answer_start 3 does not point at"),
        ("   ", "Where?", "", 0, "paragraph 0: empty context"),
        ("Paris is in France.", "why " * 70, "France", 12, "question x1: 70 tokens, more than"),
    ],
)
def test_bad_squad_is_a_clear_error_and_no_output(
    tmp_path: Path, minilm_dir: Path, capsys, monkeypatch, context, question, text, start, message
) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    data = _squad_file(tmp_path / "data", context, question, text, start)
    out = tmp_path / "out"
    argv = ["finetune", "--task", "squad", "--data", str(data), "--model", str(minilm_dir)]
    assert cli.main([*argv, "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert "bert finetune: error:" in err and "train.json" in err and message in err, err
    assert not out.exists() and not list(tmp_path.glob(".out*"))


def test_download_from_a_local_server(tmp_path: Path, shared_data: Path, serve) -> None:
    served = tmp_path / "served"
    served.mkdir()
    for name in ("train-v1.1.json", "dev-v1.1.json"):  # the official names
        (served / name).symlink_to(shared_data / "squad" / "train.json")
    (served / "train-v2.0.json").write_text('{"data": [{"title": "cut')  # truncated
    url = serve(served)
    download(tmp_path / "squad", "1.1", url)
    original = (shared_data / "squad" / "train.json").read_bytes()
    assert (tmp_path / "squad" / "train-v1.1.json").read_bytes() == original
    assert (tmp_path / "squad" / "dev-v1.1.json").read_bytes() == original
    with pytest.raises(ValueError, match="train-v2.0.json.*not valid JSON"):
        download(tmp_path / "v2", "2.0", url)
    assert not list((tmp_path / "v2").iterdir())  # nothing partial left behind


@pytest.mark.slow
def test_finetune_cli_writes_official_predictions(
    tmp_path: Path, shared_data: Path, minilm_dir: Path, monkeypatch
) -> None:
    """A `tiny` BERT on a slice of the shared file (dev split off by article), end to end: the
    pipeline runs, predictions.json holds an answer (a piece of its context) for every dev
    question, and the metrics are the official ones of those predictions. Not a quality test."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    torch.manual_seed(0)
    model = BertForPreTraining(BertConfig.from_preset("tiny", max_position_embeddings=128))
    model.save_pretrained(tmp_path / "tiny", vocab_file=minilm_dir / "vocab.txt")
    out = tmp_path / "squad"
    argv = [
        "finetune",
        "--task",
        "squad",
        "--data",
        str(shared_data / "squad"),
        "--model",
        str(tmp_path / "tiny"),
        "--output",
        str(out),
        "--max-seq-length",
        "128",
        "--doc-stride",
        "64",
        "--max-train-examples",
        "24",
        "--max-eval-examples",
        "12",
        "--epochs",
        "2",
        "--batch-size",
        "8",
        "--learning-rate",
        "1e-3",
    ]
    assert cli.main(argv) == 0
    result = json.loads((out / "metrics.json").read_text())
    assert result["task"] == "squad" and "index % 5 == 4" in result["files"]["dev"]
    assert [e["epoch"] for e in result["epochs"]] == [1, 2] and result["num_train_windows"] >= 24
    assert all(np.isfinite(e["train_loss"]) for e in result["epochs"])
    preds = json.loads((out / "predictions.json").read_text())
    dev = {e.qid: e for e in read_squad(shared_data / "squad" / "train.json", split="dev")}
    train_ids = {e.qid for e in read_squad(shared_data / "squad" / "train.json", split="train")}
    assert len(preds) == 12 and set(preds) <= set(dev) and not set(preds) & train_ids
    assert all(p and p in dev[q].context for q, p in preds.items())
    recomputed = squad_metrics([dev[q] for q in preds], preds)
    assert recomputed == pytest.approx(result["metrics"])


def test_v2_best_threshold_on_a_hand_made_case() -> None:
    """evaluate-v2.0.py's best-threshold search, counted by hand. Null odds (null score minus
    best span's), sorted: q1 -3 (right), q2 -1 (half right: F1 2/3), q4 1.0 (right), q3 1.5 (no
    answer, but a span), q5 4 (no answer). Nothing answered scores the 2 no-answer questions;
    answering up to q4 adds 1 + 2/3 + 1 (F1) or 1 + 0 + 1 (EM), q3 and q5 then cost 1 each."""
    examples = [
        Example("q1", "?", "c", [("Paris", 0)]),
        Example("q2", "?", "c", [("Rome Italy", 0)]),
        Example("q3", "?", "c", [], is_impossible=True),
        Example("q4", "?", "c", [("Berlin", 0)]),
        Example("q5", "?", "c", [], is_impossible=True),
    ]
    spans = {"q1": "Paris", "q2": "Rome", "q3": "Madrid", "q4": "Berlin", "q5": "Oslo"}
    odds = {"q1": -3.0, "q2": -1.0, "q3": 1.5, "q4": 1.0, "q5": 4.0}
    best = best_thresholds(examples, spans, odds)
    assert best["best_f1"] == pytest.approx((2 + 1 + 2 / 3 + 1) / 5)
    assert best["best_exact"] == pytest.approx((2 + 2) / 5)
    assert best["best_f1_thresh"] == 1.0 and best["best_exact_thresh"] == 1.0
    # the untuned threshold 0 answers q1 and q2 only; the tuned one gives the best scores back
    untuned = squad_metrics(examples, apply_threshold(spans, odds, 0.0), "2.0")
    assert untuned["f1"] == pytest.approx((1 + 2 / 3 + 1 + 0 + 1) / 5)
    tuned = squad_metrics(examples, apply_threshold(spans, odds, best["best_f1_thresh"]), "2.0")
    assert tuned["f1"] == pytest.approx(best["best_f1"])
    assert tuned["exact_match"] == pytest.approx(best["best_exact"])
    # ties keep the lowest threshold (the script's strict >): q4 then only matches q2's score
    odds["q3"] = 0.5
    best = best_thresholds(examples, spans, odds)
    assert best["best_exact_thresh"] == -3.0 and best["best_exact"] == pytest.approx(3 / 5)


def squad_v2_from_v1(path: Path, out: Path, articles: int = 15) -> Path:
    """A SQuAD 2.0-format file from the v1.1 one: every third question is moved to a paragraph
    of the next article, where it has no answer (is_impossible)."""
    data = json.loads(path.read_text())["data"][:articles]
    moved: list[list[dict]] = [[] for _ in data]
    for a, article in enumerate(data):
        for para in article["paragraphs"]:
            keep = []
            for i, qa in enumerate(para["qas"]):
                if i % 3 == 2:
                    moved[(a + 1) % len(data)].append(
                        {
                            "id": qa["id"] + "-x",
                            "question": qa["question"],
                            "answers": [],
                            "is_impossible": True,
                        }
                    )
                else:
                    keep.append(qa | {"is_impossible": False})
            para["qas"] = keep
    for article, qas in zip(data, moved, strict=True):
        article["paragraphs"][0]["qas"] += qas
    out.mkdir(parents=True, exist_ok=True)
    (out / "train.json").write_text(json.dumps({"version": "v2.0", "data": data}))
    return out


@pytest.mark.slow
def test_squad_v2_reports_the_tuned_threshold_beside_the_untuned_score(
    tmp_path: Path, shared_data: Path, minilm_dir: Path, monkeypatch
) -> None:
    """A `tiny` BERT on a SQuAD 2.0-format set built from the shared file: metrics.json has the
    untuned scores (those of predictions.json) and the best-threshold ones, which can only be
    as good or better, at a threshold that is one of the written null odds."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    data = squad_v2_from_v1(shared_data / "squad" / "train.json", tmp_path / "v2")
    torch.manual_seed(0)
    model = BertForPreTraining(BertConfig.from_preset("tiny", max_position_embeddings=128))
    model.save_pretrained(tmp_path / "tiny", vocab_file=minilm_dir / "vocab.txt")
    out = tmp_path / "squad_v2"
    argv = [
        "finetune",
        "--task",
        "squad_v2",
        "--data",
        str(data),
        "--model",
        str(tmp_path / "tiny"),
        "--output",
        str(out),
        "--max-seq-length",
        "128",
        "--doc-stride",
        "64",
        "--max-train-examples",
        "32",
        "--max-eval-examples",
        "40",
        "--epochs",
        "1",
        "--batch-size",
        "8",
        "--learning-rate",
        "1e-3",
    ]
    assert cli.main(argv) == 0
    result = json.loads((out / "metrics.json").read_text())
    m = result["metrics"]
    dev = {e.qid: e for e in read_squad(data / "train.json", "2.0", split="dev")}
    preds = json.loads((out / "predictions.json").read_text())
    odds = json.loads((out / "null_odds.json").read_text())
    assert set(preds) == set(odds) and len(preds) == 40
    assert {bool(dev[q].answers) for q in preds} == {True, False}  # both kinds sampled
    untuned = squad_metrics([dev[q] for q in preds], preds, "2.0")
    assert untuned == pytest.approx({k: v for k, v in m.items() if not k.startswith("best_")})
    assert m["best_f1"] >= m["f1"] and m["best_exact"] >= m["exact_match"]
    for name in ("best_f1_thresh", "best_exact_thresh"):
        assert m[name] == 0.0 or m[name] in set(odds.values())
    report = tmp_path / "report"
    assert cli.main(["evaluate", "--results", str(out), "--output", str(report)]) == 0
    table = (report / "glue_table.md").read_text()
    assert "| System | Dev EM | Dev F1 | Dev EM (tuned null threshold) | Dev F1 (tuned" in table
