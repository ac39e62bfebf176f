"""`bert embed` and `BertModel(output_hidden_states=True)`: the vectors are transformers' hidden
states of the same model, combined and pooled as asked."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from bert_core import cli
from bert_core.model.modeling import BertModel
from bert_core.serve.embed import parse_layers

TEXTS = ["The quick brown fox jumps over the lazy dog.", "BERT reads both ways!", "ok"]


@pytest.fixture(scope="module")
def reference(minilm_dir):
    """transformers' hidden states of MiniLM for TEXTS (all 7: embeddings + 6 layers)."""
    import transformers

    tok = transformers.BertTokenizerFast.from_pretrained(str(minilm_dir))
    model = transformers.BertModel.from_pretrained(str(minilm_dir)).eval()
    enc = [tok(t, return_tensors="pt") for t in TEXTS]
    with torch.no_grad():
        states = [model(**e, output_hidden_states=True).hidden_states for e in enc]
    return [tok.convert_ids_to_tokens(e["input_ids"][0]) for e in enc], states


def test_model_returns_every_hidden_state(minilm_dir):
    ours = BertModel.from_pretrained(minilm_dir).eval()
    ids = torch.tensor([[101, 7592, 2088, 102]])
    with torch.no_grad():
        out = ours(ids, output_hidden_states=True)
        assert ours(ids).hidden_states is None  # only on request
    assert len(out.hidden_states) == ours.config.num_hidden_layers + 1
    assert torch.equal(out.hidden_states[-1], out.last_hidden_state)


def run_embed(tmp_path, minilm_dir, capsys, *options):
    (tmp_path / "in.jsonl").write_text(
        "".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(TEXTS))
    )
    out = tmp_path / f"out{len(list(tmp_path.glob('out*')))}.parquet"
    argv = ["embed", "--model", str(minilm_dir), "--input", str(tmp_path / "in.jsonl")]
    assert cli.main([*argv, "--output", str(out), "--chunk-size", "2", *options]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["rows"] == len(TEXTS)
    return pq.read_table(out).to_pylist()


@pytest.mark.slow
def test_embed_equals_transformers_hidden_states(
    tmp_path, minilm_dir, reference, capsys, monkeypatch
):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.chdir(tmp_path)
    tokens, states = reference
    # the default: one vector per row, the mean of the last layer over the row's tokens (the
    # mean pooling MiniLM was trained for), no per-token columns
    default = run_embed(tmp_path, minilm_dir, capsys)
    assert set(default[0]) == {"row", "id", "num_tokens", "vector"}
    for row, hs in zip(default, states, strict=True):
        np.testing.assert_allclose(np.array(row["vector"]), hs[-1][0].mean(0).numpy(), atol=2e-4)
    per_token = run_embed(tmp_path, minilm_dir, capsys, "--layers", "last4", "--pooling", "none")
    for row, toks, hs in zip(per_token, tokens, states, strict=True):
        assert row["tokens"] == toks and row["num_tokens"] == len(toks)
        want = torch.cat(hs[-4:], dim=-1)[0].numpy()
        np.testing.assert_allclose(np.array(row["vectors"]), want, atol=2e-4)
    assert [r["id"] for r in per_token] == ["0", "1", "2"]

    pooled = run_embed(
        tmp_path, minilm_dir, capsys, "--layers=-2,0", "--combine", "sum", "--pooling", "mean"
    )
    for row, hs in zip(pooled, states, strict=True):
        want = (hs[-2] + hs[0])[0].mean(0).numpy()
        np.testing.assert_allclose(np.array(row["vector"]), want, atol=2e-4)
    cls = run_embed(tmp_path, minilm_dir, capsys, "--layers", "embeddings", "--pooling", "cls")
    np.testing.assert_allclose(np.array(cls[1]["vector"]), states[1][0][0, 0].numpy(), atol=1e-5)
    assert len(cls[0]["vector"]) == 384


def test_layer_choices_are_checked(minilm_dir):
    from bert_core.serve.embed import Embedder
    from bert_core.serve.predictors import Settings

    assert parse_layers("last4") == (-4, -3, -2, -1) and parse_layers("0,6") == (0, 6)
    with pytest.raises(ValueError, match="integers like"):
        parse_layers("top")
    with pytest.raises(ValueError, match=r"--layers 7: this model has hidden states 0..6"):
        Embedder(minilm_dir, Settings(), (7,))
