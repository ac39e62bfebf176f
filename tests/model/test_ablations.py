"""Table 5's model variants: the left-to-right model (causal attention, `is_decoder`) and the
BiLSTM added on top at fine-tuning (`top_bilstm`); parity with transformers where it has them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from bert_core.model.heads import BertForQuestionAnswering, BertForSequenceClassification
from bert_core.model.modeling import BertConfig, BertModel

torch.set_num_threads(2)


@pytest.fixture(scope="module")
def batch(minilm_dir: Path) -> dict[str, torch.Tensor]:
    tok = transformers.BertTokenizerFast(vocab_file=str(minilm_dir / "vocab.txt"))
    enc = tok(
        ["The cat sat on the mat.", "A much longer first sentence, with a few more words."],
        ["It was warm.", "And a second one."],
        padding=True,
        return_tensors="pt",
    )
    assert (enc["attention_mask"] == 0).any()
    return dict(enc)


def test_the_left_to_right_model_matches_transformers_decoder_and_sees_no_right_context(
    minilm_dir: Path, batch: dict
) -> None:
    """Real MiniLM weights run with `is_decoder`: the same hidden states as transformers' causal
    BertModel; no state moves when a token to its right changes; the pooler reads the last real
    token (under causal attention [CLS] sees only itself)."""
    ours = BertModel.from_pretrained(minilm_dir, is_decoder=True).eval()
    ref = transformers.BertModel.from_pretrained(
        minilm_dir, is_decoder=True, attn_implementation="eager"
    ).eval()
    args = batch["input_ids"], batch["token_type_ids"], batch["attention_mask"]
    with torch.no_grad():
        a, b = ours(*args), ref(**batch)
        bidirectional = BertModel.from_pretrained(minilm_dir).eval()(*args)
    real = batch["attention_mask"].bool()
    assert (a.last_hidden_state - b.last_hidden_state)[real].abs().max() < 1e-4
    assert (a.last_hidden_state - bidirectional.last_hidden_state)[real].abs().max() > 0.1

    ids = batch["input_ids"].clone()
    ids[:, 5] = 1000  # another token at position 5
    with torch.no_grad():
        changed = ours(ids, batch["token_type_ids"], batch["attention_mask"]).last_hidden_state
    assert torch.equal(changed[:, :5], a.last_hidden_state[:, :5])
    assert (changed[:, 5:] - a.last_hidden_state[:, 5:])[real[:, 5:]].abs().max() > 1e-3

    last = batch["attention_mask"].sum(1) - 1
    h = a.last_hidden_state[torch.arange(2), last]
    with torch.no_grad():
        assert torch.allclose(a.pooler_output, torch.tanh(ours.pooler.dense(h)), atol=1e-6)


def test_is_decoder_and_top_bilstm_travel_in_config_json_only_when_set(tmp_path: Path) -> None:
    plain = BertConfig.from_preset("tiny", vocab_size=100).to_dict()
    assert "is_decoder" not in plain and "top_bilstm" not in plain
    config = BertConfig.from_preset("tiny", vocab_size=100, is_decoder=True, top_bilstm=True)
    BertForSequenceClassification(config).save_pretrained(tmp_path / "m")
    saved = json.loads((tmp_path / "m" / "config.json").read_text())
    assert saved["is_decoder"] is True and saved["top_bilstm"] is True
    again = BertForSequenceClassification.from_pretrained(tmp_path / "m")
    assert again.config.is_decoder and again.bert.bilstm is not None
    assert transformers.BertConfig.from_pretrained(tmp_path / "m").is_decoder
    with pytest.raises(ValueError, match="even hidden_size"):
        BertConfig(hidden_size=9, num_attention_heads=3, intermediate_size=36, top_bilstm=True)


def test_the_top_bilstm_starts_fresh_on_a_checkpoint_and_ignores_padding(
    tmp_path: Path, minilm_dir: Path, batch: dict
) -> None:
    """A public checkpoint loads under a BiLSTM (only the BiLSTM is new); its output keeps the
    width H the heads read, and more padding changes nothing at the real tokens (packed)."""
    model = BertForQuestionAnswering.from_pretrained(minilm_dir, top_bilstm=True).eval()
    base = BertForQuestionAnswering.from_pretrained(minilm_dir).eval()
    for name, p in base.bert.named_parameters():
        assert torch.equal(p, model.bert.get_parameter(name)), name
    lstm = {n for n, _ in model.named_parameters()} - {n for n, _ in base.named_parameters()}
    assert lstm and all(n.startswith("bert.bilstm.lstm.") for n in lstm)
    args = batch["input_ids"], batch["token_type_ids"], batch["attention_mask"]
    padded = [torch.nn.functional.pad(x, (0, 7)) for x in args]
    with torch.no_grad():
        h = model.bert(*args).last_hidden_state
        h_padded = model.bert(*padded).last_hidden_state
        out = model(*args)
    assert h.shape[-1] == model.config.hidden_size
    real = batch["attention_mask"].bool()
    assert (h - h_padded[:, : h.shape[1]])[real].abs().max() < 1e-5
    assert out.start_logits.shape == batch["input_ids"].shape
