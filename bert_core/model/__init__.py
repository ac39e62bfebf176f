"""The model: BERT's configuration, layers, encoder, heads and optimiser, in pure torch.

Owns `config` (BertConfig and the size presets), `layers` (embeddings, attention, feed-forward),
`modeling` (BertModel, BertForPreTraining, checkpoints in the Hugging Face layout), `heads` (the
fine-tuning heads) and `optim` (the original's Adam without bias correction and torch's AdamW,
no decay on biases and LayerNorm, their warm-up/decay schedules, autocast, the device). The
names users know from `transformers` are re-exported here:
`from bert_core.model import BertConfig, BertModel, BertForSequenceClassification`.

May import: `errors` only. The model knows nothing about data, training or serving, so every
step above can build on it.
"""

from bert_core.model.config import BertConfig
from bert_core.model.heads import (
    BertForMultipleChoice,
    BertForQuestionAnswering,
    BertForSequenceClassification,
    BertForTokenClassification,
)
from bert_core.model.modeling import BertForPreTraining, BertModel, BertPreTrainedModel

__all__ = [
    "BertConfig",
    "BertForMultipleChoice",
    "BertForPreTraining",
    "BertForQuestionAnswering",
    "BertForSequenceClassification",
    "BertForTokenClassification",
    "BertModel",
    "BertPreTrainedModel",
]
