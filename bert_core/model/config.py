"""BERT's hyper-parameters (`BertConfig`), its size presets and the checkpoint file names.

Named as in `transformers.BertConfig` and Google's bert_config.json, and read from / written to
the same config.json, so a model folder moves between this project and transformers unchanged.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch.nn.functional as F

from bert_core.errors import BadValue, InputError, utf8_errors

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
LEGACY_WEIGHTS_NAME = "pytorch_model.bin"
VOCAB_NAME = "vocab.txt"
# files that travel with the vocabulary (casing and special tokens for tokenizers)
TOKENIZER_FILES = ("vocab.txt", "tokenizer_config.json", "special_tokens_map.json")

# Named shortcuts for a shape, (layers L, hidden H, heads A); the feed-forward size is 4H as in
# the paper. The names are Turc et al.'s (2019) BERT miniatures, base and large the paper's.
PRESETS: dict[str, tuple[int, int, int]] = {
    "tiny": (2, 128, 2),
    "mini": (4, 256, 4),
    "small": (4, 512, 8),
    "medium": (8, 512, 8),
    "base": (12, 768, 12),
    "large": (24, 1024, 16),
}


@dataclass
class BertConfig:
    """BERT hyper-parameters, named as in `transformers.BertConfig` and Google's config.

    `hidden_act` picks the GELU as transformers reads it (`ACTIVATIONS`): "gelu" is the exact,
    erf form; "gelu_new", "gelu_pytorch_tanh" and "gelu_fast" the tanh approximation. The
    original BERT trained with the tanh form but its bert_config.json says "gelu", which
    transformers (and so every BERT on the Hub) runs as erf. Our presets keep "gelu" (erf):
    a model folder then says what every BERT config.json says and means what transformers
    makes of it, and the two forms differ by at most 4.7e-4 (at x = -2.7), below bf16's
    resolution for activations near 1, so training with either is not measurably different.
    `BertConfig.from_preset(name, hidden_act="gelu_new")` trains with the original's form.
    """

    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0
    num_labels: int = 2
    classifier_dropout: float | None = None
    # A fine-tuned head's label names, as transformers keeps them: id -> name (int keys in
    # memory, string keys in config.json) and name -> id. None: no names (a regression head, a
    # span head, a pre-trained model); config.json then says LABEL_0, LABEL_1, ...
    id2label: dict[int, str] | None = None
    label2id: dict[str, int] | None = None
    finetuning_task: str | None = None  # the task a fine-tuned model was trained on
    # `heads.BertFeatureTagger`'s input (the feature-based approach, the paper's Table 7): one of
    # `heads.FEATURE_LAYERS`; None for every other model (and then not in config.json)
    feature_layers: str | None = None
    # Table 5's left-to-right model: causal self-attention (no token sees the ones to its right),
    # transformers' name for it; the pooled vector is then the last real token's
    # (`layers.pooled_token`). False for BERT (and then not in config.json).
    is_decoder: bool = False
    # Table 5's "+ BiLSTM": a randomly initialised BiLSTM between the encoder and the task head
    # (`layers.BertTopBiLSTM`), added at fine-tuning. False: none (and not in config.json).
    top_bilstm: bool = False

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads != 0:
            raise BadValue(
                f"hidden_size {self.hidden_size} is not divisible by "
                f"num_attention_heads {self.num_attention_heads}"
            )
        if self.hidden_act not in ACTIVATIONS:
            raise BadValue(
                f"hidden_act {self.hidden_act!r} is unknown: use one of {', '.join(ACTIVATIONS)}"
            )
        if self.top_bilstm and self.hidden_size % 2:
            raise BadValue(
                f"top_bilstm needs an even hidden_size (H/2 per direction), not {self.hidden_size}"
            )
        if self.num_labels < 1:
            raise BadValue(f"num_labels must be >= 1, got {self.num_labels}")
        if self.id2label is not None:
            self.id2label = {int(i): str(name) for i, name in self.id2label.items()}
            if sorted(self.id2label) != list(range(self.num_labels)):
                raise BadValue(
                    f"id2label has ids {sorted(self.id2label)}, expected 0..{self.num_labels - 1} "
                    f"(num_labels {self.num_labels})"
                )
            if self.id2label == _generic_labels(self.num_labels):
                self.id2label = None  # transformers' placeholder names are no names
        if self.id2label is None:
            self.label2id = None
        elif self.label2id is None:
            self.label2id = {name: i for i, name in self.id2label.items()}

    @classmethod
    def from_preset(cls, name: str, **overrides) -> BertConfig:
        return cls(**{**shape(name), **overrides})

    @classmethod
    def from_dict(cls, d: dict, **overrides) -> BertConfig:
        """Read a transformers/Google config (model and label names), ignoring other keys."""
        if d.get("position_embedding_type", "absolute") != "absolute":
            raise BadValue(f"position_embedding_type {d['position_embedding_type']!r} unsupported")
        d = dict(d)
        if "num_labels" not in d and isinstance(d.get("id2label"), dict):
            d["num_labels"] = len(d["id2label"])
        if "num_labels" in overrides and "id2label" not in overrides:
            if overrides["num_labels"] != d.get("num_labels"):  # a new head: its names go
                d.pop("id2label", None)
                d.pop("label2id", None)
        names = {f.name for f in fields(cls)}
        return cls(**{**{k: v for k, v in d.items() if k in names}, **overrides})

    @classmethod
    def from_json_file(cls, path: str | Path, **overrides) -> BertConfig:
        """A config.json; a broken or inconsistent one is an error that names the file."""
        try:
            with utf8_errors(path), open(path, encoding="utf-8") as f:
                d = json.load(f)
        except json.JSONDecodeError as e:
            raise InputError(path, f"not valid JSON ({e.msg})", line=e.lineno) from None
        if not isinstance(d, dict):
            raise InputError(path, f"expected a JSON object, got {type(d).__name__}")
        try:
            return cls.from_dict(d, **overrides)
        except (TypeError, ValueError) as e:
            raise InputError(path, str(e)) from None

    def to_dict(self) -> dict:
        """The transformers-compatible config.json content."""
        d = asdict(self)
        d.pop("num_labels")  # transformers counts id2label
        id2label = self.id2label or _generic_labels(self.num_labels)
        d["id2label"] = {str(i): name for i, name in id2label.items()}
        d["label2id"] = self.label2id or {name: i for i, name in id2label.items()}
        task = d.pop("finetuning_task")
        for key in ("feature_layers", "is_decoder", "top_bilstm"):  # written only when set
            if not d[key]:
                del d[key]
        d.update(model_type="bert", position_embedding_type="absolute")
        if task is not None:
            d["finetuning_task"] = task
        return d


def shape(
    preset: str, layers: int = 0, hidden: int = 0, heads: int = 0, intermediate: int = 0
) -> dict[str, int]:
    """BertConfig's size fields: the preset's (L, H, A) with each of `layers`, `hidden`, `heads`
    that is not 0 in its place, and the feed-forward size `intermediate`, else 4H (the paper's
    rule, so `hidden=1024` alone gives 4096). How Table 6's grid is swept: one preset, three
    numbers."""
    if preset not in PRESETS:
        raise BadValue(f"unknown preset {preset!r}; choose from {', '.join(PRESETS)}")
    L, H, A = PRESETS[preset]  # the paper's names
    H = hidden or H
    return {
        "num_hidden_layers": layers or L,
        "hidden_size": H,
        "num_attention_heads": heads or A,
        "intermediate_size": intermediate or 4 * H,
    }


def _generic_labels(num_labels: int) -> dict[int, str]:
    """transformers' names for a head without label names: LABEL_0, LABEL_1, ..."""
    return {i: f"LABEL_{i}" for i in range(num_labels)}


def _gelu_tanh(x):
    """The original BERT's GELU: 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))."""
    return F.gelu(x, approximate="tanh")


# config.json's `hidden_act` -> the function, as transformers reads the names
ACTIVATIONS = {
    "gelu": F.gelu,  # exact: x Phi(x), with erf
    "gelu_python": F.gelu,
    "gelu_new": _gelu_tanh,
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_fast": _gelu_tanh,
    "relu": F.relu,
}
