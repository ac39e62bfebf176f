"""The fine-tuning heads of BERT's section 4 on top of the encoder in `bert_core.model.modeling`.

One class per kind of task, with transformers' class and parameter names (`classifier.*`,
`qa_outputs.*`), so a fine-tuned checkpoint loads in either library:
`BertForSequenceClassification` (GLUE: the pooled [CLS] vector), `BertForTokenClassification`
(NER: every token), `BertForQuestionAnswering` (SQuAD: a start and an end logit per token) and
`BertForMultipleChoice` (SWAG: one score per choice from its pooled [CLS] vector). And the
feature-based approach of section 5.3: `BertFeatureTagger` (BERT frozen, a BiLSTM tagger on the
hidden states chosen as in Table 7).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from bert_core.errors import BadValue
from bert_core.model.layers import packed_lstm
from bert_core.model.modeling import BertConfig, BertModel, BertPreTrainedModel


class ClassifierOutput(NamedTuple):
    loss: torch.Tensor | None
    logits: torch.Tensor  # [B, num_labels]


class BertForSequenceClassification(BertPreTrainedModel):
    """A linear layer on the pooled [CLS] vector; regression (MSE) when num_labels == 1."""

    def __init__(self, config: BertConfig, init_weights: bool = True):
        super().__init__(config)
        self.bert = BertModel(config, init_weights)
        p = config.classifier_dropout
        self.dropout = nn.Dropout(config.hidden_dropout_prob if p is None else p)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self._init_weights(self.classifier)

    def forward(
        self,
        input_ids: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> ClassifierOutput:
        pooled = self.bert(input_ids, token_type_ids, attention_mask).pooler_output
        logits = self.classifier(self.dropout(pooled))
        loss = None
        if labels is not None:
            if self.config.num_labels == 1:
                loss = F.mse_loss(logits.squeeze(-1).float(), labels.float())
            else:
                loss = F.cross_entropy(logits.float(), labels.long())
        return ClassifierOutput(loss, logits)


class BertForMultipleChoice(BertPreTrainedModel):
    """SWAG (section 4.4): each choice is its own `[CLS] context [SEP] ending [SEP]` sequence;
    a linear layer maps each pooled [CLS] vector to one score, a softmax over the choices.

    Inputs are [B, C, L] (C choices of one example side by side), logits [B, C]; as
    transformers' class of the same name, `classifier` is Linear(hidden, 1) whatever
    `num_labels` says (the number of choices is the input's, not the config's).
    """

    def __init__(self, config: BertConfig, init_weights: bool = True):
        super().__init__(config)
        self.bert = BertModel(config, init_weights)
        p = config.classifier_dropout
        self.dropout = nn.Dropout(config.hidden_dropout_prob if p is None else p)
        self.classifier = nn.Linear(config.hidden_size, 1)
        self._init_weights(self.classifier)

    def forward(
        self,
        input_ids: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> ClassifierOutput:
        B, C, L = input_ids.shape
        flat = [
            x.reshape(B * C, L) if x is not None else None
            for x in (input_ids, token_type_ids, attention_mask)
        ]
        pooled = self.bert(*flat).pooler_output
        logits = self.classifier(self.dropout(pooled)).view(B, C)
        loss = None if labels is None else F.cross_entropy(logits.float(), labels.long())
        return ClassifierOutput(loss, logits)


class QuestionAnsweringOutput(NamedTuple):
    loss: torch.Tensor | None
    start_logits: torch.Tensor  # [B, L]
    end_logits: torch.Tensor  # [B, L]


class _TokenLevelModel(BertPreTrainedModel):
    """An encoder without pooler: token-level heads read every hidden state, never [CLS]'s pool.

    transformers builds these models with `add_pooling_layer=False`, so their checkpoints have
    no `bert.pooler.*` keys; we match that (an unused pooler would also get no gradient). A
    pre-trained checkpoint's pooler is dropped on load, like its MLM/NSP heads.
    """

    def __init__(self, config: BertConfig, init_weights: bool = True):
        super().__init__(config)
        self.bert = BertModel(config, init_weights)
        self.bert.pooler = nn.Identity()  # no parameters; pooler_output is then unused
        p = config.classifier_dropout
        self.dropout = nn.Dropout(config.hidden_dropout_prob if p is None else p)

    def load_checkpoint_state(
        self, state: dict[str, torch.Tensor], source: str = "", created: tuple[str, ...] = ()
    ) -> None:
        kept = {k: v for k, v in state.items() if ".pooler." not in f".{k}"}
        super().load_checkpoint_state(kept, source, created)

    def hidden_states(self, input_ids, token_type_ids, attention_mask) -> torch.Tensor:
        return self.bert(input_ids, token_type_ids, attention_mask).last_hidden_state


def token_loss(logits: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor | None:
    """Cross-entropy over every token whose label is not -100 (in fp32 under autocast)."""
    if labels is None:
        return None
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten().long(), ignore_index=-100)


class BertForTokenClassification(_TokenLevelModel):
    """A linear layer on every token's hidden state (NER, section 4.3 of the paper).

    `labels` [B, L] hold -100 where no prediction is scored: special tokens, padding, and every
    WordPiece of a word but its first.
    """

    def __init__(self, config: BertConfig, init_weights: bool = True):
        super().__init__(config, init_weights)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self._init_weights(self.classifier)

    def forward(
        self,
        input_ids: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> ClassifierOutput:
        h = self.hidden_states(input_ids, token_type_ids, attention_mask)
        logits = self.classifier(self.dropout(h))  # [B, L, num_labels]
        return ClassifierOutput(token_loss(logits, labels), logits)


class BertForQuestionAnswering(_TokenLevelModel):
    """Start and end logits for an answer span over every token (SQuAD, section 4.2).

    As in transformers, `qa_outputs` maps each hidden state to `num_labels` (= 2) scores, no
    dropout before it. The loss is the mean of the start and end cross-entropies; positions
    outside the sequence are ignored (clamped to L, the ignore index), as transformers does.
    """

    def __init__(self, config: BertConfig, init_weights: bool = True):
        super().__init__(config, init_weights)
        self.qa_outputs = nn.Linear(config.hidden_size, config.num_labels)
        self._init_weights(self.qa_outputs)

    def forward(
        self,
        input_ids: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        start_positions: torch.Tensor | None = None,
        end_positions: torch.Tensor | None = None,
    ) -> QuestionAnsweringOutput:
        h = self.hidden_states(input_ids, token_type_ids, attention_mask)
        start_logits, end_logits = self.qa_outputs(h).split(1, dim=-1)
        start_logits, end_logits = start_logits.squeeze(-1), end_logits.squeeze(-1)
        loss = None
        if start_positions is not None and end_positions is not None:
            ignored = start_logits.shape[1]
            start = start_positions.view(-1).long().clamp(0, ignored)
            end = end_positions.view(-1).long().clamp(0, ignored)
            loss = (
                F.cross_entropy(start_logits.float(), start, ignore_index=ignored)
                + F.cross_entropy(end_logits.float(), end, ignore_index=ignored)
            ) / 2
        return QuestionAnsweringOutput(loss, start_logits, end_logits)


# The paper's Table 7 choices of frozen features for NER (section 5.3), in its order.
FEATURE_LAYERS = (
    "embeddings",
    "second-to-last",
    "last",
    "weighted-sum-last4",
    "concat-last4",
    "weighted-sum-all",
)


def feature_states(choice: str, num_layers: int) -> tuple[tuple[int, ...], str]:
    """(hidden-state indices, how they combine: one, sum or concat) of a Table 7 choice; index 0
    is the embeddings' output, 1..L the layers' ("all 12 layers" are the L layers')."""
    last4 = tuple(range(num_layers - 3, num_layers + 1))
    return {
        "embeddings": ((0,), "one"),
        "second-to-last": ((num_layers - 1,), "one"),
        "last": ((num_layers,), "one"),
        "weighted-sum-last4": (last4, "sum"),
        "concat-last4": (last4, "concat"),
        "weighted-sum-all": (tuple(range(1, num_layers + 1)), "sum"),
    }[choice]


class FeatureBiLSTM(nn.Module):
    """The paper's tagger on fixed features: the chosen hidden states (a weighted sum where
    Table 7 says so: softmax-normalised learned weights and a scale, ELMo's scalar mix, which the
    paper does not spell out; concatenated where it says concat), a two-layer BiLSTM as wide as
    the model per direction (768 at BERT-Base, the paper's), then a linear layer per token."""

    def __init__(self, config: BertConfig):
        super().__init__()
        h = config.hidden_size
        self.layers, self.combine = feature_states(config.feature_layers, config.num_hidden_layers)
        self.mix = nn.Parameter(torch.zeros(len(self.layers)))  # equal weights at the start
        self.scale = nn.Parameter(torch.ones(1))
        width = h * len(self.layers) if self.combine == "concat" else h
        p = config.hidden_dropout_prob
        self.lstm = nn.LSTM(width, h, num_layers=2, bidirectional=True, batch_first=True, dropout=p)
        self.dropout = nn.Dropout(p)
        self.out = nn.Linear(2 * h, config.num_labels)

    def forward(self, states: tuple[torch.Tensor, ...], mask: torch.Tensor) -> torch.Tensor:
        chosen = [states[i].float() for i in self.layers]
        if self.combine == "concat":
            x = torch.cat(chosen, dim=-1)
        elif self.combine == "sum":
            w = torch.softmax(self.mix, 0)
            x = self.scale * sum(w[i] * c for i, c in enumerate(chosen))
        else:
            x = chosen[0]
        h = packed_lstm(self.lstm, self.dropout(x), mask)
        return self.out(self.dropout(h))


class BertFeatureTagger(_TokenLevelModel):
    """The feature-based approach to NER (section 5.3): BERT's weights frozen and its dropout
    off (the features are fixed, as if extracted once), `FeatureBiLSTM` trained on top.

    The tagger's parameters live under `classifier.`, a head prefix: a pre-trained checkpoint
    loads with the tagger freshly initialised, and a saved tagger loads back whole. Inputs,
    labels and outputs are `BertForTokenClassification`'s, so NER's training, prediction and
    serving code runs it unchanged.
    """

    def __init__(self, config: BertConfig, init_weights: bool = True):
        if config.feature_layers not in FEATURE_LAYERS:
            raise BadValue(
                f"feature_layers {config.feature_layers!r}: one of {', '.join(FEATURE_LAYERS)}"
            )
        super().__init__(config, init_weights)
        self.classifier = FeatureBiLSTM(config)
        self._init_weights(self.classifier.out)
        self.bert.requires_grad_(False)

    def train(self, mode: bool = True) -> BertFeatureTagger:
        super().train(mode)
        self.bert.eval()  # fixed features: no dropout inside BERT
        return self

    def forward(
        self,
        input_ids: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> ClassifierOutput:
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        with torch.no_grad():
            states = self.bert(input_ids, token_type_ids, mask, output_hidden_states=True)
        logits = self.classifier(states.hidden_states, mask)  # [B, L, num_labels]
        return ClassifierOutput(token_loss(logits, labels), logits)
