"""Token-level heads are transformers': same keys, same logits and losses (fp32, CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from bert_core.model.heads import BertForQuestionAnswering, BertForTokenClassification

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def batch(minilm_dir: Path) -> dict[str, torch.Tensor]:
    # from_pretrained: transformers 5's BertTokenizerFast(vocab_file=...) ignores the file
    tok = transformers.BertTokenizerFast.from_pretrained(str(minilm_dir))
    enc = tok(
        ["Who wrote Pride and Prejudice?", "Where is Notre Dame?"],
        [
            "Pride and Prejudice is a novel by Jane Austen, published in 1813.",
            "The University of Notre Dame is in Indiana.",
        ],
        padding=True,
        return_tensors="pt",
    )
    assert (enc["attention_mask"] == 0).any(), "the batch must contain padding"
    assert (enc["input_ids"] > 999).float().mean() > 0.5, "real WordPiece ids, not [UNK]s"
    return dict(enc)


@pytest.mark.parametrize("cls_name", ["BertForTokenClassification", "BertForQuestionAnswering"])
def test_checkpoint_round_trips_through_transformers(
    tmp_path: Path, minilm_dir: Path, batch: dict, cls_name: str
) -> None:
    ours_cls = {
        "BertForTokenClassification": BertForTokenClassification,
        "BertForQuestionAnswering": BertForQuestionAnswering,
    }[cls_name]
    num_labels = 9 if cls_name == "BertForTokenClassification" else 2
    torch.manual_seed(3)
    # a pre-trained checkpoint with a pooler: dropped on load (transformers has none here)
    ours = ours_cls.from_pretrained(minilm_dir, num_labels=num_labels).eval()
    assert not any("pooler" in k for k in ours.state_dict())
    ours.save_pretrained(tmp_path / "ckpt")
    saved = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert saved["architectures"] == [cls_name]

    ref, info = getattr(transformers, cls_name).from_pretrained(
        tmp_path / "ckpt", attn_implementation="eager", output_loading_info=True
    )
    ref.eval()
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info["mismatched_keys"], info
    B, L = batch["input_ids"].shape
    args = (batch["input_ids"], batch["token_type_ids"], batch["attention_mask"])
    with torch.no_grad():
        if cls_name == "BertForTokenClassification":
            labels = torch.randint(0, num_labels, (B, L))
            labels[batch["attention_mask"] == 0] = -100
            labels[:, 0] = -100
            a, b = ours(*args, labels=labels), ref(**batch, labels=labels)
            assert a.logits.shape == (B, L, num_labels)
            real = batch["attention_mask"].bool()
            assert (a.logits - b.logits)[real].abs().max() < 1e-4
        else:
            # one position past the end: ignored by both (clamped to the ignore index)
            start, end = torch.tensor([12, 3]), torch.tensor([14, L + 5])
            a = ours(*args, start_positions=start, end_positions=end)
            b = ref(**batch, start_positions=start, end_positions=end)
            real = batch["attention_mask"].bool()
            assert (a.start_logits - b.start_logits)[real].abs().max() < 1e-4
            assert (a.end_logits - b.end_logits)[real].abs().max() < 1e-4
    assert abs(a.loss.item() - b.loss.item()) < 1e-5
    assert a.loss.item() > 0.1  # a fresh head: a real, non-trivial loss

    again = ours_cls.from_pretrained(tmp_path / "ckpt").eval()
    for k, v in ours.state_dict().items():
        assert torch.equal(v, again.state_dict()[k]), k


def test_transformers_checkpoint_loads_in_ours(tmp_path: Path) -> None:
    config = transformers.BertConfig(
        vocab_size=300,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        num_labels=5,
    )
    torch.manual_seed(0)
    ref = transformers.BertForTokenClassification(config).eval()
    ref.save_pretrained(tmp_path / "hf")
    ours = BertForTokenClassification.from_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(1, 300, (2, 11))
    with torch.no_grad():
        assert (ours(ids).logits - ref(ids).logits).abs().max() < 1e-4
