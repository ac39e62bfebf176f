"""Faithful to the original BERT (docs/fidelity.md): each rule against a hand computation.

The initialisation, the original's optimiser and schedule, the GELU that config.json names, and
three rules of the fine-tuning tasks that no other test would see broken: SQuAD 2.0's null score
(minimum over a question's windows), conlleval's end of a guessed chunk, and the model folder's
casing carried through fine-tuning and prediction.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas
import pytest
import torch
import torch.nn.functional as F
import transformers

from bert_core.errors import InputError
from bert_core.model import optim
from bert_core.model.config import ACTIVATIONS
from bert_core.model.heads import BertForSequenceClassification
from bert_core.model.modeling import BertConfig, BertForPreTraining, BertModel

torch.set_num_threads(2)

# ------------------------------------------------------------------ initialisation


def test_init_is_the_originals_truncated_normal() -> None:
    """tf.truncated_normal_initializer(0.02): cut at 2 sigma and re-drawn, not rescaled, so the
    std is 0.02 x 0.8796 (the std of a standard normal truncated at +-2)."""
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig.from_preset("mini"))
    sigma = 0.02
    phi2 = math.exp(-2) / math.sqrt(2 * math.pi)
    truncated_std = sigma * math.sqrt(1 - 4 * phi2 / math.erf(2 / math.sqrt(2)))
    assert truncated_std == pytest.approx(0.8796 * sigma, rel=1e-4)
    emb = model.bert.embeddings
    weights = {
        "word embeddings": emb.word_embeddings.weight[1:],  # row 0 is [PAD]'s: zero
        "position embeddings": emb.position_embeddings.weight,
        "query": model.bert.encoder.layer[0].attention.self.query.weight,
        "intermediate": model.bert.encoder.layer[0].intermediate.dense.weight,
        "pooler": model.bert.pooler.dense.weight,
        "classifier": model.classifier.weight,
    }
    for name, w in weights.items():
        assert w.abs().max() <= 2 * sigma, name
        assert abs(w.mean().item()) < 5 * truncated_std / w.numel() ** 0.5, name
    big = weights["word embeddings"]  # 7.8M values: the std is known to 1e-5
    assert big.std().item() == pytest.approx(truncated_std, abs=1e-4)
    assert big.abs().max() > 1.99 * sigma  # cut at 2 sigma, not narrower
    assert weights["intermediate"].std().item() == pytest.approx(truncated_std, abs=3e-4)
    assert torch.all(emb.word_embeddings.weight[0] == 0)
    assert torch.all(model.bert.encoder.layer[0].intermediate.dense.bias == 0)


# ------------------------------------------------------------------ GELU from config.json


@pytest.mark.parametrize(
    "hidden_act, approximate",
    [
        ("gelu", "none"),
        ("gelu_python", "none"),
        ("gelu_new", "tanh"),
        ("gelu_pytorch_tanh", "tanh"),
        ("gelu_fast", "tanh"),
    ],
)
def test_gelu_form_follows_hidden_act(hidden_act: str, approximate: str) -> None:
    x = torch.linspace(-6, 6, 1001, dtype=torch.float64)
    expected = F.gelu(x, approximate=approximate)
    other = F.gelu(x, approximate="tanh" if approximate == "none" else "none")
    assert (expected - other).abs().max() > 4e-4  # the two forms are told apart
    # the original's formula, written out, for the tanh form
    tanh_form = 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))
    erf_form = 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))
    torch.testing.assert_close(expected, tanh_form if approximate == "tanh" else erf_form)
    model = BertForPreTraining(BertConfig.from_preset("tiny", vocab_size=50, hidden_act=hidden_act))
    for act in (model.bert.encoder.layer[0].intermediate.act, model.cls.predictions.transform.act):
        torch.testing.assert_close(act(x), expected, rtol=0, atol=1e-12)


def test_gelu_new_checkpoint_matches_transformers(tmp_path: Path) -> None:
    """A config.json with hidden_act gelu_new (tanh) runs as transformers runs it."""
    config = BertConfig.from_preset("tiny", vocab_size=60, hidden_act="gelu_new")
    BertModel(config).save_pretrained(tmp_path)
    ours = BertModel.from_pretrained(tmp_path).eval()
    assert ours.config.hidden_act == "gelu_new"
    theirs = transformers.BertModel.from_pretrained(tmp_path, attn_implementation="eager").eval()
    ids = torch.randint(1, 60, (2, 9))
    with torch.no_grad():
        a = ours(ids).last_hidden_state
        b = theirs(ids).last_hidden_state
    torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)


def test_unknown_hidden_act_is_a_one_line_error_naming_config_json(tmp_path: Path) -> None:
    BertModel(BertConfig.from_preset("tiny", vocab_size=40)).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"hidden_act": "swish"}))
    with pytest.raises(InputError) as e:
        BertModel.from_pretrained(tmp_path)
    message = str(e.value)
    assert "\n" not in message and str(tmp_path / "config.json") in message
    assert "hidden_act 'swish' is unknown" in message and "gelu_new" in message
    assert sorted(ACTIVATIONS) == sorted(
        ["gelu", "gelu_python", "gelu_new", "gelu_pytorch_tanh", "gelu_fast", "relu"]
    )


# ------------------------------------------------------------------ optimiser and schedule


class TwoParams(torch.nn.Module):
    """A matrix (decayed) and a bias (not decayed), in float64 for exact comparisons."""

    def __init__(self):
        super().__init__()
        f64 = torch.float64
        self.weight = torch.nn.Parameter(torch.tensor([[0.5, -1.0], [2.0, 0.0]], dtype=f64))
        self.bias = torch.nn.Parameter(torch.tensor([0.25, -0.75], dtype=f64))


GRADS = [
    ([[0.5, -0.2], [1e-3, 3.0]], [0.5, -4.0]),
    ([[-0.1, 0.4], [2e-3, 1.0]], [0.25, 1.0]),
    ([[0.3, 0.3], [-5e-3, -2.0]], [-0.5, 0.0]),
]


def run_steps(opt, sched, model: TwoParams) -> list[float]:
    lrs = []
    for gw, gb in GRADS:
        model.weight.grad = torch.tensor(gw, dtype=torch.float64)
        model.bias.grad = torch.tensor(gb, dtype=torch.float64)
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    return lrs


def test_bert_optimizer_is_the_originals_update_rule() -> None:
    """AdamWeightDecayOptimizer, computed by hand: no bias correction, decay lr*wd*p on the
    matrix only, the lr of the original's schedule (warm-up 2 of 4 steps: 0, 0.5, 1 - 2/4)."""
    lr, wd, eps, (b1, b2) = 0.1, 0.01, 1e-6, (0.9, 0.999)
    model = TwoParams()
    opt, sched = optim.optimizer_and_schedule("bert", model, lr, wd, 2, 4, eps=eps)
    assert isinstance(opt, optim.AdamWeightDecay)
    lrs = run_steps(opt, sched, model)
    assert lrs == [0.0, 0.05, 0.05]  # 0/2, 1/2 of the peak; then 1 - 2/4

    def by_hand(p0, grads, decay):  # one value, plain Python floats
        p, m, v = p0, 0.0, 0.0
        for rate, g in zip(lrs, grads, strict=True):
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g * g
            update = m / (math.sqrt(v) + eps) + (wd * p if decay else 0.0)
            p = p - rate * update
        return p

    w0 = TwoParams()
    for i in range(2):
        for j in range(2):
            expected = by_hand(w0.weight[i, j].item(), [g[0][i][j] for g in GRADS], True)
            assert model.weight[i, j].item() == pytest.approx(expected, rel=1e-12, abs=1e-15)
        expected = by_hand(w0.bias[i].item(), [g[1][i] for g in GRADS], False)
        assert model.bias[i].item() == pytest.approx(expected, rel=1e-12, abs=1e-15)

    # step 1 (at lr 1): m = 0.1 g, sqrt(v) = 0.0316 |g|, so the update is 3.16 x sign(g),
    # where bias-corrected Adam would move by ~1 x sign(g)
    p = torch.nn.Parameter(torch.tensor([1.0, 1.0], dtype=torch.float64))
    p.grad = torch.tensor([0.5, -2.0], dtype=torch.float64)
    optim.AdamWeightDecay([p], lr=1.0, eps=eps).step()
    step = (1 - b1) / math.sqrt(1 - b2)
    assert step == pytest.approx(3.16228, rel=1e-5)
    torch.testing.assert_close(
        p.detach(),
        torch.tensor(
            [1 - 0.05 / (0.5 * math.sqrt(0.001) + eps), 1 + 0.2 / (2 * math.sqrt(0.001) + eps)],
            dtype=torch.float64,
        ),
    )


def test_adamw_option_is_torch_adamw_with_transformers_schedule() -> None:
    lr, wd = 0.1, 0.01
    model, reference = TwoParams(), TwoParams()
    opt, sched = optim.optimizer_and_schedule("adamw", model, lr, wd, 2, 4)
    assert isinstance(opt, torch.optim.AdamW)
    ref_opt = torch.optim.AdamW(
        optim.param_groups(reference, wd), lr=lr, eps=1e-6, foreach=False, fused=False
    )
    ref_sched = transformers.get_linear_schedule_with_warmup(ref_opt, 2, 4)
    assert run_steps(opt, sched, model) == run_steps(ref_opt, ref_sched, reference)
    torch.testing.assert_close(model.weight, reference.weight, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(model.bias, reference.bias, rtol=1e-12, atol=1e-14)
    with pytest.raises(ValueError, match="optimizer 'lamb': use one of bert, adamw"):
        optim.optimizer_and_schedule("lamb", model, lr, wd, 2, 4)


def test_schedules_at_zero_warmup_half_and_end() -> None:
    """The original: warm-up t/w, else polynomial_decay(power 1) from step 0: 1 - t/T.
    transformers: (T - t)/(T - w) after the warm-up."""
    w, T = 100, 1000
    bert = optim.warmup_polynomial_decay(w, T)
    original = [0.0, 0.5, 1 - w / T, 0.5, 0.0, 0.0]  # t = 0, w/2, w, T/2, T, past T
    at = [0, w // 2, w, T // 2, T, T + 10]
    assert [bert(t) for t in at] == pytest.approx(original, abs=1e-15)
    hf = optim.warmup_linear_decay(w, T)
    assert [hf(t) for t in at] == pytest.approx([0.0, 0.5, 1.0, 500 / 900, 0.0, 0.0])
    assert bert(w - 1) == pytest.approx(0.99)  # the warm-up ends at (w-1)/w, then 1 - w/T
    assert optim.warmup_polynomial_decay(0, T)(0) == 1.0  # no warm-up: decay from the peak


# ------------------------------------------------------------------ SQuAD 2.0's null score


def test_squad_v2_null_score_is_the_minimum_over_the_windows() -> None:
    """run_squad.py: `score_null` is the smallest start[0] + end[0] over a question's windows.
    Three windows with null scores 5, 1, 9 and a best span of 3 in the first: the minimum (1)
    answers (odds 1 - 3 = -2); the first window's (5), the largest (9), the last (9) or the
    mean (5) would all leave the question unanswered."""
    import numpy as np

    from bert_core.finetune.tasks.squad import Example, Features, SquadConfig, decode

    ex = Example("q", "who?", "Marie Curie won.", [("Marie Curie", 0)])
    offsets = np.array(
        [[-1, -1], [-1, -1], [-1, -1], [0, 5], [6, 11], [12, 15], [15, 16], [-1, -1]]
    )
    n = len(offsets)
    f = Features(
        [np.zeros(n, np.int64)] * 3,
        [],
        np.array([0, 0, 0]),
        [offsets] * 3,
        [offsets[:, 0] >= 0] * 3,
        np.zeros(3),
        np.zeros(3),
    )
    logits = []
    for null, span in ((5.0, 2.0), (1.0, 0.0), (9.0, 0.0)):
        sl, el = np.zeros(n), np.zeros(n)
        sl[0] = el[0] = null / 2
        sl[3], el[4] = span, span / 2  # "Marie Curie": 2 + 1 = 3 in the first window
        logits.append((sl, el))
    preds, odds = decode([ex], f, logits, SquadConfig(), version_2=True)
    assert odds == {"q": pytest.approx(1.0 - 3.0)}
    assert preds == {"q": "Marie Curie"}


# ------------------------------------------------------------------ conlleval's chunk ends


def test_conlleval_ends_a_guessed_chunk_where_the_next_guess_starts_one_or_is_o() -> None:
    """Hand-counted. A guessed chunk ends before B-, before O and before another type; it is
    right only when it ends where the gold chunk does."""
    from bert_core.finetune.tasks.conlleval import conlleval

    gold = [
        ["B-PER", "I-PER", "O"],  # PER[0:2]
        ["B-LOC", "O"],  # LOC[0:1]
        ["B-ORG", "I-ORG", "O"],  # ORG[0:2]
        ["B-PER", "B-PER"],  # PER[0], PER[1]
        ["B-MISC", "O", "O"],  # MISC[0]
    ]
    pred = [
        ["B-PER", "I-PER", "B-PER"],  # PER[0:2] ends at the next B-: right; PER[2] wrong
        ["B-LOC", "I-LOC"],  # LOC[0:2] runs past the gold end: wrong
        ["B-ORG", "I-ORG", "I-MISC"],  # ORG[0:2] ends at the type change: right; MISC[2] wrong
        ["B-PER", "I-PER"],  # one PER[0:2] for two gold chunks: wrong
        ["B-MISC", "O", "I-MISC"],  # MISC[0] ends at O: right; MISC[2] (O I-) wrong
    ]
    c = conlleval(gold, pred)
    assert c["chunks"] == {"correct": 3, "found": 8, "gold": 6}
    assert (c["precision"], c["recall"]) == (3 / 8, 3 / 6)
    assert c["accuracy"] == pytest.approx(8 / 13)
    counts = {
        t: (round(s["precision"] * s["found"]), s["found"], s["support"])
        for t, s in c["per_type"].items()
    }
    # type: (correct, found, gold)
    assert counts == {"LOC": (0, 1, 1), "MISC": (1, 3, 1), "ORG": (1, 1, 1), "PER": (1, 3, 3)}


# ------------------------------------------------------------------ casing through to predict


def _pretrained_folder(root: Path, lowercase: bool) -> Path:
    """What `bert pretrain` leaves: weights, vocab.txt and tokenizer_config.json's casing."""
    from bert_core.data.tokenizer import write_tokenizer_settings

    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "apple", "Apple", "pie", "is", "."]
    vocab_dir = root / "vocab"
    vocab_dir.mkdir(parents=True)
    (vocab_dir / "vocab.txt").write_text("\n".join(tokens) + "\n")
    write_tokenizer_settings(vocab_dir, lowercase)
    torch.manual_seed(3)
    model = BertForPreTraining(BertConfig.from_preset("tiny", vocab_size=len(tokens)))
    model.save_pretrained(root / "pretrained", vocab_file=vocab_dir / "vocab.txt")
    return root / "pretrained"


@pytest.mark.parametrize("lowercase", [False, True])
def test_casing_travels_from_pretraining_through_finetuning_to_predict(
    tmp_path: Path, lowercase: bool
) -> None:
    """A cased model folder (do_lower_case false) tells "Apple" from "apple" in fine-tuning's
    tokenizer, in the fine-tuned folder it writes, and in `bert predict`'s predictor; an
    uncased one reads both as "apple"."""
    from bert_core.finetune.command import load_task
    from bert_core.finetune.engine import load_model, load_tokenizer
    from bert_core.serve.predictors import load_predictor

    pretrained = _pretrained_folder(tmp_path, lowercase)
    ids = {w: load_tokenizer(pretrained).encode(w).ids for w in ("Apple", "apple")}
    assert (ids["Apple"] == ids["apple"]) is lowercase
    assert ids["apple"] == [2, 5, 3]  # [CLS] apple [SEP]: a known piece, not [UNK]

    model = load_model(load_task("sst2"), pretrained)  # what `bert finetune` trains
    model.save_pretrained(tmp_path / "finetuned")  # ... and writes
    tuned_ids = {w: load_tokenizer(tmp_path / "finetuned").encode(w).ids for w in ids}
    assert tuned_ids == ids

    predictor = load_predictor(tmp_path / "finetuned")  # `bert predict`, `bert serve`
    assert {w: predictor.tokenizer.encode(w).ids for w in ids} == ids
    a, b = predictor.predict(pandas.DataFrame({"text": ["Apple pie is .", "apple pie is ."]}))
    same = a["probabilities"] == b["probabilities"]
    assert same is lowercase
