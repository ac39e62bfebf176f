"""The model is BERT: numerical parity with `transformers` on real and random weights, fp32, CPU."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import save_file

from bert_core.model.config import PRESETS, shape
from bert_core.model.heads import BertForSequenceClassification
from bert_core.model.modeling import BertConfig, BertForPreTraining, BertModel

torch.set_num_threads(2)


def real_sentences(shared_data: Path, n: int = 8) -> list[str]:
    lines = (shared_data / "corpus" / "sample_text.txt").read_text(encoding="utf-8").splitlines()
    lines = [s.strip() for s in lines if len(s.split()) > 3]
    # different lengths, so the batch is padded
    return sorted(lines, key=len)[:: max(1, len(lines) // n)][:n]


@pytest.fixture(scope="module")
def batch(minilm_dir: Path, shared_data: Path) -> dict[str, torch.Tensor]:
    tok = transformers.BertTokenizerFast(vocab_file=str(minilm_dir / "vocab.txt"))
    sents = real_sentences(shared_data)
    enc = tok(
        sents[:4], sents[4:], padding=True, truncation=True, max_length=96, return_tensors="pt"
    )
    assert (enc["attention_mask"] == 0).any(), "the batch must contain padding"
    return dict(enc)


def hf_config(config: BertConfig, **kw) -> transformers.BertConfig:
    return transformers.BertConfig(**config.to_dict(), attn_implementation="eager", **kw)


def test_presets_and_config_errors() -> None:
    for name, (layers, hidden, heads) in PRESETS.items():
        c = BertConfig.from_preset(name)
        assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads) == (
            layers,
            hidden,
            heads,
        )
        assert c.intermediate_size == 4 * hidden
    with pytest.raises(
        ValueError, match="hidden_size 100 is not divisible by num_attention_heads 3"
    ):
        BertConfig(hidden_size=100, num_attention_heads=3)
    with pytest.raises(ValueError, match="unknown preset"):
        BertConfig.from_preset("huge")


def test_a_shape_replaces_the_presets_numbers_and_the_feed_forward_follows_4h() -> None:
    """Table 6's grid from one preset: each number given replaces the preset's, the
    feed-forward size is 4H unless given (so H alone moves it), 0 keeps the preset's."""
    assert shape("base") == {
        "num_hidden_layers": 12,
        "hidden_size": 768,
        "num_attention_heads": 12,
        "intermediate_size": 3072,
    }
    assert shape("base", layers=6) == shape("base") | {"num_hidden_layers": 6}
    assert shape("base", hidden=1024, heads=16) == {
        "num_hidden_layers": 12,
        "hidden_size": 1024,
        "num_attention_heads": 16,
        "intermediate_size": 4096,
    }
    assert shape("tiny", intermediate=300)["intermediate_size"] == 300
    assert BertConfig.from_preset("mini") == BertConfig(**shape("mini"))
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        shape("huge", layers=3)


def test_bad_inputs_name_the_numbers() -> None:
    model = BertModel(BertConfig.from_preset("tiny", vocab_size=100, max_position_embeddings=16))
    with pytest.raises(ValueError, match="sequence length 17 exceeds max_position_embeddings 16"):
        model(torch.ones(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="token id 100 outside vocab_size 100"):
        model(torch.tensor([[1, 2, 100]]))


def test_init_follows_the_paper() -> None:
    model = BertForPreTraining(BertConfig.from_preset("mini"))
    w = model.bert.encoder.layer[0].intermediate.dense.weight
    # normal(0, 0.02) cut at 2 sigma, not rescaled (std 0.88 x 0.02): test_fidelity.py
    assert abs(w.std().item() - 0.0176) < 0.001 and abs(w.mean().item()) < 0.001
    assert w.abs().max() <= 0.04
    assert torch.all(model.bert.encoder.layer[0].intermediate.dense.bias == 0)
    assert torch.all(model.bert.embeddings.LayerNorm.weight == 1)


def test_a_loaded_model_has_the_checkpoints_weights_and_bert_init_for_the_rest(
    minilm_dir: Path, tmp_path: Path
) -> None:
    """`from_pretrained` and a fine-tuning's load build the model without drawing its weights
    (the checkpoint's replace them); what the checkpoint lacks (MiniLM: the MLM/NSP heads; a
    task head; below, a pooler) still starts from BERT's initialisation, not from PyTorch's
    constructors."""
    from bert_core.finetune.command import load_task
    from bert_core.finetune.engine import load_model
    from bert_core.model import weights

    state = weights.read(minilm_dir)
    for model in (
        BertForPreTraining.from_pretrained(minilm_dir),
        load_model(load_task("sst2"), minilm_dir),
    ):
        own = model.state_dict()
        for key, value in state.items():
            if f"bert.{key}" in own:
                assert torch.equal(own[f"bert.{key}"], value), key
        heads = (
            [model.cls.predictions.transform.dense, model.cls.seq_relationship]
            if isinstance(model, BertForPreTraining)
            else [model.classifier]
        )
        for head in heads:  # truncated normal(0, 0.02): PyTorch's kaiming uniform is wider
            assert head.weight.abs().max() <= 0.04 and torch.all(head.bias == 0)
            assert abs(head.weight.std().item() - 0.0176) < 0.002
    assert torch.all(model.bert.embeddings.LayerNorm.weight == state["embeddings.LayerNorm.weight"])
    pretraining = BertForPreTraining.from_pretrained(minilm_dir)
    assert torch.all(pretraining.cls.predictions.transform.LayerNorm.weight == 1)
    assert torch.all(pretraining.cls.predictions.bias == 0)
    without_pooler = {k: v for k, v in state.items() if not k.startswith("pooler.")}
    shutil.copytree(minilm_dir, tmp_path / "m")
    save_file(without_pooler, tmp_path / "m" / "model.safetensors")
    pooler = BertForSequenceClassification.from_pretrained(tmp_path / "m").bert.pooler.dense
    assert pooler.weight.abs().max() <= 0.04 and torch.all(pooler.bias == 0)


def test_real_weights_match_transformers(minilm_dir: Path, batch: dict) -> None:
    """(a) the real 6-layer MiniLM BERT: same hidden states and pooled output as transformers."""
    ours = BertModel.from_pretrained(minilm_dir).eval()
    ref = transformers.BertModel.from_pretrained(minilm_dir, attn_implementation="eager").eval()
    with torch.no_grad():
        a = ours(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"])
        b = ref(**batch)
    real = batch["attention_mask"].bool()
    diff = (a.last_hidden_state - b.last_hidden_state)[real].abs().max().item()
    assert diff < 1e-4, diff
    assert (a.pooler_output - b.pooler_output).abs().max().item() < 1e-4
    assert a.last_hidden_state.abs().max() > 0.1  # not a degenerate all-zero comparison


def test_bf16_autocast_keeps_the_residual_stream_in_bf16(minilm_dir: Path, batch: dict) -> None:
    """Under bf16 autocast every layer's output is bf16 (LayerNorm in fp32 inside, its output in
    its input's dtype: half the bytes of autocast's fp32), and tracks the fp32 model on real
    weights; without autocast everything stays fp32 (the parity test above)."""
    model = BertModel.from_pretrained(minilm_dir).eval()
    args = batch["input_ids"], batch["token_type_ids"], batch["attention_mask"]
    with torch.no_grad():
        ref = model(*args, output_hidden_states=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = model(*args, output_hidden_states=True)
    assert {h.dtype for h in ref.hidden_states} == {torch.float32}
    assert {h.dtype for h in low.hidden_states} == {torch.bfloat16}
    assert all(p.dtype == torch.float32 for p in model.parameters())  # fp32 master weights
    real = batch["attention_mask"].bool()
    for a, b in zip(low.hidden_states, ref.hidden_states, strict=True):
        a, b = a.float()[real], b[real]
        assert (a - b).norm() / b.norm() < 0.03  # bf16 keeps 8 bits of mantissa


def test_pretraining_heads_match_transformers() -> None:
    """(b) random BertForPreTraining weights copied into transformers: logits and losses agree."""
    torch.manual_seed(0)
    config = BertConfig.from_preset("tiny", vocab_size=1000)
    ours = BertForPreTraining(config).eval()
    ref = transformers.BertForPreTraining(hf_config(config)).eval()
    missing, unexpected = ref.load_state_dict(ours.state_dict(), strict=False)
    assert not unexpected
    assert set(missing) <= {"cls.predictions.decoder.weight", "cls.predictions.decoder.bias"}
    ref.tie_weights()

    B, L = 3, 24
    ids = torch.randint(5, 1000, (B, L))
    types = torch.cat([torch.zeros(B, L // 2), torch.ones(B, L // 2)], 1).long()
    mask = torch.ones(B, L, dtype=torch.long)
    mask[1, 18:] = 0
    positions = torch.tensor([[1, 5, 9, 0], [2, 3, 0, 0], [4, 7, 11, 20]])
    labels = torch.tensor([[10, 11, 12, -100], [13, 14, -100, -100], [15, 16, 17, 18]])
    nsp = torch.tensor([0, 1, 0])
    full_labels = torch.full((B, L), -100)
    for b in range(B):
        for p, y in zip(positions[b], labels[b], strict=True):
            if y != -100:
                full_labels[b, p] = y

    with torch.no_grad():
        a = ours(ids, types, mask, positions, labels, nsp)
        b = ref(
            input_ids=ids,
            token_type_ids=types,
            attention_mask=mask,
            labels=full_labels,
            next_sentence_label=nsp,
        )
    gathered = torch.stack([b.prediction_logits[i, positions[i]] for i in range(B)])
    valid = labels != -100
    assert (a.mlm_logits - gathered)[valid].abs().max() < 1e-4
    assert (a.nsp_logits - b.seq_relationship_logits).abs().max() < 1e-5
    assert abs(a.loss.item() - b.loss.item()) < 1e-5
    assert a.loss.item() > 1.0  # random weights: a real, non-trivial loss


@pytest.mark.parametrize(
    "cls_name, num_labels",
    [
        ("BertForPreTraining", 2),
        ("BertForSequenceClassification", 3),
        ("BertForSequenceClassification", 1),
    ],
)
def test_saved_checkpoint_loads_in_transformers(
    tmp_path: Path, minilm_dir: Path, batch: dict, cls_name: str, num_labels: int
) -> None:
    """(c) save_pretrained output: no missing/unexpected keys in transformers, same outputs."""
    ours_cls = {
        "BertForPreTraining": BertForPreTraining,
        "BertForSequenceClassification": BertForSequenceClassification,
    }[cls_name]
    torch.manual_seed(1)
    ours = ours_cls.from_pretrained(minilm_dir, num_labels=num_labels).eval()
    ours.save_pretrained(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "vocab.txt").read_text() == (minilm_dir / "vocab.txt").read_text()
    saved = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert saved["architectures"] == [cls_name]

    ref, info = getattr(transformers, cls_name).from_pretrained(
        tmp_path / "ckpt", attn_implementation="eager", output_loading_info=True
    )
    ref.eval()
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info["mismatched_keys"], info
    args = (batch["input_ids"], batch["token_type_ids"], batch["attention_mask"])
    with torch.no_grad():
        a, b = ours(*args), ref(**batch)
    if cls_name == "BertForPreTraining":
        assert (a.mlm_logits - b.prediction_logits).abs().max() < 1e-3
        assert (a.nsp_logits - b.seq_relationship_logits).abs().max() < 1e-4
    else:
        assert a.logits.shape == b.logits.shape == (4, num_labels)
        assert (a.logits - b.logits).abs().max() < 1e-4
    # and back: our own loader restores the same weights
    again = ours_cls.from_pretrained(tmp_path / "ckpt").eval()
    for k, v in ours.state_dict().items():
        assert torch.equal(v, again.state_dict()[k]), k


def test_legacy_bin_and_key_errors(tmp_path: Path) -> None:
    config = BertConfig.from_preset("tiny", vocab_size=200)
    model = BertModel(config)
    d = tmp_path / "legacy"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config.to_dict()))
    # Google-converted names (gamma/beta) in a torch pickle, loaded with weights_only=True
    state = {
        k.replace("LayerNorm.weight", "LayerNorm.gamma"): v for k, v in model.state_dict().items()
    }
    torch.save(state, d / "pytorch_model.bin")
    loaded = BertForSequenceClassification.from_pretrained(d, num_labels=2)  # new head: allowed
    assert torch.equal(loaded.bert.embeddings.LayerNorm.weight, model.embeddings.LayerNorm.weight)

    state.pop("encoder.layer.1.output.dense.weight")
    state["encoder.layer.9.output.dense.weight"] = torch.zeros(1)
    torch.save(state, d / "pytorch_model.bin")
    with pytest.raises(
        ValueError,
        match=r"missing \['encoder.layer.1.output.dense.weight'\]"
        r".*unexpected \['encoder.layer.9.output.dense.weight'\]",
    ):
        BertModel.from_pretrained(d)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        BertModel.from_pretrained(tmp_path / "nowhere")


def test_regression_head_uses_mse() -> None:
    torch.manual_seed(0)
    model = BertForSequenceClassification(
        BertConfig.from_preset("tiny", vocab_size=100, num_labels=1)
    )
    ids = torch.randint(5, 100, (4, 8))
    y = torch.tensor([0.0, 1.5, 3.0, 5.0])
    out = model(ids, labels=y)
    assert out.logits.shape == (4, 1)
    assert torch.allclose(out.loss, ((out.logits.squeeze(-1) - y) ** 2).mean())


def test_label_names_round_trip_through_config_json_and_transformers(tmp_path: Path) -> None:
    """id2label / label2id / finetuning_task are config fields: written to config.json as
    transformers writes them (string ids), read back by transformers and by us (int ids)."""
    labels = ("O", "B-PER", "I-PER")
    config = BertConfig.from_preset(
        "tiny",
        vocab_size=100,
        num_labels=3,
        id2label=dict(enumerate(labels)),
        finetuning_task="conll2003",
    )
    assert config.label2id == {"O": 0, "B-PER": 1, "I-PER": 2}
    BertForSequenceClassification(config).save_pretrained(tmp_path / "ours")
    raw = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert raw["id2label"] == {"0": "O", "1": "B-PER", "2": "I-PER"}
    assert raw["label2id"] == {"O": 0, "B-PER": 1, "I-PER": 2}
    assert raw["finetuning_task"] == "conll2003" and "num_labels" not in raw

    hf = transformers.BertConfig.from_pretrained(tmp_path / "ours")
    assert hf.id2label == dict(enumerate(labels)) and hf.num_labels == 3
    assert hf.label2id == config.label2id and hf.finetuning_task == "conll2003"
    hf.save_pretrained(tmp_path / "hf")
    back = BertConfig.from_json_file(tmp_path / "hf" / "config.json")
    assert back.id2label == dict(enumerate(labels)) and back.label2id == config.label2id
    assert back.num_labels == 3 and back.finetuning_task == "conll2003"
    assert BertForSequenceClassification.from_pretrained(tmp_path / "ours").config == config

    # no names (regression, span heads, pre-trained models): None in memory, LABEL_i on disk
    plain = BertConfig.from_preset("tiny", num_labels=1).to_dict()
    assert plain["id2label"] == {"0": "LABEL_0"} and "finetuning_task" not in plain
    assert BertConfig.from_dict(plain).id2label is None
    # a head of another size drops the checkpoint's names; names must match num_labels
    fresh = BertConfig.from_json_file(tmp_path / "ours" / "config.json", num_labels=2)
    assert fresh.id2label is None and fresh.label2id is None and fresh.num_labels == 2
    with pytest.raises(ValueError, match=r"id2label has ids \[0\], expected 0..1"):
        BertConfig(num_labels=2, id2label={0: "a"})


def test_a_weight_the_checkpoint_lacks_warns_unless_created_on_purpose(
    minilm_dir: Path, caplog
) -> None:
    """MiniLM ships no MLM/NSP heads: loading it to continue its pre-training starts them from
    zero, a WARNING naming them (as transformers warns); `bert finetune`'s task head on it is
    new on purpose, INFO only."""
    import logging

    from bert_core.finetune.command import load_task
    from bert_core.finetune.engine import load_model

    with caplog.at_level(logging.INFO, logger="bert_core.model.modeling"):
        BertForPreTraining.from_pretrained(minilm_dir)
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "newly initialised" in warning.message and "cls.predictions.bias" in warning.message
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="bert_core.model.modeling"):
        load_model(load_task("sst2"), minilm_dir)
    assert [r.levelno for r in caplog.records] == [logging.INFO], caplog.text
    assert "classifier.weight" in caplog.records[0].message
