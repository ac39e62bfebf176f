"""BERT's masked-LM rule, in one place: which tokens are predicted, and what each one shows.

Section 3.1 of the paper: `masked_lm_prob` (15 %) of the tokens are chosen for prediction (at
least one, at most `max_predictions_per_seq`; never `[CLS]`/`[SEP]`), and a chosen token is
replaced by `[MASK]` 80 % of the time, by a random token 10 %, and left unchanged 10 %. Table 8
of the paper ablates those three shares (100/0/0, 80/0/20, ...), so they are a setting, the
`MaskingRecipe`, written `MASK/RANDOM/KEEP` in percent (`--masking-recipe 80/10/10`).

Three callers apply the rule: `bert instances` vectorised over a shard
(`instance_sampling.mask_batch`), one instance at a time for whole-word masking
(`instance_sampling.mask_whole_words`), and pre-training's dynamic masking
(`pretrain_data.dynamic_mask`). They draw their random numbers differently (the whole-word path
must keep the original script's sequence of `random.Random` calls, so its output stays the same),
but all decide through `MaskingRecipe.decide` and count through `num_to_predict`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from bert_core.errors import BadValue

# What a predicted position shows (the `decisions` of `instance_sampling.mask_batch`).
MASK, RANDOM, KEEP = 0, 1, 2
DEFAULT_RECIPE = "80/10/10"


@dataclass(frozen=True)
class MaskingRecipe:
    """Shares of the predicted tokens shown as [MASK], as a random token, and unchanged.

    All three are explicit (rather than keep = 1 - the others) so that the default's thresholds
    are exactly the constants the original used (0.8, and 0.1 / 0.2 = 0.5), which keeps
    `bert instances` output byte-identical.
    """

    mask_prob: float = 0.8
    random_prob: float = 0.1
    keep_prob: float = 0.1

    def __post_init__(self):
        shares = (self.mask_prob, self.random_prob, self.keep_prob)
        if not all(0.0 <= p <= 1.0 for p in shares) or abs(sum(shares) - 1.0) > 1e-9:
            raise BadValue(
                "a masking recipe needs [MASK]/random/keep shares in [0, 1] that sum to 1, got "
                f"{self.mask_prob}/{self.random_prob}/{self.keep_prob}"
            )

    @property
    def keep_given_not_mask(self) -> float:
        """P(unchanged | not [MASK]): the second draw's threshold (0.5 for 80/10/10)."""
        rest = self.keep_prob + self.random_prob
        return self.keep_prob / rest if rest > 0 else 0.0

    def decide(self, u, v):
        """MASK where `u < mask_prob`; otherwise KEEP where `v < keep_given_not_mask`; otherwise
        RANDOM. `u`, `v` are uniform on [0, 1): numpy arrays (one decision each) or floats.

        With 80/10/10 this is the original's `if random() < 0.8: [MASK] elif random() < 0.5:
        keep else: random token`; `v` only matters where `u >= mask_prob`, so a caller that
        must not draw it otherwise (the whole-word path) may pass any number there.
        """
        keep = np.where(np.asarray(v) < self.keep_given_not_mask, KEEP, RANDOM)
        out = np.where(np.asarray(u) < self.mask_prob, MASK, keep)
        return int(out) if out.ndim == 0 else out

    @classmethod
    def parse(cls, text: str | MaskingRecipe) -> MaskingRecipe:
        """`"80/10/10"` ([MASK]/random/keep, percent) -> MaskingRecipe(0.8, 0.1, 0.1)."""
        return text if isinstance(text, MaskingRecipe) else _parse(str(text))

    def __str__(self) -> str:
        return "/".join(f"{round(p * 100, 6):g}" for p in self.shares)

    @property
    def shares(self) -> tuple[float, float, float]:
        return self.mask_prob, self.random_prob, self.keep_prob


@functools.lru_cache(maxsize=64)
def _parse(text: str) -> MaskingRecipe:
    parts = text.split("/")
    try:
        percent = [float(p) for p in parts]
    except ValueError:
        percent = []
    if len(percent) != 3 or abs(sum(percent) - 100.0) > 1e-6 or min(percent) < 0:
        raise BadValue(
            f"--masking-recipe must be MASK/RANDOM/KEEP percentages summing to 100 "
            f"(the paper's is {DEFAULT_RECIPE}), got {text!r}"
        )
    # x / 100 is the double nearest to the decimal written (80 / 100 == 0.8), as a literal.
    return MaskingRecipe(*(p / 100 for p in percent))


def num_to_predict(length, masked_lm_prob: float, max_predictions_per_seq: int):
    """How many positions a sequence of `length` tokens predicts: `masked_lm_prob` of them,
    rounded half to even (Python's `round`, numpy's `rint`: the same on every double), at least
    1 and at most `max_predictions_per_seq`. `length` is an int (-> int) or an array."""
    n = np.minimum(
        max_predictions_per_seq,
        np.maximum(1, np.rint(np.asarray(length) * masked_lm_prob).astype(np.int64)),
    )
    return int(n) if n.ndim == 0 else n


def candidates(ids, special_ids) -> np.ndarray:
    """Which tokens may be predicted: every token that is not one of `special_ids`."""
    return ~np.isin(np.asarray(ids), np.asarray(special_ids))


def replace(decisions, labels, mask_id: int, random_ids):
    """The token each predicted position shows: [MASK], a random token, or its own (`labels`)."""
    return np.where(decisions == MASK, mask_id, np.where(decisions == KEEP, labels, random_ids))
