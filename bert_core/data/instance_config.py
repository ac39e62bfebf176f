"""`bert instances`' settings (`InstanceConfig`) and their checks, in a module of their own.

The step (`bert_core.data.instances`), one shard's work (`instance_shards`) and the sampling
(`instance_sampling`) all read these settings; here they import them from below instead of from
each other (they used to import the step back, behind `TYPE_CHECKING`).
"""

from __future__ import annotations

from dataclasses import dataclass

from bert_core.data.masking import DEFAULT_RECIPE, MaskingRecipe
from bert_core.errors import BadValue
from bert_core.options import option

MIN_SEQ_LENGTH = 8
MIN_HELDOUT = 2  # documents held out at least, when the corpus allows and a fraction is asked


@dataclass(frozen=True)
class InstanceConfig:
    """`bert instances`' settings; each field is an option (`bert_core.options`)."""

    max_seq_length: int = option(128, "tokens per instance at most, [CLS] and [SEP]s included")
    max_predictions_per_seq: int = option(20, "masked LM predictions per instance, at most")
    masked_lm_prob: float = option(
        0.15, "share of the tokens predicted by the masked LM", within="share"
    )
    short_seq_prob: float = option(
        0.1,
        "probability of a random shorter target length (fine-tuning's inputs are short)",
        within="share",
    )
    dupe_factor: int = option(10, "passes over the corpus, each with other pairs and masks")
    random_seed: int = option(
        12345,
        "seed of every random draw (the output does not depend on --num-workers)",
        within="non-negative",
    )
    whole_word_mask: bool = option(False, "mask all the WordPiece tokens of a word together")
    lowercase: bool = option(
        True,
        "do not lowercase; only for a vocabulary folder without tokenizer_config.json, "
        "whose do_lower_case is used otherwise",
        "--cased",
    )
    masking_recipe: str = option(
        DEFAULT_RECIPE,
        "shares of predicted tokens shown as [MASK]/random token/unchanged, "
        "percent (default %(default)s, the paper's; Table 8 ablates e.g. 100/0/0)",
    )
    heldout_fraction: float = option(
        0.02,
        "share of the documents held out of training, whole, into heldout/ (default "
        f"%(default)s, at least {MIN_HELDOUT} documents when the corpus allows; 0: none)",
        within="share",
    )
    heldout_documents: int | None = option(
        None, "hold out exactly this many documents instead of --heldout-fraction"
    )  # 0: none
    preset: str | None = option(
        None,
        "the model size the instances are for (as `bert pretrain --preset`): "
        "--max-seq-length must fit its max_position_embeddings (default: 512, every preset's)",
    )

    @property
    def recipe(self) -> MaskingRecipe:
        return MaskingRecipe.parse(self.masking_recipe)

    def validate(self) -> None:
        if self.max_seq_length < MIN_SEQ_LENGTH:
            raise BadValue(
                f"--max-seq-length must be >= {MIN_SEQ_LENGTH} ([CLS] A [SEP] B [SEP] needs "
                f"room), got {self.max_seq_length}"
            )
        limit, model = max_positions(self.preset)
        if self.max_seq_length > limit:
            raise BadValue(
                f"--max-seq-length {self.max_seq_length} exceeds max_position_embeddings {limit} "
                f"of {model}: `bert pretrain` could not train on these instances"
            )
        if self.max_predictions_per_seq < 1:
            raise BadValue("--max-predictions-per-seq must be >= 1")
        if not 0.0 < self.masked_lm_prob < 1.0:
            raise BadValue("--masked-lm-prob must be in (0, 1)")
        if not 0.0 <= self.short_seq_prob <= 1.0:
            raise BadValue("--short-seq-prob must be in [0, 1]")
        if self.dupe_factor < 1:
            raise BadValue("--dupe-factor must be >= 1")
        MaskingRecipe.parse(self.masking_recipe)  # a bad recipe raises ValueError
        if not 0.0 <= self.heldout_fraction < 1.0:
            raise BadValue("--heldout-fraction must be in [0, 1)")
        if self.heldout_documents is not None and self.heldout_documents < 0:
            raise BadValue("--heldout-documents must be >= 0")

    def heldout_count(self, documents: int) -> int:
        """How many of `documents` are held out: --heldout-documents, else --heldout-fraction of
        them but at least MIN_HELDOUT (so held-out NSP pairs draw their random next segment
        from another held-out document); training always keeps 2 (NSP needs them)."""
        if self.heldout_documents is not None:
            if self.heldout_documents > documents - 2:
                raise BadValue(
                    f"--heldout-documents {self.heldout_documents}: the corpus has {documents} "
                    "documents and training needs at least 2"
                )
            return self.heldout_documents
        if self.heldout_fraction == 0:
            return 0
        wanted = max(MIN_HELDOUT, round(documents * self.heldout_fraction))
        return max(0, min(wanted, documents - 2))

    @property
    def holds_out(self) -> bool:
        """Whether a split is asked for (only then are the documents counted first)."""
        return bool(
            self.heldout_documents if self.heldout_documents is not None else self.heldout_fraction
        )


def max_positions(preset: str | None) -> tuple[int, str]:
    """(longest sequence, the model named) for instances made for `preset`: its
    max_position_embeddings; without a preset BERT's 512, which every preset has. Checked
    here, where the length is set, not 40 s into `bert pretrain`."""
    from bert_core.model.config import BertConfig

    if preset is None:
        return BertConfig.max_position_embeddings, "BERT (every --preset)"
    try:
        return BertConfig.from_preset(preset).max_position_embeddings, f"the {preset} preset"
    except ValueError as e:
        raise BadValue(f"--preset: {e}") from None
