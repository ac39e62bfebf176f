"""The one masked-LM rule (`bert_core.data.masking`) and its three callers: instances' vectorised
and whole-word masking, and pre-training's dynamic masking."""

from __future__ import annotations

import random

import numpy as np
import pytest

from bert_core.data import masking
from bert_core.data.instance_sampling import Vocab, mask_batch, mask_whole_words
from bert_core.data.instances import InstanceConfig
from bert_core.data.masking import KEEP, MASK, RANDOM, MaskingRecipe
from bert_core.pretrain.data import MaskingConfig, dynamic_mask

VOCAB_SIZE, CLS, SEP, MASK_ID = 500, 2, 3, 4


def test_recipe_parse_and_validation():
    assert MaskingRecipe.parse("80/10/10") == MaskingRecipe() == MaskingRecipe(0.8, 0.1, 0.1)
    assert MaskingRecipe.parse("100/0/0") == MaskingRecipe(1.0, 0.0, 0.0)
    assert str(MaskingRecipe.parse("80/0/20")) == "80/0/20" and str(MaskingRecipe()) == "80/10/10"
    assert MaskingRecipe.parse(MaskingRecipe(1.0, 0.0, 0.0)) == MaskingRecipe(1.0, 0.0, 0.0)
    for bad in ("80/10", "80/10/20", "a/b/c", "110/-5/-5", ""):
        with pytest.raises(ValueError, match="--masking-recipe must be"):
            MaskingRecipe.parse(bad)
    with pytest.raises(ValueError, match="sum to 1"):
        MaskingRecipe(0.8, 0.1, 0.2)
    # the default's thresholds are the original's constants exactly
    assert MaskingRecipe().mask_prob == 0.8 and MaskingRecipe().keep_given_not_mask == 0.5


def test_decide_is_the_originals_rule_on_arrays_and_scalars():
    rng = np.random.default_rng(0)
    u, v = rng.random(100_000), rng.random(100_000)
    got = MaskingRecipe().decide(u, v)
    assert np.array_equal(got, np.where(u < 0.8, 0, np.where(v < 0.5, 2, 1)))
    shares = np.bincount(got, minlength=3) / len(got)
    assert np.allclose(shares[[MASK, RANDOM, KEEP]], [0.8, 0.1, 0.1], atol=0.005)
    for a, b in [(0.1, 0.9), (0.85, 0.2), (0.85, 0.7)]:
        scalar = MaskingRecipe().decide(a, b)
        assert isinstance(scalar, int) and scalar == (0 if a < 0.8 else 2 if b < 0.5 else 1)
    shares = np.bincount(MaskingRecipe.parse("50/20/30").decide(u, v), minlength=3) / len(u)
    assert np.allclose(shares, [0.5, 0.2, 0.3], atol=0.005)


def test_num_to_predict_is_pythons_round_on_ints_and_arrays():
    lengths = np.arange(1, 600)
    for prob in (0.15, 0.25, 0.1, 0.5):
        want = [min(20, max(1, round(n * prob))) for n in lengths]
        assert masking.num_to_predict(lengths, prob, 20).tolist() == want
        assert [masking.num_to_predict(int(n), prob, 20) for n in lengths] == want
    assert masking.num_to_predict(10, 0.25, 20) == 2 and masking.num_to_predict(14, 0.25, 20) == 4


def _vocab() -> Vocab:
    is_subword = np.zeros(VOCAB_SIZE, dtype=bool)
    is_subword[300:] = True  # ids >= 300 are `##` pieces
    return Vocab(VOCAB_SIZE, CLS, SEP, MASK_ID, is_subword)


def _batch(rng: np.random.Generator, n: int = 200, width: int = 64):
    lengths = rng.integers(12, width + 1, n)
    ids = rng.integers(5, VOCAB_SIZE, (n, width)).astype(np.int32)
    ids[:, 0] = CLS
    ids[np.arange(n), lengths - 1] = SEP
    ids[np.arange(n), lengths // 2] = SEP
    ids[np.arange(width)[None, :] >= lengths[:, None]] = 0
    return ids, lengths


def _shown(recipe: str):
    """(shown, original) tokens at predicted positions from all three callers with `recipe`."""
    rng = np.random.default_rng(1)
    cfg = InstanceConfig(masking_recipe=recipe, masked_lm_prob=0.3)
    ids, lengths = _batch(rng)
    original = ids.copy()
    positions, labels, count, decisions = mask_batch(ids, lengths, cfg, _vocab(), rng)
    taken = np.arange(positions.shape[1])[None, :] < count[:, None]
    rows = np.broadcast_to(np.arange(len(ids))[:, None], positions.shape)
    shown = [ids[rows[taken], positions[taken]]]
    assert np.array_equal(labels[taken], original[rows[taken], positions[taken]])
    r = random.Random(2)
    dyn = MaskingConfig(VOCAB_SIZE, MASK_ID, (CLS, SEP, 0), 0.3, 20, MaskingRecipe.parse(recipe))
    labels_all = [labels[taken]]
    for row, n in zip(original, lengths, strict=True):
        tokens = row[:n].tolist()
        out, pos, lab, _ = mask_whole_words(tokens, cfg, _vocab(), r)
        shown.append(np.array([out[p] for p in pos]))
        labels_all.append(np.array(lab))
        new, pos, lab = dynamic_mask(row[:n].astype(np.int64), dyn, rng)
        shown.append(new[pos])
        labels_all.append(lab)
    return np.concatenate(shown), np.concatenate(labels_all)


@pytest.mark.parametrize("recipe", ["100/0/0", "0/0/100", "0/100/0", "80/10/10"])
def test_every_caller_follows_the_recipe(recipe):
    shown, original = _shown(recipe)
    assert len(shown) > 2000 and not np.isin(original, [CLS, SEP, MASK_ID]).any()
    as_mask = (shown == MASK_ID).mean()
    unchanged = (shown == original).mean()
    if recipe == "100/0/0":  # only [MASK] replacements
        assert as_mask == 1.0
    elif recipe == "0/0/100":  # nothing replaced
        assert unchanged == 1.0
    elif recipe == "0/100/0":  # random tokens (which are the original 1 time in 500)
        assert as_mask < 0.01 and unchanged < 0.01
    else:
        assert abs(as_mask - 0.8) < 0.03 and abs(unchanged - 0.1) < 0.03
