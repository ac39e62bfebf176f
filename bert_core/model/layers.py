"""BERT's Transformer encoder, layer by layer: embeddings, self-attention, feed-forward, pooler.

Pure `torch.nn` modules with the Hugging Face `transformers` names (`embeddings`, `encoder.layer.N
.attention.self.query`, ...), so the state dict of `bert_core.model.modeling.BertModel` built
from them loads in `transformers` and back. Attention goes through
`torch.nn.functional.scaled_dot_product_attention`, which picks a fused kernel for the device.

Under bf16 autocast (GPUs) the residual stream between the layers is bf16 too: `LayerNorm`
computes its statistics in fp32 but hands back its input's dtype, and the embeddings' output is
cast once. Autocast alone would return fp32 from every LayerNorm, so each residual add, dropout
and LayerNorm (the memory-bound kernels between the matrix products) moved twice the bytes, and
every next matrix product paid a cast. The weights stay fp32 (the optimizer's master copy).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bert_core.model.config import ACTIVATIONS, BertConfig

# ----------------------------------------------------------------------------- encoder


class LayerNorm(nn.LayerNorm):
    """LayerNorm in fp32 whose output keeps the input's dtype (a bf16 residual stream under
    autocast, which would otherwise return fp32); parameters and names are nn.LayerNorm's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).to(x.dtype)


def autocast_dtype(x: torch.Tensor) -> torch.Tensor:
    """`x` in autocast's dtype where autocast is on for its device (the embeddings' fp32 sum
    enters the bf16 stream here), else unchanged."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return x.to(torch.get_autocast_dtype(device))
    return x


class BertEmbeddings(nn.Module):
    """Token + segment + learned absolute position embeddings, then LayerNorm and dropout."""

    def __init__(self, config: BertConfig):
        super().__init__()
        h = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, h, padding_idx=config.pad_token_id)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, h)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, h)
        self.LayerNorm = LayerNorm(h, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = (
            self.word_embeddings(input_ids)
            + self.token_type_embeddings(token_type_ids)
            + self.position_embeddings(positions)
        )
        return self.dropout(autocast_dtype(self.LayerNorm(x)))


class BertSelfAttention(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        h = config.hidden_size
        self.n_head = config.num_attention_heads
        self.query, self.key, self.value = nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, h)
        self.dropout_p = config.attention_probs_dropout_prob

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        B, L, H = x.shape
        # one GEMM for q, k and v (3x wider, better device use); the parameters stay three
        # separate Linears so checkpoints keep the transformers names
        weight = torch.cat([self.query.weight, self.key.weight, self.value.weight])
        bias = torch.cat([self.query.bias, self.key.bias, self.value.bias])
        qkv = F.linear(x, weight, bias).view(B, L, 3, self.n_head, H // self.n_head)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout_p if self.training else 0.0
        )
        return y.transpose(1, 2).reshape(B, L, H)


class BertDenseLayerNorm(nn.Module):
    """dense -> dropout -> add residual -> LayerNorm (transformers' BertSelfOutput/BertOutput)."""

    def __init__(self, d_in: int, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(d_in, config.hidden_size)
        self.LayerNorm = LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dropout(self.dense(x)) + residual)


class BertAttention(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertDenseLayerNorm(config.hidden_size, config)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return self.output(self.self(x, mask), x)


class BertIntermediate(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class BertLayer(nn.Module):
    """One post-LayerNorm Transformer block, as in the paper."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertDenseLayerNorm(config.intermediate_size, config)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = self.attention(x, mask)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor | None, states: list | None = None
    ) -> torch.Tensor:
        """The last layer's output; `states`, when given, collects the input and every layer's."""
        for layer in self.layer:
            if states is not None:
                states.append(x)
            x = layer(x, mask)
        if states is not None:
            states.append(x)
        return x


def attention_mask_for(
    mask: torch.Tensor | None, causal: bool, length: int, device: torch.device
) -> torch.Tensor | None:
    """[B, L] 1/0 -> SDPA's boolean mask (True = attend): [B, 1, 1, L] over the keys; `causal`
    (the left-to-right model, `BertConfig.is_decoder`) also hides every key right of its query,
    as transformers' decoder mask does."""
    keys = None if mask is None else mask[:, None, None, :].bool()
    if not causal:
        return keys
    left = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    return left if keys is None else keys & left


def pooled_token(x: torch.Tensor, mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
    """The token the pooler reads: [CLS] (position 0), which attends to the whole sequence.
    Under causal attention [CLS] sees only itself, so the last real token instead (the final
    [SEP], the one that sees everything: GPT's choice). transformers' pooler always reads
    position 0, so a left-to-right model's pooled vector is ours alone."""
    if not causal:
        return x[:, 0]
    if mask is None:
        return x[:, -1]
    last = mask.sum(1).long() - 1
    return x[torch.arange(x.shape[0], device=x.device), last]


class BertPooler(nn.Module):
    """tanh(dense(h)) of one token's vector (h_[CLS]; `pooled_token` picks it): the
    sentence representation the NSP and classifier heads read."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, token: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(token))


def packed_lstm(lstm: nn.LSTM, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """`lstm` over each sequence's real tokens only (packed by the [B, L] 1/0 `mask`), so the
    backward direction starts at a sequence's last token, not in its padding; [B, L, out]."""
    if mask is None:
        return lstm(x)[0]
    lengths = mask.sum(1).clamp(min=1).cpu()  # pack_padded_sequence wants them on the host
    packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
    h, _ = lstm(packed)
    return nn.utils.rnn.pad_packed_sequence(h, batch_first=True, total_length=x.shape[1])[0]


class BertTopBiLSTM(nn.Module):
    """Table 5's "+ BiLSTM": a randomly initialised one-layer BiLSTM on the encoder's output,
    which the paper added to the left-to-right model at fine-tuning to give its token states the
    right-hand context they lack. H/2 units per direction, so the heads keep their width H."""

    def __init__(self, config: BertConfig):
        super().__init__()
        h = config.hidden_size
        self.lstm = nn.LSTM(h, h // 2, batch_first=True, bidirectional=True)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return packed_lstm(self.lstm, x, mask).to(x.dtype)
