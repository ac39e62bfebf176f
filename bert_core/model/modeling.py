"""BERT (Devlin et al., 2018): the encoder model, its checkpoints and its pre-training heads.

The fine-tuning heads (sequence classification, token classification, question answering) are
in `bert_core.model.heads`, on top of `BertModel` and `BertPreTrainedModel` from here.

Module and parameter names follow the Hugging Face `transformers` BERT layout exactly
(`bert.encoder.layer.0.attention.self.query.weight`, ...), so a checkpoint written by either
loads in the other with no renaming. Two choices make training faster than the reference:

- the MLM head runs only at the masked positions (gathered by `masked_lm_positions`, as the
  original TensorFlow implementation does), not at every token: at 15 % masking that skips
  ~85 % of the vocabulary projection, the largest matrix in a small BERT;
- attention goes through `torch.nn.functional.scaled_dot_product_attention`, which picks a
  fused kernel (flash / memory-efficient) for the device.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from bert_core.errors import BadValue, Diverged, NotFound, atomic_dir
from bert_core.model import weights
from bert_core.model.config import (
    ACTIVATIONS,
    CONFIG_NAME,
    TOKENIZER_FILES,
    VOCAB_NAME,
    WEIGHTS_NAME,
    BertConfig,
)
from bert_core.model.layers import (
    BertEmbeddings,
    BertEncoder,
    BertPooler,
    BertTopBiLSTM,
    attention_mask_for,
    pooled_token,
)

log = logging.getLogger(__name__)


class BertOutput(NamedTuple):
    last_hidden_state: torch.Tensor  # [B, L, H]
    pooler_output: torch.Tensor  # [B, H]
    # with output_hidden_states: the embeddings' output then every layer's, [B, L, H] each
    hidden_states: tuple[torch.Tensor, ...] | None = None


class PreTrainingOutput(NamedTuple):
    loss: torch.Tensor | None
    mlm_loss: torch.Tensor | None
    nsp_loss: torch.Tensor | None
    mlm_logits: torch.Tensor  # [B, P, V] at the masked positions (or [B, L, V] without them)
    nsp_logits: torch.Tensor  # [B, 2]


# ----------------------------------------------------------------------------- checkpoints

HEAD_PREFIXES = ("cls.", "classifier.", "qa_outputs.")
# tied to the word embeddings / the head's own bias: never stored separately by us
TIED_KEYS = ("cls.predictions.decoder.weight", "cls.predictions.decoder.bias")


def _rename_legacy(key: str) -> str:
    """Google-converted checkpoints name LayerNorm parameters gamma/beta."""
    if key.endswith(".gamma"):
        return key[: -len("gamma")] + "weight"
    if key.endswith(".beta"):
        return key[: -len("beta")] + "bias"
    return key


def _layer_hint(state: dict[str, torch.Tensor], layers: int) -> str:
    """' (a checkpoint of 4 layers, config.json says 2: ...)' when the layer counts differ: the
    usual cause of a mismatch is weights of another size (preset) beside a config.json."""
    found = {int(m.group(1)) for k in state if (m := re.search(r"encoder\.layer\.(\d+)\.", k))}
    if not found or len(found) == layers:
        return ""
    return (
        f" (a checkpoint of {len(found)} layers, config.json says {layers}: the weights of "
        "another model size?)"
    )


class BertPreTrainedModel(nn.Module):
    """Initialisation, input checks, and Hugging Face-layout checkpoints for every BERT class."""

    base_model_prefix = "bert"

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.vocab_file: Path | None = None  # remembered by from_pretrained, re-written on save

    def _init_weights(self, module: nn.Module) -> None:
        """The original's `truncated_normal_initializer(stddev=initializer_range)`: normal(0,
        0.02) cut at 2 sigma (re-drawn beyond, not rescaled: the std is ~0.88 x 0.02); zero
        biases, LayerNorm at 1 and 0. transformers draws an untruncated normal instead."""
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.trunc_normal_(module.weight, std=std, a=-2 * std, b=2 * std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.trunc_normal_(module.weight, std=std, a=-2 * std, b=2 * std)
            if module.padding_idx is not None:
                module.weight.data[module.padding_idx].zero_()
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    def check_inputs(self, input_ids: torch.Tensor) -> None:
        """A clear error, not an index error deep in an embedding (skipped when compiled)."""
        if torch.compiler.is_compiling():
            return
        c = self.config
        if input_ids.dim() != 2:
            raise ValueError(
                f"input_ids must be [batch, seq_len], got shape {tuple(input_ids.shape)}"
            )
        if input_ids.shape[1] > c.max_position_embeddings:
            raise BadValue(
                f"sequence length {input_ids.shape[1]} exceeds "
                f"max_position_embeddings {c.max_position_embeddings}"
            )
        # ids are checked on the host only: on a GPU the check would stall every step on a
        # device-to-host copy (there an out-of-range id still fails, as a device-side assert)
        if input_ids.numel() and not input_ids.is_cuda:
            lo, hi = int(input_ids.min()), int(input_ids.max())
            if lo < 0 or hi >= c.vocab_size:
                raise BadValue(
                    f"token id {hi if hi >= c.vocab_size else lo} outside vocab_size {c.vocab_size}"
                )

    # --- loading

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, **config_overrides):
        """Load a Hugging Face-layout BERT folder (ours or any public one).

        Heads that the checkpoint has but this class lacks (e.g. MLM/NSP when fine-tuning) are
        dropped, and heads this class has but the checkpoint lacks (a new classifier) keep their
        fresh initialisation; so may an absent pooler. Any other missing or unexpected weight is
        an error that names it: silently half-loaded models are the worst kind of bug.
        """
        model_dir = Path(model_dir)
        if not (model_dir / CONFIG_NAME).is_file():
            raise NotFound(f"{model_dir}: no {CONFIG_NAME} (not a BERT model folder)")
        from bert_core.model import int8

        if int8.quantization(model_dir) is not None:  # `bert quantize`'s: int8 Linears
            model = int8.load(cls, model_dir)
            weights.check_finite(model.state_dict(), model_dir / WEIGHTS_NAME)  # scales, biases
            return model
        config = BertConfig.from_json_file(model_dir / CONFIG_NAME, **config_overrides)
        model = cls(config, init_weights=False)
        model.load_checkpoint_state(weights.read(model_dir), source=str(model_dir))
        if (model_dir / VOCAB_NAME).is_file():
            model.vocab_file = model_dir / VOCAB_NAME
        return model

    def load_checkpoint_state(
        self, state: dict[str, torch.Tensor], source: str = "", created: tuple[str, ...] = ()
    ) -> None:
        """Load `state` by `from_pretrained`'s rules. A weight the checkpoint lacks starts from
        its fresh initialisation and is a WARNING naming it (as transformers warns: a pooler or
        head trained from zero changes what the model is), unless it belongs to a module the
        caller creates on purpose: `created` names them by a part of their key ("classifier"
        for `bert finetune`'s task head), logged at INFO."""
        own = self.state_dict()
        prefix = self.base_model_prefix + "."
        has_base = any(k.startswith(prefix) for k in own)
        loaded: dict[str, torch.Tensor] = {}
        for key, value in state.items():
            key = _rename_legacy(key)
            if key.endswith("position_ids") or key in TIED_KEYS:
                continue  # a buffer, or a copy of weights we tie
            if has_base and not key.startswith(prefix) and not key.startswith(HEAD_PREFIXES):
                key = prefix + key  # a bare BertModel checkpoint loaded under a head
            elif not has_base and key.startswith(prefix):
                key = key[len(prefix) :]  # a full model's checkpoint loaded as BertModel
            loaded[key] = value
        missing = [k for k in own if k not in loaded]
        unexpected = [k for k in loaded if k not in own]

        # heads, the pooler and Table 5's BiLSTM may start fresh: none is in every checkpoint
        def optional(k: str) -> bool:
            return k.startswith(HEAD_PREFIXES) or bool(re.search(r"(^|\.)(pooler|bilstm)\.", k))

        bad_missing = [k for k in missing if not optional(k)]
        bad_unexpected = [k for k in unexpected if not k.startswith(HEAD_PREFIXES)]
        if bad_missing or bad_unexpected:
            raise BadValue(
                f"{source}: checkpoint does not match {type(self).__name__}"
                f"{_layer_hint(loaded, self.config.num_hidden_layers)}: "
                f"missing {bad_missing[:10]}{'...' if len(bad_missing) > 10 else ''}, "
                f"unexpected {bad_unexpected[:10]}{'...' if len(bad_unexpected) > 10 else ''}"
            )
        shapes = [
            f"{k}: checkpoint {tuple(v.shape)} vs model {tuple(own[k].shape)}"
            for k, v in loaded.items()
            if k in own and v.shape != own[k].shape
        ]
        if shapes:
            raise BadValue(f"{source}: shape mismatch: {'; '.join(shapes)}")
        planned = [k for k in missing if set(k.split(".")) & set(created)]
        if planned:
            log.info("%s: newly initialised, as asked: %s", source, planned)
        if fresh := [k for k in missing if k not in planned]:
            log.warning("%s: newly initialised (absent in the checkpoint): %s", source, fresh)
        if unexpected:
            log.info("%s: dropped (not used by %s): %s", source, type(self).__name__, unexpected)
        # what the checkpoint lacks starts from BERT's initialisation here, whether or not the
        # model was built with it (`init_weights=False` skips it for what the checkpoint has)
        for owner in dict.fromkeys(k.rpartition(".")[0] for k in missing):
            self._init_weights(self.get_submodule(owner))
        self.load_state_dict({k: v for k, v in loaded.items() if k in own}, strict=False)

    # --- saving

    def save_pretrained(self, model_dir: str | Path, vocab_file: str | Path | None = None) -> None:
        """Write config.json, model.safetensors and vocab.txt; atomically (temp dir + rename).

        The weights are serialised in memory and written by Python: safetensors' own file
        writer reports a full disk as a `SafetensorError`, which hides the errno that
        `atomic_dir` turns into a clear "no space" error. Non-finite weights are not written
        (`errors.Diverged`): nothing could load them."""
        from safetensors.torch import save

        vocab = Path(vocab_file) if vocab_file is not None else self.vocab_file
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        if (name := weights.nonfinite(state)) is not None:
            raise Diverged(f"{model_dir}: weight {name} holds NaN or infinite values; not saved")
        with atomic_dir(model_dir) as tmp:
            config = {"architectures": [type(self).__name__], **self.config.to_dict()}
            (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
            (tmp / WEIGHTS_NAME).write_bytes(save(state, metadata={"format": "pt"}))
            if vocab is not None:
                for name in TOKENIZER_FILES:
                    if (vocab.parent / name).is_file():
                        shutil.copyfile(vocab.parent / name, tmp / name)
                shutil.copyfile(vocab, tmp / VOCAB_NAME)
        if vocab is not None:
            self.vocab_file = Path(model_dir) / VOCAB_NAME


class BertModel(BertPreTrainedModel):
    """The bidirectional Transformer encoder plus pooler; left-to-right with `is_decoder` and a
    BiLSTM on top with `top_bilstm` (the paper's Table 5 ablations)."""

    def __init__(self, config: BertConfig, init_weights: bool = True):
        """`init_weights=False` (`from_pretrained`, a fine-tuning's load): the weights stay as
        PyTorch's constructors left them, for a checkpoint to replace; drawing BERT's truncated
        normal for them first took 1.4 of MiniLM's 1.7 s to build (BERT-Base: seconds more),
        every load, for nothing (transformers skips it the same way)."""
        super().__init__(config)
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)
        self.bilstm = BertTopBiLSTM(config) if config.top_bilstm else None
        self.pooler = BertPooler(config)
        if init_weights:
            self.apply(self._init_weights)

    def forward(
        self,
        input_ids: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        output_hidden_states: bool = False,
    ) -> BertOutput:
        """`output_hidden_states`: also every layer's output (the feature-based approach of
        section 5.3 reads e.g. the last four, `bert embed`)."""
        self.check_inputs(input_ids)
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        states = [] if output_hidden_states else None
        causal, length = self.config.is_decoder, input_ids.shape[1]
        x = self.embeddings(input_ids, token_type_ids)
        x = self.encoder(x, attention_mask_for(attention_mask, causal, length, x.device), states)
        if self.bilstm is not None:
            x = self.bilstm(x, attention_mask)
        pooled = self.pooler(pooled_token(x, attention_mask, causal))
        return BertOutput(x, pooled, tuple(states) if states is not None else None)


# ----------------------------------------------------------------------------- heads


class BertPredictionHeadTransform(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.act = ACTIVATIONS[config.hidden_act]
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.act(self.dense(x)))


class BertLMPredictionHead(nn.Module):
    """Transform, then the decoder tied to the word embeddings, with its own output bias."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.transform = BertPredictionHeadTransform(config)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))

    def forward(self, x: torch.Tensor, word_embeddings: torch.Tensor) -> torch.Tensor:
        return F.linear(self.transform(x), word_embeddings, self.bias)


class BertPreTrainingHeads(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.predictions = BertLMPredictionHead(config)
        self.seq_relationship = nn.Linear(config.hidden_size, 2)


class BertForPreTraining(BertPreTrainedModel):
    """Masked LM + next sentence prediction (the paper's pre-training objective)."""

    def __init__(self, config: BertConfig, init_weights: bool = True):
        super().__init__(config)
        self.bert = BertModel(config, init_weights)
        self.cls = BertPreTrainingHeads(config)
        self.cls.apply(self._init_weights)

    def forward(
        self,
        input_ids: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        masked_lm_positions: torch.Tensor | None = None,
        masked_lm_labels: torch.Tensor | None = None,
        next_sentence_label: torch.Tensor | None = None,
    ) -> PreTrainingOutput:
        """MLM logits at `masked_lm_positions` [B, P] (padded with 0, labels padded with -100).

        Without positions the MLM head runs at every token and `masked_lm_labels` is [B, L]
        (-100 where not masked), the transformers convention.
        """
        out = self.bert(input_ids, token_type_ids, attention_mask)
        h = out.last_hidden_state
        if masked_lm_positions is not None:
            index = masked_lm_positions.long().unsqueeze(-1).expand(-1, -1, h.shape[-1])
            h = torch.gather(h, 1, index)
        mlm_logits = self.cls.predictions(h, self.bert.embeddings.word_embeddings.weight)
        nsp_logits = self.cls.seq_relationship(out.pooler_output)
        mlm_loss = nsp_loss = loss = None
        if masked_lm_labels is not None:
            mlm_loss = F.cross_entropy(
                mlm_logits.flatten(0, 1).float(),
                masked_lm_labels.flatten().long(),
                ignore_index=-100,
            )
            loss = mlm_loss
        if next_sentence_label is not None:
            nsp_loss = F.cross_entropy(nsp_logits.float(), next_sentence_label.view(-1).long())
            loss = nsp_loss if loss is None else loss + nsp_loss
        return PreTrainingOutput(loss, mlm_loss, nsp_loss, mlm_logits, nsp_logits)


def num_parameters(model: nn.Module) -> int:
    """Unique parameters (the tied decoder counts once), for MFU's 6 * N * tokens."""
    return sum(p.numel() for p in model.parameters())
