"""`bert_core.serve.predictors`: the answers of every kind of model equal a reference's.

References: transformers' pipelines on the same folder (classification, NER with "first"
aggregation, fill-mask), and, for question answering, our own SQuAD fine-tuning decoder on real
SQuAD questions (transformers' QA pipeline decodes differently: no max-context rule).
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pandas as pd
import pytest
import torch

from bert_core.finetune.engine import load_tokenizer
from bert_core.finetune.tasks import squad
from bert_core.serve.predictors import BadInput, Settings, load_predictor, predictor_class
from bert_core.serve.predictors_span import EntityTagger, entities
from tests.serving_helpers import build

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module")
def folders(tmp_path_factory, minilm_dir):
    root = tmp_path_factory.mktemp("models")
    kinds = (
        "classification",
        "pair",
        "regression",
        "ner",
        "question-answering",
        "fill-mask",
        "multiple-choice",
    )
    return {kind: build(kind, minilm_dir, root / kind) for kind in kinds}


def hf_pipeline(task: str, folder, **kwargs):
    import transformers

    transformers.logging.set_verbosity_error()
    return transformers.pipeline(task, model=str(folder), device="cpu", **kwargs)


SENTENCES = [
    "it 's a charming and often affecting journey . ",
    "unflinchingly bleak and desperate",
    "The acting, frankly, was a good deal better than the script deserved!",
]


def test_classification_probabilities_equal_transformers(folders):
    ours = load_predictor(folders["classification"], Settings(batch_size=2)).predict(
        pd.DataFrame({"text": SENTENCES})
    )
    theirs = hf_pipeline("text-classification", folders["classification"], top_k=None)(SENTENCES)
    for o, t in zip(ours, theirs, strict=True):
        assert o["probabilities"] == pytest.approx({x["label"]: x["score"] for x in t}, abs=1e-5)
        assert o["label"] == max(t, key=lambda x: x["score"])["label"]
        assert o["score"] == max(o["probabilities"].values())


def test_sentence_pairs_and_regression(folders, tmp_path):
    pairs = pd.DataFrame({"text": SENTENCES[:2], "text_pair": [SENTENCES[2], SENTENCES[0]]})
    mrpc = load_predictor(folders["pair"])
    assert (mrpc.inputs, mrpc.optional) == (("text", "text_pair"), ())  # a pair task: both
    pipe = hf_pipeline("text-classification", folders["pair"], top_k=None)
    theirs = [pipe({"text": a, "text_pair": b}) for a, b in zip(*pairs.T.values, strict=True)]
    for o, t in zip(mrpc.predict(pairs), theirs, strict=True):
        assert o["probabilities"] == pytest.approx({x["label"]: x["score"] for x in t}, abs=1e-5)
    # a pair task's row without its second sentence is refused, not answered as one sentence
    with pytest.raises(BadInput, match="row 1: 'text_pair' is missing"):
        mrpc.predict(pd.DataFrame({"text": SENTENCES[:2], "text_pair": [SENTENCES[2], None]}))
    # a single-sentence task's model reads no text_pair; one of no known task may have one
    sst2 = load_predictor(folders["classification"])
    assert (sst2.inputs, sst2.optional) == (("text",), ())
    assert sst2.predict(pairs) == sst2.predict(pairs[["text"]])
    other = tmp_path / "other"
    shutil.copytree(folders["pair"], other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps(config | {"finetuning_task": "my-task"}))
    either = load_predictor(other)
    assert (either.inputs, either.optional) == (("text",), ("text_pair",))
    ours = either.predict(pd.DataFrame({"text": SENTENCES[:2], "text_pair": [SENTENCES[2], None]}))
    theirs = [theirs[0], pipe([SENTENCES[1]])[0]]
    for o, t in zip(ours, theirs, strict=True):
        assert o["probabilities"] == pytest.approx({x["label"]: x["score"] for x in t}, abs=1e-5)
    stsb = load_predictor(folders["regression"])
    assert stsb.kind == "regression" and stsb.inputs == ("text", "text_pair")
    (score,) = stsb.predict(pd.DataFrame({"text": ["a b"], "text_pair": ["c"]}))
    assert set(score) == {"score"} and isinstance(score["score"], float)


def test_entities_equal_transformers_first_aggregation(folders):
    texts = [
        "EU rejects German call to boycott British lamb .",
        "Peter Blackburn visited the U.S. embassy in São Paulo, didn't he?",
        "  spaces   around\twords  ",
    ]
    ours = load_predictor(folders["ner"]).predict(pd.DataFrame({"text": texts}))
    theirs = hf_pipeline("token-classification", folders["ner"], aggregation_strategy="first")(
        texts
    )
    assert sum(len(o["entities"]) for o in ours) > 10  # an untrained head tags most words
    for text, o, t in zip(texts, ours, theirs, strict=True):
        want = [(e["entity_group"], e["start"], e["end"], float(e["score"])) for e in t]
        got = [(e["entity"], e["start"], e["end"], e["score"]) for e in o["entities"]]
        assert [g[:3] for g in got] == [w[:3] for w in want]
        assert [g[3] for g in got] == pytest.approx([w[3] for w in want], abs=1e-5)
        assert all(text[e["start"] : e["end"]] == e["text"] for e in o["entities"])


def test_iob2_grouping():
    text = "New York Times and Bob"
    spans = [(0, 3), (4, 8), (9, 14), (15, 18), (19, 22)]
    found = entities(text, ["B-ORG", "I-ORG", "I-ORG", "O", "I-PER"], [1, 0.5, 0, 1, 0.25], spans)
    assert found == [
        {"entity": "ORG", "text": "New York Times", "start": 0, "end": 14, "score": 0.5},
        {"entity": "PER", "text": "Bob", "start": 19, "end": 22, "score": 0.25},
    ]
    two = entities(text, ["B-LOC", "B-LOC", "I-PER", "O", "O"], [1.0] * 5, spans)
    assert [e["text"] for e in two] == ["New", "York", "Times"]


def test_answers_equal_squad_finetuning_decoder_with_offsets(folders, shared_data):
    examples = squad.read_squad(shared_data / "squad" / "train.json", split="dev")[:10]
    # short windows: most contexts span several, so the max-context rule matters
    settings = Settings(max_seq_length=96, doc_stride=32, batch_size=16)
    predictor = load_predictor(folders["question-answering"], settings)
    frame = pd.DataFrame(
        {"question": [e.question for e in examples], "context": [e.context for e in examples]}
    )
    answers = predictor.predict(frame)

    cfg = squad.SquadConfig(max_seq_length=96, doc_stride=32)
    tokenizer = load_tokenizer(folders["question-answering"])
    tokenizer.no_truncation()
    features = squad.featurize(examples, tokenizer, cfg)
    assert len(features) > 2 * len(examples)  # several windows per context
    logits = squad.predict_logits(predictor.model, features, torch.device("cpu"), 16)
    texts, _ = squad.decode(examples, features, logits, cfg, version_2=False)
    for ex, a in zip(examples, answers, strict=True):
        assert a["answer"] == texts[ex.qid] != ""
        assert ex.context[a["start"] : a["end"]] == a["answer"]
        assert 0 < a["score"] <= 1


def test_fill_mask_equals_transformers(folders):
    texts = ["The capital of France is [MASK].", "[MASK] went to the [MASK] yesterday."]
    ours = load_predictor(folders["fill-mask"], Settings(top_k=5)).predict(
        pd.DataFrame({"text": texts})
    )
    pipe = hf_pipeline("fill-mask", folders["fill-mask"], top_k=5)
    (first,) = [pipe(texts[0])]
    assert ours[0]["masks"][0]["tokens"][0] == first[0]["token_str"]
    assert ours[0]["masks"][0]["scores"] == pytest.approx([x["score"] for x in first], abs=1e-6)
    # the mask's place takes the best piece as text (a `##` continuation piece without `##`)
    best = first[0]["token_str"].removeprefix("##")
    assert ours[0]["filled"] == texts[0].replace("[MASK]", best)
    both = pipe(texts[1])  # one list per mask, in order
    assert [m["start"] for m in ours[1]["masks"]] == [0, 19]
    for mask, want in zip(ours[1]["masks"], both, strict=True):
        assert mask["scores"] == pytest.approx([x["score"] for x in want], abs=1e-6)
        assert np.all(np.diff(mask["scores"]) <= 0)


def test_fill_mask_and_classification_run_under_bf16_autocast(folders, monkeypatch):
    """On a GPU the encoder runs under bf16 autocast (`optim.autocast`) and hands back bf16
    states; a head applied outside it must not meet them in fp32 (an H100 run failed MLflow's
    input-example check with "mat1 and mat2 must have the same dtype"). CPU bf16 autocast
    stands in for the GPU's: the same predictions as fp32, to bf16's precision."""
    from bert_core.model import optim

    texts = ["The capital of France is [MASK].", "a [MASK] film ."]
    fill = load_predictor(folders["fill-mask"], Settings(top_k=3))
    label = load_predictor(folders["classification"])
    sentences = pd.DataFrame({"text": SENTENCES})
    fp32 = fill.predict(pd.DataFrame({"text": texts})), label.predict(sentences)
    monkeypatch.setattr(optim, "autocast", lambda device: torch.autocast("cpu", torch.bfloat16))
    bf16 = fill.predict(pd.DataFrame({"text": texts})), label.predict(sentences)
    for ours, want in zip(bf16[0], fp32[0], strict=True):
        (top, want_top) = ours["masks"][0], want["masks"][0]
        assert top["tokens"][0] == want_top["tokens"][0]
        assert top["scores"][0] == pytest.approx(want_top["scores"][0], abs=0.05)
    for ours, want in zip(bf16[1], fp32[1], strict=True):
        assert ours["label"] == want["label"]


def test_choices_equal_swag_finetuning_predictions(folders):
    from bert_core.finetune.tasks import swag

    examples = [
        swag.SwagExample(
            "0",
            "A man fills a kettle with water.",
            "He",
            ("pours it into a cup.", "eats the kettle.", "flies.", "sings."),
            None,
        ),
        swag.SwagExample(
            "1",
            "The crowd cheers as the runner",
            "",
            ("crosses the line.", "a", "bakes bread in the rain today", "x y"),
            None,
        ),
    ]
    rows = [{"context": e.context, "start": e.start or None} for e in examples]
    for row, e in zip(rows, examples, strict=True):
        row |= dict(zip(swag.ENDINGS, e.endings, strict=True))
    frame = pd.DataFrame(rows)
    predictor = load_predictor(folders["multiple-choice"])
    answers = predictor.predict(frame)
    tokenizer = load_tokenizer(folders["multiple-choice"])
    features = swag.featurize(examples, tokenizer, 128)
    logits = swag.predict(predictor.model, features, torch.device("cpu"), 8)
    for a, row in zip(answers, logits, strict=True):
        p = np.exp(row - row.max()) / np.exp(row - row.max()).sum()
        assert a["scores"] == pytest.approx(p.tolist(), abs=1e-6)
        assert a["label"] == int(row.argmax()) and a["score"] == max(a["scores"])
    assert len({round(s, 4) for s in answers[0]["scores"]}) == 4  # the choices differ


def test_bad_input_names_the_row_and_the_problem(folders):
    cls = load_predictor(folders["classification"], Settings(max_chars=50))
    cases = [
        (pd.DataFrame({"sentence": ["x"]}), "missing column 'text'", None),
        (pd.DataFrame({"text": ["fine", " \n "]}), "'text' is empty", 1),
        (pd.DataFrame({"text": ["fine", 3]}), "'text' must be text, got int", 1),
        (pd.DataFrame({"text": ["fine", "ok", "x" * 51]}), "more than max_chars 50", 2),
        (pd.DataFrame([{"text": "a"}, {"text_pair": "b"}]), "'text' is missing", 1),
    ]
    for frame, message, row in cases:
        with pytest.raises(BadInput, match=message) as e:
            cls.predict(frame)
        assert e.value.row == row
    assert cls.predict(pd.DataFrame({"text": []})) == []
    qa = load_predictor(folders["question-answering"])
    long_question = " ".join(["why"] * 70)
    with pytest.raises(BadInput, match="row 0: 'question' has 70 tokens, more than max_query"):
        qa.predict(pd.DataFrame({"question": [long_question], "context": ["c"]}))
    with pytest.raises(BadInput, match="row 0: 'text' has no \\[MASK\\] token"):
        load_predictor(folders["fill-mask"]).predict(pd.DataFrame({"text": ["no mask"]}))


def test_kind_comes_from_config_architectures(folders, minilm_dir):
    config = json.loads((folders["ner"] / "config.json").read_text())
    assert predictor_class(config) is EntityTagger
    with pytest.raises(ValueError, match="BertModel.*no prediction head.*bert embed"):
        load_predictor(minilm_dir)  # a bare encoder: nothing to answer with
    assert Settings.from_dict({"max_seq_length": 64, "learning_rate": 1e-4}).max_seq_length == 64
